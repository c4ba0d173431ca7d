"""e2e_ttft's judging: every measured run checked against the hit its row must show, each
row's medians and ratios, and the targets (wall clock and at equal compute).

A hit that did not happen is a FAIL, never a number.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.ttft.workload import DISK_TARGET, HOST_TARGET, HYBRID_CONFIGS, LMCACHE_CONFIG


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
                                   "the chunk-aligned hybrid hit")
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
    if config == "tieredkv_disk_restart" and main:
        row["first_after_restart_s"] = main[0]["seconds"]
    return row


def hybrid_verdicts(rows: dict[str, dict[str, Any]], read_s: float) -> list[dict[str, Any]]:
    """The hybrid rows against the hybrid floor (``hybrid_vllm_prefix``) with rows 4 and 5a's
    targets: host hit <= 1.3 x floor, disk hit <= 1.3 x (floor + hybrid KV / raw disk BW
    = ``read_s``); on the wall-clock medians and at equal compute (the hybrid floor's median
    forward + the row's median TTFT − forward). The hybrid hit is chunk-aligned, so its
    wall clock includes a forward over the tail blocks the floor takes from its cache: the
    equal-compute view leaves that out. A row or floor whose hits did not happen FAILs."""
    floor_row = rows.get("hybrid_vllm_prefix")
    if floor_row is None:
        return []
    compute = floor_row.get("forward_median_s")
    out = []
    for config, target, limit_text, extra in (
        ("hybrid_tieredkv_host", "hybrid host hit <= 1.3 x hybrid floor", "1.3 x hybrid floor", 0.0),
        ("hybrid_tieredkv_disk", "hybrid disk hit <= 1.3 x (hybrid floor + hybrid KV / raw disk BW)",
         f"1.3 x (hybrid floor + {fmt_ms(read_s)} ms)", read_s),
    ):
        row = rows.get(config)
        if row is None:
            continue
        factor = HOST_TARGET if extra == 0.0 else DISK_TARGET
        ok_hit = bool(row["hit_ok"] and floor_row["hit_ok"])
        note = ""
        if not row["hit_ok"]:
            note = "hit did not happen: " + "; ".join(row["problems"])
        elif not floor_row["hit_ok"]:
            note = "hybrid floor's hits did not happen: " + "; ".join(floor_row["problems"])
        entry: dict[str, Any] = {"target": target, "config": config, "limit": limit_text,
                                 "note": note, **engine_ratios(row, floor_row)}
        ovh = row.get("overhead_median_s")
        floor_med, row_med = floor_row.get("median_s"), row.get("median_s")
        views = {
            "wall": (row_med, factor * (floor_med + extra) if floor_med else None),
            "equal_compute": (None if ovh is None or compute is None else compute + ovh,
                              factor * (floor_med + extra) if floor_med else None),
        }
        for view, (value, limit) in views.items():
            entry[view] = {"value_s": value, "limit_s": limit,
                           "pass": bool(ok_hit and value is not None and limit is not None
                                        and value <= limit)}
        entry["pass"] = entry["wall"]["pass"]
        out.append(entry)
    return out


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


def verdicts(rows: dict[str, dict[str, Any]], kv_bytes: int, disk_bw: float) -> list[dict[str, Any]]:
    """Each target on the wall-clock medians (floor = row 2), and again at equal compute.

    Every hit ends with the same model forward (2 tokens on the full context); on this shared
    machine its wall time swings several-fold with the load. "Equal compute" gives every row
    the floor row's median forward time plus the row's own median of TTFT − forward (the
    connector's load, the polling steps, scheduling): a comparison of what the cache paths
    cost that the machine's load skews much less. A row whose hits did not all hit FAILs.
    """
    floor_row = rows["vllm_prefix"]
    compute = floor_row["forward_median_s"]
    read_s = kv_bytes / disk_bw
    example = rows["example_connector"]
    example_disk = example.get("from_disk") or {}

    def wall(sub: dict[str, Any]) -> float | None:
        return sub.get("median_s")

    def equal(sub: dict[str, Any]) -> float | None:
        ovh = sub.get("overhead_median_s")
        return None if ovh is None or compute is None else compute + ovh

    out = []

    def add(target: str, config: str, limit_of, limit_text: str, ref_ok: bool = True,
            reference: dict[str, Any] | None = None) -> None:
        row = rows[config]
        # At equal hit tokens: the row's hits, per prompt, are the floor's (and the compared
        # connector's).
        equal_hits = same_hits(row, floor_row) and (
            reference is None or same_hits(reference, floor_row))
        ok_hit = bool(row["hit_ok"] and floor_row["hit_ok"] and ref_ok and equal_hits)
        note = "" if row["hit_ok"] else "hit did not happen: " + "; ".join(row["problems"])
        if row["hit_ok"] and not equal_hits:
            note = "hit tokens differ from the floor's"
        entry: dict[str, Any] = {"target": target, "config": config, "limit": limit_text,
                                 "note": note, "equal_hit_tokens": equal_hits,
                                 **engine_ratios(row, floor_row)}
        for view, fn in (("wall", wall), ("equal_compute", equal)):
            value, limit = fn(row), limit_of(fn)
            entry[view] = {"value_s": value, "limit_s": limit,
                           "pass": bool(ok_hit and value is not None and limit is not None and value <= limit)}
        entry["pass"] = entry["wall"]["pass"]
        out.append(entry)

    add("host hit <= 1.3 x floor", "tieredkv_host",
        lambda fn: HOST_TARGET * fn(floor_row) if fn(floor_row) else None, "1.3 x floor")
    for config, label in (("tieredkv_disk", "disk hit"), ("tieredkv_disk_restart", "disk hit after restart")):
        add(f"{label} <= 1.3 x (floor + KV / raw disk BW)", config,
            lambda fn: DISK_TARGET * (fn(floor_row) + read_s) if fn(floor_row) else None,
            f"1.3 x (floor + {fmt_ms(read_s)} ms)")
    for config, label in (("tieredkv_host", "host hit"), ("tieredkv_disk", "disk hit"),
                          ("tieredkv_disk_restart", "disk hit after restart")):
        add(f"{label} faster than ExampleConnector", config, lambda fn: fn(example),
            "< ExampleConnector (page cache warm)", ref_ok=example["hit_ok"], reference=example)
        if config != "tieredkv_host" and example_disk:
            add(f"{label} faster than ExampleConnector reading from disk (info)", config,
                lambda fn: fn(example_disk), "< ExampleConnector (files dropped from page cache)",
                ref_ok=example_disk.get("hit_ok", False), reference=example_disk)
    return out


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
    out["text"] = "info (no target, not in the exit status): " + text
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
    """1 when a target missed (its wall-clock verdict) or the remote or a hybrid row's hits did
    not happen, else 0. The "(info)" lines, the hybrid rows' 1.3x reference lines (a hybrid hit
    ends on a chunk boundary and recomputes up to a chunk the floor does not, so on this CPU
    build they miss by design) and the LMCache peer's row do not count."""
    rows = payload["rows"]
    remote_ok = payload["remote"].get("hit_ok", True)
    hybrid_ok = all(rows[c]["hit_ok"] for c in HYBRID_CONFIGS if c in rows)
    targets_ok = all(v["pass"] for v in payload["verdicts"] if "(info)" not in v["target"])
    return 0 if targets_ok and remote_ok and hybrid_ok else 1
