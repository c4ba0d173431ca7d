"""e2e_ttft's judging: every measured run checked against the hit its row must show, each
row's medians and ratios, and the targets (wall clock and at equal compute).

A hit that did not happen is a FAIL, never a number.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.ttft.workload import (
    CHUNK_TOKENS,
    HYBRID_CONFIGS,
    LMCACHE_CONFIG,
    SLOW_DISK_CONFIG,
    SLOW_REMOTE_CONFIG,
)

# The slow rows' per-run check: the cost model declined the hit (a disk hit once its read is
# predicted slower than recomputing; a remote one then, or at the probe, not waited for).
DECLINED_DISK = "hits_declined_slower_than_recompute_disk"
DECLINED_REMOTE = ("hits_declined_slower_than_recompute_remote",
                   "hits_declined_probe_wait_over_saving_remote")
# Each slow row: its tier, the counters that say "declined".
SLOW_ROWS = {SLOW_DISK_CONFIG: ("disk", (DECLINED_DISK,)),
             SLOW_REMOTE_CONFIG: ("remote", DECLINED_REMOTE)}


def fmt_ms(seconds: float | None) -> str:
    if seconds is None or seconds != seconds:
        return "n/a"
    return f"{seconds * 1000:,.1f}"


def _check_hits(runs: list[dict[str, Any]], expected: dict[str, int], tier: str | None,
                what: str = "the prefix-cache hit") -> list[str]:
    """Every run hit exactly ``expected`` of its prompt (vLLM's prefix-cache hit unless told),
    and from ``tier`` if given; a remote read that failed is a problem too."""
    problems = []
    wrong = [(r["prompt"], r["num_cached_tokens"]) for r in runs
             if r["num_cached_tokens"] != expected[r["prompt"]]]
    if wrong:
        problems.append(f"num_cached_tokens {wrong}: {len(wrong)} run(s) other than "
                        f"{what} {expected}")
    if tier is not None:
        short = [(r["prompt"], r["tieredkv"].get(f"hit_tokens_{tier}", 0)) for r in runs
                 if r["tieredkv"].get(f"hit_tokens_{tier}", 0) < expected[r["prompt"]]]
        if short:
            problems.append(f"tieredkv hit_tokens_{tier} {short}: not every hit came from the {tier} tier")
    if tier == "remote":
        failed = sorted({k for r in runs for k, v in r["tieredkv"].items()
                         if v and k.startswith(("remote_read_failed_", "remote_probe_failed_"))})
        if failed:
            problems.append(f"remote reads or probes failed: {', '.join(failed)}")
    return problems


def _check_declined(runs: list[dict[str, Any]], config: str = SLOW_DISK_CONFIG) -> list[str]:
    """A slow row (disk, or Redis): every measured run's hit declined by the cost model
    (counted), at most one chunk loaded (an exploration reads its chunk aside: the request
    loads nothing from the slow tier)."""
    tier, names = SLOW_ROWS[config]
    problems = []
    taken = [r["label"] for r in runs if not any(r["tieredkv"].get(n) for n in names)]
    if taken:
        problems.append(f"{len(taken)} run(s) without a declined {tier} hit "
                        f"({' or '.join(names)}): {taken}")
    loaded = [(r["label"], r["num_cached_tokens"]) for r in runs
              if r["num_cached_tokens"] > CHUNK_TOKENS]
    if loaded:
        problems.append(f"num_cached_tokens {loaded}: more than one chunk loaded from the slow {tier}")
    return problems


def hits_by_prompt(runs: list[dict[str, Any]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for r in runs:
        out.setdefault(r["prompt"], []).append(r["num_cached_tokens"])
    return dict(sorted(out.items()))


def median_of(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def by_prompt(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Medians per prompt (A and B differ in what a chunk-aligned hit leaves to compute)."""
    out: dict[str, dict[str, Any]] = {}
    for prompt in sorted({r["prompt"] for r in runs}):
        mine = [r for r in runs if r["prompt"] == prompt]
        timed = [r for r in mine if r.get("forward_s") is not None]
        out[prompt] = {
            "n": len(mine),
            "median_s": median_of([r["seconds"] for r in mine]),
            "forward_median_s": median_of([r["forward_s"] for r in timed]),
            "overhead_median_s": median_of([r["seconds"] - r["forward_s"] for r in timed]),
            "samples_s": [r["seconds"] for r in mine],
        }
    return out


def summarize(config: str, result: dict[str, Any], expected_hit: dict[str, int],
              expected_remote: dict[str, int] | None = None,
              expected_hybrid: dict[str, int] | None = None,
              expected_lmcache: dict[str, int] | None = None) -> dict[str, Any]:
    """The measured runs of one configuration, with the proof that each hit hit.

    ``expected_remote``: the remote row's expected hit per prompt (:func:`remote_hit`);
    ``expected_hybrid``: the hybrid tieredkv rows' (:func:`hybrid_hit`);
    ``expected_lmcache``: the LMCache row's whole-chunk hit (:func:`lmcache_hit`)."""
    hybrid_tieredkv = config.startswith("hybrid_tieredkv")
    bare = config.removeprefix("hybrid_")
    records = result["records"]

    def runs(prefix: str) -> list[dict[str, Any]]:
        return [r for r in records if r["label"].rstrip("0123456789") == prefix]

    main = runs("recompute" if config == "recompute" else "hit")
    secs = [r["seconds"] for r in main]
    cached = [r["num_cached_tokens"] for r in main]
    if config == "recompute":
        problems = [f"recompute runs reported cached tokens {cached}"] if any(cached) else []
    else:
        tier = None
        if bare.startswith("tieredkv"):
            tier = {"tieredkv_host": "host", "tieredkv_remote": "remote"}.get(bare, "disk")
        if config == "tieredkv_remote":
            problems = _check_hits(main, expected_remote or {}, tier,
                                   "the chunk-aligned remote hit")
        elif hybrid_tieredkv:
            problems = _check_hits(main, expected_hybrid or {}, tier,
                                   "the hybrid hit (vLLM's prefix-cache hit)")
        elif config in SLOW_ROWS:
            problems = _check_declined(main, config)
        elif config == LMCACHE_CONFIG:
            problems = _check_hits(main, expected_lmcache or {}, None,
                                   "LMCache's whole-chunk hit")
        else:
            problems = _check_hits(main, expected_hit, tier)
    row: dict[str, Any] = {
        "config": config,
        "n": len(secs),
        "median_s": median_of(secs),
        "min_s": min(secs) if secs else None,
        "max_s": max(secs) if secs else None,
        "samples_s": secs,
        "num_cached_tokens": cached,
        "hit_tokens_by_prompt": hits_by_prompt(main),
        "cold_s": [r["seconds"] for r in records if r["label"].startswith("cold")],
        "forward_median_s": median_of([r["forward_s"] for r in main if r.get("forward_s") is not None]),
        # TTFT minus the model's forward compute: what the cache path itself costs
        "overhead_median_s": median_of([r["seconds"] - r["forward_s"] for r in main
                                      if r.get("forward_s") is not None]),
        "overhead_samples_s": [r["seconds"] - r["forward_s"] for r in main if r.get("forward_s") is not None],
        "hit_ok": bool(secs) and not problems,
        "problems": problems,
        "startup_s": result.get("startup_s"),
        "threads": result.get("threads"),
    }
    if bare.startswith("tieredkv"):
        row["tieredkv_counters"] = [r["tieredkv"] for r in main]
    row["by_prompt"] = by_prompt(main)
    pfloor = runs("pfloor")
    if pfloor:
        # pfloor{i} ran right after hit{i} in the same engine: a vLLM prefix-cache hit.
        by_label = {r["label"]: r for r in records}
        pairs = [(h["prompt"], h["seconds"] / by_label[f"pfloor{h['label'][3:]}"]["seconds"])
                 for h in main if f"pfloor{h['label'][3:]}" in by_label]
        ratios = [x for _, x in pairs]
        for prompt, figures in row["by_prompt"].items():
            figures["same_engine_ratio"] = median_of([x for q, x in pairs if q == prompt])
        row["paired_floor"] = {
            "median_s": median_of([r["seconds"] for r in pfloor]),
            "forward_median_s": median_of([r["forward_s"] for r in pfloor]),
            "overhead_median_s": median_of([r["seconds"] - r["forward_s"] for r in pfloor]),
            "samples_s": [r["seconds"] for r in pfloor],
            "num_cached_tokens": [r["num_cached_tokens"] for r in pfloor],
            "hit_tokens_by_prompt": hits_by_prompt(pfloor),
            "hit_ok": not _check_hits(pfloor, expected_hit, None),
            "ratio_median": median_of(ratios),
            "ratios": ratios,
            # (prompt, hit s, same-engine floor s) per round: the targets' same-engine figures
            "pairs_s": [(h["prompt"], h["seconds"], by_label[f"pfloor{h['label'][3:]}"]["seconds"])
                        for h in main if f"pfloor{h['label'][3:]}" in by_label],
        }
    diskhits = runs("diskhit")
    if diskhits:
        disk_problems = _check_hits(diskhits, expected_hit, None)
        row["from_disk"] = {
            "median_s": median_of([r["seconds"] for r in diskhits]),
            "samples_s": [r["seconds"] for r in diskhits],
            "forward_median_s": median_of([r["forward_s"] for r in diskhits]),
            "overhead_median_s": median_of([r["seconds"] - r["forward_s"] for r in diskhits]),
            "overhead_samples_s": [r["seconds"] - r["forward_s"] for r in diskhits],
            "num_cached_tokens": [r["num_cached_tokens"] for r in diskhits],
            "hit_tokens_by_prompt": hits_by_prompt(diskhits),
            "hit_ok": not disk_problems,
            "problems": disk_problems,
        }
    hosthits = runs("hosthit")
    if hosthits:
        host_problems = _check_hits(hosthits, (expected_hybrid or {}) if hybrid_tieredkv
                                    else expected_hit, "host")
        row["host_hits_same_engine"] = {
            "median_s": median_of([r["seconds"] for r in hosthits]),
            "forward_median_s": median_of([r["forward_s"] for r in hosthits]),
            "overhead_median_s": median_of([r["seconds"] - r["forward_s"] for r in hosthits]),
            "overhead_samples_s": [r["seconds"] - r["forward_s"] for r in hosthits],
            "samples_s": [r["seconds"] for r in hosthits],
            "num_cached_tokens": [r["num_cached_tokens"] for r in hosthits],
            "hit_tokens_by_prompt": hits_by_prompt(hosthits),
            "hit_ok": not host_problems,
            "problems": host_problems,
        }
    if config in SLOW_ROWS:  # runs that still loaded a chunk of the slow tier
        if runs("fill"):  # the filler before each measured hit: its same-engine recompute
            row["paired_recompute"] = paired_recompute(main, runs("fill"))
        hit_tokens = f"hit_tokens_{SLOW_ROWS[config][0]}"
        row["explored_runs"] = sum(1 for r in main if r["tieredkv"].get(hit_tokens, 0) > 0)
        learning = runs("learn")  # the unmeasured hits that taught the cost model (taken)
        row["learning_s"] = [r["seconds"] for r in learning]
        row["learning_hit_tokens"] = [r["tieredkv"].get(hit_tokens, 0) for r in learning]
    if config == "tieredkv_disk_restart" and main:
        row["first_after_restart_s"] = main[0]["seconds"]
    return row


def paired_recompute(hits: list[dict[str, Any]], fills: list[dict[str, Any]]) -> dict[str, Any]:
    """A slow row's same-engine recompute: fill{i}, a fresh prompt of hit{i}'s length computed
    cold in the same engine right before it. ``ratio_median``: the median over rounds of
    hit{i} / fill{i} (paired by round, in round order; a round without its fill is left out)."""
    by_round = {r["label"][4:]: r for r in fills}
    pairs = sorted(((int(h["label"][3:]), h, by_round[h["label"][3:]]) for h in hits
                    if h["label"][3:] in by_round), key=lambda p: p[0])
    ratios = [h["seconds"] / f["seconds"] for _, h, f in pairs if f["seconds"] > 0]
    timed = [r for r in fills if r.get("forward_s") is not None]
    return {
        "median_s": median_of([r["seconds"] for r in fills]),
        "forward_median_s": median_of([r["forward_s"] for r in timed]),
        "overhead_median_s": median_of([r["seconds"] - r["forward_s"] for r in timed]),
        "samples_s": [r["seconds"] for r in fills],
        "num_cached_tokens": [r["num_cached_tokens"] for r in fills],
        # a fill is a fresh prompt: nothing cached, or it is no recompute
        "hit_ok": bool(fills) and not any(r["num_cached_tokens"] for r in fills),
        "ratio_median": median_of(ratios),
        "ratios": ratios,
        "pairs_s": [(h["prompt"], h["seconds"], f["seconds"]) for _, h, f in pairs],
    }


def same_hits(row: dict[str, Any], floor_row: dict[str, Any]) -> bool:
    """Every run of ``row`` hit, per prompt, the tokens every floor run hit."""
    mine, floor = row.get("hit_tokens_by_prompt") or {}, floor_row.get("hit_tokens_by_prompt") or {}
    return bool(mine) and all(
        prompt in floor and len(set(floor[prompt])) == 1 and set(hits) == set(floor[prompt])
        for prompt, hits in mine.items()
    )


def engine_ratios(row: dict[str, Any], floor_row: dict[str, Any]) -> dict[str, float | None]:
    """A hit row's TTFT against vLLM's prefix-cache hit: cross-engine (row median / the floor
    row's median, another engine) and same-engine (median of hit{i} / pfloor{i}: the same
    prompt hit in vLLM's prefix cache of the same engine right after)."""
    cross = None
    if row.get("median_s") and floor_row.get("median_s"):
        cross = row["median_s"] / floor_row["median_s"]
    same = (row.get("paired_floor") or {}).get("ratio_median")
    worse = max((r for r in (cross, same) if r is not None), default=None)
    return {"cross_engine_ratio": cross, "same_engine_ratio": same, "worse_ratio": worse}


def remote_ratios(row: dict[str, Any], floor_row: dict[str, Any],
                  recompute_row: dict[str, Any]) -> dict[str, float | None]:
    """The remote row against the floor (cross-engine and same-engine, as
    :func:`engine_ratios`) and against recompute (row median / recompute median, and its
    inverse: how many times faster than recomputing the whole prompt)."""
    out: dict[str, float | None] = dict(engine_ratios(row, floor_row))
    mine, recompute = row.get("median_s"), recompute_row.get("median_s")
    out["x_recompute"] = mine / recompute if mine and recompute else None
    out["speedup_vs_recompute"] = recompute / mine if mine and recompute else None
    return out


def remote_ratios_by_prompt(row: dict[str, Any], floor_row: dict[str, Any],
                            recompute_row: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """:func:`remote_ratios` per prompt: A's chunk-aligned hit leaves many more tokens to
    compute than B's, so the two prompts' TTFTs are far apart and their median hides both."""
    out: dict[str, dict[str, float | None]] = {}
    floors, recomputes = floor_row.get("by_prompt") or {}, recompute_row.get("by_prompt") or {}
    for prompt, mine in (row.get("by_prompt") or {}).items():
        median = mine.get("median_s")
        floor = (floors.get(prompt) or {}).get("median_s")
        recompute = (recomputes.get(prompt) or {}).get("median_s")
        out[prompt] = {
            "median_s": median,
            "cross_engine_ratio": median / floor if median and floor else None,
            "same_engine_ratio": mine.get("same_engine_ratio"),
            "x_recompute": median / recompute if median and recompute else None,
            "speedup_vs_recompute": recompute / median if median and recompute else None,
            "forward_median_s": mine.get("forward_median_s"),
            "overhead_median_s": mine.get("overhead_median_s"),
        }
    return out


def lmcache_server_check(row: dict[str, Any], counts: dict[str, int] | None) -> list[str]:
    """The LMCache server's own account of the row: it must have logged exactly the tokens
    the measured hits report (its ``Retrieved N tokens`` lines). Nothing else in the run
    retrieves: the cold runs and the warm-up are misses, and each same-engine floor run hits
    vLLM's prefix cache beyond LMCache's chunks, so the connector loads nothing for it."""
    if counts is None:
        return ["no LMCache server log counts"]
    taken = sum(row.get("num_cached_tokens") or [])
    if counts.get("retrieved_tokens", 0) != taken:
        return [f"the LMCache server logged {counts.get('retrieved_tokens', 0)} retrieved tokens, "
                f"not the {taken} the measured hits report"]
    return []


def lmcache_comparison(rows: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Info, no target: row 4 (tieredkv host hit) against the LMCache row: the ratio of the
    medians (both prompts, and each alone) and the hit tokens of each, per prompt. No ratio
    when either row's hits did not happen."""
    peer, host = rows.get(LMCACHE_CONFIG), rows.get("tieredkv_host")
    if peer is None or host is None:
        return None
    peer_hits, host_hits = peer.get("hit_tokens_by_prompt") or {}, host.get("hit_tokens_by_prompt") or {}

    def single(hits: list[int]) -> int | None:
        return hits[0] if hits and len(set(hits)) == 1 else None

    ok = bool(peer["hit_ok"] and host["hit_ok"])
    out: dict[str, Any] = {"hits_ok": ok, "by_prompt": {}}
    out["tieredkv_host_over_lmcache"] = (host["median_s"] / peer["median_s"]
                                         if ok and host.get("median_s") and peer.get("median_s") else None)
    for prompt in sorted(set(peer_hits) | set(host_hits)):
        mine, theirs = single(host_hits.get(prompt, [])), single(peer_hits.get(prompt, []))
        host_med = ((host.get("by_prompt") or {}).get(prompt) or {}).get("median_s")
        peer_med = ((peer.get("by_prompt") or {}).get(prompt) or {}).get("median_s")
        out["by_prompt"][prompt] = {
            "tieredkv_host_hit_tokens": mine, "lmcache_hit_tokens": theirs,
            "lmcache_fewer_tokens": None if mine is None or theirs is None else mine - theirs,
            "tieredkv_host_over_lmcache": host_med / peer_med if ok and host_med and peer_med else None,
        }
    if ok:
        ratio = out["tieredkv_host_over_lmcache"]
        text = (f"tieredkv host hit / LMCache hit = {ratio:.2f} (medians "
                f"{fmt_ms(host['median_s'])} / {fmt_ms(peer['median_s'])} ms; "
                + ", ".join(f"{k} {fmt_or_na(v['tieredkv_host_over_lmcache'])}"
                            for k, v in out["by_prompt"].items()) + "); ")
    else:
        which = " and ".join(name for name, r in (("LMCache's", peer), ("tieredkv host's", host))
                             if not r["hit_ok"])
        text = f"tieredkv host hit vs LMCache hit: no ratio, {which} hits did not happen; "
    text += "hit tokens " + "; ".join(
        f"{k} tieredkv {fmt_or_na(v['tieredkv_host_hit_tokens'], ',')} vs LMCache "
        f"{fmt_or_na(v['lmcache_hit_tokens'], ',')}"
        + ("" if v["lmcache_fewer_tokens"] is None else f" (LMCache {v['lmcache_fewer_tokens']} fewer)")
        for k, v in out["by_prompt"].items()
    ) + " (LMCache stores whole 256-token chunks only; its hit computes the rest of the prompt)"
    out["text"] = ("info (ratio of raw medians, not in the exit status; the target compares "
                   "each row's ratio to its own floor): " + text)
    return out


def fmt_or_na(x: float | int | None, spec: str = ".2f") -> str:
    return "n/a" if x is None else format(x, spec)


def judge_rows(results: dict[str, Any], expected_hit: dict[str, int], expected_remote: dict[str, int],
               expected_hybrid: dict[str, int], lmcache_info: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every configuration's row (:func:`summarize`); the LMCache row also checked against its
    server's own count, its verdict and the info comparison recorded in ``lmcache_info``."""
    expected_lmcache = lmcache_info.get("expected_hit_tokens") or {}
    rows = {c: summarize(c, r, expected_hit, expected_remote, expected_hybrid, expected_lmcache)
            for c, r in results.items()}
    if LMCACHE_CONFIG in rows:  # the server's own count of what the hits took from it
        server_problems = lmcache_server_check(rows[LMCACHE_CONFIG], lmcache_info.get("server_log_counts"))
        rows[LMCACHE_CONFIG]["problems"] += server_problems
        rows[LMCACHE_CONFIG]["hit_ok"] = rows[LMCACHE_CONFIG]["hit_ok"] and not server_problems
        lmcache_info["hit_ok"] = rows[LMCACHE_CONFIG]["hit_ok"]
        lmcache_info["comparison"] = lmcache_comparison(rows)
    return rows


def exit_status(payload: dict[str, Any]) -> int:
    """1 when a target missed (its worse-of verdict, the hybrid host target included) or the
    remote or a hybrid row's hits did not happen, else 0. The hybrid disk reference line, a
    target not judged (the LMCache row missing or not hitting) and the LMCache peer's own
    hits do not count."""
    rows = payload["rows"]
    remote_ok = payload["remote"].get("hit_ok", True)
    hybrid_ok = all(rows[c]["hit_ok"] for c in HYBRID_CONFIGS if c in rows)
    judged = [*payload["verdicts"], *(payload.get("hybrid_verdicts") or [])]
    targets_ok = all(v["pass"] for v in judged
                     if v.get("judged", True) and not v.get("reference") and "(info)" not in v["target"])
    return 0 if targets_ok and remote_ok and hybrid_ok else 1
