"""The soak's workload: a pool of prompts sharing a few prefixes, chosen by Zipf weights per
client, each reply compared token by token with its float32 reference."""

from __future__ import annotations

import bisect
import itertools
import random
from collections.abc import Sequence
from typing import Any

NAME = "soak"


MODEL = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2}


DTYPE = "float32"


DTYPE_BYTES = 4


CHUNK_TOKENS = 256  # tieredkv's auto chunk size for 32-token blocks


VOCAB = (3, 2000)


MiB = 1 << 20


PROFILES: dict[str, dict[str, Any]] = {
    "quick": {
        "duration_s": 300.0, "pool": 16, "groups": 4, "shared_tokens": 512,
        "suffix_tokens": (512, 1280), "max_tokens": 16, "clients": 2, "zipf_s": 1.1,
        "sample_every_s": 5.0, "warmup_s": 60.0, "fault_every_s": 30.0, "fault_slots": 2, "fault_bytes": 16,
        "request_timeout_s": 120.0, "host_chunks": 12, "disk_chunks": 24,
    },
    "full": {
        "duration_s": 3600.0, "pool": 48, "groups": 8, "shared_tokens": 512,
        "suffix_tokens": (512, 2048), "max_tokens": 16, "clients": 3, "zipf_s": 1.1,
        "sample_every_s": 10.0, "warmup_s": 600.0, "fault_every_s": 60.0, "fault_slots": 3, "fault_bytes": 16,
        "request_timeout_s": 180.0, "host_chunks": 24, "disk_chunks": 64,
    },
}


def make_pool(seed: int, pool: int, groups: int, shared_tokens: int,
              suffix_tokens: tuple[int, int]) -> list[list[int]]:
    """``pool`` prompts; prompt ``i`` = shared prefix of group ``i % groups`` + its own suffix.

    With ``groups == 0`` every prompt is independent (suffix only).
    """
    rnd = random.Random(f"{seed}:pool")
    shared = [[rnd.randrange(*VOCAB) for _ in range(shared_tokens)] for _ in range(groups)]
    out = []
    for i in range(pool):
        length = rnd.randint(*suffix_tokens)
        prefix = shared[i % groups] if groups else []
        out.append(prefix + [rnd.randrange(*VOCAB) for _ in range(length)])
    return out


def zipf_weights(n: int, s: float) -> list[float]:
    """Normalised weights ``1 / rank**s`` for ranks 1..n."""
    raw = [1.0 / (rank ** s) for rank in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


class ZipfChooser:
    """Seeded zipf-like choice over ``n`` items: rank order is a seeded permutation."""

    def __init__(self, n: int, s: float, seed: int | str) -> None:
        self._rnd = random.Random(seed)
        order = list(range(n))
        random.Random(f"{seed}:order").shuffle(order)
        self.order = order
        self._cum = list(itertools.accumulate(zipf_weights(n, s)))

    def __call__(self) -> int:
        rank = bisect.bisect_left(self._cum, self._rnd.random() * self._cum[-1])
        return self.order[min(rank, len(self.order) - 1)]


def working_set_chunks(prompts: Sequence[Sequence[int]], chunk_tokens: int = CHUNK_TOKENS) -> int:
    """Distinct full chunks (distinct token prefixes ending on a chunk boundary) in the pool."""
    seen = set()
    for prompt in prompts:
        for end in range(chunk_tokens, len(prompt) + 1, chunk_tokens):
            seen.add(hash(tuple(prompt[:end])))
    return len(seen)


def first_difference(want: Sequence[int], got: Sequence[int]) -> int | None:
    """Index of the first differing token (length differences count); None when equal."""
    for i, (a, b) in enumerate(zip(want, got, strict=False)):
        if a != b:
            return i
    return None if len(want) == len(got) else min(len(want), len(got))
