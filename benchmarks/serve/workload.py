"""serve_bench's workload: N users' seeded multi-turn conversations, their lengths (random,
never a multiple of the block), and the sizes drawn from them (:class:`Plan`: device blocks,
host and disk tiers, model length), plus the run order of a sweep (:func:`sessions`, :func:`schedule`).

Pure: no server, no clock.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import kv_bytes_per_token
from tieredkv.disk.format import slot_stride
from tieredkv.tools.vllm_server import BLOCK_SIZE

NAME = "serve_bench"


MODEL = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2}


DTYPE = "float32"  # faster than bf16 on this CPU, and greedy outputs comparable across configs


DTYPE_BYTES = 4


# ``--model-shape``: the tiny default (4 KiB of KV per token in float32) and one with an
# 8B-class model's KV bytes per token (Llama-3-8B in bf16: 128 KiB), here in float32 with half
# the KV heads (32 layers x 4 KV heads x 128 head dim x 4 bytes x K and V = 128 KiB), on a
# small hidden size so that it still runs on 2 cores: the copy paths, not the compute, decide.
MODEL_SHAPES: dict[str, dict[str, int]] = {
    "tiny": MODEL,
    "8b-kv": {"hidden_size": 256, "num_layers": 32, "num_heads": 8, "num_kv_heads": 4,
              "head_dim": 128},
}


CHUNK_TOKENS = 256  # tieredkv's auto chunk size (config.CHUNK_TOKENS_TARGET)


VOCAB = (3, 2000)


FIT_USERS = 2  # the device KV cache holds the system prompt plus this many conversations


PROFILES: dict[str, dict[str, Any]] = {
    # 6-7 configurations x 5 repeats, one server at a time (a start each: about 30 s on 2
    # cores) x (1 + 4 + 8 users) x 4 turns: about 45 min, the budget stops new runs at 60.
    "quick": {
        "levels": (1, 4, 8), "turns": 4, "system_tokens": 1024, "user_tokens": 384,
        "reply_tokens": 64, "think_mean_s": 0.5, "jitter": 0.4, "repeats": 5,
        "level_timeout_s": 120.0, "request_timeout_s": 120.0, "budget_s": 3600.0,
    },
    "full": {
        "levels": (1, 2, 4, 8, 16), "turns": 8, "system_tokens": 1024, "user_tokens": 384,
        "reply_tokens": 64, "think_mean_s": 1.0, "jitter": 0.4, "repeats": 5,
        "level_timeout_s": 900.0, "request_timeout_s": 300.0, "budget_s": 21600.0,
    },
}


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


def random_tokens(rnd: random.Random, n: int) -> tuple[int, ...]:
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
    return random_tokens(random.Random(f"{spec.seed}:system"), spec.max_system_tokens)


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
        texts = tuple(random_tokens(rnd, n) for n in lengths)
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
              fit_users: int = FIT_USERS, block_size: int = BLOCK_SIZE,
              model: dict[str, int] = MODEL) -> Plan:
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
    chunk_bytes = CHUNK_TOKENS * kv_bytes_per_token(model, DTYPE_BYTES)
    total = chunks_of_convs(spec, everything)  # every level's and repeat's, the system once
    largest = max(chunks_of_convs(spec, convs[max(levels), r]) for r in range(repeats))
    return Plan(
        spec=spec, levels=levels, repeats=repeats, workdir=workdir, conversations=convs,
        device_blocks=num_blocks, max_model_len=longest * block_size, working_set=working,
        exceeding=exceeding, block_bytes=block_size * kv_bytes_per_token(model, DTYPE_BYTES),
        chunk_bytes=chunk_bytes, total_chunks=total, largest_chunks=largest,
        host_all=max(16, 2 * total) * chunk_bytes, host_half=max(2, ceil_div(largest, 2)) * chunk_bytes,
        disk_bytes=max(32, 4 * total) * slot_stride(chunk_bytes),
    )


def sessions(repeats: int, configs: Sequence[str]) -> list[tuple[int, str]]:
    """(repeat, configuration) in run order: each a server of its own, started, measured at
    every level and stopped before the next starts, so nothing else runs beside the one
    measured. Repeat by repeat, the configurations' order reversed every other repeat (none
    always goes first, and none loses only its own last runs when the time budget runs out)."""
    out = []
    for r in range(repeats):
        order = list(configs) if r % 2 == 0 else list(configs)[::-1]
        out += [(r, c) for c in order]
    return out


def schedule(levels: Sequence[int], repeats: int, configs: Sequence[str]) -> list[tuple[int, int, str]]:
    """(repeat, level, configuration) in run order: the levels of each :func:`sessions` slot
    one after another, on that slot's server."""
    return [(r, level, c) for r, c in sessions(repeats, configs) for level in levels]
