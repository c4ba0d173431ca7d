"""remote_throughput's report: rows (MB/s, ops/s, the spread), verdicts against the target
ratio, the Markdown table and its headline."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks import common
from benchmarks.remote.passes import Samples
from benchmarks.remote.workload import BASELINES, MB, OPS, TARGET, Case


def verdict(ratio: float) -> str:
    if not math.isfinite(ratio) or ratio <= 0:
        return "n/a"
    return "PASS" if ratio >= TARGET else "MISS"


def build_rows(case: Case, clients: int, samples: Samples) -> list[dict[str, Any]]:
    rows = []
    value = case.shard.value_bytes
    for op in OPS:
        tkv = samples["tieredkv"][op]
        for baseline in BASELINES:
            base = samples[baseline][op]
            ratio = statistics.median(tkv) / statistics.median(base)
            per_round = [a / b for a, b in zip(tkv, base, strict=True)]
            scale = value / MB if op != "exists" else None
            rows.append({
                "shard": case.shard.name,
                "size_label": case.shard.label,
                "payload_bytes": case.shard.payload_bytes,
                "value_bytes": value,
                "op": op.upper(),
                "batch": case.shard.batch,
                "clients": clients,
                "items_per_round": case.count(op),
                "baseline": baseline,
                "tieredkv_ops_s": statistics.median(tkv),
                "baseline_ops_s": statistics.median(base),
                "tieredkv_mb_s": statistics.median(tkv) * scale if scale else None,
                "baseline_mb_s": statistics.median(base) * scale if scale else None,
                "tieredkv_spread": _spread(tkv, scale),
                "baseline_spread": _spread(base, scale),
                "ratio": ratio,
                "ratio_rounds": [round(x, 3) for x in per_round],
                "target": TARGET,
                "verdict": verdict(ratio),
                "samples_tieredkv_ops_s": [round(x, 1) for x in tkv],
                "samples_baseline_ops_s": [round(x, 1) for x in base],
            })
    return rows


def _spread(samples: Sequence[float], scale: float | None) -> list[float]:
    """[min, max] of the rounds, in MB/s (SET, GET) or ops/s (EXISTS)."""
    k = scale or 1.0
    return [min(samples) * k, max(samples) * k]


def _fig(median: float | None, spread: Sequence[float]) -> str:
    if median is None:
        return ""
    return f"{_num(median)} ({_num(spread[0])}–{_num(spread[1])})"


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def table(rows: Sequence[dict[str, Any]]) -> str:
    view = []
    for r in rows:
        moved = r["op"] != "EXISTS"
        view.append({
            "size": r["size_label"], "op": r["op"], "batch": r["batch"], "clients": r["clients"],
            "baseline": r["baseline"],
            "tkv": _fig(r["tieredkv_mb_s"], r["tieredkv_spread"]) if moved else "",
            "base": _fig(r["baseline_mb_s"], r["baseline_spread"]) if moved else "",
            "tkv_ops": _fig(r["tieredkv_ops_s"], [x / (r["value_bytes"] / MB) for x in r["tieredkv_spread"]]
                            if moved else r["tieredkv_spread"]),
            "base_ops": _fig(r["baseline_ops_s"], [x / (r["value_bytes"] / MB) for x in r["baseline_spread"]]
                             if moved else r["baseline_spread"]),
            "ratio": f"{r['ratio']:.2f} ({min(r['ratio_rounds']):.2f}–{max(r['ratio_rounds']):.2f})",
            "target": f">= {r['target']}",
            "verdict": r["verdict"],
        })
    return common.markdown_table(view, [
        ("size", "value size (shard)"), ("op", "op"), ("batch", "batch / -P"),
        ("clients", "clients"), ("baseline", "baseline"),
        ("tkv", "tieredkv MB/s median (min–max)"), ("base", "baseline MB/s median (min–max)"),
        ("tkv_ops", "tieredkv ops/s"), ("base_ops", "baseline ops/s"),
        ("ratio", "ratio tieredkv/baseline (per-round range)"), ("target", "target"),
        ("verdict", "verdict"),
    ])


def headline(rows: Sequence[dict[str, Any]]) -> str:
    misses = [r for r in rows if r["verdict"] != "PASS"]
    if not misses:
        return f"**Target tieredkv / baseline >= {TARGET}: PASS on all {len(rows)} ratios.**"
    listed = "; ".join(
        f"{r['op']} {r['size_label'].split(' (')[0]} c={r['clients']} vs {r['baseline']}: {r['ratio']:.2f}"
        for r in misses)
    return (f"**Target tieredkv / baseline >= {TARGET}: MISS on {len(misses)} of {len(rows)} ratios** "
            f"({listed}); the other {len(rows) - len(misses)} PASS.")
