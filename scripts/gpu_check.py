"""tieredkv's GPU check: install, test, benchmark and record, on a bare GPU machine.

Run it through ``scripts/gpu_check.sh`` (which picks the interpreter); ``--help`` says what it
needs and does. Standard library only at the top: it must start on a machine where the
project's own dependencies may be missing, and say so in its results instead of crashing
(``--copy-check``, the short copy run, imports torch and tieredkv when it runs).
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS_GPU = ROOT / "benchmarks" / "results" / "gpu"
INTEGRATION = "tests/transfer/test_gpu_integration.py"
EXTRA_WHEELS = {"pytest_asyncio": "pytest-asyncio", "pytest_timeout": "pytest-timeout"}
WHEEL_FILL = (
    "python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 "
    "--implementation cp --platform manylinux2014_x86_64 --platform any -d .whl "
    "pytest-asyncio pytest-timeout"
)
SANITIZER_PATHS = ("/usr/local/cuda/bin/compute-sanitizer", "/opt/cuda/bin/compute-sanitizer")
OK_STATUSES = ("pass", "skip", "warn", "info")
PIP_QUIET = ("--disable-pip-version-check", "--no-input")  # no network here: ask nothing of it

HELP = f"""\
Verify tieredkv on a GPU machine and write results ready to commit.

The machine needs Python >= 3.11 with torch (CUDA), numpy, pytest, hypothesis, xxhash,
aiofiles, prometheus-client and setuptools already installed, and CuPy for the cupy backend
(cupy-cuda13x for a CUDA 13 torch, cupy-cuda12x for CUDA 12). It needs no vLLM, no network and
no compiler. What it does not have it takes from a wheel folder you bring along (default
.whl/, git-ignored): pytest-asyncio and pytest-timeout. Fill that folder on any machine with
network (for a Python 3.12 x86_64 target), from the repository root:

    {WHEEL_FILL}

Steps (each one's outcome, log and time go into the results; a failed step does not stop the
next one):
  environment  GPU, driver, torch/CUDA, CuPy, numpy versions, commit, source digest
  wheels       install pytest-asyncio/pytest-timeout from the wheel folder if missing
  install      pip install --no-deps --no-build-isolation -e . (torch is left alone); if that
               fails (e.g. no compiler for the optional C extension): PYTHONPATH=checkout
  cuda-tests   every test marked `cuda` (python -m pytest -m cuda ...)
  integration  {INTEGRATION}: the real worker half and transfer engine on
               vLLM's CUDA KV-cache layouts (cpu and cuda; --device cpu: cpu only)
  bench        python -m benchmarks.transfer_bench --device DEVICE (quick profile), figures vs targets
  copy-check   gpu_check.py --copy-check: every backend's bytes on small caches in vLLM's
               layouts, under compute-sanitizer memcheck when it is on PATH (or in
               /usr/local/cuda/bin)

Results go to one folder: gpu_check.json, gpu_check.md, transfer_bench.{{json,txt}}, junit XML
and logs/. Default: $OUT if set, else benchmarks/results/gpu/<gpu-name>-<date>/. Commit them
under benchmarks/results/gpu/<gpu-name>-<date>/ (the JSON names that folder).

--device cpu runs the same integration test on the CPU, the CPU transfer benchmark and the copy
check without CUDA: CI runs it (tests/test_gpu_check_script.py) to prove this script works.

Exit status: 0 when every step passed (on CUDA: the auto backend met every benchmark target),
1 otherwise, 2 on bad arguments.
"""


# ---------------------------------------------------------------------------- helpers


def slug(text: str) -> str:
    """A folder-name-safe form of a device name: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def source_digest(root: Path = ROOT) -> str:
    """sha256 (first 16 hex) over the code this check exercises: ties results to a tree when
    the machine has no git history. ``gpu_check.py --source-digest`` prints it locally."""
    digest = hashlib.sha256()
    files: list[Path] = []
    for pattern in ("tieredkv/**/*.py", "tieredkv/**/*.c", "tests/transfer/*.py",
                    "benchmarks/transfer_bench.py", "scripts/gpu_check*",
                    "pyproject.toml", "setup.py"):
        files.extend(p for p in root.glob(pattern) if p.is_file() and "__pycache__" not in p.parts)
    for path in sorted(set(files)):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def git_commit(root: Path = ROOT) -> str | None:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=20, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=20, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}{'-dirty' if dirty else ''}" if head else None


def parse_junit(path: Path) -> dict[str, Any]:
    """Counts and skip reasons from a pytest JUnit XML file."""
    counts: dict[str, Any] = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0,
                              "skip_reasons": {}, "failures": []}
    if not path.exists():
        counts["errors"] = 1
        counts["failures"].append(f"no JUnit file {path.name}: pytest did not finish")
        return counts
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:
        counts["errors"] = 1
        counts["failures"].append(f"unreadable JUnit file: {exc}")
        return counts
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None:
            counts["failed"] += 1
            counts["failures"].append(name)
        elif case.find("error") is not None:
            counts["errors"] += 1
            counts["failures"].append(name)
        elif (skip := case.find("skipped")) is not None:
            counts["skipped"] += 1
            reason = (skip.get("message") or "").strip()[:200]
            counts["skip_reasons"][reason] = counts["skip_reasons"].get(reason, 0) + 1
        else:
            counts["passed"] += 1
    return counts


def cuda_test_files(root: Path = ROOT) -> list[str]:
    """Test files that mark tests ``cuda`` (outside tests/e2e, which needs vLLM), less the
    integration test, which has its own step."""
    found = []
    for path in sorted((root / "tests").rglob("test_*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("tests/e2e/") or rel == INTEGRATION:
            continue
        if re.search(r"mark\.cuda\b", path.read_text(errors="replace")):
            found.append(rel)
    return found


def find_sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    return next((p for p in SANITIZER_PATHS if os.access(p, os.X_OK)), None)


_PROBE = r"""
import json, platform, sys
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
    info["torch_error"] = repr(exc)
try:
    import numpy
    info["numpy"] = numpy.__version__
except Exception as exc:
    info["numpy_error"] = repr(exc)
try:
    import cupy
    info["cupy"] = cupy.__version__
    try:
        info["cupy_cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
        info["cuda_driver_api"] = cupy.cuda.runtime.driverGetVersion()
    except Exception as exc:
        info["cupy_runtime_error"] = repr(exc)
except Exception as exc:
    info["cupy_error"] = repr(exc).splitlines()[0][:200]
try:
    import vllm
    info["vllm"] = getattr(vllm, "__version__", "?")
except Exception:
    info["vllm"] = None
try:
    import tieredkv, os
    info["tieredkv_from"] = os.path.dirname(tieredkv.__file__)
    try:
        import tieredkv.transfer.backends._rowcopy  # noqa: F401
        info["rowcopy_extension"] = True
    except Exception:
        info["rowcopy_extension"] = False
except Exception as exc:
    info["tieredkv_error"] = repr(exc)
print(json.dumps(info))
"""


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown CPU"


def nvidia_smi() -> tuple[dict[str, str], str]:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return {}, ""
    try:
        query = subprocess.run(
            [smi, "--query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=30, check=False)
        full = subprocess.run([smi], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return {}, ""
    line = query.stdout.strip().splitlines()[0] if query.stdout.strip() else ""
    fields = [f.strip() for f in line.split(",")]
    keys = ["name", "driver", "memory", "pcie_gen", "pcie_width"]
    return dict(zip(keys, fields, strict=False)), full.stdout


# ---------------------------------------------------------------------------- the check


class Check:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = args.device
        self.python = sys.executable
        self.started = time.monotonic()
        self.date = dt.datetime.now(dt.UTC)
        self.steps: list[dict[str, Any]] = []
        self.tests: dict[str, Any] = {}
        self.bench: dict[str, Any] | None = None
        self.timeline: dict[str, Any] | None = None
        self.machine: dict[str, Any] = {}
        self.env = dict(os.environ)
        self.pythonpath: list[str] = []
        self.pytest_extra: list[str] = []
        self.hidden_vllm: str | None = None
        if args.without_vllm:
            self.hidden_vllm = tempfile.mkdtemp(prefix="gpu-check-no-vllm-")
            pkg = Path(self.hidden_vllm, "vllm")
            pkg.mkdir()
            (pkg / "__init__.py").write_text(
                'raise ModuleNotFoundError("No module named \'vllm\' (hidden by gpu_check.sh '
                '--without-vllm, as on the GPU machines)", name="vllm")\n')
            self.pythonpath.append(self.hidden_vllm)
        self.out: Path = args.out  # set for real once the device name is known
        self.suggested = ""

    # -------------------------------------------------------------- running things

    def run_env(self) -> dict[str, str]:
        env = dict(self.env)
        parts = [*self.pythonpath, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
        if parts:
            env["PYTHONPATH"] = os.pathsep.join(parts)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def run(self, name: str, cmd: list[str], timeout: float, log_name: str | None = None) -> tuple[int, str, float]:
        """Run ``cmd`` in the repository root; stdout+stderr to logs/<log_name>.log."""
        log = self.out / "logs" / f"{log_name or name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        print(f"[gpu_check] {name}: {' '.join(cmd)}", flush=True)
        with open(log, "w") as fh:
            fh.write(f"$ {' '.join(cmd)}\n")
            fh.flush()
            try:
                proc = subprocess.run(cmd, cwd=ROOT, env=self.run_env(), stdout=fh,
                                      stderr=subprocess.STDOUT, timeout=timeout, check=False)
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                rc = 124
                fh.write(f"\n[gpu_check] timed out after {timeout:.0f} s\n")
            except OSError as exc:
                rc = 127
                fh.write(f"\n[gpu_check] could not start: {exc}\n")
        seconds = time.monotonic() - start
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        print(f"[gpu_check] {name}: exit {rc} in {seconds:.1f} s ({tail[0][:160]})", flush=True)
        return rc, log.relative_to(self.out).as_posix(), seconds

    def record(self, name: str, status: str, detail: str, seconds: float = 0.0,
               log: str | None = None, command: str | None = None) -> dict[str, Any]:
        step = {"name": name, "status": status, "seconds": round(seconds, 1), "detail": detail,
                "log": log, "command": command}
        self.steps.append(step)
        print(f"[gpu_check] {name}: {status.upper()} - {detail}", flush=True)
        self.write()  # partial results survive a run killed at its time limit
        return step

    def skip(self, name: str) -> bool:
        return name in self.args.skip

    # -------------------------------------------------------------- steps

    def environment(self) -> bool:
        start = time.monotonic()
        probe = subprocess.run([self.python, "-c", _PROBE], cwd=ROOT, env=self.run_env(),
                               capture_output=True, text=True, timeout=300, check=False)
        try:
            info = json.loads(probe.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            info = {"probe_error": (probe.stderr or probe.stdout)[-2000:]}
        smi, smi_text = nvidia_smi() if self.device == "cuda" else ({}, "")
        info["cpu"] = cpu_model()
        info["cpu_count"] = os.cpu_count()
        if smi:
            info["driver"] = smi.get("driver")
            info["nvidia_smi"] = smi
        if self.device == "cuda":
            name = info.get("gpu") or smi.get("name") or "unknown-gpu"
        else:
            name = f"cpu-{info['cpu']}"
        info["device_name"] = name
        info["commit"] = self.args.commit or os.environ.get("GPU_CHECK_COMMIT") or git_commit()
        info["source_digest"] = source_digest()
        self.machine = info
        day = self.date.strftime("%Y-%m-%d")
        self.suggested = f"benchmarks/results/gpu/{slug(name)}-{day}"
        if self.args.out is None:
            self.out = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / self.suggested
        self.out.mkdir(parents=True, exist_ok=True)
        if smi_text:
            (self.out / "logs").mkdir(exist_ok=True)
            (self.out / "logs" / "nvidia-smi.txt").write_text(smi_text)
        problems = []
        if "torch" not in info:
            problems.append(f"torch is not importable with {self.python} "
                            f"({info.get('torch_error') or info.get('probe_error', '')[:300]}); set "
                            "PYTHON= to the interpreter that has it")
        elif self.device == "cuda" and not info.get("cuda_available"):
            problems.append(f"torch {info['torch']} sees no CUDA device")
        if problems:
            self.record("environment", "fail", "; ".join(problems), time.monotonic() - start)
            return False
        what = (f"{name}, driver {info.get('driver', '?')}, torch {info['torch']} (CUDA "
                f"{info.get('torch_cuda')}), cupy {info.get('cupy', 'not installed')}, numpy "
                f"{info.get('numpy', '?')}, Python {info['python']}"
                if self.device == "cuda" else
                f"{name}, torch {info['torch']}, numpy {info.get('numpy', '?')}, Python {info['python']}")
        if info.get("vllm"):
            what += f"; vLLM {info['vllm']} importable"
        self.record("environment", "pass", what, time.monotonic() - start)
        return True

    def _output(self, code: str) -> str | None:
        """Last line ``code`` prints, run outside the checkout (so only installed code counts)."""
        proc = subprocess.run([self.python, "-c", code], cwd="/", env=self.run_env(),
                              capture_output=True, text=True, timeout=300, check=False)
        lines = proc.stdout.strip().splitlines()
        return lines[-1] if proc.returncode == 0 and lines else None

    def _importable(self, module: str) -> bool:
        return subprocess.run([self.python, "-c", f"import {module}"], cwd="/", env=self.run_env(),
                              capture_output=True, timeout=120, check=False).returncode == 0

    def wheels(self) -> None:
        missing = [m for m in EXTRA_WHEELS if not self._importable(m)]
        if not missing:
            self.record("wheels", "pass", "pytest-asyncio and pytest-timeout already installed")
            return
        names = [EXTRA_WHEELS[m] for m in missing]
        folder = self.args.wheels
        have = sorted(p.name for p in folder.glob("*.whl")) if folder.is_dir() else []
        if self.args.no_install:
            self.record("wheels", "warn", f"{', '.join(names)} missing; not installed (--no-install)")
            return
        if not have:
            self.record("wheels", "warn",
                        f"{', '.join(names)} missing and no wheels in {folder}: the tests run "
                        f"without them (no per-test timeout). Fill it with: {WHEEL_FILL}")
            return
        cmd = [self.python, "-m", "pip", "install", *PIP_QUIET, "--no-deps", "--no-index",
               "--find-links", str(folder), *names]
        rc, log, seconds = self.run("wheels", cmd, 300)
        still = [EXTRA_WHEELS[m] for m in missing if not self._importable(m)]
        loads = subprocess.run([self.python, "-m", "pytest", "--version"], cwd=ROOT,
                               env=self.run_env(), capture_output=True, timeout=120, check=False)
        if loads.returncode != 0:
            # A plugin wheel too new for this pytest: run without it rather than not at all.
            self.pytest_extra += ["-p", "no:asyncio"]
            self.record("wheels", "warn", f"pytest does not start with the installed plugins "
                        f"({loads.stderr.decode(errors='replace').strip()[-300:]}); running with "
                        "-p no:asyncio", seconds, log, " ".join(cmd))
            return
        if rc == 0 and not still:
            self.record("wheels", "pass", f"installed {', '.join(names)} from {folder}", seconds, log,
                        " ".join(cmd))
        else:
            self.record("wheels", "warn",
                        f"could not install {', '.join(still or names)} from {folder} "
                        f"(exit {rc}); the tests run without them. Fill it with: {WHEEL_FILL}",
                        seconds, log, " ".join(cmd))

    def install(self) -> None:
        if self.args.no_install:
            self.pythonpath.append(str(ROOT))
            self.record("install", "skip", f"--no-install: PYTHONPATH={ROOT}")
            return
        before = self.machine.get("torch")
        cmd = [self.python, "-m", "pip", "install", *PIP_QUIET, "--no-index", "--no-deps",
               "--no-build-isolation", "-e", str(ROOT)]
        rc, log, seconds = self.run("install", cmd, 600)
        after = self._output("import torch; print(torch.__version__)")
        where = self._output("import os, tieredkv; print(os.path.dirname(tieredkv.__file__))")
        if after != before:
            self.pythonpath.append(str(ROOT))
            self.record("install", "fail", f"torch changed from {before} to {after} during the "
                        "install: restore it before trusting any figure", seconds, log, " ".join(cmd))
            return
        if rc == 0 and where and Path(where).resolve() == (ROOT / "tieredkv").resolve():
            ext = self._importable("tieredkv.transfer.backends._rowcopy")
            self.record("install", "pass", f"pip install -e . (torch {after} untouched; C "
                        f"extension {'built' if ext else 'not built: numpy CPU path'})",
                        seconds, log, " ".join(cmd))
            return
        self.pythonpath.append(str(ROOT))
        self.record("install", "warn", f"pip install -e . failed (exit {rc}, see log): running "
                    f"from the checkout with PYTHONPATH={ROOT}", seconds, log, " ".join(cmd))

    def pytest_step(self, name: str, paths: list[str], marker: str | None, timeout: float) -> None:
        junit = self.out / f"junit-{name}.xml"
        cmd = [self.python, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *self.pytest_extra,
               f"--junitxml={junit}", *(["-m", marker] if marker else []), *paths]
        rc, log, seconds = self.run(name, cmd, timeout)
        counts = parse_junit(junit)
        self.tests[name] = counts
        summary = (f"{counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, "
                   f"{counts['skipped']} skipped")
        if rc == 124:
            status, summary = "fail", f"timed out after {timeout:.0f} s; {summary}"
        elif rc == 5 or counts["passed"] == 0:
            status, summary = "fail", f"no test passed (exit {rc}); {summary}"
        elif rc != 0 or counts["failed"] or counts["errors"]:
            status = "fail"
        else:
            status = "pass"
        self.record(name, status, summary, seconds, log, " ".join(cmd[1:]))

    def cuda_tests(self) -> None:
        if self.device != "cuda":
            self.record("cuda-tests", "skip", "--device cpu: no CUDA tests")
            return
        files = cuda_test_files()
        if not files:
            self.record("cuda-tests", "fail", "no test file marks tests cuda")
            return
        self.pytest_step("cuda-tests", files, "cuda", self.args.test_timeout)

    def integration(self) -> None:
        marker = None if self.device == "cuda" else "not cuda"
        timeline = self.out / "overlap_timeline.json"
        self.env["GPU_CHECK_TIMELINE"] = str(timeline)
        try:
            self.pytest_step("integration", [INTEGRATION], marker, self.args.test_timeout)
        finally:
            self.env.pop("GPU_CHECK_TIMELINE", None)
        if timeline.exists():
            try:
                self.timeline = json.loads(timeline.read_text())
            except (OSError, json.JSONDecodeError):
                self.timeline = None
            self.write()

    def run_bench(self) -> None:
        profile = self.args.bench
        if profile == "none":
            self.record("bench", "skip", "--bench none")
            return
        json_path = self.out / "transfer_bench.json"
        cmd = [self.python, "-m", "benchmarks.transfer_bench", "--device", self.device,
               "--json", str(json_path), *({"quick": [], "smoke": ["--smoke"], "full": ["--full"]}[profile])]
        rc, log, seconds = self.run("bench", cmd, self.args.bench_timeout)
        shutil.copyfile(self.out / log, self.out / "transfer_bench.txt")
        try:
            data = json.loads(json_path.read_text())
        except (OSError, json.JSONDecodeError):
            data = None
        if rc != 0 or data is None:
            self.record("bench", "fail", f"transfer_bench exited {rc} without figures", seconds, log,
                        " ".join(cmd[1:]))
            return
        auto = data.get("auto_backend")
        by_backend = data.get("targets_met_by_backend", {})
        self.bench = {
            "profile": profile, "device": data.get("device"), "auto_backend": auto,
            "targets": data.get("targets"), "targets_met_best": data.get("targets_met"),
            "targets_met_by_backend": by_backend, "rows": data.get("rows", []),
        }
        met = by_backend.get(auto) or {"passed": 0, "judged": 0}
        others = ", ".join(f"{b} {v['passed']}/{v['judged']}" for b, v in by_backend.items() if b != auto)
        detail = (f"{profile} profile: auto backend ({auto}) met {met['passed']}/{met['judged']} "
                  f"targets" + (f"; {others}" if others else ""))
        self.record("bench", "pass", detail, seconds, log, " ".join(cmd[1:]))
        if self.device == "cuda":
            ok = met["judged"] > 0 and met["passed"] == met["judged"]
            self.record("bench-targets", "pass" if ok else "fail",
                        f"{auto} (what copy_backend auto picks): {met['passed']}/{met['judged']} rows "
                        f"meet {data.get('targets')}")
        else:
            self.record("bench-targets", "info",
                        f"CPU figures are not judged here ({met['passed']}/{met['judged']} met; a "
                        "shared 2-core machine measures mostly its neighbours)")

    def copy_check(self) -> None:
        cmd = [self.python, "scripts/gpu_check.py", "--copy-check", "--device", self.device]
        sanitizer = find_sanitizer() if self.device == "cuda" else None
        how = "plain run"
        if sanitizer and not self.args.no_sanitizer:
            cmd = [sanitizer, "--tool", "memcheck", "--error-exitcode", "99", "--print-limit", "50",
                   "--target-processes", "all", *cmd]
            how = "under compute-sanitizer memcheck"
        elif self.device == "cuda":
            how = ("plain run: compute-sanitizer not found (it comes with the CUDA toolkit, not "
                   "with torch's wheels)" if not sanitizer else "plain run (--no-sanitizer)")
        rc, log, seconds = self.run("copy-check", cmd, self.args.sanitizer_timeout)
        text = (self.out / log).read_text(errors="replace")
        errors = re.findall(r"ERROR SUMMARY: (\d+) error", text)
        detail = how + (f", {errors[-1]} sanitizer errors" if errors else "")
        if rc == 124:
            self.record("copy-check", "fail", f"{detail}: timed out after "
                        f"{self.args.sanitizer_timeout:.0f} s", seconds, log, " ".join(cmd))
            return
        last = [line for line in text.splitlines() if line.startswith("copy-check:")]
        detail += f"; {last[-1][len('copy-check:'):].strip()}" if last else ""
        self.record("copy-check", "pass" if rc == 0 else "fail", detail if rc == 0 else
                    f"{detail} (exit {rc})", seconds, log, " ".join(cmd))

    # -------------------------------------------------------------- results

    def verdict(self) -> str:
        ran = [s for s in self.steps]
        return "pass" if ran and all(s["status"] in OK_STATUSES for s in ran) else "fail"

    def results(self) -> dict[str, Any]:
        return {
            "tool": "scripts/gpu_check.sh",
            "device": self.device,
            "date": self.date.isoformat(timespec="seconds"),
            "commit": self.machine.get("commit"),
            "source_digest": self.machine.get("source_digest"),
            "suggested_dir": self.suggested,
            "arguments": sys.argv[1:],
            "vllm_hidden": bool(self.args.without_vllm),
            "seconds": round(time.monotonic() - self.started, 1),
            "verdict": self.verdict(),
            "machine": self.machine,
            "steps": self.steps,
            "tests": self.tests,
            "bench": self.bench,
            "overlap_timeline": self.timeline,
            "fill_wheels": WHEEL_FILL,
        }

    def write(self) -> None:
        if self.out is None:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        data = self.results()
        (self.out / "gpu_check.json").write_text(json.dumps(data, indent=1) + "\n")
        (self.out / "gpu_check.md").write_text(markdown(data))


def _mib(n: int) -> str:
    return f"{n / 2**20:g} MiB" if n >= 2**20 else f"{n // 1024} KiB"


def markdown(data: dict[str, Any]) -> str:
    m = data["machine"]
    lines = [
        f"# tieredkv GPU check: {m.get('device_name', '?')} ({data['date'][:10]})",
        "",
        f"**Verdict: {data['verdict'].upper()}** (`scripts/gpu_check.sh {' '.join(data['arguments'])}`, "
        f"{data['seconds']:.0f} s)",
        "",
        "| | |",
        "|---|---|",
        f"| device | `{data['device']}`: {m.get('device_name', '?')}"
        + (f", compute capability {m['capability']}, {m.get('gpu_memory_gib')} GiB" if m.get("capability") else "")
        + " |",
    ]
    if data["device"] == "cuda":
        lines += [
            f"| driver | {m.get('driver', '?')} (CUDA driver API {m.get('cuda_driver_api', '?')}) |",
            f"| torch | {m.get('torch', '?')} (CUDA {m.get('torch_cuda', '?')}) |",
            f"| CuPy | {m.get('cupy', 'not installed: ' + str(m.get('cupy_error', '')))} "
            f"(CUDA runtime {m.get('cupy_cuda_runtime', '?')}) |",
        ]
    else:
        lines.append(f"| torch | {m.get('torch', '?')} |")
    lines += [
        f"| numpy / Python | {m.get('numpy', '?')} / {m.get('python', '?')} |",
        f"| CPU | {m.get('cpu', '?')} ({m.get('cpu_count', '?')} CPUs) |",
        f"| vLLM | {m.get('vllm') or ('hidden (--without-vllm)' if data.get('vllm_hidden') else 'not installed')} |",
        f"| commit | {data.get('commit') or 'unknown (no git here: pass --commit)'} |",
        f"| source digest | `{data.get('source_digest')}` (`python scripts/gpu_check.py --source-digest`) |",
        f"| folder to commit | `{data['suggested_dir']}/` |",
        "",
        "## Steps",
        "",
        "| step | result | time | detail |",
        "|---|---|---|---|",
    ]
    for step in data["steps"]:
        log = f" ([log]({step['log']}))" if step.get("log") else ""
        detail = step["detail"].replace("|", "\\|")
        lines.append(f"| {step['name']} | **{step['status'].upper()}** | {step['seconds']:.0f} s | {detail}{log} |")
    for name, counts in data["tests"].items():
        if counts["failures"]:
            lines += ["", f"### {name}: failures", ""]
            lines += [f"- `{f}`" for f in counts["failures"][:50]]
        if counts["skip_reasons"]:
            lines += ["", f"### {name}: skipped", ""]
            lines += [f"- {n} x {reason or '(no reason)'}" for reason, n in counts["skip_reasons"].items()]
    timeline = data.get("overlap_timeline")
    if timeline:
        lines += ["", "## d2h / h2d / compute overlap (integration test, CUDA events)", "",
                  "Milliseconds after forward N ended; both copies were queued behind it and ran "
                  "beside forward N+1.", "",
                  "| backend | MiB each way | d2h | h2d | forward N+1 |", "|---|---|---|---|---|"]
        for name, t in timeline.items():
            span = " | ".join(f"{t[k][0]:.2f}-{t[k][1]:.2f}" for k in ("d2h_ms", "h2d_ms", "forward_ms"))
            lines.append(f"| {name} | {t['bytes_each_way'] / 2**20:g} | {span} |")
    bench = data.get("bench")
    if bench:
        backends = list(bench["targets_met_by_backend"])
        lines += [
            "", f"## Transfer benchmark ({bench['profile']} profile): {bench.get('device')}", "",
            f"Targets (ratio to one contiguous copy of the same bytes): {bench.get('targets')}. "
            f"`copy_backend: auto` picks **{bench.get('auto_backend')}** here. Targets met: "
            + ", ".join(f"{b} {v['passed']}/{v['judged']}" for b, v in bench["targets_met_by_backend"].items())
            + ". Full table: `transfer_bench.txt`.",
            "",
            "| dir | chunk | batch | contig GB/s | "
            + " | ".join(f"{b} GB/s (ratio)" for b in [*backends, "vllm"]) + " | target | "
            + " | ".join(backends) + " |",
            "|---|---|---|---|" + "---|" * (len(backends) + 1) + "---|" + "---|" * len(backends),
        ]
        for row in bench["rows"]:
            g, r = row["gbps"], row["ratio_to_contig"]
            cells = " | ".join(f"{g[b]:.2f} ({r[b]:.2f})" for b in [*backends, "vllm"] if b in g)
            verdicts = " | ".join(row.get("result_by_backend", {}).get(b, "?") for b in backends)
            lines.append(f"| {row['direction']} | {_mib(row['chunk_bytes'])} | {row['batch']} | "
                         f"{g['contig']:.2f} | {cells} | {row.get('target_text') or '-'} | {verdicts} |")
    lines += ["", "Wheel folder (pytest-asyncio, pytest-timeout) filled with:", "",
              f"    {data['fill_wheels']}", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- --copy-check
# A short copy run, small enough for compute-sanitizer: every copy backend moves the right
# bytes between small KV caches in vLLM's CUDA layouts and host slots, directly and through
# the transfer engine's lanes, and touches nothing else. Needs torch and tieredkv, imported
# only here; prints one line per (layout, backend) and a final "copy-check: ..." line.

COPY_CASES = ("flash_attn-LBNHC", "triton_attn-LBNHC-fp8", "flashinfer-sm100-BLHNC",
              "flashinfer-sm90-LBNHC-block128", "flashmla-MLA")
_CC_LAYERS, _CC_BLOCKS, _CC_CHUNK, _CC_SLOTS = 2, 16, 4, 6


def _copy_check_imports() -> None:
    """torch and tieredkv for the copy check, bound as module globals (the rest of this
    script runs without them)."""
    global torch, CASE_BY_ID, build_kv_caches, HostPool, CopyBackend, CupyCopyBackend
    global NativeCopyBackend, TorchCopyBackend, TransferEngine, LoadChunk, LoadJob, StoreJob, KVViews
    sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "transfer")]
    import torch
    from vllm_cuda_layouts import CASE_BY_ID, build_kv_caches

    from tieredkv.protocol import LoadChunk, LoadJob, StoreJob
    from tieredkv.transfer.backends.base import CopyBackend
    from tieredkv.transfer.backends.cupy_backend import CupyCopyBackend
    from tieredkv.transfer.backends.native_backend import NativeCopyBackend
    from tieredkv.transfer.backends.torch_backend import TorchCopyBackend
    from tieredkv.transfer.engine import TransferEngine
    from tieredkv.transfer.host_pool import HostPool
    from tieredkv.transfer.kv_views import KVViews


class Mismatch(AssertionError):
    """A wrong byte found by the copy check."""


def _copy_backends(device: torch.device) -> tuple[dict[str, CopyBackend], list[str]]:
    found: dict[str, CopyBackend] = {"torch": TorchCopyBackend()}
    notes = []
    if device.type == "cuda":
        ok, why = CupyCopyBackend.available(device)
        if ok:
            found["cupy"] = CupyCopyBackend(device)
        else:
            notes.append(f"cupy not checked: {why}")
    else:
        ok, why = NativeCopyBackend.available(device)
        if ok:
            found["native"] = NativeCopyBackend()
        else:
            notes.append(f"native not checked: {why}")
    return found, notes


def _slot_rows(kv: KVViews, host: HostPool, slot: int, layer: int, position: int) -> torch.Tensor:
    chunk_blocks = kv.chunk_blocks_for(host.payload_bytes)
    offset = kv.layer_offsets(chunk_blocks)[layer] + position * kv.block_bytes[layer]
    return host.slot(slot)[offset : offset + kv.block_bytes[layer]]


def _copy_check_case(case: Any, device: torch.device, name: str, backend: CopyBackend) -> int:
    """Direct d2h/h2d with the backend on a side stream, then a store + load through the
    engine's lanes; returns the number of blocks verified."""
    caches, raw = build_kv_caches(case, _CC_LAYERS, _CC_BLOCKS, device, seed=7)
    replica, replica_raw = build_kv_caches(case, _CC_LAYERS, _CC_BLOCKS, "cpu", seed=7)
    kv = KVViews.from_kv_caches(caches, _CC_BLOCKS, layout=case.layout)
    ref = KVViews.from_kv_caches(replica, _CC_BLOCKS, layout=case.layout)
    host = HostPool(_CC_SLOTS, kv.slot_payload_bytes(_CC_CHUNK), pin=device.type == "cuda")
    host.buffer.zero_()
    cuda = device.type == "cuda"
    stream = torch.cuda.Stream(device) if cuda else None
    verified = 0

    def on_stream(fn) -> None:
        if stream is None:
            fn()
            return
        with torch.cuda.stream(stream):
            fn()
        stream.synchronize()

    down = [(0, 0, (9, 2, 14, 5)), (3, 1, (7, 11))]  # a full chunk and a partial one
    on_stream(lambda: backend.d2h(kv, host, down))
    for slot, first, ids in down:
        for layer in range(_CC_LAYERS):
            for j, block in enumerate(ids):
                if not torch.equal(_slot_rows(kv, host, slot, layer, first + j), ref.rows[layer][block]):
                    raise Mismatch(f"{case.id}/{name}: d2h block {block} layer {layer} -> slot {slot}")
                verified += 1
    up = [(0, 1, (0, 1, 3)), (3, 1, (15, 12))]
    on_stream(lambda: backend.h2d(kv, host, up))
    for slot, first, ids in up:
        for layer in range(_CC_LAYERS):
            for j, block in enumerate(ids):
                ref.rows[layer][block] = _slot_rows(kv, host, slot, layer, first + j)
                verified += 1
    if not torch.equal(raw.cpu(), replica_raw):
        raise Mismatch(f"{case.id}/{name}: h2d left the device cache different from expected")

    engine = TransferEngine(kv, host, None, backend=backend)
    try:
        engine.submit([StoreJob(1, b"c1", 5, (4, 6, 8, 10))])
        _wait_for_job(engine, 1)
        engine.submit([LoadJob(2, "r", (LoadChunk(b"c1", 5, 2, (13, 0)),))])
        _wait_for_job(engine, 2)
    finally:
        engine.shutdown(timeout_s=5.0)
    for layer in range(_CC_LAYERS):
        ref.rows[layer][13] = ref.rows[layer][8]
        ref.rows[layer][0] = ref.rows[layer][10]
    if cuda:
        torch.cuda.synchronize(device)
    if not torch.equal(raw.cpu(), replica_raw):
        raise Mismatch(f"{case.id}/{name}: store + load through the engine gave wrong bytes")
    return verified + 2 * _CC_LAYERS


def _wait_for_job(engine: TransferEngine, job_id: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for result in engine.poll():
            if result.job_id == job_id:
                if not result.ok:
                    raise Mismatch(f"job {job_id} failed: {result.failure}")
                return
        time.sleep(0.005)
    raise Mismatch(f"job {job_id} gave no result in {timeout_s:.0f} s")


def copy_check_main(device_name: str) -> int:
    """The copy check (``--copy-check``); prints a final ``copy-check: ...`` line."""
    _copy_check_imports()
    device = torch.device(device_name)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("copy-check: FAILED: torch sees no CUDA device")
        return 1
    backends, notes = _copy_backends(device)
    for note in notes:
        print(note)
    total = 0
    try:
        for case_id in COPY_CASES:
            case = CASE_BY_ID[case_id]
            for name, backend in backends.items():
                count = _copy_check_case(case, device, name, backend)
                total += count
                print(f"{case.id:34} {name:7} ok ({count} blocks)", flush=True)
    except Mismatch as exc:
        print(f"copy-check: FAILED: {exc}")
        return 1
    print(f"copy-check: {len(COPY_CASES)} layouts x {', '.join(backends)}: {total} blocks right"
          + (f" ({'; '.join(notes)})" if notes else ""))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/gpu_check.sh", description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--out", type=Path, default=None,
                        help="results folder (default: $OUT if set, else benchmarks/results/gpu/<name>-<date>)")
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl",
                        help="folder of extra wheels (default .whl/)")
    parser.add_argument("--no-install", action="store_true",
                        help="install nothing; run from the checkout with PYTHONPATH")
    parser.add_argument("--bench", choices=("quick", "smoke", "full", "none"), default="quick",
                        help="transfer_bench profile (default quick; smoke takes seconds)")
    parser.add_argument("--no-sanitizer", action="store_true", help="copy check without compute-sanitizer")
    parser.add_argument("--skip", action="append", default=[],
                        choices=("wheels", "install", "cuda-tests", "integration", "bench", "copy-check"),
                        help="leave a step out (repeatable)")
    parser.add_argument("--without-vllm", action="store_true",
                        help="hide an installed vLLM from every step, as on the GPU machines")
    parser.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    parser.add_argument("--test-timeout", type=float, default=420.0, help="seconds per pytest step")
    parser.add_argument("--bench-timeout", type=float, default=360.0)
    parser.add_argument("--sanitizer-timeout", type=float, default=300.0, help="seconds for the copy check")
    parser.add_argument("--copy-check", action="store_true",
                        help="only the short copy run (what the copy-check step runs, under "
                        "compute-sanitizer when there is one) on --device")
    parser.add_argument("--source-digest", action="store_true",
                        help="print this tree's source digest and exit (compare with the results)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.source_digest:
        print(source_digest())
        return 0
    if args.copy_check:
        return copy_check_main(args.device)
    if args.out is not None:
        args.out = args.out.resolve()
    args.wheels = args.wheels.resolve()
    check = Check(args)
    try:
        if check.environment():
            steps = [("wheels", check.wheels), ("install", check.install),
                     ("cuda-tests", check.cuda_tests), ("integration", check.integration),
                     ("bench", check.run_bench), ("copy-check", check.copy_check)]
            for name, step in steps:
                if check.skip(name):
                    check.record(name, "skip", "--skip " + name)
                    continue
                try:
                    step()
                except Exception as exc:  # noqa: BLE001 - a broken step is a result, not a crash
                    check.record(name, "fail", f"the check itself failed: {exc!r}")
    finally:
        if check.hidden_vllm:
            shutil.rmtree(check.hidden_vllm, ignore_errors=True)
        check.write()
    verdict = check.verdict()
    print(f"[gpu_check] verdict: {verdict.upper()}; results in {check.out}"
          + (f" (commit them under {check.suggested}/)" if check.out != ROOT / check.suggested else ""))
    return 0 if verdict == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
