"""e2e_ttft's workload: the model's geometry, the two prompts, the hit each row must show,
the rows' names and labels.

Pure arithmetic, no engine: the parent, the children and the tests share it.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.common import kv_bytes_per_token

HERE = Path(__file__).resolve().parents[1]  # the benchmarks package (the LMCache child imports it)


NAME = "e2e_ttft"


BLOCK_SIZE = 32


CHUNK_BLOCKS = 16


CHUNK_TOKENS = BLOCK_SIZE * CHUNK_BLOCKS


MODEL = {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4}


# ``--model-shape``: the default tiny model (8 KiB of KV per token), and one whose KV per token
# is an 8B-class model's (Llama-3-8B: 32 layers x 8 KV heads x 128 head dim, bf16 = 128 KiB)
# with a small hidden size, so it still runs on 2 cores: there the copy paths, not the
# compute, decide. Its prompts are shorter (``prompt_tokens``), so that every engine's KV
# cache still fits the machine's memory beside the others'.
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"model": MODEL, "prompt_tokens": {"quick": 4000, "full": 8000},
             "slow_disk_read_delay_s": 1.5, "slow_remote_delay_s": 0.01},
    "8b-kv": {"model": {"hidden_size": 256, "num_layers": 32, "num_heads": 8, "num_kv_heads": 8,
                        "head_dim": 128},
              "prompt_tokens": {"quick": 1500, "full": 3000},
              "slow_disk_read_delay_s": 2.0, "slow_remote_delay_s": 0.0005},
}


DTYPE_BYTES = 2  # bf16, the tiny model's dtype


HOST_TARGET = 1.3  # host hit <= 1.3 x floor (and the hybrid host hit <= 1.3 x hybrid floor)


DISK_TARGET = 1.3  # disk hit <= 1.3 x (floor + KV bytes / raw disk read bandwidth)


REMOTE_TARGET = 1.5  # remote hit <= 1.5 x floor (issue 25)


SLOW_DISK_TARGET = 1.1  # a hit from a disk slower than recompute <= 1.1 x recompute (issue 25)


# The slow-disk row: every slab read sleeps this long (``TIEREDKV_FAULTS``), several times a
# chunk's recompute on the tiny model (~0.19 s per 512 tokens), so the cost model declines
# (per shape: ``MODEL_SHAPES[...]["slow_disk_read_delay_s"]``; ``--slow-disk-delay``). At
# 0.5 s a prompt's 8-chunk read was predicted at 2.0 s against a 1.9 s recompute: a loaded
# box's slower recompute then made the hit worth taking (seen once), so 1.5 s.
SLOW_DISK_READ_DELAY_S = 1.5


# Prompts computed cold before (C0..C2, the length of A): the cost model's prefill rate counts
# only steps of at least a chunk's tokens, and needs MIN_SAMPLES (3) of them before it decides;
# A and B's cold runs alone can be two steps, and a hit's steps compute a tail only.
SLOW_DISK_RATE_PROMPTS = 3


# Unmeasured disk hits first (A, B, A, B): at least the cost model's MIN_SAMPLES (3) fill
# rounds, an even number so that B is in host and round 0's A is read from disk.
SLOW_DISK_LEARNING_HITS = 4


SLOW_REMOTE_TARGET = 1.1  # a hit from a Redis slower than recompute <= 1.1 x recompute (issue 25)


# The slow-Redis row (6c): its engine reaches replica A's Redis through a throttling loopback
# proxy (``tieredkv.testing.throttled_proxy``, started by the parent) that delays every 16 KiB
# block of a value it sends back by its shape's ``slow_remote_delay_s`` (``MODEL_SHAPES``;
# ``--slow-remote-delay``). Tiny, 0.01 s: 2.6 s per 4 MiB chunk on one connection (a
# 4,000-token prompt read on two at once: ~10 s, against ~2 s to recompute it, ~4.5 s on a
# loaded box; at 0.005 s its read, 4.7 s, was predicted only 1.12 x a loaded recompute, a
# margin one busier moment would close). 8b-kv, 0.0005 s: 2 s per 64 MiB chunk. Probes and
# writes (short replies) are not delayed.


# The slow-Redis row's ``remote_timeout_s``: its reads take seconds, and at the default
# (0.5 s) they would fail by timeout (a failed read, not a declined hit) before the cost model
# has measured them.
SLOW_REMOTE_TIMEOUT_S = 30.0


WARMUP_TOKENS = 96  # a short first prompt: first-forward costs stay out of every figure


# Every measured round starts with a prompt shorter than one block (nothing to store, nothing
# to hit, in vLLM's cache or any connector's): engines take turns round by round, so without it
# a round's first generate ran in an engine left cold by seconds of the others' work (caches,
# code paths) and the same-engine floor right after it ran warm, a gap of ~3 ms that was no
# connector's doing. With it, a hit and its floor both run in a warm engine, as in serving.
TOUCH_TOKENS = 16


KiB, MiB = 1024, 1024 * 1024


PROFILES = {
    # prompt A's tokens (B: a random length, see random_b_length), recompute repeats, hit
    # repeats, timeout per child (s)
    "quick": {"prompt_tokens": 4000, "recompute_repeats": 2, "hit_repeats": 10, "timeout": 420},
    "full": {"prompt_tokens": 8000, "recompute_repeats": 3, "hit_repeats": 20, "timeout": 900},
}


PROMPT_SEED = 2026  # prompt B's length


def random_length(low: int, high: int, seed: int = PROMPT_SEED) -> int:
    """A length in [low, high) that is no multiple of the block (nor, then, of the chunk)."""
    rnd = random.Random(seed)
    while True:
        n = rnd.randrange(low, high)
        if n % BLOCK_SIZE:
            return n


def random_b_length(a_tokens: int, seed: int = PROMPT_SEED) -> int:
    """Prompt B: a random length that takes as many tieredkv host slots as A (whole chunks
    and a tail of at least one block), so the disk rows' host tier, sized for one prompt,
    holds either one whole and each measured disk hit is read from disk entirely."""
    entries = host_entries(a_tokens)
    return random_length((entries - 1) * CHUNK_TOKENS + BLOCK_SIZE, entries * CHUNK_TOKENS, seed)


def prefix_hit(tokens: int) -> int:
    """vLLM's prefix-cache hit for a prompt seen before: every full block but the one
    holding the last token (vLLM computes at least one token)."""
    return (tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def host_entries(tokens: int) -> int:
    """tieredkv host slots one prompt takes: its whole chunks and its tail."""
    return -(-(tokens // BLOCK_SIZE) // CHUNK_BLOCKS)


def remote_hit(tokens: int) -> int:
    """The hit a fresh replica gets from the remote tier for a prompt another replica
    computed: what vLLM's own prefix cache would give (:func:`prefix_hit`), since the
    prompt's tail is in Redis as a value of its own rows (issue #25)."""
    return prefix_hit(tokens)


# Hybrid rows: the same geometry, layers alternating sliding-window (window < chunk) and full.
HYBRID_WINDOW = 256


def hybrid_layer_types(num_layers: int) -> list[str]:
    return ["sliding_attention", "full_attention"] * (num_layers // 2)


HYBRID_LAYER_TYPES = hybrid_layer_types(MODEL["num_layers"])


HYBRID_CONFIGS = ("hybrid_vllm_prefix", "hybrid_tieredkv_host", "hybrid_tieredkv_disk")


def hybrid_hit(tokens: int) -> int:
    """tieredkv's hit on a hybrid model for a prompt seen before: vLLM's own
    (:func:`prefix_hit`). A prompt's tail keeps the sliding window before its end, and a
    prompt ending on a block boundary (A) also the entry one block shorter, where a repeat of
    it hits (issue #25)."""
    return prefix_hit(tokens)


def hybrid_host_slots(lengths: dict[str, int]) -> int:
    """The hybrid disk row's host slots: the entries one prompt's hit reads (its whole chunks
    and the partial entry it ends in), so the other prompt's hit evicts all of them. A's cold
    run stores one more (its tail, past the hit): tieredkv stores the entry a repeat hits
    first, so the one a full host tier skips is that tail."""
    return max(-(-hybrid_hit(n) // CHUNK_TOKENS) for n in lengths.values())


def hybrid_kv_bytes(hit_tokens: int, window: int = HYBRID_WINDOW,
                    layer_types: list[str] | None = None, model: Mapping[str, int] = MODEL) -> int:
    """Bytes a hybrid hit of ``hit_tokens`` copies: every block of the full-attention layers,
    the last ``ceil((window-1)/block)`` blocks of each whole chunk of the sliding layers, and
    as many (at most the entry's blocks) of the partial entry the hit ends in."""
    layer_types = hybrid_layer_types(model["num_layers"]) if layer_types is None else layer_types
    per_layer_token = kv_bytes_per_token(model, DTYPE_BYTES) // model["num_layers"]
    sliding_blocks = min(CHUNK_BLOCKS, -(-(window - 1) // BLOCK_SIZE))
    chunks = hit_tokens // CHUNK_TOKENS
    partial = min(sliding_blocks, hit_tokens % CHUNK_TOKENS // BLOCK_SIZE)
    full = layer_types.count("full_attention") * hit_tokens
    sliding = (layer_types.count("sliding_attention") * (chunks * sliding_blocks + partial)
               * BLOCK_SIZE)
    return (full + sliding) * per_layer_token


REMOTE_KEY_PREFIX = "e2e_ttft"  # remote_key_prefix of both replicas (keys: prefix:namespace:r0:...)


REMOTE_CONFIGS = ("tieredkv_remote_writer", "tieredkv_remote")


# The LMCache peer row (benchmarks/peers/lmcache.py; its module is imported by the parent only:
# the row's child runs in .venv-lmcache, where nothing of tieredkv is installed).
LMCACHE_CONFIG = "lmcache"


# LMCache's own floor: vLLM's prefix-cache hit in .venv-lmcache (its vLLM, its python).
LMCACHE_FLOOR_CONFIG = "lmcache_vllm_prefix"


SLOW_DISK_CONFIG = "tieredkv_slow_disk"


SLOW_REMOTE_CONFIG = "tieredkv_slow_remote"


LMCACHE_BUILD = "bash benchmarks/peers/lmcache_env.sh"


def host_tier_bytes(lengths: dict[str, int], model: Mapping[str, int] = MODEL) -> int:
    """Row 4's host tier (``host_bytes``): room for both prompts several times over. The
    LMCache row's server gets the same bytes as its L1 (CPU memory) budget."""
    return 4 * max(lengths.values()) * kv_bytes_per_token(model, DTYPE_BYTES) + 64 * MiB


def lmcache_hit(tokens: int, chunk_tokens: int) -> int:
    """LMCache's hit for a prompt it stored: its whole ``chunk_tokens`` chunks (a trailing
    partial chunk is never stored), one token less when the chunks cover the whole prompt
    (``LMCacheMPConnector.get_num_new_matched_tokens`` leaves the last token to compute)."""
    whole = tokens // chunk_tokens * chunk_tokens
    return tokens - 1 if whole == tokens else whole


def lmcache_llm_kwargs(flags: list[str] | tuple[str, ...]) -> tuple[dict[str, Any], list[str]]:
    """The offline-``LLM`` keyword arguments for LMCache's vLLM CLI flags
    (``benchmarks.peers.lmcache.vllm_settings``), and the flags deliberately not applied.

    ``--disable-hybrid-kv-cache-manager`` applies as is. ``--no-enable-prefix-caching`` is
    not applied: the row keeps vLLM's prefix cache on and resets it before every measured
    hit, as row 4 does (the same-engine floor ``pfloor`` needs it; LMCache's connector
    handles an APC hit). Any other flag is an error, so a change to the peer's settings
    cannot be dropped silently."""
    kwargs: dict[str, Any] = {}
    not_applied: list[str] = []
    for flag in flags:
        if flag == "--disable-hybrid-kv-cache-manager":
            kwargs["disable_hybrid_kv_cache_manager"] = True
        elif flag == "--no-enable-prefix-caching":
            not_applied.append(flag)
        else:
            raise ValueError(f"LMCache vLLM flag {flag!r}: no offline-LLM equivalent known to e2e_ttft")
    return kwargs, not_applied


def make_prompt(seed: int, length: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, 2000) for _ in range(length)]


LABELS = {
    "recompute": "1. recompute (no connector, no prefix cache) — ceiling",
    "vllm_prefix": "2. vLLM prefix-cache hit — floor",
    "example_connector": "3. ExampleConnector hit",
    "tieredkv_host": "4. tieredkv host-tier hit",
    "tieredkv_disk": "5a. tieredkv disk-tier hit (evicted from host)",
    "tieredkv_disk_restart": "5b. tieredkv disk-tier hit after restart",
    SLOW_DISK_CONFIG: "5c. tieredkv, slow disk (every slab read delayed; the cost model declines "
                      "the hit) — against recompute",
    "tieredkv_remote": "6. tieredkv remote-tier hit (Redis; fresh replica B)",
    SLOW_REMOTE_CONFIG: "6c. tieredkv, slow Redis (replica A's Redis behind a throttling proxy; "
                        "the cost model declines the hit) — against recompute",
    LMCACHE_CONFIG: "7. LMCache hit (peer: MP server, L1 = row 4's host budget, 256-token chunks, "
                    "chunk-aligned hit)",
    LMCACHE_FLOOR_CONFIG: "7f. vLLM prefix-cache hit in LMCache's environment — LMCache's floor",
}


HYBRID_LABELS = {
    "hybrid_vllm_prefix": "H1. hybrid model: vLLM prefix-cache hit — hybrid floor",
    "hybrid_tieredkv_host": "H2. hybrid model: tieredkv host-tier hit",
    "hybrid_tieredkv_disk": "H3. hybrid model: tieredkv disk-tier hit (evicted from host)",
}
