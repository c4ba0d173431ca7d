"""scripts/gpu_check.sh works: its CPU half runs here, as on a GPU machine without vLLM.

``--device cpu`` runs the GPU integration test on the CPU, the transfer benchmark's smoke
profile and the copy check; ``--without-vllm`` hides the installed vLLM (the GPU machines have
none) and ``--no-install`` leaves this environment alone. About 40 s on 2 cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"

pytestmark = pytest.mark.timeout(300)


def _helper():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def _run(*args: str, timeout: float = 280) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("OUT", None)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_cpu_run_writes_passing_results(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = _run("--device", "cpu", "--out", str(out), "--no-install", "--bench", "smoke",
                "--without-vllm")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    data = json.loads((out / "gpu_check.json").read_text())
    assert data["verdict"] == "pass" and data["device"] == "cpu"
    steps = {step["name"]: step for step in data["steps"]}
    assert [s["name"] for s in data["steps"]] == [
        "environment", "wheels", "install", "cuda-tests", "integration", "bench", "bench-targets",
        "copy-check",
    ]
    assert steps["environment"]["status"] == "pass"
    assert steps["cuda-tests"]["status"] == "skip"
    for name in ("integration", "bench", "copy-check"):
        assert steps[name]["status"] == "pass", steps[name]
    integration = data["tests"]["integration"]
    assert integration["passed"] >= 30 and integration["failed"] == integration["errors"] == 0
    # Without vLLM only the cross-check against the installed vLLM is skipped.
    assert integration["skipped"] == 1, integration["skip_reasons"]
    assert data["machine"]["vllm"] is None and data["vllm_hidden"]
    assert data["suggested_dir"].startswith("benchmarks/results/gpu/cpu-")
    assert len(data["source_digest"]) == 16  # (the tree may change while this runs)
    bench = data["bench"]
    assert bench["profile"] == "smoke" and bench["rows"]
    assert all("target_text" in row and "result_by_backend" in row for row in bench["rows"])
    for name in ("gpu_check.md", "transfer_bench.json", "transfer_bench.txt",
                 "junit-integration.xml", "logs/integration.log", "logs/copy-check.log"):
        assert (out / name).is_file(), name
    md = (out / "gpu_check.md").read_text()
    assert "**Verdict: PASS**" in md and "| integration | **PASS**" in md
    assert "copy-check: 5 layouts" in (out / "logs" / "copy-check.log").read_text()


def test_help_says_how_to_fill_the_wheel_folder() -> None:
    proc = _run("--help", timeout=60)
    assert proc.returncode == 0
    assert (
        "python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 "
        "--implementation cp --platform manylinux2014_x86_64 --platform any -d .whl "
        "pytest-asyncio pytest-timeout"
    ) in proc.stdout
    assert "--device" in proc.stdout and "compute-sanitizer" in proc.stdout


def test_a_failing_step_fails_the_verdict_and_the_exit_status(tmp_path: Path) -> None:
    out = tmp_path / "results"
    # An integration run that selects no test counts as a failure, never as a pass.
    proc = _run("--device", "cpu", "--out", str(out), "--no-install", "--bench", "none",
                "--skip", "copy-check", "--test-timeout", "0.01")
    assert proc.returncode == 1, proc.stdout[-3000:]
    data = json.loads((out / "gpu_check.json").read_text())
    steps = {step["name"]: step for step in data["steps"]}
    assert data["verdict"] == "fail" and steps["integration"]["status"] == "fail"
    assert "timed out" in steps["integration"]["detail"]
    assert "**Verdict: FAIL**" in (out / "gpu_check.md").read_text()


def test_helpers(tmp_path: Path) -> None:
    helper = _helper()
    assert helper.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    (tmp_path / "tieredkv").mkdir()
    (tmp_path / "tieredkv" / "a.py").write_text("x = 1\n")
    first = helper.source_digest(tmp_path)
    assert first == helper.source_digest(tmp_path)
    (tmp_path / "tieredkv" / "a.py").write_text("x = 2\n")
    assert helper.source_digest(tmp_path) != first
    files = helper.cuda_test_files()
    assert "tests/transfer/test_cuda.py" in files
    assert helper.INTEGRATION not in files and not any(f.startswith("tests/e2e/") for f in files)
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite><testcase classname="t" name="ok"/>'
        '<testcase classname="t" name="bad"><failure message="x"/></testcase>'
        '<testcase classname="t" name="gone"><skipped message="needs a CUDA device"/></testcase>'
        '</testsuite></testsuites>')
    counts = helper.parse_junit(junit)
    assert (counts["passed"], counts["failed"], counts["skipped"]) == (1, 1, 1)
    assert counts["skip_reasons"] == {"needs a CUDA device": 1} and counts["failures"] == ["t::bad"]
    assert helper.parse_junit(tmp_path / "missing.xml")["errors"] == 1


def test_missing_wheels_are_a_warning_that_says_how_to_fill_the_folder(tmp_path: Path) -> None:
    helper = _helper()
    args = helper.parse_args(["--device", "cpu", "--out", str(tmp_path), "--wheels",
                              str(tmp_path / "empty")])
    check = helper.Check(args)
    check._importable = lambda module: False  # as on a machine without pytest-asyncio
    check.wheels()
    step = check.steps[-1]
    assert step["name"] == "wheels" and step["status"] == "warn"
    assert helper.WHEEL_FILL in step["detail"] and "pytest-asyncio" in step["detail"]
    assert json.loads((tmp_path / "gpu_check.json").read_text())["verdict"] == "pass"
