"""multi_replica's judging: hits and counts summed over both replicas, rounds pooled, the
shared tier against separate replicas, the replies compared, and the checks that decide the
exit status."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.replicas.breakdown import pool as pool_breakdown
from benchmarks.replicas.breakdown import where_time_goes
from benchmarks.replicas.workload import CONFIGS, replica_for
from benchmarks.serve.judging import level_summary, metric_sum

# key: (metric, labels); counted per replica and summed; the *_tokens ones also as rates.
HIT_METRICS: dict[str, tuple[str, dict[str, str] | None]] = {
    "device": ("vllm:prefix_cache_hits_total", None),
    "connector": ("vllm:external_prefix_cache_hits_total", None),
    "tieredkv_host": ("vllm:tieredkv_hit_tokens_total", {"tier": "host"}),
    "tieredkv_disk": ("vllm:tieredkv_hit_tokens_total", {"tier": "disk"}),
    "tieredkv_remote": ("vllm:tieredkv_hit_tokens_total", {"tier": "remote"}),
}


COUNT_METRICS: dict[str, tuple[str, dict[str, str] | None]] = {
    "remote_read_chunks": ("vllm:tieredkv_chunks_total", {"op": "remote_read"}),
    "remote_written_chunks": ("vllm:tieredkv_chunks_total", {"op": "remote_written"}),
    "remote_probes": ("vllm:tieredkv_remote_probes_total", None),
    "remote_probe_failures": ("vllm:tieredkv_remote_probe_failures_total", None),
    "remote_read_failures": ("vllm:tieredkv_remote_read_failures_total", None),
    "remote_writes_dropped": ("vllm:tieredkv_remote_writes_dropped_total", None),
    "evictions_host": ("vllm:tieredkv_evictions_total", {"tier": "host"}),
    "preemptions": ("vllm:num_preemptions_total", None),
}


def aggregate_hits(befores: Sequence[str], afters: Sequence[str], prompt_tokens: int) -> dict[str, float]:
    """Hit tokens (and counts) between two scrapes of every replica's /metrics, summed over
    the replicas; hit rates are shares of ``prompt_tokens`` (the prompt tokens sent to all)."""
    if len(befores) != len(afters):
        raise ValueError("one scrape before and one after per replica")
    out: dict[str, float] = {}
    for key, (name, labels) in {**HIT_METRICS, **COUNT_METRICS}.items():
        delta = sum(metric_sum(a, name, labels) - metric_sum(b, name, labels)
                    for b, a in zip(befores, afters, strict=True))
        if key in HIT_METRICS:
            out[key + "_tokens"] = delta
            out[key + "_rate"] = delta / prompt_tokens if prompt_tokens else math.nan
        else:
            out[key] = delta
    tieredkv = sum(out[f"tieredkv_{t}_tokens"] for t in ("host", "disk", "remote"))
    out["tieredkv_tokens"] = tieredkv
    out["tieredkv_rate"] = tieredkv / prompt_tokens if prompt_tokens else math.nan
    return out


def pool_hits(per_level: Sequence[Mapping[str, float]], prompt_tokens: int) -> dict[str, float]:
    """Several levels' :func:`aggregate_hits` pooled: tokens and counts summed, rates again."""
    out: dict[str, float] = {}
    for hits in per_level:
        for key, value in hits.items():
            if not key.endswith("_rate"):
                out[key] = out.get(key, 0.0) + value
    for key in [k for k in out if k.endswith("_tokens")]:
        out[key[: -len("_tokens")] + "_rate"] = out[key] / prompt_tokens if prompt_tokens else math.nan
    return out


def ratio(numerator: float | None, denominator: float | None) -> float:
    """``numerator / denominator``; NaN when either is missing, NaN or the denominator 0."""
    if numerator is None or denominator is None:
        return math.nan
    if numerator != numerator or denominator != denominator or denominator == 0:
        return math.nan
    return numerator / denominator


def shared_vs_separate(results: Mapping[str, Mapping[Any, Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """Per level (and ``all``): shared_remote / separate for TTFT p50, p99 and prompt tok/s
    (a TTFT ratio below 1 and a throughput ratio above 1 favour the shared tier)."""
    shared, separate = results.get("shared_remote", {}), results.get("separate", {})
    rows = []
    for level in [lv for lv in shared if lv in separate]:
        a, b = shared[level], separate[level]
        theirs = {r["round"]: r for r in b.get("rounds", [])}
        per_round = [ratio(r["ttft_p50_s"], theirs[r["round"]]["ttft_p50_s"])
                     for r in a.get("rounds", []) if r["round"] in theirs]
        rows.append({
            "users": level,
            "ttft_p50_ratio": ratio(a.get("ttft_p50_s"), b.get("ttft_p50_s")),
            "ttft_p99_ratio": ratio(a.get("ttft_p99_s"), b.get("ttft_p99_s")),
            "prompt_tps_ratio": ratio(a.get("prompt_tokens_per_s"), b.get("prompt_tokens_per_s")),
            "shared_p50_s": a.get("ttft_p50_s"), "separate_p50_s": b.get("ttft_p50_s"),
            "shared_p99_s": a.get("ttft_p99_s"), "separate_p99_s": b.get("ttft_p99_s"),
            "ttft_p50_ratio_per_round": per_round,
        })
    return rows


def pooled_summary(records_by_level: Mapping[Any, Sequence[Mapping[str, Any]]],
                   per_level: Mapping[Any, Mapping[str, Any]]) -> dict[str, Any]:
    """Several runs' requests together (levels, or one level's rounds): TTFT percentiles over
    all of them, throughput over the runs' summed wall time, hits pooled."""
    records = [r for key in records_by_level for r in records_by_level[key]]
    wall = sum(per_level[key]["wall_s"] for key in records_by_level if key in per_level)
    out = level_summary(records, wall)
    out["hits"] = pool_hits([per_level[key]["hits"] for key in records_by_level
                             if "hits" in per_level.get(key, {})], out["prompt_tokens"])
    return out


def first_divergences(replies: Mapping[str, Mapping[Any, Mapping[str, Sequence[int]]]]) -> list[dict[str, Any]]:
    """Per conversation whose greedy replies differ between the configurations, the first
    turn that differs (its prompt was the same in both: every reply before it agreed) and the
    first differing token; later turns of that conversation differ because their prompts do."""
    a, b = replies.get("shared_remote", {}), replies.get("separate", {})
    out = []
    for level, got in a.items():
        want = b.get(level, {})
        users = sorted({int(k.split(":")[0]) for k in got})
        for user in users:
            turns = sorted(int(k.split(":")[1]) for k in got if int(k.split(":")[0]) == user)
            for turn in turns:
                key = f"{user}:{turn}"
                if key not in want:
                    break
                x, y = list(got[key]), list(want[key])
                if x != y:
                    token = next((i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q),
                                 min(len(x), len(y)))
                    users, round_ = level if isinstance(level, tuple) else (level, 0)
                    out.append({"users": users, "round": round_, "user": user, "turn": turn,
                                "token": token, "replica": replica_for(user, turn)})
                    break
    return out


def replies_agree(replies: Mapping[str, Mapping[Any, Mapping[Any, Sequence[int]]]]) -> tuple[int, int]:
    """(equal, compared): greedy replies of ``shared_remote`` against ``separate``, per level,
    user and turn, where both configurations have one."""
    a, b = replies.get("shared_remote", {}), replies.get("separate", {})
    same = total = 0
    for level, got in a.items():
        for key, tokens in got.items():
            want = b.get(level, {}).get(key)
            if want is None:
                continue
            total += 1
            same += list(tokens) == list(want)
    return same, total


def checks(results: Mapping[str, Mapping[Any, Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """What must hold for the comparison to mean anything (not targets): the shared
    configuration really read from Redis, the separate one never did, no remote failures."""
    out = []
    shared = results.get("shared_remote", {}).get("all", {}).get("hits", {})
    separate = results.get("separate", {}).get("all", {}).get("hits", {})
    if shared:
        tokens = shared.get("tieredkv_remote_tokens", 0)
        out.append({"check": "shared_remote: replicas hit each other's chunks in Redis",
                    "measured": f"{tokens:,.0f} remote hit tokens, {shared.get('remote_read_chunks', 0):,.0f} "
                                f"chunks read, {shared.get('remote_written_chunks', 0):,.0f} written",
                    "verdict": "PASS" if tokens > 0 else "FAIL"})
        fails = shared.get("remote_probe_failures", 0) + shared.get("remote_read_failures", 0)
        dropped = shared.get("remote_writes_dropped", 0)
        out.append({"check": "shared_remote: no remote probe/read failure, no dropped write (info)",
                    "measured": f"{fails:,.0f} failures, {dropped:,.0f} writes dropped",
                    "verdict": "PASS" if fails == 0 and dropped == 0 else "INFO"})
    for config, hits in (("shared_remote", shared), ("separate", separate)):
        if hits:
            evicted = hits.get("evictions_host", 0)
            out.append({"check": f"{config}: the host tier never evicted (it holds the whole run)",
                        "measured": f"{evicted:,.0f} host evictions",
                        "verdict": "PASS" if evicted == 0 else "FAIL"})
    if separate:
        tokens = separate.get("tieredkv_remote_tokens", 0)
        out.append({"check": "separate: no remote tier",
                    "measured": f"{tokens:,.0f} remote hit tokens",
                    "verdict": "PASS" if tokens == 0 else "FAIL"})
    return out


def hit_rate(hits: Mapping[str, float]) -> float:
    """Share of the prompt tokens sent that were not recomputed: vLLM's device prefix cache
    plus every tieredkv tier."""
    device, tieredkv = hits.get("device_rate", math.nan), hits.get("tieredkv_rate", math.nan)
    return device + tieredkv


def _side(mine: Sequence[float], other: Sequence[float], lower_is_better: bool) -> str:
    """PASS when every round of ``mine`` beats every round of ``other`` (outside the
    spread), FAIL for the reverse, MISS otherwise (within the spread: no win shown)."""
    a = [x for x in mine if x == x]
    b = [x for x in other if x == x]
    if len(a) < 2 or len(b) < 2:
        return "MISS"
    if not lower_is_better:
        a, b = [-x for x in a], [-x for x in b]
    return "PASS" if max(a) < min(b) else ("FAIL" if min(a) > max(b) else "MISS")


#: Target rows: (figure in a round, label, lower is better).
TARGET_FIGURES = (("ttft_p50_s", "TTFT p50", True), ("ttft_p99_s", "TTFT p99", True),
                  ("hit_rate", "hit rate (device + tieredkv)", False))


def targets(results: Mapping[str, Mapping[Any, Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """Per level: shared TTFT p50 and p99 below separate's and its hit rate above, each
    outside the spread of the rounds (PASS), the reverse (FAIL) or neither (MISS); a missed
    TTFT target says where the time goes (:func:`breakdown.where_time_goes`)."""
    shared, separate = results.get("shared_remote", {}), results.get("separate", {})
    out = []
    for level in [lv for lv in shared if lv in separate and lv != "all"]:
        a, b = shared[level].get("rounds", []), separate[level].get("rounds", [])
        for key, label, lower in TARGET_FIGURES:
            mine, other = [r[key] for r in a if key in r], [r[key] for r in b if key in r]
            verdict = _side(mine, other, lower)
            scale, unit = (1e3, " ms") if key.endswith("_s") else (100.0, " %")
            fmt = ", ".join
            row = {"users": level, "target": f"shared {label} {'<' if lower else '>'} separate, outside the spread",
                   "measured": f"shared {fmt(f'{scale * x:.1f}' for x in mine)}{unit} vs separate "
                               f"{fmt(f'{scale * x:.1f}' for x in other)}{unit} (rounds)",
                   "verdict": verdict}
            if verdict != "PASS" and lower and "breakdown" in shared[level] and "breakdown" in separate[level]:
                row["where"] = where_time_goes(shared[level]["breakdown"], separate[level]["breakdown"])
            out.append(row)
    return out


def pool_results(full: Mapping[str, Mapping[tuple[int, int], list[dict[str, Any]]]],
                 runs: Mapping[str, Mapping[tuple[int, int], dict[str, Any]]],
                 levels: Sequence[int]) -> dict[str, dict[Any, dict[str, Any]]]:
    """Per configuration: each level's rounds pooled (with each round's own figures), and
    ``"all"``, every round of every level pooled."""
    results: dict[str, dict[Any, dict[str, Any]]] = {c: {} for c in CONFIGS}
    for config in CONFIGS:
        for level in levels:
            keys = [k for k in full[config] if k[0] == level]
            if keys:
                results[config][level] = pooled_summary({k: full[config][k] for k in keys}, runs[config])
                results[config][level]["rounds"] = [
                    {"round": k[1], **{x: runs[config][k][x] for x in ("ttft_p50_s", "ttft_p99_s",
                                                                        "prompt_tokens_per_s", "wall_s")},
                     "hit_rate": hit_rate(runs[config][k].get("hits", {}))}
                    for k in keys]
                parts = [runs[config][k]["breakdown"] for k in keys if "breakdown" in runs[config][k]]
                if parts:
                    results[config][level]["breakdown"] = pool_breakdown(parts)
        if full[config]:
            results[config]["all"] = pooled_summary(full[config], runs[config])
    return results


def consistency(replies: Mapping[str, Mapping[Any, Mapping[str, list[int]]]]) -> dict[str, Any]:
    """The replies of ``shared_remote`` against ``separate``'s: how many equal, where each
    conversation first differs, and the sentence the report prints (empty when none compared)."""
    same, compared = replies_agree(replies)
    divergences = first_divergences(replies)
    note = (f"Greedy replies of `shared_remote` equal to `separate`'s: {same}/{compared} "
            "(once one reply differs, that conversation's later prompts differ too)."
            if compared else "")
    if divergences:
        note += " First differing turn per conversation (same prompt in both): " + "; ".join(
            f"{d['users']} users, user {d['user']} turn {d['turn']} (replica {d['replica']}), "
            f"from reply token {d['token']}" for d in divergences) + "."
    return {"equal": same, "compared": compared, "first_divergences": divergences, "note": note}
