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

FORMAT_VERSION = 2  # 2: keys are hash prefix + namespace prefix
KEY_BYTES = 32
FINGERPRINT_BYTES = 32
_NS_PART = 8
_HASH_PART = KEY_BYTES - _NS_PART


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
    """Key of one chunk: the chunk's last block hash (24 bytes) + the namespace (8 bytes).

    vLLM's sha256 block hashes are already uniform and cover the whole prefix and its
    ``cache_salt``; concatenating costs ~0.15 us per key where a keyed hash cost ~1 us, which
    matters for 128k-token prompts. Slot headers carry the full fingerprint as well.
    """
    if len(block_hash) >= _HASH_PART:
        return block_hash[:_HASH_PART] + fingerprint[:_NS_PART]
    return bytes(block_hash).ljust(_HASH_PART, b"\0") + fingerprint[:_NS_PART]


class LazyChunkKeys:
    """Chunk keys of a growing request, derived only as far as someone reads them.

    A lookup that misses at chunk 0 derives one key instead of all of them; keys once made
    are kept, so repeated lookups and store planning never derive a key twice.
    """

    __slots__ = ("_fingerprint", "_hashes", "_per_chunk", "_keys")

    def __init__(self, fingerprint: bytes, block_hashes: Sequence[bytes], hashes_per_chunk: int) -> None:
        self._fingerprint = fingerprint
        self._hashes = block_hashes  # vLLM's list, which grows as the request does
        self._per_chunk = hashes_per_chunk
        self._keys: list[bytes] = []

    def __len__(self) -> int:
        return len(self._hashes) // self._per_chunk

    def __getitem__(self, chunk: int) -> bytes:
        keys = self._keys
        if chunk < len(keys):
            return keys[chunk]
        if not 0 <= chunk < len(self):
            raise IndexError(chunk)
        return self.materialize(chunk + 1)[chunk]

    def materialize(self, stop: int) -> list[bytes]:
        """The key list with at least the first ``min(stop, len(self))`` keys derived."""
        keys = self._keys
        stop = min(stop, len(self))
        if stop <= len(keys):
            return keys
        namespace, hashes, per = self._fingerprint[:_NS_PART], self._hashes, self._per_chunk
        append = keys.append
        for i in range(len(keys), stop):
            block_hash = hashes[(i + 1) * per - 1]
            if len(block_hash) >= _HASH_PART:  # sha256: 32 bytes, the common case
                append(block_hash[:_HASH_PART] + namespace)
            else:
                append(chunk_key(self._fingerprint, block_hash))
        return keys


def chunk_keys(
    fingerprint: bytes, block_hashes: Sequence[bytes], chunk_blocks: int, start_chunk: int = 0
) -> list[bytes]:
    """Keys of every *full* chunk of a request, from chunk ``start_chunk`` on."""
    keys = LazyChunkKeys(fingerprint, block_hashes, chunk_blocks)
    return keys.materialize(len(keys))[start_chunk:]


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
