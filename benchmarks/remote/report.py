"""remote_throughput's report: rows (MB/s, ops/s, the spread) per deployment, verdicts on
the worse of one node and a Cluster against each op's target, the tables and headline."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks import common
from benchmarks.remote.passes import Samples
from benchmarks.remote.workload import BASELINES, MB, OPS, TARGET_BASELINE, TARGETS, Case


def verdict(ratio: float, target: float) -> str:
    if not math.isfinite(ratio) or ratio <= 0:
        return "n/a"
    return "PASS" if ratio >= target else "MISS"


def build_rows(case: Case, clients: int, samples: Samples, deployment: str) -> list[dict[str, Any]]:
    """One row per op and baseline; only the rows against :data:`TARGET_BASELINE` have a
    target (redis-benchmark's are the reference: ``target`` None, verdict ``info``)."""
    rows = []
    value = case.shard.value_bytes
    for op in OPS:
        tkv = samples["tieredkv"][op]
        for baseline in BASELINES:
            base = samples[baseline][op]
            ratio = statistics.median(tkv) / statistics.median(base)
            per_round = [a / b for a, b in zip(tkv, base, strict=True)]
            scale = value / MB if op != "exists" else None
            target = TARGETS[op] if baseline == TARGET_BASELINE else None
            rows.append({
                "deployment": deployment,
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
                "target": target,
                "verdict": "info" if target is None else verdict(ratio, target),
                "samples_tieredkv_ops_s": [round(x, 1) for x in tkv],
                "samples_baseline_ops_s": [round(x, 1) for x in base],
            })
    return rows


def verdicts(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per shard, op and client count: the worse ratio of the deployments measured against
    :data:`TARGET_BASELINE`, judged against the op's target."""
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in rows:
        if r["target"] is not None:
            groups.setdefault((r["shard"], r["op"], r["clients"]), []).append(r)
    out = []
    for (shard, op, clients), group in groups.items():
        worst = min(group, key=lambda r: r["ratio"])
        out.append({
            "shard": shard, "size_label": worst["size_label"], "op": op, "clients": clients,
            "baseline": TARGET_BASELINE,
            "ratios": {r["deployment"]: r["ratio"] for r in group},
            "worse_deployment": worst["deployment"], "ratio": worst["ratio"],
            "target": worst["target"], "verdict": verdict(worst["ratio"], worst["target"]),
        })
    return out


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


def _target(target: float | None) -> str:
    return "reference" if target is None else f">= {target}"


def table(rows: Sequence[dict[str, Any]]) -> str:
    view = []
    for r in rows:
        moved = r["op"] != "EXISTS"
        view.append({
            "deployment": r["deployment"],
            "size": r["size_label"], "op": r["op"], "batch": r["batch"], "clients": r["clients"],
            "baseline": r["baseline"],
            "tkv": _fig(r["tieredkv_mb_s"], r["tieredkv_spread"]) if moved else "",
            "base": _fig(r["baseline_mb_s"], r["baseline_spread"]) if moved else "",
            "tkv_ops": _fig(r["tieredkv_ops_s"], [x / (r["value_bytes"] / MB) for x in r["tieredkv_spread"]]
                            if moved else r["tieredkv_spread"]),
            "base_ops": _fig(r["baseline_ops_s"], [x / (r["value_bytes"] / MB) for x in r["baseline_spread"]]
                             if moved else r["baseline_spread"]),
            "ratio": f"{r['ratio']:.2f} ({min(r['ratio_rounds']):.2f}–{max(r['ratio_rounds']):.2f})",
            "target": _target(r["target"]),
            "verdict": r["verdict"],
        })
    return common.markdown_table(view, [
        ("deployment", "deployment"),
        ("size", "value size (shard)"), ("op", "op"), ("batch", "batch / -P"),
        ("clients", "clients"), ("baseline", "baseline"),
        ("tkv", "tieredkv MB/s median (min–max)"), ("base", "baseline MB/s median (min–max)"),
        ("tkv_ops", "tieredkv ops/s"), ("base_ops", "baseline ops/s"),
        ("ratio", "ratio tieredkv/baseline (per-round range)"), ("target", "target"),
        ("verdict", "verdict"),
    ])


def verdict_table(judged: Sequence[dict[str, Any]]) -> str:
    view = [{
        "size": v["size_label"], "op": v["op"], "clients": v["clients"],
        "ratios": ", ".join(f"{d} {x:.2f}" for d, x in v["ratios"].items()),
        "worse": f"{v['ratio']:.2f} ({v['worse_deployment']})",
        "target": f">= {v['target']}", "verdict": v["verdict"],
    } for v in judged]
    return common.markdown_table(view, [
        ("size", "value size (shard)"), ("op", "op"), ("clients", "clients"),
        ("ratios", f"tieredkv / {TARGET_BASELINE} by deployment"),
        ("worse", "worse (judged)"), ("target", "target"), ("verdict", "verdict"),
    ])


def headline(judged: Sequence[dict[str, Any]]) -> str:
    targets = ", ".join(f"{op.upper()} >= {t}" for op, t in TARGETS.items())
    lead = f"Target tieredkv / raw {TARGET_BASELINE} ({targets}; the worse of the deployments)"
    misses = [v for v in judged if v["verdict"] != "PASS"]
    if not misses:
        return f"**{lead}: PASS on all {len(judged)} verdicts.**"
    listed = "; ".join(
        f"{v['op']} {v['size_label'].split(' (')[0]} c={v['clients']}: {v['ratio']:.2f} "
        f"({v['worse_deployment']}) < {v['target']}" for v in misses)
    return (f"**{lead}: MISS on {len(misses)} of {len(judged)} verdicts** ({listed}); "
            f"the other {len(judged) - len(misses)} PASS.")
