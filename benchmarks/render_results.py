"""Render ``benchmarks/RESULTS.md`` from the kept results files, so no figure can drift.

Every figure on that page is read here from a JSON file under ``benchmarks/results/``
(written by the benchmark, stamped by :mod:`benchmarks.run_all`). For each benchmark the page
shows its stamp (commit, profile, date, machine, load before and after), whether the code it
measured has changed since (``git diff`` of ``tieredkv/`` and the benchmark's script against
the checkout), and every judged target with its measured figure and verdict. A missed target is a
``MISS`` in the headline table, whatever another run did. Prose lives in
``benchmarks/README.md``, which quotes no figures.

    python -m benchmarks.render_results            # rewrite benchmarks/RESULTS.md
    python -m benchmarks.render_results --check    # exit 1 if RESULTS.md is not what the files give
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import common

ROOT = Path(__file__).resolve().parent.parent
RESULTS_MD = Path(__file__).resolve().parent / "RESULTS.md"

Row = dict[str, str]  # what, measured, target, verdict
#: Verdicts of reference lines: printed beside the targets, not in the exit status, and still
#: named in the headline when missed.
REF_PASS, REF_MISS = "reference: PASS", "reference: MISS"


@dataclass
class Section:
    """What the page says about one results file."""

    name: str
    file: str
    title: str
    stamp: dict[str, Any] | None
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def judged(self) -> list[Row]:
        return [r for r in self.rows if r["verdict"] in ("PASS", "MISS")]

    @property
    def misses(self) -> list[Row]:
        return [r for r in self.rows if r["verdict"] == "MISS"]

    @property
    def reference_misses(self) -> list[Row]:
        return [r for r in self.rows if r["verdict"] == REF_MISS]


def _num(x: Any, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{x:,.{digits}f}"


def _verdict(ok: Any) -> str:
    """PASS/MISS from a bool or a benchmark's own word (PASS, FAIL, MISS, PASS (within noise))."""
    if isinstance(ok, bool):
        return "PASS" if ok else "MISS"
    word = str(ok).split()[0].upper() if ok else ""
    if word in ("PASS", "OK"):
        return "PASS"
    if word in ("FAIL", "MISS"):
        return "MISS"
    return "info"


def _row(what: str, measured: str, target: str, verdict: str) -> Row:
    return {"what": what, "measured": measured, "target": target, "verdict": verdict}


# ---------------------------------------------------------------------------- per benchmark


def transfer_rows(d: Mapping[str, Any]) -> tuple[list[Row], list[str]]:
    rows = []
    for r in d["rows"]:
        if r.get("target") is None:
            continue
        ratios = r["ratio_to_contig"]
        backend = "native" if "native" in ratios else ("cupy" if "cupy" in ratios else "torch")
        what = f"{r['direction']} {r['chunk_bytes'] // 1024} KiB chunks x {r['batch']} ({backend})"
        rows.append(_row(what, f"{ratios[backend]:.2f} of contiguous ({r['gbps'][backend]:.2f} GB/s)",
                         f">= {r['target']}", _verdict(r.get("result"))))
    notes = [f"{d.get('device')}, torch {d.get('torch')}, {d.get('clock')}, {d.get('rounds')} rounds per row; "
             f"load average at the end {d.get('loadavg_end')}."]
    return rows, notes


def disk_rows(d: Mapping[str, Any]) -> tuple[list[Row], list[str]]:
    rows = []
    for r in d["rows"]:
        target = f">= {r['target']}" if r.get("target") is not None else "info"
        verdict = "info" if r.get("passed") is None else _verdict(bool(r["passed"]))
        depth = f", {r['depth']} in flight both sides" if r.get("depth") is not None else ""
        rows.append(_row(f"{r['what']} {r['chunk_bytes'] // 1024} KiB{depth}",
                         f"{r['ratio']:.2f} of raw ({r['tieredkv_gbs']:.2f} vs {r['raw_gbs']:.2f} GB/s)",
                         target, verdict))
    mode = "O_DIRECT" if d.get("direct") else f"buffered ({d.get('direct_note')})"
    notes = [f"{d.get('filesystem')} at {d.get('directory')}, {mode}, {d.get('repeats')} passes of "
             f"{d.get('total_bytes', 0) // (1 << 20)} MiB, " + (
                 f"queue depths {d['depths']} on both sides." if d.get("depths") else
                 f"{d.get('inflight')} I/Os in flight.")]
    return rows, notes


def scheduler_rows(d: Mapping[str, Any]) -> tuple[list[Row], list[str]]:
    rows = []
    for r in d["rows"]:
        rows.append(_row(f"{r['operation']} @ {r['size_label']}",
                         f"{r['ratio']:.2f}x vLLM ({_num(r['tieredkv_median_us'], 1)} vs "
                         f"{_num(r['vllm_median_us'], 1)} us median)", r.get("target", ""),
                         _verdict(r.get("verdict"))))
    targets = d.get("targets", {})
    if "lookup_128k_under_2ms" in targets:
        rows.append(_row("128k-token lookup", str(targets["lookup_128k_under_2ms"]), "< 2 ms",
                         _verdict(targets["lookup_128k_under_2ms"])))
    notes = [str(d["keying"]["summary"])] if isinstance(d.get("keying"), Mapping) and "summary" in d["keying"] else []
    return rows, notes


def remote_rows(d: Mapping[str, Any]) -> tuple[list[Row], list[str]]:
    rows = []
    for r in d["rows"]:
        if r.get("tieredkv_mb_s") is not None and r.get("baseline_mb_s") is not None:
            rate = f"{r['tieredkv_mb_s']:,.0f} vs {r['baseline_mb_s']:,.0f} MB/s"
        else:
            rate = f"{r['tieredkv_ops_s']:,.0f} vs {r['baseline_ops_s']:,.0f} ops/s"
        target = "reference" if r.get("target") is None else f">= {r['target']}"
        where = f"{r['deployment']}: " if r.get("deployment") else ""
        # With verdicts (the worse deployment, below), a deployment's own row is information.
        verdict = "info" if d.get("verdicts") else _verdict(r.get("verdict"))
        rows.append(_row(f"{where}{r['op']} {r['size_label'].split(' (')[0]} c={r['clients']} vs {r['baseline']}",
                         f"{r['ratio']:.2f} ({rate})", target, verdict))
    for v in d.get("verdicts", []):  # the judged figure: the worse deployment
        rows.append(_row(f"verdict: {v['op']} {v['size_label'].split(' (')[0]} c={v['clients']} vs {v['baseline']}",
                         f"{v['ratio']:.2f} ({v['worse_deployment']}, the worse)", f">= {v['target']}",
                         _verdict(v.get("verdict"))))
    return rows, [f"{d.get('deployment')}; versions {d.get('versions')}."]


def _e2e_measured(v: Mapping[str, Any]) -> str:
    """A worse-of e2e_ttft target's figures: the ratio that decides, the two it is the worse
    of, the equal-compute ratio (info) and a note."""
    worse = v.get("worse_ratio")
    out = "n/a" if worse is None else f"{worse:.2f}x (worse of cross/same engine)"
    if v.get("cross_engine_ratio") is not None and v.get("same_engine_ratio") is not None:
        out += f"; cross-engine {v['cross_engine_ratio']:.2f}, same-engine {v['same_engine_ratio']:.2f}"
    if v.get("equal_compute_ratio") is not None:
        out += f"; at equal compute {v['equal_compute_ratio']:.2f}x (info)"
    return out + (f" ({v['note']})" if v.get("note") else "")


def _e2e_old_rows(d: Mapping[str, Any]) -> list[Row]:
    """Runs from before the worse-of verdicts (wall-clock and equal-compute views)."""
    rows = []
    for v in d.get("verdicts", []):
        wall, eq = v.get("wall", {}), v.get("equal_compute", {})
        measured = f"{v['worse_ratio']:.2f}x floor (worse of cross/same engine)"
        if wall:
            measured += f"; {wall['value_s'] * 1e3:,.1f} ms vs limit {wall['limit_s'] * 1e3:,.1f} ms"
        if eq:
            measured += f"; equal compute {eq['value_s'] * 1e3:,.1f} vs {eq['limit_s'] * 1e3:,.1f} ms " \
                        f"({'pass' if eq.get('pass') else 'miss'})"
        # e2e_ttft leaves its "(info)" lines out of its exit status: they are not targets.
        verdict = ("info" if "(info)" in v["target"] else _verdict(bool(v["pass"])))
        rows.append(_row(v["target"], measured, v.get("limit", ""), verdict))
    for v in d.get("hybrid_verdicts", []):
        eq = v.get("equal_compute", {})
        rows.append(_row(f"{v['target']} (reference line: chunk-aligned hybrid hits recompute the tail)",
                         f"{v['worse_ratio']:.2f}x on the wall clock; at equal compute "
                         f"{eq.get('value_s', math.nan) * 1e3:,.1f} vs {eq.get('limit_s', math.nan) * 1e3:,.1f} ms "
                         f"({'pass' if eq.get('pass') else 'miss'})", v.get("limit", ""),
                         REF_PASS if v["pass"] else REF_MISS))
    return rows


def e2e_ttft_rows(d: Mapping[str, Any]) -> tuple[list[Row], list[str]]:
    rows = []
    for r in d["rows"].values():
        hits = r.get("hit_tokens_by_prompt") or {}
        hit_text = ", ".join(f"{p}: {'/'.join(str(x) for x in sorted(set(v)))}" for p, v in hits.items())
        rows.append(_row(f"TTFT {r['config']}", f"{r['median_s'] * 1e3:,.1f} ms median (n={r['n']})"
                         + (f"; hit tokens {hit_text}" if hit_text else ""), "", "info"))
    if any("wall" in v for v in d.get("verdicts", [])):
        rows += _e2e_old_rows(d)
    else:
        for v in d.get("verdicts", []):
            # Targets not judged (no LMCache row) are left out of the exit status: info here.
            info = "(info)" in v["target"] or not v.get("judged", True)
            rows.append(_row(v["target"], _e2e_measured(v), v.get("limit", ""),
                             "info" if info else _verdict(bool(v["pass"]))))
        for v in d.get("hybrid_verdicts", []):  # the host line a target, the disk line a reference
            ref = bool(v.get("reference", True))
            rows.append(_row(v["target"], _e2e_measured(v), v.get("limit", ""),
                             (REF_PASS if v["pass"] else REF_MISS) if ref else _verdict(bool(v["pass"]))))
    notes = []
    lmcache = d.get("lmcache") or {}
    if (lmcache.get("comparison") or {}).get("text"):
        notes.append(f"Peer (info, not a target): {lmcache['comparison']['text']}")
    return rows, notes


def serve_rows(d: Mapping[str, Any]) -> tuple[list[Row], list[str]]:
    rows = []
    for t in d.get("targets", []):
        # A target is met only by a PASS: "within spread" is no demonstrated win.
        verdict = "PASS" if str(t.get("verdict", "")).upper().startswith("PASS") else "MISS"
        rows.append(_row(f"{t.get('config')} @ {t.get('users')} users", str(t.get("measured", "")),
                         str(t.get("target", "")), verdict))
    for c in d.get("comparisons", []):
        cells = [f"{label} {c[key]}" for key, label in (("ttft_p50_s_cell", "TTFT p50"), ("ttft_p99_s_cell", "p99"),
                                                        ("prompt_tokens_per_s_cell", "prompt tok/s")) if key in c]
        rows.append(_row(f"{c.get('config')} vs {c.get('reference')} ({c.get('kind')}) @ {c.get('users')} users",
                         "; ".join(cells), "", "info"))
    notes = []
    noise = d.get("noise_floor") or {}
    p50 = noise.get("ttft_p50_s") if isinstance(noise, Mapping) else None
    if p50:
        medians = ", ".join(f"{c} {m * 1e3:,.0f}" for c, m in (p50.get("medians") or {}).items())
        notes.append(f"Noise floor ({noise.get('users')} user: the working set fits the device cache, no tieredkv "
                     f"hit expected; {noise.get('tieredkv_hit_tokens', 0):,.0f} tieredkv hit tokens seen): TTFT p50 of "
                     f"{', '.join(noise.get('configs', []))} spans {p50['min'] * 1e3:,.0f}–{p50['max'] * 1e3:,.0f} ms "
                     f"({p50['rel'] * 100:,.0f} % of the median) across repeats"
                     + (f"; medians {medians} ms." if medians else "."))
    if d.get("consistency_note"):
        notes.append(str(d["consistency_note"]))
    notes += [str(n) for n in d.get("notes", [])]
    return rows, notes


def multi_replica_rows(d: Mapping[str, Any]) -> tuple[list[Row], list[str]]:
    rows = [_row(c["check"], c["measured"], "", _verdict(c["verdict"])) for c in d.get("checks", [])]
    for t in d.get("targets", []):  # runs from before #27 have none
        where = f"; where the time goes: {t['where']}" if t.get("where") else ""
        rows.append(_row(f"{t['users']} users: {t['target']}", f"{t['measured']}{where}",
                         "outside the spread of the rounds", _verdict(t["verdict"])))
    for r in d.get("ratios", []):
        per_round = ", ".join(f"{x:.2f}" for x in r.get("ttft_p50_ratio_per_round", []))
        rounds = f" (rounds {per_round})" if per_round else ""  # the pooled "all" row has none
        rows.append(_row(f"{r['users']} users: TTFT shared / separate",
                         f"p50 {r['ttft_p50_ratio']:.2f}{rounds}, p99 {r['ttft_p99_ratio']:.2f}",
                         "", "info"))
    notes = [str(d["consistency_note"])] if d.get("consistency_note") else []
    return rows, notes


def soak_rows(d: Mapping[str, Any]) -> tuple[list[Row], list[str]]:
    rows = [_row(c["check"], c["measured"], "", _verdict(c["verdict"])) for c in d.get("checks", [])]
    series_rows = ([(k, v, True) for k, v in d.get("leaks", {}).items()]
                   + [(k, v, False) for k, v in d.get("leaks_info", {}).items()])
    for series, res, judged in series_rows:
        name = f"leak rule: {series}" if judged else f"{series} (information; RSS is judged as rss_excess_bytes)"
        verdict = _verdict(res.get("verdict")) if judged else "info"
        if "slope_per_h" not in res:
            rows.append(_row(name, res.get("reason", ""), "", verdict))
            continue
        unit, scale = ("MiB", 1 << 20) if series.endswith("bytes") else ("", 1)
        measured = f"slope {res['slope_per_h'] / scale:+,.2f} {unit}/h"
        if judged:
            measured += f", judged {res['climb'] / scale:+,.2f}"
        rows.append(_row(f"{name} ({res['mode']})", measured,
                         f"<= {res['limit'] / scale:,.2f}" if judged else "", verdict))
    s = d.get("summary", {})
    notes = [f"{s.get('requests', 0):,} requests over {s.get('load_s', 0):,.0f} s, {s.get('faults', 0)} disk slots "
             f"corrupted on purpose; warm-up {d.get('params', {}).get('warmup_s', 'n/a')} s."]
    return rows, notes


Extractor = Callable[[Mapping[str, Any]], tuple[list[Row], list[str]]]
# (results file, benchmark script, title, extractor), in the order of the page.
FILES: tuple[tuple[str, str, str, Extractor], ...] = (
    ("transfer_bench_cpu.json", "transfer_bench", "Transfer engine, CPU (quick)", transfer_rows),
    ("transfer_bench_cpu_full.json", "transfer_bench", "Transfer engine, CPU (full)", transfer_rows),
    ("disk_bench.json", "disk_bench", "Disk tier: slab I/O vs raw I/O (quick)", disk_rows),
    ("disk_bench_full.json", "disk_bench", "Disk tier: slab I/O vs raw I/O (full)", disk_rows),
    ("scheduler_bench.json", "scheduler_bench", "Scheduler half vs vLLM's OffloadingConnector", scheduler_rows),
    ("remote_throughput.json", "remote_throughput", "Remote tier (Redis) throughput", remote_rows),
    ("e2e_ttft.json", "e2e_ttft", "TTFT of long prompts on real vLLM", e2e_ttft_rows),
    ("serve_bench.json", "serve_bench", "Multi-turn chat served by vLLM's OpenAI server", serve_rows),
    ("e2e_ttft_8b-kv.json", "e2e_ttft", "TTFT of long prompts, 8B-class KV bytes per token", e2e_ttft_rows),
    ("serve_bench_8b-kv.json", "serve_bench", "Multi-turn chat, 8B-class KV bytes per token", serve_rows),
    ("multi_replica.json", "multi_replica", "Two replicas sharing a Redis tier", multi_replica_rows),
    ("soak.json", "soak", "Soak (quick)", soak_rows),
    ("soak-full.json", "soak", "Soak (full: one hour)", soak_rows),
)


#: What shapes every measurement besides the benchmark's own script: the package (its test
#: harness aside; the launcher that builds every vLLM server's command line and environment
#: is ``tools/vllm_server.py``) and the shared benchmark code.
MEASURED_CODE = ("tieredkv", ":(exclude)tieredkv/testing", "benchmarks/common.py")
#: Code only some benchmarks run: their parts (each benchmark's subpackage; ``benchmarks/serve/``,
#: serve_bench's chat workload, client and servers, is played by multi_replica and soak too)
#: and the peers' settings.
MEASURED_BY: dict[str, tuple[str, ...]] = {
    "scheduler_bench": ("benchmarks/scheduler",),
    "remote_throughput": ("benchmarks/remote",),
    "e2e_ttft": ("benchmarks/ttft", "benchmarks/peers"),
    "serve_bench": ("benchmarks/serve", "benchmarks/peers"),
    "multi_replica": ("benchmarks/replicas", "benchmarks/serve"),
    "soak": ("benchmarks/endurance", "benchmarks/serve"),
}


def code_changed_since(commit: str, script: str, root: Path = ROOT) -> bool | None:
    """Whether :data:`MEASURED_CODE`, the benchmark's script or its :data:`MEASURED_BY` parts
    differ between ``commit`` and the checkout.

    Compared with the working tree, not HEAD, so a page rendered just before a commit and
    checked on a clean clone of that commit give the same answer.
    """
    try:
        proc = subprocess.run(
            ["git", "-C", str(root), "diff", "--quiet", commit, "--", *MEASURED_CODE, *MEASURED_BY.get(script, ()),
             f"benchmarks/{script}.py"],
            capture_output=True, check=False, timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return {0: False, 1: True}.get(proc.returncode)


def load_sections(results: Path) -> list[Section]:
    sections = []
    for file, script, title, extract in FILES:
        path = results / file
        if not path.exists():
            continue
        payload = json.loads(path.read_text())
        rows, notes = extract(payload)
        sections.append(Section(script, file, title, payload.get("stamp"), rows, notes))
    return sections


def _stamp_cells(s: Section) -> tuple[str, str, str, str]:
    if not s.stamp:
        return "not stamped (predates run_all)", "", "", ""
    st = s.stamp
    changed = code_changed_since(st["commit"], s.name)
    fresh = {False: "no", True: "**yes**", None: "unknown"}[changed]
    load = f"{st['load_before'][0]:.1f} → {st['load_after'][0]:.1f}"
    dirty = " (dirty)" if st.get("dirty") else ""
    return f"`{st['commit'][:8]}`{dirty} {st['profile']}", st["date_start"][:16], load, fresh


def _interval(stamp: Mapping[str, Any]) -> tuple[str, str]:
    return stamp["date_start"], stamp["date_end"]  # "YYYY-MM-DD HH:MM:SS UTC" sorts as time


def overlapping_runs(sections: Sequence[Section]) -> list[tuple[str, str]]:
    """Pairs of results files whose stamped runs overlapped in time: run_all runs benchmarks one
    at a time, so an overlap means one was rerun by hand beside another."""
    stamped = [(s.file, _interval(s.stamp)) for s in sections if s.stamp]
    return [(a, b) for i, (a, (a0, a1)) in enumerate(stamped) for b, (b0, b1) in stamped[i + 1:]
            if a0 < b1 and b0 < a1]


def render(sections: Sequence[Section]) -> str:
    out = [
        "# Benchmark results",
        "",
        "<!-- Generated by `python -m benchmarks.render_results` from the JSON files in `results/`; "
        "do not edit by hand. -->",
        "",
        "Generated from the kept results files under `results/` by `benchmarks/render_results.py`; "
        "`python -m benchmarks.run_all` regenerates them all and this page. Each row below is read "
        "from the named JSON file. **Load** is the 1-minute load average before and after the "
        "benchmark (this machine is shared; compare configurations within one run, never across "
        "files). **Code changed since** says whether `tieredkv/` (its `testing/` harness aside), "
        "`benchmarks/common.py`, "
        "the benchmark's script, its parts (its subpackage: `scheduler/`, `remote/`, `ttft/`, `serve/`, "
        "`replicas/`, `endurance/`; `serve/` counts for multi_replica and soak too) or, for those with a "
        "peer row, `benchmarks/peers/` differ between the stamped commit and the "
        "checkout this page was rendered from. **Reference lines** are printed beside the targets "
        "without being targets; a missed one is named in the headline all the same. What each "
        "benchmark measures and why: `benchmarks/README.md`.",
        "",
        "| benchmark | file | commit, profile | started (UTC) | load | code changed since | targets met | missed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in sections:
        commit, date, load, fresh = _stamp_cells(s)
        judged, misses = s.judged, s.misses
        met = f"{len(judged) - len(misses)} of {len(judged)}" if judged else "none judged"
        missed = "; ".join(r["what"] for r in misses[:4]) + (f"; +{len(misses) - 4} more" if len(misses) > 4 else "")
        cell = [f"**MISS**: {missed}"] if misses else []
        if s.reference_misses:
            cell.append("reference lines (not targets) missed: "
                        + "; ".join(r["what"].split(" (reference line")[0] for r in s.reference_misses))
        out.append(f"| {s.title} | `results/{s.file}` | {commit} | {date} | {load} | {fresh} | {met} | "
                   f"{'; '.join(cell)} |")
    machines = sorted({s.stamp["machine"]["name"] for s in sections if s.stamp})
    if machines:
        out += ["", "Machines: " + "; ".join(machines) + "."]
    overlaps = overlapping_runs(sections)
    out += ["", ("**Runs that overlapped** (each disturbed the other's timings): "
                 + "; ".join(f"`{a}` and `{b}`" for a, b in overlaps) + ".") if overlaps
            else "No two of these runs overlapped in time: each had the machine to itself (other jobs aside; see the load)."]
    for s in sections:
        out += ["", f"## {s.title}", "", f"From `results/{s.file}`"
                + (f" (`{s.stamp['command']}`, {s.stamp['wall_s']:,.0f} s, exit status {s.stamp['exit_status']})."
                   if s.stamp else " (not stamped by run_all: it predates it).")]
        for note in s.notes:
            out += ["", note]
        if s.rows:
            out += ["", common.markdown_table(s.rows, [("what", "what"), ("measured", "measured"),
                                                       ("target", "target"), ("verdict", "verdict")])]
    return "\n".join(out).rstrip() + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=None, help="results directory (default: benchmarks/results)")
    parser.add_argument("--output", type=Path, default=RESULTS_MD)
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from what the files give")
    args = parser.parse_args(argv)
    text = render(load_sections(common.results_dir(args.results)))
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is out of date: run python -m benchmarks.render_results", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
