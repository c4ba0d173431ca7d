"""scripts/gpu_check.py works before a GPU ever runs it: a rehearsal of the whole check on CPU.

The GPU machines return at most 8 files from a command that may run 10 minutes, get the tree
without ``.git`` and have no vLLM: the check must write exactly its three result files, stay
inside its time budget (a step cut short is ``timeout``, and the files are still written), and
fail its exit status only on a correctness failure. ``--device cpu --without-vllm`` runs the
CPU half here as on such a machine. About 70 s on 2 cores.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
sys.path.insert(0, str(ROOT / "scripts"))

from gpucheck import report, steps  # noqa: E402
from gpucheck.cli import parse_args  # noqa: E402
from gpucheck.common import (  # noqa: E402
    INTEGRATION,
    RESULT_FILES,
    WHEEL_FILL,
    Budget,
    cuda_test_files,
    parse_junit,
    provenance,
    slug,
    source_digest,
)
from gpucheck.runner import Runner  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _run(*args: str, timeout: float = 280,
         env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ}
    for name in ("OUT", "GPU_CHECK_COMMIT", "GPU_CHECK_TIMELINE"):
        env.pop(name, None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def _archive(out: Path) -> dict[str, bytes]:
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        return {m.name.removeprefix("gpu_check/"): tar.extractfile(m).read()  # type: ignore[union-attr]
                for m in tar.getmembers() if m.isfile()}


def test_cpu_rehearsal_writes_three_files_and_passes(tmp_path: Path) -> None:
    out = tmp_path / "results"
    proc = _run("--device", "cpu", "--out", str(out), "--bench", "smoke", "--without-vllm")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == sorted(RESULT_FILES)
    data = json.loads((out / "gpu_check.json").read_text())
    assert (data["verdict"], data["device"]) == ("pass", "cpu")
    assert data["seconds"] <= data["budget_s"] == 360  # the default: a normal run fits 6 minutes
    assert [(s["name"], s["kind"]) for s in data["steps"]] == [
        ("environment", "setup"), ("wheels", "setup"), ("build", "setup"),
        ("cuda-tests", "correctness"), ("integration", "correctness"), ("copy-check", "correctness"),
        ("overlap", "correctness"), ("bench", "speed"), ("sanitizer", "correctness"),
    ]
    status = {s["name"]: s["status"] for s in data["steps"]}
    assert status["cuda-tests"] == status["sanitizer"] == "skip" and status["bench"] == "info"
    assert all(status[n] == "pass" for n in ("environment", "integration", "copy-check", "overlap"))
    assert data["speed"] == "not judged"  # CPU figures are not judged
    integration = data["tests"]["integration"]
    assert integration["passed"] >= 28 and integration["failed"] == integration["errors"] == 0
    assert data["tests"]["overlap"]["passed"] == 1
    assert data["machine"]["vllm"] is None and data["vllm_hidden"]
    assert data["machine"]["tieredkv_from"] == str(ROOT / "tieredkv")
    assert len(data["source_digest"]) == 16
    archive = _archive(out)
    for name in ("logs/integration.log", "logs/overlap.log", "logs/copy-check.log", "logs/bench.log",
                 "junit-integration.xml", "transfer_bench.json"):
        assert name in archive, sorted(archive)
    assert b"copy-check: 6 layouts" in archive["logs/copy-check.log"]
    assert all(b"::test_d2h_and_h2d_overlap" not in line for line in
               archive["logs/integration.log"].splitlines() if line.endswith(b"PASSED"))
    md = (out / "gpu_check.md").read_text()
    assert "**Correctness: PASS**" in md and md.strip() in proc.stdout  # printed at the end too


def test_a_tiny_budget_cuts_later_steps_short_and_still_writes_the_files(tmp_path: Path) -> None:
    out = tmp_path / "results"
    # Every test the check runs stalls first (a pytest plugin the check's pytest steps load
    # through the inherited PYTHONPATH and PYTEST_ADDOPTS), so the integration step needs more
    # than the budget however fast this machine is: it and everything after it must be cut.
    (tmp_path / "stall_every_test.py").write_text(
        "import time\n\ndef pytest_runtest_setup(item):\n    time.sleep(120)\n")
    proc = _run("--device", "cpu", "--out", str(out), "--bench", "smoke", "--without-vllm",
                "--budget-s", "20",
                env_extra={"PYTHONPATH": str(tmp_path), "PYTEST_ADDOPTS": "-p stall_every_test"})
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]  # nothing wrong found
    assert sorted(p.name for p in out.iterdir()) == sorted(RESULT_FILES)
    data = json.loads((out / "gpu_check.json").read_text())
    status = {s["name"]: s["status"] for s in data["steps"]}
    assert data["verdict"] == "incomplete" and "fail" not in status.values(), status
    for name in ("integration", "copy-check", "overlap", "bench"):
        assert status[name] == "timeout", status
    assert status["sanitizer"] == "skip"  # CPU: nothing to run
    assert data["seconds"] <= data["budget_s"] == 20
    assert "**Correctness: INCOMPLETE**" in (out / "gpu_check.md").read_text()
    assert "logs/integration.log" in _archive(out)


def test_a_failing_test_fails_correctness_and_the_exit_status(tmp_path: Path) -> None:
    failing = tmp_path / "test_wrong_bytes.py"
    failing.write_text("def test_ok():\n    pass\n\n\ndef test_wrong_bytes():\n    assert 1 == 2\n")
    runner = Runner(parse_args(["--device", "cpu", "--out", str(tmp_path / "out")]))
    try:
        runner.machine = {"pytest_timeout": True}
        steps.pytest_step(runner, "integration", "correctness", [str(failing)], None, None)
    finally:
        runner.close()
    step = runner.steps[-1]
    assert (step["status"], runner.tests["integration"]["failed"]) == ("fail", 1)
    # JUnit's class name is the module's path from pytest's rootdir, which depends on where
    # the checkout and the temporary folder lie: judge the failing test by its own names.
    (failure,) = runner.tests["integration"]["failures"]
    assert failure.split(".")[-1] == "test_wrong_bytes::test_wrong_bytes", failure
    assert report.verdicts(runner.steps)["correctness"] == "fail"
    assert report.exit_status(runner.steps) == 1


def _step(name: str, kind: str, status: str) -> dict[str, Any]:
    return {"name": name, "kind": kind, "status": status, "seconds": 0.0, "detail": "", "log": None}


def test_a_missed_speed_target_never_fails_a_correct_run() -> None:
    correct = [_step("environment", "setup", "pass"), _step("integration", "correctness", "pass")]
    slow = [*correct, _step("bench", "speed", "fail"), _step("overlap", "speed", "pass")]
    assert report.verdicts(slow) == {"correctness": "pass", "speed": "missed"}
    assert report.exit_status(slow) == 0
    cut = [*correct, _step("copy-check", "correctness", "timeout"), _step("bench", "speed", "timeout")]
    assert report.verdicts(cut) == {"correctness": "incomplete", "speed": "incomplete"}
    assert report.exit_status(cut) == 0
    broken = [*correct, _step("copy-check", "correctness", "fail"), _step("bench", "speed", "pass")]
    assert report.verdicts(broken) == {"correctness": "fail", "speed": "met"}
    assert report.exit_status(broken) == 1
    no_gpu = [_step("environment", "setup", "fail")]
    assert report.verdicts(no_gpu)["correctness"] == "incomplete"


def test_every_backend_that_ran_is_judged_not_only_auto() -> None:
    assert steps.every_backend_met({"torch": {"passed": 12, "judged": 12}, "cupy": {"passed": 12, "judged": 12}})
    assert not steps.every_backend_met({"torch": {"passed": 12, "judged": 12}, "cupy": {"passed": 9, "judged": 12}})
    assert not steps.every_backend_met({"torch": {"passed": 0, "judged": 0}})


def test_the_contiguous_baseline_copies_uint8_to_uint8() -> None:
    from benchmarks.transfer_bench import Setup

    setup = Setup(torch.device("cpu"), 64 * 1024, layers=4, chunk_blocks=1, max_batch=1)
    assert setup.contig_src.dtype == setup.contig_dst.dtype == torch.uint8
    assert setup.contig_src.numel() == setup.contig_dst.numel() == 64 * 1024


def test_budget_clips_every_step_to_what_is_left() -> None:
    now = [100.0]
    budget = Budget(60.0, clock=lambda: now[0])
    assert budget.clip(200.0) == 60.0 - Budget.RESERVE_S and budget.clip(10.0) == 10.0
    now[0] += 50.0
    assert budget.clip(200.0) == 60.0 - 50.0 - Budget.RESERVE_S
    now[0] += 30.0
    assert budget.left() == budget.clip(10.0) == 0.0


def test_help_shows_the_one_line_command_and_the_wheel_folder() -> None:
    proc = _run("--help", timeout=60)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    assert 'python3 scripts/gpu_check.py --out "$OUT"' in text and "GPU_CHECK_COMMIT=" in text
    assert WHEEL_FILL in text and 'carry: [".whl"]' in text
    assert "--budget-s" in text and "compute-sanitizer" in text
    sh = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--source-digest"], cwd="/",
                        env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True,
                        timeout=60, check=False)
    assert sh.stdout.strip() == source_digest(), sh.stderr  # the shell wrapper runs the same check


def test_provenance_without_git_comes_from_the_environment(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "tieredkv").mkdir()
    (tmp_path / "tieredkv" / "a.py").write_text("x = 1\n")
    monkeypatch.delenv("GPU_CHECK_COMMIT", raising=False)
    assert provenance(None, tmp_path)["commit"] is None  # no .git, nothing given
    monkeypatch.setenv("GPU_CHECK_COMMIT", "0123abc")
    got = provenance(None, tmp_path)
    assert (got["commit"], got["commit_from"]) == ("0123abc", "GPU_CHECK_COMMIT")
    assert got["source_digest"] == source_digest(tmp_path) and len(got["source_digest"]) == 16
    assert provenance("feed42", tmp_path)["commit_from"] == "--commit"
    (tmp_path / "tieredkv" / "a.py").write_text("x = 2\n")
    assert source_digest(tmp_path) != got["source_digest"]


def test_helpers(tmp_path: Path) -> None:
    assert slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    files = cuda_test_files()
    assert "tests/transfer/test_cuda.py" in files
    assert INTEGRATION not in files and not any(f.startswith("tests/e2e/") for f in files)
    junit = tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite><testcase classname="t" name="ok"/>'
        '<testcase classname="t" name="bad"><failure message="x"/></testcase>'
        '<testcase classname="t" name="gone"><skipped message="needs a CUDA device"/></testcase>'
        '</testsuite></testsuites>')
    counts = parse_junit(junit)
    assert (counts["passed"], counts["failed"], counts["skipped"]) == (1, 1, 1)
    assert counts["skip_reasons"] == {"needs a CUDA device": 1} and counts["failures"] == ["t::bad"]
    assert parse_junit(tmp_path / "missing.xml")["errors"] == 1


def test_missing_wheels_are_a_warning_that_says_how_to_fill_the_folder(tmp_path: Path) -> None:
    runner = Runner(parse_args(["--device", "cpu", "--out", str(tmp_path), "--wheels",
                                str(tmp_path / "empty")]))
    try:
        runner.machine = {"pytest_timeout": False, "pytest_asyncio": False}  # as on a bare machine
        steps.wheels(runner)
    finally:
        runner.close()
    step = runner.steps[-1]
    assert step["name"] == "wheels" and step["status"] == "warn"
    assert WHEEL_FILL in step["detail"] and "pytest-timeout" in step["detail"]
    assert report.exit_status(runner.steps) == 0
    # Only pytest-timeout, pinned: no test the check runs is async, and an unpinned
    # pytest-asyncio loaded into every pytest step could clash with the machine's pytest.
    assert "asyncio" not in step["detail"]
    assert re.search(r"(?:^| )pytest-timeout==\d+\.\d+\.\d+$", WHEEL_FILL), WHEEL_FILL


FAKE_SANITIZER = """#!/usr/bin/env bash
echo "$* PYTORCH_NO_CUDA_MEMORY_CACHING=$PYTORCH_NO_CUDA_MEMORY_CACHING" > "{args}"
{body}
"""


def _fake_sanitizer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> Path:
    """A stand-in ``compute-sanitizer`` first on PATH that runs ``body``; the file its
    arguments are written to."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "compute-sanitizer"
    seen = tmp_path / "args.txt"
    fake.write_text(FAKE_SANITIZER.format(args=seen, body=body))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return seen


@pytest.mark.parametrize(("body", "status", "exit_status"), [
    ('echo "copy-check: 6 layouts x torch, cupy: 312 blocks right"; '
     'echo "========= ERROR SUMMARY: 0 errors"; exit 0', "pass", 0),
    ('echo "copy-check: 6 layouts x torch, cupy: 312 blocks right"; '
     'echo "========= Invalid __global__ write of size 16 bytes"; '
     'echo "========= ERROR SUMMARY: 3 errors"; exit 99', "fail", 1),
    ('echo "compute-sanitizer: unrecognized option --report-api-errors" >&2; exit 1', "warn", 0),
], ids=["clean", "memcheck-errors", "sanitizer-too-old"])
def test_sanitizer_step_judges_memcheck_on_tieredkv_kernels_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, status: str, exit_status: int
) -> None:
    """The sanitizer's own output is judged (a stand-in prints what memcheck prints): errors in
    tieredkv's kernels fail correctness; a sanitizer that cannot run the check is a warning."""
    seen = _fake_sanitizer(tmp_path, monkeypatch, body)
    runner = Runner(parse_args(["--device", "cuda", "--out", str(tmp_path / "out")]))
    try:
        steps.sanitizer(runner)
    finally:
        runner.close()
    step = runner.steps[-1]
    assert (step["name"], step["status"]) == ("sanitizer", status), step
    assert report.exit_status(runner.steps) == exit_status
    args = seen.read_text()
    assert "--tool memcheck --kernel-name kns=tieredkv_ --report-api-errors no" in args
    assert args.rstrip().endswith("--copy-check --device cuda PYTORCH_NO_CUDA_MEMORY_CACHING=1")


@pytest.mark.parametrize(("body", "budget", "status"), [
    ('echo "copy-check: 6 layouts x torch, cupy: 312 blocks right"; exec sleep 60', None, "warn"),
    ('echo "========= Invalid __global__ read of size 16 bytes"; '
     'echo "========= ERROR SUMMARY: 1 error"; exec sleep 60', None, "fail"),
    ("exit 0", "0.5", "warn"),
], ids=["cut-short", "errors-then-cut-short", "not-started"])
def test_a_sanitizer_the_budget_stops_is_a_warning_not_an_incomplete_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, budget: str | None, status: str
) -> None:
    """memcheck is a supplementary check (the copy-check step proved the bytes): cut short or
    never started, it must not turn a run whose bytes and ordering tests passed INCOMPLETE;
    errors it reported before the cut still fail correctness."""
    _fake_sanitizer(tmp_path, monkeypatch, body)
    monkeypatch.setitem(steps.CAPS_S, "sanitizer", 2.0)
    runner = Runner(parse_args(["--device", "cuda", "--out", str(tmp_path / "out"),
                                *(["--budget-s", budget] if budget else [])]))
    proven = [_step(n, "correctness", "pass") for n in ("cuda-tests", "integration", "copy-check")]
    try:
        steps.sanitizer(runner)
    finally:
        runner.close()
    step = runner.steps[-1]
    assert (step["name"], step["status"]) == ("sanitizer", status), step
    verdict = report.verdicts([*proven, step])["correctness"]
    assert verdict == ("fail" if status == "fail" else "pass"), step
    if status == "warn":
        assert "supplementary" in step["detail"]
        assert ("not started" if budget else "cut short") in step["detail"]
