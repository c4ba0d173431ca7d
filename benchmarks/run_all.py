"""Run every benchmark in sequence and stamp what each one wrote, so figures come from HEAD.

One command regenerates every kept results file under ``benchmarks/results/`` on a clean
tree, one benchmark at a time (they would disturb each other's timings), then renders
``benchmarks/RESULTS.md`` from those files (:mod:`benchmarks.render_results`). Each JSON it
produced gets a ``stamp``: the commit it ran (refused on a tree with uncommitted changes
outside ``benchmarks/results/`` and ``RESULTS.md``, unless ``--allow-dirty``, and then the stamp says so), the
machine (CPU model, usable cores, GPUs), the load average before and after, the date, the
profile, the command and its exit status. Each Markdown file gets the same stamp as its
first line. ``results/run_all.json`` lists the run.

A benchmark that misses a target exits 1 and the run goes on (its files are kept and the
miss is in its headline); one that crashes or writes nothing makes ``run_all`` exit 1.

    python -m benchmarks.run_all                      # quick profile of every benchmark
    python -m benchmarks.run_all --full               # longer runs (the soak runs an hour)
    python -m benchmarks.run_all --only soak --full   # some of them
    python -m benchmarks.run_all --list               # what would run, and for how long
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.stamps import describe_stamp, stamp_markdown, stamp_png

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Bench:
    """One benchmark as ``run_all`` runs it."""

    name: str
    quick_args: tuple[str, ...]
    full_args: tuple[str, ...]
    # Results files (names in the results directory) the quick / full profile writes.
    quick_files: tuple[str, ...]
    full_files: tuple[str, ...]
    minutes: tuple[float, float]  # rough duration here, quick and full
    # Scripts that print their table and write only JSON: their stdout is kept as the .txt file.
    keeps_stdout: bool = False
    module: str = ""  # the script under benchmarks/ (default: ``name``)

    @property
    def script(self) -> str:
        return self.module or self.name

    def args(self, full: bool) -> tuple[str, ...]:
        return self.full_args if full else self.quick_args

    def files(self, full: bool) -> tuple[str, ...]:
        return self.full_files if full else self.quick_files


# ``{out}`` is the results directory, ``{work}`` a scratch directory on the same disk as the
# checkout (the disk benchmark must not measure a tmpfs).
BENCHES: tuple[Bench, ...] = (
    Bench("transfer_bench", ("--device", "cpu", "--json", "{out}/transfer_bench_cpu.json"),
          ("--device", "cpu", "--full", "--json", "{out}/transfer_bench_cpu_full.json"),
          ("transfer_bench_cpu.json", "transfer_bench_cpu.txt"),
          ("transfer_bench_cpu_full.json", "transfer_bench_cpu_full.txt"), (2, 10), keeps_stdout=True),
    Bench("disk_bench", ("--dir", "{work}/disk_bench", "--json", "{out}/disk_bench.json"),
          ("--dir", "{work}/disk_bench", "--total-bytes", "1GiB", "--repeats", "5",
           "--json", "{out}/disk_bench_full.json"),
          ("disk_bench.json", "disk_bench.txt"), ("disk_bench_full.json", "disk_bench_full.txt"), (3, 12),
          keeps_stdout=True),
    Bench("scheduler_bench", ("--out-dir", "{out}", "--quiet"), ("--out-dir", "{out}", "--quiet", "--full"),
          ("scheduler_bench.json", "scheduler_bench.md", "scheduler_bench.png"),
          ("scheduler_bench.json", "scheduler_bench.md", "scheduler_bench.png"), (1, 10)),
    Bench("remote_throughput", ("--out-dir", "{out}", "--quiet"), ("--out-dir", "{out}", "--quiet", "--full"),
          ("remote_throughput.json", "remote_throughput.md"), ("remote_throughput.json", "remote_throughput.md"),
          (5, 10)),
    Bench("e2e_ttft", (), ("--full",), ("e2e_ttft.json", "e2e_ttft.md", "e2e_ttft.png"),
          ("e2e_ttft.json", "e2e_ttft.md", "e2e_ttft.png"), (6, 25)),
    Bench("serve_bench", ("--out", "{out}", "--no-progress"), ("--out", "{out}", "--no-progress", "--full"),
          ("serve_bench.json", "serve_bench.md", "serve_bench.png"),
          ("serve_bench.json", "serve_bench.md", "serve_bench.png"), (25, 300)),
    # Realistic KV sizes (#27): a random model with an 8B-class model's KV bytes per token, where
    # the copy paths rather than the compute decide. Its prefill is about ten times slower than
    # the tiny model's: serve_bench's quick profile (1, 4 and 8 users, 5 repeats) took over 20
    # minutes a repeat and would stop at its hour's budget, so the quick run measures 1 and 4
    # users (4: the working set exceeds the device) 3 times: 36 minutes in the kept run.
    Bench("e2e_ttft_8b-kv", ("--model-shape", "8b-kv"), ("--model-shape", "8b-kv", "--full"),
          ("e2e_ttft_8b-kv.json", "e2e_ttft_8b-kv.md", "e2e_ttft_8b-kv.png"),
          ("e2e_ttft_8b-kv.json", "e2e_ttft_8b-kv.md", "e2e_ttft_8b-kv.png"), (5, 40), module="e2e_ttft"),
    Bench("serve_bench_8b-kv", ("--out", "{out}", "--no-progress", "--model-shape", "8b-kv",
                                "--levels", "1,4", "--repeats", "3"),
          ("--out", "{out}", "--no-progress", "--model-shape", "8b-kv", "--full"),
          ("serve_bench_8b-kv.json", "serve_bench_8b-kv.md", "serve_bench_8b-kv.png"),
          ("serve_bench_8b-kv.json", "serve_bench_8b-kv.md", "serve_bench_8b-kv.png"), (37, 360),
          module="serve_bench"),
    Bench("multi_replica", ("--out", "{out}", "--no-progress"), ("--out", "{out}", "--no-progress", "--full"),
          ("multi_replica.json", "multi_replica.md", "multi_replica.png"),
          ("multi_replica.json", "multi_replica.md", "multi_replica.png"), (6, 75)),
    Bench("soak", ("--out", "{out}", "--no-progress"), ("--out", "{out}", "--no-progress", "--full"),
          ("soak.json", "soak.md", "soak.png"), ("soak-full.json", "soak-full.md", "soak-full.png"), (6, 65)),
)
BENCH_NAMES = tuple(b.name for b in BENCHES)


def tree_changes(root: Path = ROOT) -> list[str]:
    """Files changed or added (not git-ignored) outside ``benchmarks/results/`` and the page
    rendered from them (``benchmarks/RESULTS.md``, which a run rewrites itself, so a second
    ``run_all`` after a first would otherwise refuse): what a stamp could not name. An
    untracked module would run too, so it counts."""
    out = subprocess.run(
        ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=all", "--", ".",
         ":(exclude)benchmarks/results", ":(exclude)benchmarks/RESULTS.md"],
        capture_output=True, text=True, check=True,
    ).stdout
    return [line[3:] for line in out.splitlines() if line.strip()]


def c_copier_problem(root: Path = ROOT) -> str | None:
    """Why the tree's C copier does not import (None when it does). The benchmarks, and the
    servers they start from this directory, import ``tieredkv`` from the tree: in a fresh
    clone without the built extension they would quietly measure the numpy fallback."""
    proc = subprocess.run([sys.executable, "-c", "import tieredkv.transfer.backends._rowcopy"],
                          cwd=root, capture_output=True, text=True, check=False)
    if proc.returncode == 0:
        return None
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return (f"tieredkv's C copier does not import from {root} ({last}); build it there first: "
            f"{Path(sys.executable).name} setup.py build_ext --inplace")


def head_commit(root: Path = ROOT) -> str:
    return subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def expand(args: Sequence[str], out: Path, work: Path) -> list[str]:
    return [a.format(out=out, work=work) for a in args]


def stamp_files(files: Sequence[Path], stamp: dict[str, Any]) -> list[str]:
    """Add ``stamp`` to each JSON file, the stamp line atop each Markdown file and under each
    PNG figure; returns problems."""
    problems = []
    for path in files:
        if not path.exists():
            problems.append(f"{path.name} was not written")
            continue
        if path.stat().st_mtime < stamp["t_start"]:
            problems.append(f"{path.name} is older than this run (not rewritten)")
            continue
        if path.suffix == ".json":
            payload = json.loads(path.read_text())
            payload["stamp"] = {k: v for k, v in stamp.items() if k != "t_start"}
            common.write_json(path, payload)
        elif path.suffix == ".md":
            stamp_markdown(path, describe_stamp(stamp))
        elif path.suffix == ".png":
            stamp_png(path, describe_stamp(stamp))
    return problems


def run_one(bench: Bench, full: bool, out: Path, work: Path, commit: str, dirty: list[str]) -> dict[str, Any]:
    """Run one benchmark in its own process; stamp and return what it wrote."""
    args = expand(bench.args(full), out, work)
    cmd = [sys.executable, "-m", f"benchmarks.{bench.script}", *args]
    env = dict(os.environ, TIEREDKV_RESULTS_DIR=str(out), PYTHONUNBUFFERED="1")
    files = [out / f for f in bench.files(full)]
    stdout_path = next(f for f in files if f.suffix == ".txt") if bench.keeps_stdout else None
    print(f"[run_all] {bench.name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    load_before = os.getloadavg()
    t_start = time.time()
    date_start = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    t0 = time.monotonic()
    if stdout_path is not None:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, check=False)
        stdout_path.write_text(proc.stdout)
        sys.stdout.write(proc.stdout)
    else:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, check=False)
    stamp = {
        "commit": commit, "dirty": dirty, "profile": "full" if full else "quick",
        "command": "python -m benchmarks." + bench.script + (" " + " ".join(args) if args else ""),
        "machine": common.machine_info(), "load_before": list(load_before),
        "load_after": list(os.getloadavg()), "date_start": date_start,
        "date_end": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "wall_s": round(time.monotonic() - t0, 1), "exit_status": proc.returncode, "t_start": t_start,
    }
    problems = stamp_files(files, stamp)
    if proc.returncode not in (0, 1):
        problems.append(f"exit status {proc.returncode}")
    status = "crashed" if problems else ("target missed" if proc.returncode == 1 else "ok")
    print(f"[run_all] {bench.name}: {status} in {stamp['wall_s']:.0f} s"
          + (f" ({'; '.join(problems)})" if problems else ""), file=sys.stderr, flush=True)
    return {"name": bench.name, "status": status, "problems": problems, "files": [f.name for f in files],
            **{k: v for k, v in stamp.items() if k not in ("t_start", "machine")}}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="the longer profiles (the soak runs an hour)")
    parser.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(BENCH_NAMES)}")
    parser.add_argument("--skip", default="", help="comma-separated benchmarks to leave out")
    parser.add_argument("--out", type=Path, default=None, help="results directory (default: benchmarks/results)")
    parser.add_argument("--allow-dirty", action="store_true",
                        help="run on uncommitted changes (the stamps name the changed files)")
    parser.add_argument("--no-render", action="store_true", help="do not regenerate RESULTS.md")
    parser.add_argument("--list", action="store_true", help="print what would run and exit")
    args = parser.parse_args(argv)

    wanted = args.only.split(",") if args.only else list(BENCH_NAMES)
    skip = [s for s in args.skip.split(",") if s]
    unknown = [n for n in [*wanted, *skip] if n not in BENCH_NAMES]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCH_NAMES)}")
    benches = [b for b in BENCHES if b.name in wanted and b.name not in skip]
    profile = "full" if args.full else "quick"
    minutes = sum(b.minutes[1 if args.full else 0] for b in benches)
    if args.list:
        for b in benches:
            print(f"{b.name:<18} ~{b.minutes[1 if args.full else 0]:>3.0f} min  -> {', '.join(b.files(args.full))}")
        print(f"total ~{minutes:.0f} min ({profile} profile, on a 2-core machine)")
        return 0
    dirty = tree_changes()
    if dirty and not args.allow_dirty:
        print("run_all: uncommitted changes outside benchmarks/results/ and RESULTS.md (commit them, or --allow-dirty):\n  "
              + "\n  ".join(dirty), file=sys.stderr)
        return 2
    problem = c_copier_problem()
    if problem:
        print(f"run_all: {problem}", file=sys.stderr)
        return 2
    out = common.results_dir(args.out)
    commit = head_commit()
    print(f"[run_all] {len(benches)} benchmarks, {profile} profile, about {minutes:.0f} min; commit {commit[:10]}"
          + (" with uncommitted changes" if dirty else "") + f"; results in {out}", file=sys.stderr, flush=True)
    runs = []
    with tempfile.TemporaryDirectory(prefix=".run_all.", dir=ROOT) as work:
        for bench in benches:
            runs.append(run_one(bench, args.full, out, Path(work), commit, dirty))
    manifest_path = out / ("run_all_full.json" if args.full else "run_all.json")
    common.write_json(manifest_path, {"benchmark": "run_all", "profile": profile, "commit": commit,
                                      "dirty": dirty, "machine": common.machine_info(), "runs": runs})
    if not args.no_render:
        from benchmarks import render_results

        render_results.main(["--results", str(out)])
    crashed = [r["name"] for r in runs if r["status"] == "crashed"]
    missed = [r["name"] for r in runs if r["status"] == "target missed"]
    print(f"[run_all] done: {len(runs) - len(crashed)} of {len(runs)} ran"
          + (f"; targets missed in {', '.join(missed)}" if missed else "")
          + (f"; CRASHED: {', '.join(crashed)}" if crashed else ""), file=sys.stderr)
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
