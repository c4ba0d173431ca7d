"""What the machine has: GPU, driver, torch/CUDA, CuPy, numpy, pytest plugins, tieredkv's origin.

The probe runs in a child interpreter with the check's environment (the tree first on
``PYTHONPATH``), so it sees exactly what the test steps will see, and a broken import is a
line in the results instead of a crash of the check.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

from gpucheck.common import ROOT

PROBE = r"""
import importlib.util, json, os, platform, sys
info = {"python": platform.python_version(), "executable": sys.executable}
try:
    import torch
    info["torch"] = torch.__version__
    info["torch_cuda"] = torch.version.cuda
    info["cuda_available"] = torch.cuda.is_available()
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
        info["capability"] = f"{p.major}.{p.minor}"
        info["gpu_memory_gib"] = round(p.total_memory / 2**30, 1)
        info["sm_count"] = p.multi_processor_count
except Exception as exc:
    info["torch_error"] = repr(exc)[:300]
for name in ("numpy", "cupy", "xxhash", "aiofiles", "prometheus_client", "hypothesis"):
    try:
        module = __import__(name)
        info[name] = getattr(module, "__version__", "?")
    except Exception as exc:
        info[name + "_error"] = repr(exc).splitlines()[0][:200]
if "cupy" in info:
    try:
        import cupy
        info["cupy_cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        info["cuda_driver_api"] = cupy.cuda.runtime.driverGetVersion()
    except Exception as exc:
        info["cupy_runtime_error"] = repr(exc)[:200]
for name in ("pytest", "pytest_timeout", "pytest_asyncio"):
    info[name] = importlib.util.find_spec(name) is not None
try:
    import vllm
    info["vllm"] = getattr(vllm, "__version__", "?")
except Exception:
    info["vllm"] = None
try:
    import tieredkv
    info["tieredkv_from"] = os.path.dirname(os.path.abspath(tieredkv.__file__))
    try:
        import tieredkv.transfer.backends._rowcopy  # noqa: F401
        info["rowcopy_extension"] = True
    except Exception:
        info["rowcopy_extension"] = False
except Exception as exc:
    info["tieredkv_error"] = repr(exc)[:300]
print(json.dumps(info))
"""


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def nvidia_smi(timeout_s: float) -> tuple[dict[str, str], str]:
    """(name, driver, memory, PCIe generation and width) and the full ``nvidia-smi`` text."""
    smi = shutil.which("nvidia-smi")
    if not smi or timeout_s <= 0:
        return {}, ""
    try:
        query = subprocess.run(
            [smi, "--query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=timeout_s, check=False)
        full = subprocess.run([smi], capture_output=True, text=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.SubprocessError):
        return {}, ""
    line = query.stdout.strip().splitlines()[0] if query.stdout.strip() else ""
    fields = [f.strip() for f in line.split(",")]
    keys = ["name", "driver", "memory", "pcie_gen", "pcie_width"]
    return dict(zip(keys, fields, strict=False)), full.stdout


def probe(python: str, env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """The child interpreter's view of the machine (``probe_error`` when it could not say)."""
    try:
        proc = subprocess.run([python, "-c", PROBE], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=max(timeout_s, 1.0), check=False)
    except subprocess.TimeoutExpired:
        return {"probe_error": f"the probe did not finish in {timeout_s:.0f} s", "probe_timeout": True}
    except OSError as exc:
        return {"probe_error": f"could not start {python}: {exc}"}
    try:
        info = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"probe_error": (proc.stderr or proc.stdout)[-2000:]}
    info["cpu"] = cpu_model()
    info["cpu_count"] = os.cpu_count()
    return info


def problems(info: dict[str, Any], device: str) -> list[str]:
    """Why nothing can be checked here (empty: go on)."""
    if info.get("probe_timeout"):
        return [info["probe_error"]]
    found = []
    if "torch" not in info:
        found.append(f"torch is not importable ({info.get('torch_error') or info.get('probe_error', '')[:300]}); "
                     "set PYTHON= to the interpreter that has it")
    elif device == "cuda" and not info.get("cuda_available"):
        found.append(f"torch {info['torch']} sees no CUDA device")
    if "tieredkv_from" not in info and "torch" in info:
        found.append(f"tieredkv does not import from the tree: {info.get('tieredkv_error', '?')}")
    elif info.get("tieredkv_from") and Path(info["tieredkv_from"]).resolve() != (ROOT / "tieredkv").resolve():
        found.append(f"tieredkv imports from {info['tieredkv_from']}, not from this tree")
    if not info.get("pytest", True):
        found.append("pytest is not installed")
    return found
