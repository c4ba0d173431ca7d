"""Key makers the test packages share (import as ``from tests.helpers import ...``)."""

from __future__ import annotations

import hashlib


def short_key(i: int) -> bytes:
    """A 4-byte key: policies and tier indexes take any bytes."""
    return i.to_bytes(4, "big")


def wide_key(i: int) -> bytes:
    """A 32-byte key in counting order: journal records sort and read back as written."""
    return i.to_bytes(32, "big")


def make_key(i: int) -> bytes:
    """A chunk-key-shaped 32-byte key (a hash), distinct for every ``i``."""
    return hashlib.sha256(f"key-{i}".encode()).digest()


def full_attention_spec(block_size: int, num_kv_heads: int, head_size: int, page_size_bytes: int):
    """vLLM's ``FullAttentionSpec`` with a given page size (one block of one layer), for tests
    that describe a KV cache by hand (tieredkv refuses kinds of attention it does not know).
    Without vLLM (the GPU check's bare machine): a stand-in of the same class name."""
    try:
        import torch
        from vllm.v1.kv_cache_interface import FullAttentionSpec
    except ImportError:
        from types import SimpleNamespace

        stand_in = type("FullAttentionSpec", (SimpleNamespace,), {})
        return stand_in(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                        page_size_bytes=page_size_bytes)
    return FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                             dtype=torch.int8, page_size_padded=page_size_bytes)
