"""scheduler_bench's report: rows with medians and verdicts (no slower than vLLM beyond the
noise band, lookups under their target), the Markdown table and the plot."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.scheduler.measure import Samples
from benchmarks.scheduler.workload import (
    BLOCK_SIZE,
    CHUNK_TOKENS,
    KEYING_TOKENS,
    LOOKUP_TARGET_US,
    NOISE_BAND,
    Profile,
    fmt_size,
    is_aligned,
)


def verdict(ratio: float) -> str:
    if ratio != ratio:  # NaN
        return "n/a"
    if ratio <= 1.0:
        return "PASS"
    if ratio <= NOISE_BAND:
        return "PASS (within noise)"
    return "FAIL"


def _row(
    samples: Samples, operation: str, key: tuple[str, ...], size: int, unit: str,
    events: bool = False, **extra: Any
) -> dict[str, Any]:
    t = common.summarize(samples.get(("tieredkv", *key)))
    v = common.summarize(samples.get(("vllm", *key)))
    ratio = t["median"] / v["median"] if v["median"] else float("nan")
    row = {
        "operation": operation,
        "size": size,
        "size_label": fmt_size(size) + (" tokens" if unit == "tokens" else f" {unit}")
        + (" (chunk-aligned)" if extra.get("group") == "lookup" and is_aligned(size) else ""),
        "unit": unit,
        "tieredkv_median_us": t["median"],
        "tieredkv_p90_us": t["p90"],
        "vllm_median_us": v["median"],
        "vllm_p90_us": v["p90"],
        "ratio": ratio,
        "target": "<= vLLM",
        "verdict": verdict(ratio),
        "samples": min(t["n"], v["n"]),
        **extra,
    }
    if events:
        row.update(_events_fields(samples, key, t["median"]))
    return row


def build_rows(samples: Samples, profile: Profile, events: bool = False) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for state in ("hit", "miss"):
        for phase in ("cold", "repeat"):
            what = "first call, cold keys" if phase == "cold" else "repeated call"
            for n in profile.sizes:
                rows.append(_row(
                    samples, f"get_num_new_matched_tokens {state} ({what})",
                    ("lookup", state, phase, str(n)), n, "tokens",
                    events, group="lookup", state=state, phase=phase,
                ))
    for variant, what in (("decode", "decode, 1 token each"),
                          ("prefill", "prefill, 512-token chunk each, 1 store each")):
        for count in profile.running:
            rows.append(_row(
                samples, f"build_connector_meta ({what})", ("meta", variant, "", str(count)),
                count, "requests", events, group="meta", variant=variant,
            ))
    n = KEYING_TOKENS
    rows.append(_row(samples, "keying alone: chunk keys from block hashes (256 keys)",
                     ("keying", "", "", str(n)), n, "tokens", group="keying"))
    rows.append(_row(samples, "index lookups alone: 256 keys, all present",
                     ("index", "", "", str(n)), n, "tokens", group="keying"))
    big = max(profile.sizes)
    for row in rows:
        if row.get("group") == "lookup" and row["size"] == big and row["state"] == "hit" \
                and row["phase"] == "cold" and big >= KEYING_TOKENS:
            passed = row["tieredkv_median_us"] < LOOKUP_TARGET_US
            rows.append({
                **row,
                "operation": f"128k-token lookup ({big:,} tokens; hit, cold keys) in under 2 ms",
                "group": "target",
                "ratio": row["ratio"],
                "target": "< 2000 us",
                "verdict": ("PASS" if passed else "FAIL")
                + f" (p90 {row['tieredkv_p90_us']:,.0f} us)",
            })
    for row in rows:
        row["tieredkv_us"] = _us(row["tieredkv_median_us"], row["tieredkv_p90_us"])
        row["vllm_us"] = _us(row["vllm_median_us"], row["vllm_p90_us"])
        row["ratio_text"] = f"{row['ratio']:.2f}" if row["ratio"] == row["ratio"] else "n/a"
        row["target_text"] = f"{row['target']}: {row['verdict']}"
        if events:
            row["tieredkv_events_us"] = _us(row.get("tieredkv_events_median_us", math.nan),
                                            row.get("tieredkv_events_p90_us", math.nan))
            ratio = row.get("events_ratio", math.nan)
            row["events_ratio_text"] = f"{ratio:.2f}" if ratio == ratio else "n/a"
    return rows


def _events_fields(samples: Samples, key: tuple[str, ...], off: float) -> dict[str, Any]:
    """--kv-events: tieredkv with events on beside the plain tieredkv side (events off), the
    ratio of medians as for the vLLM ratio; keying rows have no events side (n/a)."""
    e = common.summarize(samples.get(("tieredkv_events", *key)))
    ratio = e["median"] / off if off and e["n"] else float("nan")
    return {
        "tieredkv_events_median_us": e["median"],
        "tieredkv_events_p90_us": e["p90"],
        "events_ratio": ratio,
    }


def events_summary(rows: list[dict[str, Any]]) -> str:
    """One line on the on/off ratios; the events-off figures are the plain tieredkv side."""
    ratios = [(r["events_ratio"], r) for r in rows
              if r["group"] != "target" and not math.isnan(r.get("events_ratio", math.nan))]
    if not ratios:
        return "**KV events on/off: no rows measured.**"
    worst, row = max(ratios, key=lambda pair: pair[0])
    middle = common.summarize([ratio for ratio, _ in ratios])["median"]
    return (
        "**KV events: tieredkv events on / events off, ratio of medians per row (column "
        f"'ratio events on/off'): median {middle:.2f} over {len(ratios)} rows, highest "
        f"{worst:.2f} ({row['operation']} @ {row['size_label']}).** The events-off figures are "
        "the plain tieredkv side (column 'tieredkv µs median (p90)'); events on: vLLM's KVEventsConfig "
        "(enable_kv_cache_events, publisher 'null'), take_events() after each "
        "update_connector_output, calls interleaved with the other two sides."
    )


def load_average() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:
        return None


def _us(median: float, p90: float) -> str:
    if median != median:
        return "n/a"
    return f"{_num(median)} (p90 {_num(p90)})"


def _num(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


COLUMNS = [
    ("operation", "operation"),
    ("size_label", "size"),
    ("tieredkv_us", "tieredkv µs median (p90)"),
    ("vllm_us", "vLLM µs median (p90)"),
    ("ratio_text", "ratio tieredkv/vLLM"),
    ("target_text", "target"),
]

EVENTS_COLUMNS = [
    *COLUMNS[:4],
    ("tieredkv_events_us", "tieredkv events on µs median (p90)"),
    ("events_ratio_text", "ratio events on/off"),
    *COLUMNS[4:],
]


def keying_summary(samples: Samples) -> str:
    n = str(KEYING_TOKENS)
    keying = common.summarize(samples.get(("tieredkv", "keying", "", "", n)))
    index = common.summarize(samples.get(("tieredkv", "index", "", "", n)))
    plain = common.summarize(samples.get(("dict", "index", "", "", n)))
    keys = KEYING_TOKENS // CHUNK_TOKENS
    return (
        f"Keying a 128k-token prompt ({KEYING_TOKENS // BLOCK_SIZE} vLLM block hashes -> "
        f"{keys} chunk keys): {keying['median']:.1f} us median "
        f"({keying['median'] * 1000 / keys:.0f} ns/key, p90 {keying['p90']:.1f} us); "
        f"looking the {keys} keys up in the host index: {index['median']:.1f} us "
        f"(p90 {index['p90']:.1f} us; a bare dict membership test: {plain['median']:.1f} us); "
        f"together {keying['median'] + index['median']:.1f} us."
    )


def plot(rows: list[dict[str, Any]], path: Path, machine: str, profile: Profile) -> Path:
    colors = {"tieredkv": "tab:blue", "vllm": "tab:orange"}
    names = {"tieredkv": "tieredkv", "vllm": "vLLM Offloading"}

    def series(select: Callable[[dict[str, Any]], bool], variants: dict[str, tuple[str, str]]):
        out = []
        for variant, (label, style) in variants.items():
            chosen = [r for r in rows if select(r) and _variant_of(r) == variant]
            if not chosen:
                continue
            chosen.sort(key=lambda r: r["size"])
            for side in ("tieredkv", "vllm"):
                out.append({
                    "label": f"{names[side]} {label}",
                    "x": [r["size"] for r in chosen],
                    "y": [r[f"{side}_median_us"] for r in chosen],
                    "yerr_hi": [r[f"{side}_p90_us"] for r in chosen],
                    "color": colors[side],
                    "linestyle": style,
                    "marker": "o" if side == "tieredkv" else "s",
                })
        return out

    sizes = list(profile.sizes)
    running = list(profile.running)
    lookup_variants = {"cold": ("cold keys", "-"), "repeat": ("repeated", "--")}
    panels = [
        {
            "title": "get_num_new_matched_tokens, hit (all chunks in CPU tier)",
            "xlabel": "prompt tokens", "ylabel": "µs per call (median; bar to p90)",
            "xticks": (sizes, [fmt_size(s) for s in sizes]),
            "series": series(lambda r: r.get("group") == "lookup" and r["state"] == "hit",
                             lookup_variants),
            "hlines": [(LOOKUP_TARGET_US, "2 ms target (128k)")],
        },
        {
            "title": "get_num_new_matched_tokens, miss (empty tier)",
            "xlabel": "prompt tokens", "ylabel": "µs per call (median; bar to p90)",
            "xticks": (sizes, [fmt_size(s) for s in sizes]),
            "series": series(lambda r: r.get("group") == "lookup" and r["state"] == "miss",
                             lookup_variants),
        },
        {
            "title": "build_connector_meta per scheduler step",
            "xlabel": "running requests", "ylabel": "µs per call (median; bar to p90)",
            "xticks": (running, [str(c) for c in running]),
            "series": series(lambda r: r.get("group") == "meta",
                             {"decode": ("decode (1 token each)", "-"),
                              "prefill": ("prefill (512-token chunk each)", "--")}),
        },
    ]
    return common.plot_panels(
        path, panels,
        title="Scheduler-half cost: tieredkv vs vLLM OffloadingConnector (lower is better)",
        footnote=f"{machine} | profile {profile.name} | 512-token chunks, block size 32",
    )


def _variant_of(row: dict[str, Any]) -> str:
    return row.get("phase") or row.get("variant") or ""
