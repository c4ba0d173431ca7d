"""Running the check's steps inside the budget, recording them, and writing the three files.

The output folder only ever holds ``gpu_check.json``, ``gpu_check.md`` and
``gpu_check.tar.gz`` (the device machines return at most 8 files); every log, JUnit file,
timeline and benchmark file is written to a temporary folder and packed into the archive,
which is rewritten after every step, like the JSON and Markdown, so that a run stopped from
outside still leaves its results.
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpucheck import report
from gpucheck.common import RESULT_FILES, ROOT, WHEEL_FILL, Budget

MAX_MEMBER_BYTES = 4 << 20  # a longer log keeps its first and last 2 MiB in the archive
HIDDEN_VLLM = (
    'raise ModuleNotFoundError("No module named \'vllm\' (hidden by gpu_check --without-vllm, '
    'as on the GPU machines)", name="vllm")\n'
)


@dataclass
class Ran:
    """One command's outcome: exit status (124: cut short), its log (archive path), seconds."""

    rc: int
    log: str
    seconds: float
    timed_out: bool
    timeout_s: float

    def text(self, work: Path) -> str:
        return (work / self.log).read_text(errors="replace")


class Runner:
    """State of one check: budget, temporary folder, steps recorded, machine facts."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device: str = args.device
        self.python = sys.executable
        self.budget = Budget(args.budget_s)
        self.date = dt.datetime.now(dt.UTC)
        self.work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
        self.out: Path | None = args.out
        self.steps: list[dict[str, Any]] = []
        self.tests: dict[str, Any] = {}
        self.bench: dict[str, Any] | None = None
        self.timeline: dict[str, Any] | None = None
        self.machine: dict[str, Any] = {}
        self.provenance: dict[str, Any] = {}
        self.suggested = ""
        self.env = dict(os.environ)
        self.env.pop("GPU_CHECK_TIMELINE", None)
        self.pythonpath = [str(ROOT)]  # the tree under test comes before anything installed
        self.pytest_extra: list[str] = []
        if args.without_vllm:
            hidden = self.work / "_no-vllm"
            (hidden / "vllm").mkdir(parents=True)
            (hidden / "vllm" / "__init__.py").write_text(HIDDEN_VLLM)
            self.pythonpath.insert(0, str(hidden))

    # -------------------------------------------------------------- running things

    def run_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = dict(self.env)
        parts = [*self.pythonpath, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
        env["PYTHONPATH"] = os.pathsep.join(parts)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.setdefault("PYTHONDONTWRITEBYTECODE", "1")
        env.update(extra or {})
        return env

    def run(self, name: str, cmd: list[str], cap_s: float, extra_env: dict[str, str] | None = None) -> Ran:
        """Run ``cmd`` in the tree for at most ``cap_s``, clipped to the budget; its output to
        logs/<name>.log. Cut short: its whole process group is stopped and ``timed_out`` set."""
        timeout = self.budget.clip(cap_s)
        log = self.work / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        print(f"[gpu_check] {name}: {' '.join(cmd)} (at most {timeout:.0f} s)", flush=True)
        timed_out, rc = False, 124
        with open(log, "w") as fh:
            fh.write(f"$ {' '.join(cmd)}\n")
            fh.flush()
            if timeout < 1.0:
                timed_out = True
                fh.write("[gpu_check] not started: the time budget is spent\n")
            else:
                try:
                    proc = subprocess.Popen(cmd, cwd=ROOT, env=self.run_env(extra_env), stdout=fh,
                                            stderr=subprocess.STDOUT, start_new_session=True)
                except OSError as exc:
                    rc = 127
                    fh.write(f"\n[gpu_check] could not start: {exc}\n")
                else:
                    try:
                        rc = proc.wait(timeout=timeout)
                    except subprocess.TimeoutExpired:
                        timed_out = True
                        _stop_group(proc)
                        fh.write(f"\n[gpu_check] cut short after {timeout:.0f} s (budget)\n")
        seconds = time.monotonic() - start
        print(f"[gpu_check] {name}: {'cut short' if timed_out else f'exit {rc}'} in {seconds:.1f} s",
              flush=True)
        return Ran(124 if timed_out else rc, log.relative_to(self.work).as_posix(), seconds,
                   timed_out, timeout)

    def record(self, name: str, kind: str, status: str, detail: str, ran: Ran | None = None,
               seconds: float | None = None) -> dict[str, Any]:
        """One step's outcome. ``kind``: setup, correctness or speed (judged separately)."""
        step = {"name": name, "kind": kind, "status": status,
                "seconds": round(seconds if seconds is not None else ran.seconds if ran else 0.0, 1),
                "detail": detail, "log": ran.log if ran else None}
        self.steps.append(step)
        print(f"[gpu_check] {name}: {status.upper()} ({kind}) - {detail}", flush=True)
        self.write()
        return step

    def skip(self, name: str) -> bool:
        return name in self.args.skip

    # -------------------------------------------------------------- results

    def results(self) -> dict[str, Any]:
        verdicts = report.verdicts(self.steps)
        return {
            "tool": "scripts/gpu_check.py",
            "device": self.device,
            "date": self.date.isoformat(timespec="seconds"),
            **self.provenance,
            "suggested_dir": self.suggested,
            "arguments": sys.argv[1:],
            "vllm_hidden": bool(self.args.without_vllm),
            "budget_s": self.args.budget_s,
            "seconds": round(self.budget.elapsed(), 1),
            "verdict": verdicts["correctness"],
            "speed": verdicts["speed"],
            "machine": self.machine,
            "steps": self.steps,
            "tests": self.tests,
            "bench": self.bench,
            "overlap_timeline": self.timeline,
            "files": list(RESULT_FILES),
            "fill_wheels": WHEEL_FILL,
        }

    def write(self) -> str:
        """The three result files, from what is known now; returns the Markdown."""
        data = self.results()
        text = report.markdown(data)
        if self.out is None:
            return text
        self.out.mkdir(parents=True, exist_ok=True)
        _atomic(self.out / "gpu_check.json", (json.dumps(data, indent=1) + "\n").encode())
        _atomic(self.out / "gpu_check.md", text.encode())
        _atomic(self.out / "gpu_check.tar.gz", _pack(self.work))
        return text

    def close(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the step's process group (pytest, a sanitizer's child), then SIGKILL."""
    for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def _atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _pack(work: Path) -> bytes:
    """Every file of the temporary folder as a .tar.gz (long logs keep their head and tail)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path in sorted(p for p in work.rglob("*")  # _folders: installed wheels, build files
                           if p.is_file() and not p.relative_to(work).parts[0].startswith("_")):
            data = path.read_bytes()
            if len(data) > MAX_MEMBER_BYTES:
                half = MAX_MEMBER_BYTES // 2
                data = data[:half] + b"\n[... middle left out by gpu_check ...]\n" + data[-half:]
            info = tarfile.TarInfo(f"gpu_check/{path.relative_to(work).as_posix()}")
            info.size, info.mtime = len(data), int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()
