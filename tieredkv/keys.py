"""Chunk keys: vLLM's chained block hash combined with a namespace fingerprint.

vLLM already hashes every full block of a request (chained, covering LoRA, multimodal inputs
and ``cache_salt``). A chunk is keyed by the hash of its *last* block, which therefore covers
the whole prefix up to the chunk's end. The namespace fingerprint keeps caches of different
models, dtypes, layouts or TP layouts apart, even when they share one ``disk_path``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

FORMAT_VERSION = 1
KEY_BYTES = 32
FINGERPRINT_BYTES = 32


@dataclass(frozen=True)
class Namespace:
    """Everything that must match for stored KV bytes to be valid for this engine."""

    model: str
    dtype: str
    kv_layout: str
    block_size: int
    chunk_blocks: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    tp_size: int = 1
    weights_version: str = ""
    cache_shape: str = ""
    format_version: int = FORMAT_VERSION

    def fingerprint(self) -> bytes:
        """A stable 32-byte digest of every field (same in every process and after restart)."""
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).digest()


def chunk_key(fingerprint: bytes, block_hash: bytes) -> bytes:
    """Key of one chunk: a keyed BLAKE2b of the chunk's last block hash (about 1 us)."""
    return hashlib.blake2b(block_hash, key=fingerprint, digest_size=KEY_BYTES).digest()


def chunk_keys(
    fingerprint: bytes, block_hashes: Sequence[bytes], chunk_blocks: int, start_chunk: int = 0
) -> list[bytes]:
    """Keys of every *full* chunk of a request, from chunk ``start_chunk`` on."""
    count = len(block_hashes) // chunk_blocks
    return [
        chunk_key(fingerprint, bytes(block_hashes[(i + 1) * chunk_blocks - 1]))
        for i in range(start_chunk, count)
    ]


def sha256_block_hashes(
    token_ids: Sequence[int], block_size: int, salt: str | None = None
) -> list[bytes]:
    """Chained block hashes for tests and tools that run without vLLM.

    Mirrors vLLM's scheme in spirit: each full block's hash covers its parent hash, its tokens
    and (for the first block) the salt, so equal prefixes give equal hashes across processes.
    """
    hashes: list[bytes] = []
    parent = hashlib.sha256((salt or "").encode()).digest()
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        digest = hashlib.sha256(parent)
        digest.update(b"".join(int(t).to_bytes(4, "little", signed=False) for t in block))
        parent = digest.digest()
        hashes.append(parent)
    return hashes
