"""scheduler_bench's workload: the chunk geometry, prompt sizes, running-request counts and
the profiles' iteration counts."""

from __future__ import annotations

import random
from dataclasses import dataclass

NAME = "scheduler_bench"


BLOCK_SIZE = 32


CHUNK_BLOCKS = 16


CHUNK_TOKENS = BLOCK_SIZE * CHUNK_BLOCKS


SIZE_SEED = 2027  # the prompt sizes' random offsets


ALIGNED_SIZE = 4096  # the one chunk-aligned row, labelled as such (its hit ends on a chunk)


def unaligned_size(nominal: int, seed: int = SIZE_SEED) -> int:
    """A random length in ``[nominal, nominal + chunk)`` that is no multiple of the block (so
    none of the chunk either): the hit ends inside a chunk, in a block of the tail, as a
    chat's prompts do. Seeded by ``nominal`` and ``seed``: the same sizes every run."""
    rnd = random.Random(seed * 1_000_003 + nominal)
    while True:
        n = nominal + rnd.randrange(1, CHUNK_TOKENS)
        if n % BLOCK_SIZE:
            return n


def prompt_sizes(nominals: tuple[int, ...], aligned: int = ALIGNED_SIZE) -> tuple[int, ...]:
    """Sorted sizes: one random unaligned length per nominal size, and ``aligned`` as is."""
    return tuple(sorted({*(unaligned_size(n) for n in nominals), aligned}))


# Six random unaligned lengths around 1k..128k (the largest just above 128k, the lookup
# target's size) and one 4k chunk-aligned row.
PROMPT_SIZES = prompt_sizes((1024, 2048, 16384, 32768, 65536, 131072))


RUNNING = (1, 4, 16, 64, 256)


DECODE_PROMPT_TOKENS = 2048


PREFILL_PROMPT_TOKENS = 2 * CHUNK_TOKENS


# Scheduler side only: nothing is allocated. Above the ~1.5 GiB of chunks the run stores (no
# eviction), below host_bytes' bound (the machine's physical memory).
TIER_BYTES = 8 << 30


NUM_GPU_BLOCKS = 1 << 17


LOOKUP_TARGET_US = 2000.0


NOISE_BAND = 1.10


KEYING_TOKENS = 131072


@dataclass(frozen=True)
class Profile:
    name: str
    sizes: tuple[int, ...]
    running: tuple[int, ...]
    lookup_iters: int  # fresh requests per (size, hit/miss) and connector
    lookup_repeats: int  # repeated calls per fresh request
    decode_iters: int
    prefill_iters: int  # fresh connector pairs per running-request count
    keying_iters: int


PROFILES = {
    "smoke": Profile("smoke", prompt_sizes((1024, 2048)), (1, 4), 4, 2, 10, 3, 10),
    "quick": Profile("quick", PROMPT_SIZES, RUNNING, 300, 3, 800, 60, 1000),
    "full": Profile("full", PROMPT_SIZES, RUNNING, 1500, 5, 4000, 250, 5000),
}


def fmt_size(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else f"{tokens:,}"


def is_aligned(tokens: int) -> bool:
    """A prompt of whole chunks: its hit ends on a chunk boundary (the kind case)."""
    return tokens % CHUNK_TOKENS == 0
