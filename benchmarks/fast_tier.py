"""Time the fast unit tier (``pytest -m "not vllm and not redis"``) and keep the figure.

The README quotes how long the fast tier takes; this writes the kept file the quote comes
from, stamped like every other results file (commit, machine, load before and after):

    python -m benchmarks.fast_tier            # -> benchmarks/results/fast_tier.{json,md}

It runs the tier once in a child process with this interpreter and records the wall time
and pytest's own summary line (passed, skipped, deselected).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import git_revision, machine_info, results_dir, write_json, write_markdown

ROOT = Path(__file__).resolve().parents[1]
MARKER = "not vllm and not redis"
# pytest's last line: "==== 5 passed in 1.2s ====", or with -q "5 passed, 1 skipped in 1.2s".
_SUMMARY = re.compile(r"^(?:=+ )?(\d+ (?:passed|failed).*?) in [\d.]+s", re.MULTILINE)


def run_tier(extra: list[str]) -> tuple[float, int, str]:
    """(wall seconds, pytest exit status, pytest's summary line)."""
    cmd = [sys.executable, "-m", "pytest", "-m", MARKER, "-q", "-p", "no:cacheprovider", *extra]
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    seconds = time.monotonic() - start
    found = _SUMMARY.findall(done.stdout)
    return seconds, done.returncode, found[-1] if found else done.stdout.strip()[-200:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", default=None, help="results folder (default benchmarks/results)")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (e.g. a folder)")
    args = parser.parse_args(argv)
    load_start = os.getloadavg()
    seconds, status, summary = run_tier(args.pytest_args)
    payload = {
        "commit": git_revision(ROOT),
        "machine": machine_info(),
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "marker": MARKER,
        "pytest_args": args.pytest_args,
        "wall_s": round(seconds, 1),
        "exit_status": status,
        "summary": summary,
    }
    out = results_dir(args.out_dir)
    write_json(out / "fast_tier.json", payload)
    text = (f"`pytest -m \"{MARKER}\"` at {payload['commit']}: **{seconds:.0f} s** wall "
            f"({summary}; exit {status}) on {payload['machine']['usable_cpus']} CPUs, load "
            f"{load_start[0]:.1f} before and {payload['load_average_end'][0]:.1f} after.")
    write_markdown(out / "fast_tier.md", "Fast unit tier", [text])
    print(text)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
