"""serve_bench's figures and verdicts: a level's TTFT percentiles and throughput, hit rates
from two ``/metrics`` scrapes, the spread over repeats, wins and losses only outside it, the
targets and the noise floor.

Pure: it reads summaries, never a server.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from benchmarks import common

SPEEDUP_TARGET = 2.0


def percentile(samples: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (same rule as numpy's default); NaN for no samples."""
    return common.percentile(list(samples), q)


def level_summary(records: Sequence[Mapping[str, Any]], wall_s: float) -> dict[str, Any]:
    """TTFT percentiles and throughput of one level's completed requests."""
    ok = [r for r in records if r.get("ok")]
    ttfts = [r["ttft_s"] for r in ok]
    wall = max(wall_s, 1e-9)
    return {
        "requests": len(records),
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "ttft_mean_s": (sum(ttfts) / len(ttfts)) if ttfts else math.nan,
        "ttft_p50_warm_s": percentile([r["ttft_s"] for r in ok if r["turn"] > 0], 50),
        "wall_s": wall_s,
        "requests_per_s": len(ok) / wall,
        "output_tokens_per_s": sum(len(r.get("output") or ()) for r in ok) / wall,
        "prompt_tokens_per_s": sum(r["prompt_tokens"] for r in ok) / wall,
        "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
    }


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def metric_sum(text: str, name: str, labels: Mapping[str, str] | None = None) -> float:
    """Sum of the samples of ``name`` in Prometheus text whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match.group(1) != name:
            continue
        if labels:
            have = dict(_LABEL.findall(match.group(2) or ""))
            if any(have.get(k) != v for k, v in labels.items()):
                continue
        try:
            total += float(match.group(3))
        except ValueError:
            continue
    return total


HIT_METRICS = {
    # key: (metric name, labels)
    "device": ("vllm:prefix_cache_hits_total", None),
    "connector": ("vllm:external_prefix_cache_hits_total", None),
    "tieredkv_host": ("vllm:tieredkv_hit_tokens_total", {"tier": "host"}),
    "tieredkv_disk": ("vllm:tieredkv_hit_tokens_total", {"tier": "disk"}),
    "preemptions": ("vllm:num_preemptions_total", None),
}


def hit_rates(before: str, after: str, prompt_tokens: int) -> dict[str, float]:
    """Per-tier hit tokens between two /metrics scrapes, as shares of the prompt tokens sent."""
    out: dict[str, float] = {}
    for key, (name, labels) in HIT_METRICS.items():
        delta = metric_sum(after, name, labels) - metric_sum(before, name, labels)
        if key == "preemptions":
            out[key] = delta
            continue
        out[key + "_tokens"] = delta
        out[key + "_rate"] = delta / prompt_tokens if prompt_tokens else math.nan
    return out


# The figures aggregated over repeats: key -> (name, True when higher is better).
SPREAD_METRICS: dict[str, tuple[str, bool]] = {
    "ttft_p50_s": ("TTFT p50", False),
    "ttft_p99_s": ("TTFT p99", False),
    "prompt_tokens_per_s": ("throughput", True),
}


WITHIN = "within spread"


NO_SPREAD = "no spread (1 run)"  # a side with a single repeat: no win or loss can be called


def finite(values: Iterable[float]) -> list[float]:
    return [float(v) for v in values if v is not None and v == v and not math.isinf(v)]


def spread(values: Iterable[float]) -> dict[str, Any]:
    """Median and min-max of the finite values (a repeat with no figure is left out)."""
    vals = finite(values)
    if not vals:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {"median": float(statistics.median(vals)), "min": min(vals), "max": max(vals), "n": len(vals)}


def compare(mine: Iterable[float], other: Iterable[float], higher_is_better: bool = False) -> str:
    """``better`` when every repeat of ``mine`` beats every repeat of ``other`` (its worst
    repeat better than the other's best), ``worse`` for the reverse, otherwise ``within
    spread`` (overlapping or touching ranges); ``n/a`` when either side has no figure and
    :data:`NO_SPREAD` when either has only one (no spread measured)."""
    a, b = finite(mine), finite(other)
    if not a or not b:
        return "n/a"
    if len(a) < 2 or len(b) < 2:
        return NO_SPREAD
    if higher_is_better:
        a, b = [-x for x in a], [-x for x in b]
    if max(a) < min(b):
        return "better"
    if min(a) > max(b):
        return "worse"
    return WITHIN


def ratio_range(mine: Iterable[float], other: Iterable[float]) -> tuple[float, float]:
    """The spread of ``mine / other`` over every pairing of the two sides' repeats (min, max):
    a comparison is a win or a loss (:func:`compare`) exactly when this range lies wholly on
    one side of 1. NaN when either side has no figure."""
    a, b = finite(mine), finite(other)
    if not a or not b or min(b) <= 0:
        return math.nan, math.nan
    return min(a) / max(b), max(a) / min(b)


def ratio_verdict(base: Iterable[float], mine: Iterable[float], factor: float) -> tuple[str, float, float, float]:
    """Is ``base / mine >= factor`` (lower is better: e.g. no_cache's TTFT over tieredkv's)?

    (verdict, ratio of the medians, worst-case ratio, best-case ratio): PASS when even the
    worst pairing (base's best repeat over mine's worst) reaches ``factor``, FAIL when not even
    the best pairing does, otherwise within spread (:data:`NO_SPREAD` with a single repeat).
    """
    b, m = finite(base), finite(mine)
    if not b or not m or min(m) <= 0:
        return "n/a", math.nan, math.nan, math.nan
    worst, best = min(b) / max(m), max(b) / min(m)
    mid = statistics.median(b) / statistics.median(m)
    if len(b) < 2 or len(m) < 2:
        return NO_SPREAD, mid, worst, best
    verdict = "PASS" if worst >= factor else ("FAIL" if best < factor else WITHIN)
    return verdict, mid, worst, best


def repeats_of(entry: Any) -> list[Mapping[str, Any]]:
    """A (configuration, level)'s per-repeat summaries (a lone summary counts as one repeat)."""
    if entry is None:
        return []
    return list(entry) if isinstance(entry, list | tuple) else [entry]


def values(runs: Mapping[str, Mapping[int, Any]], config: str, level: int, key: str) -> list[float]:
    return [r.get(key, math.nan) for r in repeats_of(runs.get(config, {}).get(level))]


def infer_role(name: str) -> str:
    if name.startswith("tieredkv"):
        return "tieredkv"
    return "equal_mem" if "equal_mem" in name else "baseline"


def judge(
    runs: Mapping[str, Mapping[int, Any]],
    exceeding_levels: Sequence[int],
    *,
    speedup: float = SPEEDUP_TARGET,
    roles: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Target rows for each tieredkv configuration and level whose working set exceeds the device.

    ``runs[config][level]``: the per-repeat summaries (or one summary). Against ``no_cache``:
    TTFT p50 ``speedup`` x better (:func:`ratio_verdict`); against every same-device
    non-tieredkv configuration (role ``baseline``, not the equal-memory control): better
    outside the spread. A row is PASS, FAIL, ``within spread``, or n/a when a figure is missing
    (a skipped level or configuration never passes).
    """
    role = {c: (roles or {}).get(c) or infer_role(c) for c in runs}
    rows: list[dict[str, Any]] = []
    others = [c for c in runs if role[c] == "baseline"]
    for config in (c for c in runs if role[c] == "tieredkv"):
        for level in exceeding_levels:
            mine = values(runs, config, level, "ttft_p50_s")
            base = values(runs, "no_cache", level, "ttft_p50_s")
            verdict, ratio, worst, best = ratio_verdict(base, mine, speedup)
            rows.append({
                "config": config, "users": level,
                "target": f"TTFT p50 >= {speedup:g}x better than no_cache",
                "measured": f"{ratio:.2f}x (spread {worst:.2f}–{best:.2f}x; median "
                            f"{spread(mine)['median'] * 1e3:,.0f} vs {spread(base)['median'] * 1e3:,.0f} ms)"
                if ratio == ratio else "n/a",
                "ratio": ratio, "verdict": verdict,
            })
            rivals = {c: values(runs, c, level, "ttft_p50_s") for c in others}
            known = {c: v for c, v in rivals.items() if finite(v)}
            if not finite(mine) or not known:
                verdict, measured = "n/a", "n/a"
            else:
                calls = {c: compare(mine, v) for c, v in known.items()}
                if any(v == "worse" for v in calls.values()):
                    verdict = "FAIL"
                elif all(v == "better" for v in calls.values()) and len(known) == len(rivals):
                    verdict = "PASS"
                elif len(known) != len(rivals):
                    verdict = "n/a"
                else:
                    verdict = NO_SPREAD if NO_SPREAD in calls.values() else WITHIN
                best_c = min(known, key=lambda c: spread(known[c])["median"])
                measured = (f"median {spread(mine)['median'] * 1e3:,.0f} ms vs best other {best_c} "
                            f"{spread(known[best_c])['median'] * 1e3:,.0f} ms; "
                            + ", ".join(f"{c}: {v}" for c, v in calls.items()))
            rows.append({
                "config": config, "users": level,
                "target": "TTFT p50 better than every same-device non-tieredkv configuration",
                "measured": measured, "verdict": verdict,
            })
    return rows


def overall_verdict(targets: Sequence[Mapping[str, Any]]) -> str:
    verdicts = [t["verdict"] for t in targets]
    if any(v == "FAIL" for v in verdicts):
        return "FAIL"
    if verdicts and all(v == "PASS" for v in verdicts):
        return "PASS"
    for undecided in (WITHIN, NO_SPREAD):
        if undecided in verdicts:
            return undecided
    return "n/a"


def comparisons(
    runs: Mapping[str, Mapping[int, Any]],
    levels: Sequence[int],
    roles: Mapping[str, str],
    same_device: str = "prefix_cache",
    peers: Mapping[str, str] | None = None,
    budget_of: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Each tieredkv configuration against the same-device prefix cache, against the
    equal-memory control sized from its own RAM and against each peer whose budget it set, per
    level: per figure the verdict (:func:`compare`) and the ratio of the medians (mine / other:
    below 1 is better for TTFT, above 1 for throughput). ``budget_of``: control or peer ->
    the tieredkv configuration whose memory it was given (``peers``: the same for peers, kept
    for older callers); an equal-memory control named in neither is compared with every
    tieredkv configuration (results files from before the controls were split)."""
    budget = {**(peers or {}), **(budget_of or {})}
    same = [(same_device, "same device")] if same_device in runs else []
    rows = []
    for config in (c for c in runs if roles.get(c) == "tieredkv"):
        mine_refs = same + [
            (c, "equal memory") for c in runs
            if roles.get(c) == "equal_mem" and budget.get(c, config) == config] + [
            (p, "peer") for p in runs if roles.get(p) == "peer" and budget.get(p, "tieredkv_host") == config]
        for level in levels:
            for ref, kind in mine_refs:
                row: dict[str, Any] = {"config": config, "users": level, "reference": ref, "kind": kind}
                for key, (_label, higher) in SPREAD_METRICS.items():
                    mine, other = values(runs, config, level, key), values(runs, ref, level, key)
                    a, b = spread(mine)["median"], spread(other)["median"]
                    ratio = a / b if a == a and b == b and b else math.nan
                    row[key] = compare(mine, other, higher)
                    row[key + "_ratio"] = ratio
                    low, high = ratio_range(mine, other)
                    row[key + "_ratio_spread"] = [low, high]
                    spread_text = f", spread {low:.2f}–{high:.2f}x" if low == low and low != high else ""
                    row[key + "_cell"] = (f"{row[key]} ({ratio:.2f}x{spread_text})" if ratio == ratio
                                          else row[key])
                rows.append(row)
    return rows


def noise_floor(
    runs: Mapping[str, Mapping[int, Any]],
    level: int,
    configs: Sequence[str],
) -> dict[str, Any]:
    """The spread at ``level`` (one that fits the device cache) pooled over the repeats of
    ``configs`` (those that behave alike there: prefix caching on, nothing to offload).
    ``rel`` = (max - min) / median: differences below it are noise."""
    out: dict[str, Any] = {"users": level, "configs": list(configs)}
    for key in SPREAD_METRICS:
        pooled = [v for c in configs for v in values(runs, c, level, key)]
        s = spread(pooled)
        s["rel"] = (s["max"] - s["min"]) / s["median"] if s["n"] and s["median"] else math.nan
        s["medians"] = {c: spread(values(runs, c, level, key))["median"] for c in configs}
        out[key] = s
    hits = [r.get("hits", {}).get(k, 0.0) for c in configs for r in repeats_of(runs.get(c, {}).get(level))
            for k in ("tieredkv_host_tokens", "tieredkv_disk_tokens")]
    out["tieredkv_hit_tokens"] = sum(h for h in hits if h == h)
    return out


def aggregate(runs: Mapping[str, Mapping[int, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    """Per configuration and level: the median and spread of each :data:`SPREAD_METRICS` figure."""
    return {c: {lv: {k: spread(values(runs, c, lv, k)) for k in SPREAD_METRICS} for lv in per}
            for c, per in runs.items()}


def analyse(payload: Mapping[str, Any]) -> dict[str, Any]:
    """Targets, comparisons and the noise floor, from the per-repeat figures alone."""
    runs = payload["runs"]
    exceeding = payload["exceeding_levels"]
    roles = {c["name"]: c.get("role") or infer_role(c["name"]) for c in payload["configs"]}
    roles.update({c: infer_role(c) for c in runs if c not in roles})
    targets = judge(runs, exceeding, roles=roles)
    fitting = [lv for lv in payload["levels"] if lv not in exceeding]
    alike = [c["name"] for c in payload["configs"]
             if c.get("prefix_caching") and c["name"] in runs and roles.get(c["name"]) != "peer"]
    noise = noise_floor(runs, min(fitting), alike) if fitting and alike else None
    budget_of = {c["name"]: (c.get("sizes") or {})["budget_of"] for c in payload["configs"]
                 if "budget_of" in (c.get("sizes") or {})}
    return {"targets": targets, "comparisons": comparisons(runs, payload["levels"], roles, budget_of=budget_of),
            "noise_floor": noise, "verdict": overall_verdict(targets), "roles": roles}
