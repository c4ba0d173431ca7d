"""Run benchmarks on two commits in one sitting and print them side by side.

A refactor that must not change behaviour (issue 13) is shown by the same benchmark run on
the commit before it and on the commit after it, on the same machine, minutes apart: this
machine is shared and noisy, so figures from different days do not compare. Each commit is
checked out into its own temporary git worktree (C extension built in place) and each
benchmark runs in its own process with that tree first on ``PYTHONPATH``. Order is
before, after, after, before per benchmark (ABBA) when ``--rounds 2``, so a drift in machine
load hits both sides alike.

    python -m benchmarks.before_after --before f31e8db            # scheduler_bench + e2e_ttft
    python -m benchmarks.before_after --before f31e8db --only scheduler_bench

Each table ends with its verdict: the geometric mean of the rows' after/before ratios
against the noise measured in the same sitting (with ``--rounds 2``, how far each side's two
runs of a row lie apart; with one round, the interquartile range of a row's own samples,
where the benchmark keeps them). "no slower" holds when that mean is at most 1 + the median
row noise; every row slower beyond its own noise is named either way.

Writes ``benchmarks/results/<--out>.{json,md}`` (default ``before_after``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import machine_info

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BENCHMARKS = ("scheduler_bench", "e2e_ttft")

# An installed tieredkv registers its vLLM plugin as ``tieredkv.vllm.plugin:register``; trees
# from before that module existed get a two-line shim so vLLM still finds the connector by name.
_PLUGIN_SHIM = "from tieredkv.plugin import register  # noqa: F401 - before_after.py shim\n"


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def checkout(rev: str, parent: Path) -> Path:
    """A detached worktree of ``rev`` with its C extension built in place."""
    sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    tree = parent / sha[:12]
    _git("worktree", "add", "--detach", "--force", str(tree), sha)
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree,
                   check=True, capture_output=True)
    plugin = tree / "tieredkv" / "vllm" / "plugin.py"
    if not plugin.exists():
        plugin.parent.mkdir(exist_ok=True)
        (plugin.parent / "__init__.py").touch()
        plugin.write_text(_PLUGIN_SHIM)
    return tree


def _command(tree: Path, name: str) -> list[str]:
    if (tree / "benchmarks" / "__init__.py").exists():
        return [sys.executable, "-m", f"benchmarks.{name}"]
    return [sys.executable, str(tree / "benchmarks" / f"{name}.py")]


def harness_dir(tree: Path, harness: Path, parent: Path) -> Path:
    """A directory where ``tieredkv`` is ``tree``'s and ``benchmarks`` is ``harness``'s: the
    same measuring code over both sides' packages (run from it, it is first on sys.path)."""
    run_dir = parent / f"run-{tree.name}-with-{harness.name}"
    run_dir.mkdir(exist_ok=True)
    for name, source in (("tieredkv", tree), ("benchmarks", harness)):
        link = run_dir / name
        if not link.exists():
            link.symlink_to(source / name, target_is_directory=True)
    return run_dir


def run_one(tree: Path, name: str, out: Path, extra: list[str] | None = None) -> dict[str, Any]:
    """Run benchmark ``name`` from ``tree`` (with ``extra`` arguments); its JSON result.
    ``tree`` is a worktree, or a :func:`harness_dir` (its ``benchmarks`` a link)."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    args = _command(tree, name) + list(extra or [])
    if name == "scheduler_bench":
        out.mkdir(parents=True, exist_ok=True)
        args += ["--quiet", "--no-plot", "--out-dir", str(out)]
        result_file = out / "scheduler_bench.json"
    else:
        result_file = tree / "benchmarks" / "results" / f"{name}.json"
        result_file.unlink(missing_ok=True)
    t0 = time.monotonic()
    done = subprocess.run(args, cwd=tree, env=env, capture_output=True, text=True)
    if not result_file.exists():
        raise RuntimeError(f"{name} in {tree} wrote no result (exit {done.returncode}):\n"
                           f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    data = json.loads(result_file.read_text())
    data["_wall_s"] = time.monotonic() - t0
    return data


def _merge(runs: list[dict[str, Any]], rows: Callable[[dict[str, Any]], dict[str, float]]) -> dict[str, float]:
    """Median over rounds of each row's figure."""
    per_row: dict[str, list[float]] = {}
    for run in runs:
        for key, value in rows(run).items():
            per_row.setdefault(key, []).append(value)
    return {key: statistics.median(values) for key, values in per_row.items()}


def _rel_spread(values: list[float]) -> float | None:
    """(max - min) / median of two runs, or the interquartile range / median of samples."""
    if len(values) < 2 or statistics.median(values) <= 0:
        return None
    mid = statistics.median(values)
    if len(values) < 4:
        return (max(values) - min(values)) / mid
    q1, _, q3 = statistics.quantiles(values, n=4)
    return (q3 - q1) / mid


def noise(runs: dict[str, list[dict[str, Any]]], rows: Callable[[dict[str, Any]], dict[str, float]],
          samples: Callable[[dict[str, Any]], dict[str, list[float]]]) -> dict[str, float]:
    """Each row's relative noise in this sitting: the larger of the two sides' spreads, from
    their runs when each side ran twice, else from the row's own samples (rows without
    either are left out)."""
    out: dict[str, float] = {}
    for key in rows(runs["before"][0]):
        spreads: list[float] = []
        for side in ("before", "after"):
            if len(runs[side]) > 1:
                spread = _rel_spread([rows(run).get(key, 0.0) for run in runs[side]])
            else:
                spread = _rel_spread(samples(runs[side][0]).get(key, []))
            if spread is not None:
                spreads.append(spread)
        if len(spreads) == 2:
            out[key] = max(spreads)
    return out


def verdict(table: dict[str, Any]) -> dict[str, Any]:
    """Geometric mean of after/before over the rows both sides have, the median row noise,
    the rows slower than their own noise, and whether the after side is no slower."""
    before, after, row_noise = table["before"], table["after"], table.get("noise", {})
    ratios = {k: after[k] / b for k, b in before.items() if b > 0 and after.get(k) is not None}
    if not ratios:
        return {"geomean": None, "noise": None, "slower_rows": [], "no_slower": False}
    geomean = statistics.geometric_mean(ratios.values())
    typical = statistics.median(row_noise.values()) if row_noise else 0.0
    slower = sorted(k for k, r in ratios.items() if k in row_noise and r > 1 + row_noise[k])
    return {"geomean": geomean, "noise": typical, "slower_rows": slower,
            "no_slower": geomean <= 1 + typical}


def _row_key(row: dict[str, Any]) -> str:
    """A scheduler row by its operation and exact size (labels were reworded over time)."""
    if "size" in row:
        return f"{row['operation']} @ {row['size']:,} {row.get('unit', '')}".rstrip()
    return f"{row['operation']} @ {row['size_label']}"


def scheduler_rows(data: dict[str, Any]) -> dict[str, float]:
    return {_row_key(r): r["tieredkv_median_us"] for r in data["rows"]}


def same_sizes(before: dict[str, Any]) -> list[str]:
    """Arguments that make the after side look up the prompt sizes the before side did (the
    benchmark's sizes changed over time; ``--sizes`` exists on the side that changed them)."""
    sizes = sorted({int(r["size"]) for r in before["rows"]
                    if r["operation"].startswith("get_num_new_matched_tokens") and "size" in r})
    return ["--sizes", ",".join(map(str, sizes))] if sizes else []


def e2e_rows(data: dict[str, Any]) -> dict[str, float]:
    rows = {f"TTFT {name} (median s)": row["median_s"] for name, row in data["rows"].items()}
    for verdict in data["verdicts"]:
        if verdict.get("worse_ratio") is not None:  # a target not judged has no figure
            rows[f"{verdict['target']} (worse-of ratio)"] = verdict["worse_ratio"]
    return rows


def no_samples(data: dict[str, Any]) -> dict[str, list[float]]:
    return {}


def e2e_samples(data: dict[str, Any]) -> dict[str, list[float]]:
    """Each TTFT row's own measured hits (the ratio rows have none)."""
    return {f"TTFT {name} (median s)": list(row.get("samples_s") or []) for name, row in data["rows"].items()}


ROWS = {"scheduler_bench": (scheduler_rows, "µs", no_samples), "e2e_ttft": (e2e_rows, "", e2e_samples)}


def render(before: str, after: str, tables: dict[str, dict[str, Any]]) -> str:
    lines = [
        f"# Before/after: {before} vs {after}",
        "",
        "Same machine, one sitting, each side in its own worktree and process. Ratio = after /",
        "before (below 1: the after commit is faster). Rounds per side: "
        + ", ".join(f"{name} {t['rounds']}" for name, t in tables.items()) + ".",
        "",
    ]
    for name, table in tables.items():
        unit = ROWS[name][1]
        lines += [f"## {name}", "", f"| row | before{' ' + unit if unit else ''} | after | after / before |",
                  "|---|---:|---:|---:|"]
        row_noise = table.get("noise", {})
        for key, b in table["before"].items():
            a = table["after"].get(key)
            ratio = f"{a / b:.2f}" if a is not None and b else "—"
            spread = f" (noise ±{row_noise[key]:.2f})" if key in row_noise else ""
            lines.append(f"| {key} | {b:.4g} | {a:.4g} | {ratio}{spread} |" if a is not None else f"| {key} | {b:.4g} | — | — |")
        judged = verdict(table)
        lines.append("")
        if judged["geomean"] is None:
            lines += ["**Verdict: not judged** (no row on both sides).", ""]
            continue
        word = "no slower" if judged["no_slower"] else "SLOWER"
        lines.append(f"**Verdict: {word}.** Geometric mean of after / before over the rows: "
                     f"{judged['geomean']:.3f}; target ≤ 1 + median row noise = {1 + judged['noise']:.3f}.")
        slower = judged["slower_rows"]
        lines += [f"Rows slower beyond their own noise: {', '.join(slower) if slower else 'none'}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="commit before the change")
    parser.add_argument("--after", default="HEAD", help="commit after the change (default HEAD)")
    parser.add_argument("--only", choices=BENCHMARKS, action="append", help="run only these")
    parser.add_argument("--rounds", type=int, default=1, choices=(1, 2),
                        help="2: ABBA order, median of two runs per side")
    parser.add_argument("--harness", choices=("own", "after"), default="own",
                        help="own: each side runs its own benchmark code; after: both run the "
                        "after commit's (the measuring code changed in between)")
    parser.add_argument("--same-sizes", action="store_true",
                        help="scheduler_bench: the after side looks up the before side's prompt "
                        "sizes (--sizes; for a before commit whose sizes differ)")
    parser.add_argument("--out", default="before_after",
                        help="results file name under benchmarks/results/ (no suffix)")
    args = parser.parse_args(argv)
    names = args.only or list(BENCHMARKS)
    load_before = os.getloadavg()
    # Named now: HEAD may move while the benchmarks run (the trees are checked out now too).
    before, after = _git("rev-parse", "--short", args.before), _git("rev-parse", "--short", args.after)
    tables: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="tieredkv-before-after-") as tmp:
        parent = Path(tmp)
        trees = {"before": checkout(args.before, parent), "after": checkout(args.after, parent)}
        runs_in = dict(trees) if args.harness == "own" else {
            side: harness_dir(tree, trees["after"], parent) for side, tree in trees.items()}
        try:
            for name in names:
                order = ["before", "after"] if args.rounds == 1 else ["before", "after", "after", "before"]
                runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
                for i, side in enumerate(order):
                    print(f"{name}: {side} ({i + 1}/{len(order)})", flush=True)
                    extra = (same_sizes(runs["before"][0])
                             if side == "after" and name == "scheduler_bench" and args.same_sizes else [])
                    runs[side].append(run_one(runs_in[side], name, parent / f"out-{side}-{i}", extra))
                rows, _, samples = ROWS[name]
                tables[name] = {"rounds": len(runs["before"]), "noise": noise(runs, rows, samples),
                                "before": _merge(runs["before"], rows), "after": _merge(runs["after"], rows)}
                tables[name]["verdict"] = verdict(tables[name])
        finally:
            for tree in trees.values():
                _git("worktree", "remove", "--force", str(tree))
    text = render(before, after, tables)
    if args.harness == "after":
        text = text.replace("each side in its own worktree and process.",
                            f"each side in its own worktree and process, both measured by {after}'s "
                            "benchmark code.")
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out}.md").write_text(text + "\n")
    (RESULTS / f"{args.out}.json").write_text(json.dumps({
        "before": before, "after": after, "machine": machine_info(),
        "load_average_start": load_before, "load_average_end": os.getloadavg(), "tables": tables,
    }, indent=1) + "\n")
    return 0 if all(t["verdict"]["no_slower"] for t in tables.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
