"""The soak's judging: a leak rule per sampled series (least-squares slope after the warm-up,
or the climb of a short run), the idle state, and the checks that make the verdict."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks import common
from benchmarks.endurance.runner import Run
from benchmarks.endurance.workload import MiB
from benchmarks.serve.judging import metric_sum


@dataclass(frozen=True)
class LeakRule:
    """How flat one sampled series must stay after the warm-up; see :func:`leak_check`.

    ``per_hour``: the largest least-squares slope allowed, in the series' units per hour, once
    at least ``judge_span_s`` of samples follow the warm-up (a server must be flat, so the
    limits are absolute, not a fraction of the level). ``rise``: on a shorter run, the most the
    fitted line may climb over its span; on any run, the most the last quarter's maximum may
    exceed the first post-warm-up quarter's maximum.
    """

    per_hour: float
    rise: float
    judge_span_s: float = 1800.0
    min_samples: int = 8


LEAK_RULES: dict[str, LeakRule] = {
    "rss_bytes": LeakRule(per_hour=16 * MiB, rise=32 * MiB),
    # With a control server (vLLM without tieredkv under the same load), the RSS rule judges
    # the tieredkv server's RSS minus the control's, sampled in the same tick: vLLM's own
    # growth (allocator and per-shape caches of its CPU worker) is not tieredkv's leak.
    "rss_excess_bytes": LeakRule(per_hour=16 * MiB, rise=32 * MiB),
    "open_fds": LeakRule(per_hour=1, rise=2),
    "threads": LeakRule(per_hour=1, rise=2),
    "host_slots_used": LeakRule(per_hour=1, rise=2),
    # Pins of hits and transfers in flight come and go with the load; a leak of pins shows as a
    # trend here and, exactly, in the idle check at the end (every pin must be gone).
    "pinned_host_slots": LeakRule(per_hour=2, rise=8),
    "disk_slots_used": LeakRule(per_hour=1, rise=2),
    "journal_entries": LeakRule(per_hour=1, rise=2),
    "disk_usage_bytes": LeakRule(per_hour=1 * MiB, rise=1 * MiB),
    # The journal is compacted as it grows: a saw tooth is fine, a journal that only grows is not.
    "journal_bytes": LeakRule(per_hour=256 * 1024, rise=64 * 1024),
}


def lsq_slope(ts: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ``ys`` over ``ts`` (0 for fewer than two distinct times)."""
    n = len(ts)
    if n < 2:
        return 0.0
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    if var == 0:
        return 0.0
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / var


def leak_check(ts: Sequence[float], ys: Sequence[float], rule: LeakRule, warmup_s: float) -> dict[str, Any]:
    """Decide whether a sampled series is flat after ``warmup_s`` (see the module docstring).

    Returns the figures and ``verdict``: ``PASS``, ``FAIL`` or ``n/a`` (too few samples
    after the warm-up to decide; never a PASS). ``mode`` says which trend limit applied:
    ``hourly`` (slope per hour against ``rule.per_hour``) or ``short run`` (the fitted climb
    over the run against ``rule.rise``; the hourly rule needs ``rule.judge_span_s`` of samples).
    """
    pairs = sorted((t, y) for t, y in zip(ts, ys, strict=True) if y is not None and y == y)
    if len(pairs) < 2:
        return {"verdict": "n/a", "reason": "fewer than two samples"}
    t0, t_end = pairs[0][0], pairs[-1][0]
    post = [(t, y) for t, y in pairs if t >= t0 + warmup_s]
    if len(post) < rule.min_samples:
        return {"verdict": "n/a", "reason": f"{len(post)} samples after the {warmup_s:.0f} s warm-up "
                                            f"(< {rule.min_samples})"}
    p0 = post[0][0]
    span = t_end - p0
    slope = lsq_slope([t for t, _ in post], [y for _, y in post])
    per_hour = slope * 3600
    level = statistics.median(y for _, y in post)
    if span >= rule.judge_span_s:
        mode, climb, limit = "hourly", per_hour, rule.per_hour
    else:
        mode, climb, limit = "short run", slope * span, rule.rise
    quarter = span / 4
    first_q = [y for t, y in post if t <= p0 + quarter]
    last_q = [y for t, y in post if t >= t_end - quarter]
    ceiling = max(first_q) + rule.rise
    trend_ok = climb <= limit
    ceiling_ok = max(last_q) <= ceiling
    reasons = []
    if not trend_ok:
        if mode == "hourly":
            reasons.append(f"slope {per_hour:.4g}/h > {limit:.4g}/h")
        else:
            reasons.append(f"climbs {climb:.4g} over {span:.0f} s > {limit:.4g}")
    if not ceiling_ok:
        reasons.append(f"last-quarter max {max(last_q):.4g} > first-quarter max {max(first_q):.4g} + {rule.rise:g}")
    return {
        "verdict": "PASS" if trend_ok and ceiling_ok else "FAIL", "mode": mode,
        "slope_per_s": slope, "slope_per_h": per_hour, "climb": climb, "limit": limit,
        "span_s": span, "median": level, "first_quarter_max": max(first_q),
        "last_quarter_max": max(last_q), "ceiling": ceiling, "samples": len(post),
        "reason": "; ".join(reasons),
    }


#: The control's own RSS is read with the server's RSS rule (information only).
INFO_RULE_OF = {"control_rss_bytes": "rss_bytes"}

#: With a control, the tieredkv server's own RSS is judged too, under this looser cap (4x the
#: excess rule): growth vLLM shares with the control is not tieredkv's, but an operator still
#: pays for it, and a leak the control happened to match must not pass unbounded.
OWN_RSS_CAP = LeakRule(per_hour=64 * MiB, rise=128 * MiB)

#: The control must serve at least this share of the requests tieredkv served: a baseline that
#: carried much less of the load would understate vLLM's own growth.
CONTROL_MIN_SHARE = 0.95


def rule_for(series: str, with_control: bool = False) -> LeakRule:
    if with_control and series == "rss_bytes":
        return OWN_RSS_CAP
    return LEAK_RULES[INFO_RULE_OF.get(series, series)]


def judged_series(with_control: bool) -> tuple[list[str], list[str]]:
    """The series the verdict judges and those shown for information only: with a control, RSS
    is judged as the excess over the control and, under :data:`OWN_RSS_CAP`, as the server's
    own; the control's RSS is shown. Without a control, the server's RSS is judged as it is."""
    info = ["control_rss_bytes"] if with_control else []
    skip = "" if with_control else "rss_excess_bytes"
    return [k for k in LEAK_RULES if k != skip], info


def per_process_slopes(samples: Sequence[Mapping[str, Any]], key: str, warmup_s: float) -> dict[str, float]:
    """Least-squares RSS slope per hour of each kind of process (``key``: ``rss_by_process`` or
    ``control_rss_by_process``) after the warm-up: where the growth is."""
    if not samples:
        return {}
    t0 = samples[0]["t"] + warmup_s
    roles = sorted({role for x in samples for role in x.get(key) or {}})
    out: dict[str, float] = {}
    for role in roles:
        pts = [(x["t"], x[key][role]) for x in samples if x["t"] >= t0 and role in (x.get(key) or {})]
        if len(pts) >= 2:
            out[role] = lsq_slope([t for t, _ in pts], [y for _, y in pts]) * 3600
    return out


def control_check(run: Run) -> dict[str, str]:
    """The control carried the same load: it kept answering and served at least
    :data:`CONTROL_MIN_SHARE` of tieredkv's requests; its lag behind the tieredkv clients and
    its outputs against the reference are information."""
    c_ok = [r for r in run.control_records if r.get("ok")]
    served = len([r for r in run.records if r.get("ok")])
    errors = len(run.control_records) - len(c_ok)
    lags = [r["lag_s"] for r in c_ok if "lag_s" in r]
    lag = f"lag behind tieredkv's clients mean {statistics.fmean(lags):.2f} s, max {max(lags):.2f} s; " if lags else ""
    short = len(c_ok) < CONTROL_MIN_SHARE * served
    return {
        "check": "control server (vLLM without tieredkv, its prefix cache on) kept answering and "
                 f"served at least {CONTROL_MIN_SHARE:.0%} of tieredkv's requests (its RSS is the leak rule's baseline)",
        "measured": f"{len(c_ok)} of tieredkv's {served} requests, {errors} error{'s' * (errors != 1)}; {lag}"
                    f"{sum(1 for r in c_ok if r.get('mismatch'))} differ from the reference (information: vLLM's own)",
        "verdict": "FAIL" if run.control_lost or not c_ok or short else "PASS",
    }


def idle_verdict(idle: Mapping[str, Any]) -> tuple[str, str]:
    """PASS when nothing is pinned, in flight or waiting once idle; the figures as text."""
    if not idle:
        return "FAIL", "not measured (the engine had stopped answering)"
    if "error" in idle:
        return "FAIL", idle["error"]
    keys = ("pinned_host_slots", "jobs_in_flight", "host_slots_in_flight", "requests_waiting_on_load")
    text = ", ".join(f"{k} {idle.get(k, math.nan):g}" for k in keys)
    return ("PASS" if all(idle.get(k) == 0 for k in keys) else "FAIL"), text


def judge(run: Run, p: Mapping[str, Any], prompts: Sequence[list[int]]) -> dict[str, Any]:
    """The run's leaks (one rule per sampled series), tieredkv's final counters, the checks,
    the verdict and the summary; a leaking series is added to ``run.failures``."""
    samples, records, faults, failures = run.samples, run.records, run.faults, run.failures
    final_metrics, idle = run.final_metrics, run.idle
    load_end, load_start = run.load_end, run.load_start
    load_s = max(1e-9, load_end - load_start)
    run_s = p["duration_s"]
    judged_keys, info_keys = judged_series(run.with_control)
    leaks, leaks_info = {}, {}
    for key in judged_keys + info_keys:
        ts = [s["t"] for s in samples if key in s]
        ys = [s[key] for s in samples if key in s]
        rule = rule_for(key, run.with_control)
        (leaks if key in judged_keys else leaks_info)[key] = leak_check(ts, ys, rule, warmup_s=p["warmup_s"])
    ok = [r for r in records if r.get("ok")]
    ttfts = [r["ttft_s"] for r in ok]
    mismatches = sum(1 for r in ok if r.get("mismatch"))
    errors = sum(1 for r in records if not r.get("ok"))
    counters = {}
    for label, (name, labels) in {
        "hit_tokens{tier=host}": ("vllm:tieredkv_hit_tokens_total", {"tier": "host"}),
        "hit_tokens{tier=disk}": ("vllm:tieredkv_hit_tokens_total", {"tier": "disk"}),
        "chunks{op=stored}": ("vllm:tieredkv_chunks_total", {"op": "stored"}),
        "chunks{op=spilled}": ("vllm:tieredkv_chunks_total", {"op": "spilled"}),
        "chunks{op=promoted}": ("vllm:tieredkv_chunks_total", {"op": "promoted"}),
        "evictions{tier=disk}": ("vllm:tieredkv_evictions_total", {"tier": "disk"}),
        "load_failures{cause=checksum}": ("vllm:tieredkv_load_failures_total", {"cause": "checksum"}),
        "load_failures (all causes)": ("vllm:tieredkv_load_failures_total", None),
        "spills_dropped": ("vllm:tieredkv_spills_dropped_total", None),
    }.items():
        counters[label] = metric_sum(final_metrics, name, labels) if final_metrics else math.nan
    leak_fail = [k for k, v in leaks.items() if v["verdict"] == "FAIL"]
    leak_undecided = [k for k, v in leaks.items() if v["verdict"] not in ("PASS", "FAIL")]
    hourly = all(v.get("mode") == "hourly" for v in leaks.values())
    cap = OWN_RSS_CAP
    if run.with_control:
        rss_rule = (f"RSS above the control's: slope < 16 MiB/h, own RSS slope < {cap.per_hour / MiB:g} MiB/h"
                    if hourly else
                    f"RSS above the control's climbs < 32 MiB, own RSS climbs < {cap.rise / MiB:g} MiB")
    else:
        rss_rule = "RSS: slope < 16 MiB/h" if hourly else "RSS climbs < 32 MiB"
    leak_check_name = "every sampled series flat after the warm-up " + (
        f"({rss_rule})" if hourly else f"(short run: {rss_rule}; hourly rule: full profile)")
    if leak_fail:
        leak_text = "not flat: " + ", ".join(leak_fail)
    elif leak_undecided:
        leak_text = (f"not decided (too few samples after the warm-up: the load ran {load_s:.0f} s): "
                     + ", ".join(leak_undecided))
    else:
        leak_text = "all flat"
    checks = [
        {"check": "every response equals its float32 reference",
         "measured": f"{len(ok) - mismatches}/{len(ok)} equal", "verdict": "PASS" if ok and not mismatches else "FAIL"},
        {"check": "engine kept answering (no request error/timeout, /health)",
         "measured": f"{errors} request errors, {sum(1 for s in samples if not s.get('healthy'))} failed health checks",
         "verdict": "PASS" if not any(f.startswith(("engine", "server", "soak")) for f in failures) and ok else "FAIL"},
        {"check": leak_check_name,
         "measured": leak_text, "verdict": "PASS" if not leak_fail and not leak_undecided else "FAIL"},
        {"check": "nothing pinned, in flight or waiting once idle",
         "measured": idle_verdict(idle)[1], "verdict": idle_verdict(idle)[0]},
        {"check": "load ran for the planned duration",
         "measured": f"{load_s:.0f} of {run_s:.0f} s", "verdict": "PASS" if load_s >= 0.95 * run_s else "FAIL"},
        {"check": "faults injected (informational: detected = corrupted slots later read)",
         "measured": f"{len(faults)} slots corrupted; tieredkv counted "
                     f"{counters['load_failures{cause=checksum}']:.0f} checksum failures",
         "verdict": "info"},
    ]
    if run.with_control:
        checks.insert(3, control_check(run))
    for key in leak_fail:
        failures.append(f"series {key}: {leaks[key]['verdict']}: {leaks[key].get('reason', '')}")
    verdict = "PASS" if all(c["verdict"] in ("PASS", "info") for c in checks) else "FAIL"
    summary = {
        "requests": len(records), "ok": len(ok), "mismatches": mismatches, "errors": errors,
        "rps": len(ok) / load_s, "ttft_p50_ms": common.percentile(ttfts, 50) * 1e3 if ttfts else math.nan,
        "ttft_p99_ms": common.percentile(ttfts, 99) * 1e3 if ttfts else math.nan,
        "faults": len(faults), "load_s": load_s,
        "prompt_tokens_min": min(len(x) for x in prompts), "prompt_tokens_max": max(len(x) for x in prompts),
    }
    slopes = {"tieredkv": per_process_slopes(samples, "rss_by_process", p["warmup_s"]),
              "control": per_process_slopes(samples, "control_rss_by_process", p["warmup_s"])}
    return {"load_s": load_s, "leaks": leaks, "leaks_info": leaks_info, "counters": counters,
            "checks": checks, "verdict": verdict, "summary": summary, "mismatches": mismatches,
            "rss_slopes_by_process": {k: v for k, v in slopes.items() if v}}
