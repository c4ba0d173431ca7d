"""Paths, provenance, JUnit parsing and the time budget shared by the check's parts."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
INTEGRATION = "tests/transfer/test_gpu_integration.py"
OVERLAP = "overlap"  # -k expression: the integration test that is a speed check, not correctness
RESULT_FILES = ("gpu_check.json", "gpu_check.md", "gpu_check.tar.gz")
# Only pytest-timeout: no test the check runs is async, and a pytest-asyncio plugin loaded into
# every pytest step could clash with the machine's own pytest. Pinned to what CI runs with.
EXTRA_WHEELS = {"pytest_timeout": "pytest-timeout"}
WHEEL_FOLDER = ".whl"  # git-ignored: name it in the device run's carry so it travels
WHEEL_FILL = (
    "python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 "
    "--implementation cp --platform manylinux2014_x86_64 --platform any -d .whl "
    "pytest-timeout==2.4.0"
)
SANITIZER_PATHS = ("/usr/local/cuda/bin/compute-sanitizer", "/opt/cuda/bin/compute-sanitizer")
OWN_KERNELS = "tieredkv_"  # every CUDA kernel tieredkv defines is named tieredkv_* (cupy_backend)
PER_TEST_TIMEOUT_S = 90  # pytest-timeout per test (the project's 1500 s is for e2e runs)
SANITIZER_CAP_S = 120.0
DIGEST_PATTERNS = ("tieredkv/**/*.py", "tieredkv/**/*.c", "tests/transfer/*.py",
                   "benchmarks/transfer_bench.py", "scripts/gpu_check*", "scripts/gpucheck/*.py",
                   "pyproject.toml", "setup.py")


def slug(text: str) -> str:
    """A folder-name-safe form of a device name: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def source_digest(root: Path = ROOT) -> str:
    """sha256 (first 16 hex) over the code this check exercises: ties results to a tree when
    the machine has no git history. ``gpu_check.py --source-digest`` prints it locally."""
    digest = hashlib.sha256()
    files: list[Path] = []
    for pattern in DIGEST_PATTERNS:
        files.extend(p for p in root.glob(pattern) if p.is_file() and "__pycache__" not in p.parts)
    for path in sorted(set(files)):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def git_commit(root: Path = ROOT) -> str | None:
    """HEAD (with ``-dirty`` for uncommitted changes to tracked files), or None without git."""
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=20, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=20, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}{'-dirty' if dirty else ''}" if head else None


def provenance(explicit: str | None, root: Path = ROOT) -> dict[str, str | None]:
    """Which tree ran: ``--commit``, else ``GPU_CHECK_COMMIT`` (the device machines get the
    tree without ``.git``), else git; always the source digest beside it."""
    env = os.environ.get("GPU_CHECK_COMMIT") or None
    commit, source = (explicit, "--commit") if explicit else (env, "GPU_CHECK_COMMIT") if env else (
        git_commit(root), "git")
    return {"commit": commit, "commit_from": source if commit else None,
            "source_digest": source_digest(root)}


def parse_junit(path: Path) -> dict[str, Any]:
    """Counts, failures and skip reasons from a pytest JUnit XML file."""
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
    integration test, which has its own steps."""
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


class Budget:
    """Seconds left of ``total_s``, less a reserve for writing and packing the results.

    Every step's timeout is clipped to what is left, so the whole run ends inside the budget
    (the device machines stop a command at 10 minutes and lose what it had not written).
    """

    RESERVE_S = 5.0

    def __init__(self, total_s: float, clock: Any = time.monotonic) -> None:
        self.total_s = total_s
        self._clock = clock
        self.started = clock()

    def elapsed(self) -> float:
        return self._clock() - self.started

    def left(self) -> float:
        return max(0.0, self.total_s - self.elapsed() - self.RESERVE_S)

    def clip(self, cap_s: float) -> float:
        """The timeout for a step that would take at most ``cap_s``."""
        return max(0.0, min(cap_s, self.left()))
