"""e2e_ttft's targets: each judged on the worse of its cross-engine and same-engine figures.

Every hit row is compared with vLLM's prefix-cache hit twice: cross-engine (the row's median
over the floor row's median, another engine) and same-engine (the median over rounds of
``hit{i} / pfloor{i}``, the same prompt hit in vLLM's prefix cache of the row's own engine
right after). The verdict takes the worse (larger) of the two: a target passes only when both
are within it. For a disk target the floor is ``floor + KV / raw disk bandwidth`` on both
sides. "At equal compute" (the floor's forward + the row's TTFT − forward) is printed beside
as information; it does not decide.

The targets: host hit <= 1.3 x floor; disk hits (5a, 5b) <= 1.3 x (floor + KV / raw disk BW);
remote hit <= 1.5 x floor; a hit from a slow disk (5c), or from a slow Redis (6c), <= 1.1 x
recompute (the cost model declines it; cross-engine against row 1, same-engine against the
fresh prompt of the same length its round computes right before it); host hit, as a multiple of its floor, <= LMCache's hit as a multiple of LMCache's
own floor (measured in LMCache's environment; the smaller of its two figures); the hybrid host
hit <= 1.3 x the hybrid floor. The hybrid disk line is a reference (MISS, not in the exit
status). A row whose hits did not happen FAILs; a target whose reference row (LMCache) is
missing or did not hit is not judged, and says so.
"""

from __future__ import annotations

from typing import Any

from benchmarks.ttft.judging import SLOW_ROWS, fmt_ms, fmt_or_na, median_of, same_hits
from benchmarks.ttft.workload import (
    DISK_TARGET,
    HOST_TARGET,
    LMCACHE_CONFIG,
    LMCACHE_FLOOR_CONFIG,
    REMOTE_TARGET,
    SLOW_DISK_CONFIG,
    SLOW_DISK_TARGET,
    SLOW_REMOTE_CONFIG,
    SLOW_REMOTE_TARGET,
    MiB,
)


def floor_ratios(row: dict[str, Any], floor_row: dict[str, Any],
                 extra_s: float = 0.0) -> dict[str, float | None]:
    """``row`` over ``floor + extra_s``: cross-engine (medians of two engines), same-engine
    (median of each round's hit over its own engine's prefix-cache hit right after, plus
    ``extra_s``), and the worse of the two."""
    cross = None
    if row.get("median_s") and floor_row.get("median_s"):
        cross = row["median_s"] / (floor_row["median_s"] + extra_s)
    pairs = (row.get("paired_floor") or {}).get("pairs_s") or []
    same = median_of([hit / (floor + extra_s) for _, hit, floor in pairs if floor + extra_s > 0])
    worse = max((r for r in (cross, same) if r is not None), default=None)
    return {"cross_engine_ratio": cross, "same_engine_ratio": same, "worse_ratio": worse}


def _entry(target: str, config: str, limit: str, factor: float, ratios: dict[str, float | None],
           ok_hit: bool, note: str, **extra: Any) -> dict[str, Any]:
    worse = ratios["worse_ratio"]
    return {"target": target, "config": config, "limit": limit, "factor": factor,
            "note": note, "judged": True, **ratios, **extra,
            "pass": bool(ok_hit and worse is not None and worse <= factor)}


def _problem(row: dict[str, Any] | None, floor_row: dict[str, Any], what: str) -> str:
    if row is None:
        return f"{what} not run"
    if not row["hit_ok"]:
        return "hit did not happen: " + "; ".join(row["problems"])
    if not floor_row["hit_ok"]:
        return "the floor's hits did not happen: " + "; ".join(floor_row["problems"])
    return ""


def _equal_compute(row: dict[str, Any], floor_row: dict[str, Any], extra_s: float) -> float | None:
    """Info: (floor's forward + row's TTFT − forward) / (floor + extra)."""
    compute, ovh, floor = (floor_row.get("forward_median_s"), row.get("overhead_median_s"),
                           floor_row.get("median_s"))
    if compute is None or ovh is None or not floor:
        return None
    return (compute + ovh) / (floor + extra_s)


def verdicts(rows: dict[str, dict[str, Any]], kv_bytes: int, disk_bw: float) -> list[dict[str, Any]]:
    """Every target of the non-hybrid rows present, judged on the worse-of figure."""
    floor_row = rows["vllm_prefix"]
    read_s = kv_bytes / disk_bw
    out: list[dict[str, Any]] = []
    for config, label, factor, extra in (
        ("tieredkv_host", "host hit", HOST_TARGET, 0.0),
        ("tieredkv_disk", "disk hit", DISK_TARGET, read_s),
        ("tieredkv_disk_restart", "disk hit after restart", DISK_TARGET, read_s),
        ("tieredkv_remote", "remote hit", REMOTE_TARGET, 0.0),
    ):
        row = rows.get(config)
        if row is None:
            continue
        equal = same_hits(row, floor_row)
        note = _problem(row, floor_row, config) or ("" if equal else "hit tokens differ from the floor's")
        base = "floor" if not extra else f"(floor + KV / raw disk BW = {fmt_ms(read_s)} ms)"
        out.append(_entry(f"{label} <= {factor:g} x {base}", config, f"{factor:g} x {base}", factor,
                          floor_ratios(row, floor_row, extra), not note, note,
                          equal_hit_tokens=equal,
                          equal_compute_ratio=_equal_compute(row, floor_row, extra)))
    out += slow_verdicts(rows)
    lmcache = lmcache_verdict(rows)
    if lmcache is not None:
        out.append(lmcache)
    return out


def slow_verdicts(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The slow rows present (5c disk, 6c Redis): each hit declined, so its TTFT <= 1.1 x
    recompute, on the worse of cross-engine (row median over recompute's median, row 1) and
    same-engine (median over rounds of hit{i} / fill{i}: the fresh prompt of the same length
    computed cold in the row's own engine right before, :func:`~judging.paired_recompute`)."""
    out = []
    for config, what, factor in ((SLOW_DISK_CONFIG, "slow disk", SLOW_DISK_TARGET),
                                 (SLOW_REMOTE_CONFIG, "slow Redis", SLOW_REMOTE_TARGET)):
        slow = rows.get(config)
        if slow is None:
            continue
        recompute = rows["recompute"]
        cross = (slow["median_s"] / recompute["median_s"]
                 if slow.get("median_s") and recompute.get("median_s") else None)
        same = (slow.get("paired_recompute") or {}).get("ratio_median")
        worse = max((r for r in (cross, same) if r is not None), default=None)
        note = "" if slow["hit_ok"] else "not declined as it should be: " + "; ".join(slow["problems"])
        out.append(_entry(f"{what} <= {factor:g} x recompute", config, f"{factor:g} x recompute",
                          factor, {"cross_engine_ratio": cross, "same_engine_ratio": same,
                                   "worse_ratio": worse}, not note, note))
    return out


def lmcache_floor_ratios(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """LMCache's row over each floor: its own (vLLM's prefix cache in LMCache's environment:
    the ``lmcache_vllm_prefix`` row cross-engine, its engine's ``pfloor`` same-engine) and
    tieredkv's (row 2, cross-engine: another vLLM build)."""
    peer = rows.get(LMCACHE_CONFIG)
    if peer is None:
        return {}
    out = {"tieredkv_floor": floor_ratios({**peer, "paired_floor": None}, rows["vllm_prefix"])}
    own = rows.get(LMCACHE_FLOOR_CONFIG)
    same_only = floor_ratios({"paired_floor": peer.get("paired_floor")}, {})
    out["own_floor"] = floor_ratios(peer, own) if own is not None else same_only
    figures = [r for r in (out["own_floor"]["cross_engine_ratio"],
                           out["own_floor"]["same_engine_ratio"]) if r is not None]
    out["own_floor"]["better_ratio"] = min(figures, default=None)
    return out


def lmcache_verdict(rows: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Host hit x its floor (worse of) <= LMCache hit x its own floor (the better of its
    cross- and same-engine figures: the harder bar). Not judged when LMCache's row, its
    floor, or its hits are missing; None when no LMCache row was asked for."""
    host = rows.get("tieredkv_host")
    if host is None or (LMCACHE_CONFIG not in rows and LMCACHE_FLOOR_CONFIG not in rows):
        return None
    mine = floor_ratios(host, rows["vllm_prefix"])
    theirs = lmcache_floor_ratios(rows).get("own_floor") or {}
    bar = theirs.get("better_ratio")
    peer, own = rows.get(LMCACHE_CONFIG), rows.get(LMCACHE_FLOOR_CONFIG)
    reason = ("LMCache row not run" if peer is None else
              "LMCache's hits did not happen" if not peer["hit_ok"] else
              "LMCache's floor row not run" if own is None else
              "LMCache's floor's hits did not happen" if not own["hit_ok"] else
              "no LMCache figure" if bar is None else "")
    text = "host hit x floor <= LMCache hit x LMCache's own floor"
    if reason:
        return {"target": text, "config": "tieredkv_host", "limit": "LMCache's ratio",
                "factor": None, "note": f"not judged: {reason}", "judged": False, "pass": False,
                **mine}
    note = _problem(host, rows["vllm_prefix"], "tieredkv_host")
    return _entry(text, "tieredkv_host", f"LMCache x own floor = {bar:.2f}", bar, mine,
                  not note, note, lmcache_own_floor=theirs)


def hybrid_verdicts(rows: dict[str, dict[str, Any]], read_s: float) -> list[dict[str, Any]]:
    """The hybrid rows against the hybrid floor: host hit <= 1.3 x hybrid floor (a target),
    disk hit <= 1.3 x (hybrid floor + hybrid KV / raw disk BW = ``read_s``) (a reference:
    ``reference`` True, not in the exit status); each on the worse-of figure. The hybrid hit
    is as long as the floor's (#25), so both compute the same tokens; the equal-compute ratio
    beside it leaves any difference in forward time out."""
    floor_row = rows.get("hybrid_vllm_prefix")
    if floor_row is None:
        return []
    out = []
    for config, label, factor, extra, reference in (
        ("hybrid_tieredkv_host", "hybrid host hit", HOST_TARGET, 0.0, False),
        ("hybrid_tieredkv_disk", "hybrid disk hit", DISK_TARGET, read_s, True),
    ):
        row = rows.get(config)
        if row is None:
            continue
        base = "hybrid floor" if not extra else f"(hybrid floor + {fmt_ms(read_s)} ms)"
        note = _problem(row, floor_row, config)
        out.append(_entry(f"{label} <= {factor:g} x {base}" + (" (reference)" if reference else ""),
                          config, f"{factor:g} x {base}", factor,
                          floor_ratios(row, floor_row, extra), not note, note,
                          reference=reference,
                          equal_compute_ratio=_equal_compute(row, floor_row, extra)))
    return out


def lmcache_floor_text(rows: dict[str, dict[str, Any]]) -> str:
    """LMCache's hit over each floor: its own (row 7f, vLLM's prefix cache in LMCache's
    environment; and its engine's same-engine floor) and tieredkv's (row 2)."""
    ratios = lmcache_floor_ratios(rows)
    if not ratios:
        return ""
    own, theirs = ratios["own_floor"], ratios["tieredkv_floor"]
    own_row = rows.get(LMCACHE_FLOOR_CONFIG)
    return ("LMCache's hit over its own floor (row 7f, measured in `.venv-lmcache`"
            + (f", median {fmt_ms(own_row['median_s'])} ms" if own_row else ", **not run**")
            + f"): cross-engine {fmt_or_na(own['cross_engine_ratio'])}, same-engine "
            f"{fmt_or_na(own['same_engine_ratio'])}, the better of the two "
            f"**{fmt_or_na(own['better_ratio'])}** (the bar of the target 'host hit x floor <= "
            f"LMCache hit x LMCache's own floor'); over tieredkv's floor (row 2, another "
            f"environment): {fmt_or_na(theirs['cross_engine_ratio'])}.")


# How the slow rows' TTFT is held against recompute (their row texts say it).
_AGAINST_RECOMPUTE = ("row 1's median (cross-engine) and, in the row's own engine, the fresh "
                      "prompt of the same length computed right before each hit (the filler that "
                      "takes the host slots; same-engine: the median over rounds of hit / filler), "
                      "the worse of the two deciding")


def slow_disk_text(payload: dict[str, Any]) -> str:
    """Row 5c's set-up: the delay injected, the unmeasured hits that taught the cost model."""
    info = payload["params"].get("slow_disk") or {}
    if SLOW_DISK_CONFIG not in payload["rows"]:
        return f"**Row 5c (slow disk) not run**: {info.get('skipped', 'not selected')}."
    return (f"**Row 5c, a slow disk.** Every read of the slab file sleeps "
            f"{info.get('disk_read_delay_s', '?')} s first (`TIEREDKV_FAULTS` "
            "`disk_read_delay_s`), far slower than recomputing; the cost model is on (the "
            f"default). {info.get('learning_hits', '?')} unmeasured disk hits first teach it "
            "the disk's speed; each measured hit must then be declined (counted in "
            "`hits_declined{tier=\"disk\",reason=\"slower_than_recompute\"}`; an exploration reads "
            "its chunk aside, never on the request's path), so its TTFT is judged against "
            f"recompute: {_AGAINST_RECOMPUTE}.")


def slow_remote_text(payload: dict[str, Any]) -> str:
    """Row 6c's set-up: the proxy's delay, the timeout, the hits that taught the cost model."""
    info = payload["params"].get("slow_remote") or {}
    rows = payload["rows"]
    if SLOW_REMOTE_CONFIG not in rows:
        return f"**Row 6c (slow Redis) not run**: {info.get('skipped', 'not selected')}."
    delay = info.get("proxy_delay_s")
    block = info.get("block_bytes", 16384)
    row = rows[SLOW_REMOTE_CONFIG]
    learned = ", ".join(
        f"{fmt_ms(x)} ms ({f'{n:,} tokens read' if n else 'declined'})"
        for x, n in zip(row.get("learning_s") or [], row.get("learning_hit_tokens") or [], strict=False))
    recompute = (rows.get("recompute") or {}).get("median_s")
    rate = (f" ({delay * MiB / block:.2f} s per MiB on one connection)"
            if isinstance(delay, (int, float)) else "")
    return (f"**Row 6c, a slow Redis.** A fresh engine (replica B's tiers, `remote_timeout_s` "
            f"{info.get('remote_timeout_s', '?')} s, so a read is slow, not failed) reaches "
            "replica A's Redis through a throttling loopback proxy "
            "(`tieredkv/testing/throttled_proxy.py`) that holds every "
            f"{block // 1024} KiB block of a value it sends back {delay if delay is not None else '?'} "
            f"s first{rate}; probes and writes pass. The cost model is on (the default). "
            f"{info.get('learning_hits', '?')} unmeasured remote hits first teach it the read "
            "time (taken while nothing is known"
            + (f"; their TTFTs {learned}, against recompute's median {fmt_ms(recompute)} ms"
               if learned else "")
            + "); before each measured hit a fresh prompt takes every host slot, so the hit is "
            "in Redis only, and it must be declined (counted in `hits_declined{tier=\"remote\"}`, "
            "`reason=\"slower_than_recompute\"` or, not waited for at the probe, "
            "`\"probe_wait_over_saving\"`; an exploration reads its chunk aside), so its TTFT "
            f"is judged against recompute: {_AGAINST_RECOMPUTE}.")


def slow_rows_text(payload: dict[str, Any]) -> str:
    """The slow rows' set-ups (5c, 6c): one paragraph each."""
    return slow_disk_text(payload) + "\n\n" + slow_remote_text(payload)


def slow_row_hit(config: str, row: dict[str, Any]) -> str | None:
    """A slow row's "hit?" cell: whether every hit was declined, and how many runs still
    loaded a chunk of the slow tier; None for any other row."""
    if config not in SLOW_ROWS:
        return None
    return ("declined, every run" if row["hit_ok"] else "**NOT DECLINED — FAIL**") + (
        f" ({row.get('explored_runs', 0)} run(s) still loaded a {SLOW_ROWS[config][0]} chunk)")


# A row's other runs in its own engine, each a line under it in the table: key in the row, label.
SUB_ROWS = {
    "from_disk": "↳ same, files dropped from the page cache first (read from disk)",
    "host_hits_same_engine": "↳ host-tier hit of the same prompt, same engine, right after",
    "paired_recompute": "↳ recompute, same engine, right before each hit: a fresh prompt of the "
                        "same length (the filler; hit / it = the same-engine figure)",
}


def sub_row_hit(key: str, extra: dict[str, Any]) -> str:
    """A sub-row's "hit?" cell: the filler must hit nothing (it is a recompute), the others hit."""
    if key == "paired_recompute":
        return "none (a recompute)" if extra["hit_ok"] else "**cached tokens: not a recompute**"
    return "yes" if extra["hit_ok"] else "**NO — FAIL**"


def counts(v: dict[str, Any]) -> bool:
    """Whether a verdict sets the exit status: judged, and not a reference line."""
    return bool(v.get("judged", True)) and not v.get("reference")


def verdict_table(entries: list[dict[str, Any]], title: str = "target") -> str:
    """Each target with its figures beside it: cross-engine, same-engine, the worse of the
    two (which decides) against the limit, and the equal-compute ratio (info)."""
    out = [f"| {title} | limit | x cross-engine | x same-engine | **worse of (decides)** "
           "| verdict | at equal compute (info) |", "|---|---|---:|---:|---:|---|---:|"]
    for v in entries:
        if not v.get("judged", True):
            verdict = "**NOT JUDGED**"
        elif v["pass"]:
            verdict = "**PASS**"
        else:
            verdict = "**MISS**" if v.get("reference") else "**FAIL**"
        note = f" ({v['note']})" if v["note"] else ""
        out.append(f"| {v['target']} | {v['limit']} | {fmt_or_na(v.get('cross_engine_ratio'))} "
                   f"| {fmt_or_na(v.get('same_engine_ratio'))} "
                   f"| **{fmt_or_na(v.get('worse_ratio'))}** vs {fmt_or_na(v.get('factor'))} "
                   f"| {verdict}{note} | {fmt_or_na(v.get('equal_compute_ratio'))} |")
    return "\n".join(out)


def print_lines(entries: list[dict[str, Any]]) -> list[str]:
    """One line per target for the terminal: the deciding figure beside its limit."""
    lines = []
    for v in entries:
        state = ("not judged" if not v.get("judged", True) else "PASS" if v["pass"]
                 else "MISS" if v.get("reference") else "FAIL")
        lines.append(f"{state:>10}  {v['target']}: {fmt_or_na(v.get('worse_ratio'))} "
                     f"(cross-engine {fmt_or_na(v.get('cross_engine_ratio'))}, same-engine "
                     f"{fmt_or_na(v.get('same_engine_ratio'))}) vs {fmt_or_na(v.get('factor'))}"
                     + (f" — {v['note']}" if v["note"] else ""))
    return lines


def raw_get_markdown(raw: dict[str, Any] | None, kv_bytes: int, floor_s: float) -> str:
    """What plain redis-py reads a hit's bytes at on this machine: a reference for row 6."""
    if not raw or not raw.get("gb_per_s") or not kv_bytes:
        return "**Plain redis-py for reference**: not measured."
    read_s = kv_bytes / (raw["gb_per_s"] * 1e9)
    ratio = (floor_s + read_s) / floor_s
    ways = " and ".join(f"{way} {seconds * 1e3:.1f} ms"
                        for way, seconds in (raw.get("medians_s") or {}).items())
    return (
        "**Plain redis-py for reference.** The "
        f"{raw['keys']} values replica A wrote ({raw['bytes'] / MiB:.1f} MiB) read by redis-py "
        "on one connection, by a client doing nothing else, as GETs one after another and in one "
        f"pipeline (medians of {len(raw['samples_s'])}: {ways}); the faster, {raw['way']}: "
        f"**{raw['gb_per_s']:.2f} GB/s**. A hit's KV ({kv_bytes / MiB:.1f} MiB) takes "
        f"{read_s * 1e3:.1f} ms at that rate: a hit that did nothing but read it so would be "
        f"{ratio:.2f} x the floor ({fmt_ms(floor_s)} ms), against the {REMOTE_TARGET:g} x target."
    )


def raw_disk_line(disk: dict[str, Any], kv_bytes: int) -> str:
    """The raw disk read the disk targets are built on, and how it was read."""
    how = (f"{disk['io_bytes'] // MiB} MiB I/Os, {disk['depth']} in flight (the disk tier's I/O "
           f"threads), each into its own part of a {disk['bytes'] / MiB:.0f} MiB destination in "
           "huge pages, as a hit reads into host slots" if "depth" in disk else
           f"sequential, {disk['io_bytes'] // MiB} MiB I/Os into one reused buffer")
    line = (f"Raw disk read bandwidth ({disk['mode']}, {how}; {disk['bytes'] / MiB:.0f} MiB file "
            f"on the disk tier's filesystem): **{disk['gb_per_s']:.2f} GB/s** (median of "
            f"{len(disk['seconds'])}); KV / bandwidth = {fmt_ms(kv_bytes / disk['gb_per_s'] / 1e9)} ms.")
    one = disk.get("one_buffer")
    if one:
        line += (f" The same file read into one reused {disk['io_bytes'] // MiB} MiB buffer, one "
                 f"I/O at a time (this baseline before 2026-11-28), alternating with it: "
                 f"{one['gb_per_s']:.2f} GB/s (median); no hit reads that way (its KV lands in "
                 "as many distinct bytes, which the CPU's cache does not absorb), so it is "
                 "information only.")
    return line


def raw_copy_line(copy: dict[str, Any] | None, kv_bytes: int, floor_s: float) -> str:
    """What a plain copy of a hit's KV takes on this machine: a reference for the host target."""
    if not copy or not copy.get("gb_per_s") or not kv_bytes or not floor_s:
        return ""
    copy_s = kv_bytes / (copy["gb_per_s"] * 1e9)
    return (
        f"\n\n**Plain copy for reference.** One contiguous torch `copy_` of a hit's KV "
        f"({kv_bytes / MiB:.1f} MiB) between two tensors in huge pages, {copy['threads']} "
        f"thread(s) (torch's, as vLLM's forward uses), caches scrubbed by writing "
        f"{copy['scrub_bytes'] // MiB} MiB first (a hit's host slots are cold), median of "
        f"{len(copy['seconds'])}: **{copy['gb_per_s']:.2f} GB/s**, {copy_s * 1e3:.1f} ms: a host "
        f"hit that did nothing but copy its KV so would be {(floor_s + copy_s) / floor_s:.2f} x "
        f"the floor ({fmt_ms(floor_s)} ms), against the {HOST_TARGET:g} x target.\n")
