"""scheduler_bench's workload: the chunk geometry, prompt sizes, running-request counts and
the profiles' iteration counts."""

from __future__ import annotations

from dataclasses import dataclass

NAME = "scheduler_bench"


BLOCK_SIZE = 32


CHUNK_BLOCKS = 16


CHUNK_TOKENS = BLOCK_SIZE * CHUNK_BLOCKS


# 2,348 = 4 chunks + 300 tokens: its hit ends inside a chunk (the prompt's 9-block tail).
PROMPT_SIZES = (1024, 2348, 4096, 16384, 32768, 65536, 131072)


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
    "smoke": Profile("smoke", (1024, 2348, 4096), (1, 4), 4, 2, 10, 3, 10),
    "quick": Profile("quick", PROMPT_SIZES, RUNNING, 300, 3, 800, 60, 1000),
    "full": Profile("full", PROMPT_SIZES, RUNNING, 1500, 5, 4000, 250, 5000),
}


def fmt_size(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)
