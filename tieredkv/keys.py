"""Chunk keys: vLLM's chained block hash combined with a namespace fingerprint.

vLLM already hashes every full block of a request (chained, covering the LoRA adapter's *name
and path*, multimodal inputs and ``cache_salt``). A chunk is keyed by the hash of its *last*
block, which therefore covers the whole prefix up to the chunk's end. Because the hashes are
chained, the key of *any* block names that block, its position and its whole prefix: a
stored chunk (whole, or a prompt's tail holding its first ``n`` blocks) is keyed by its last
block and also found by the keys of its other blocks (its *aliases*), which is how a hit
ends at the last block tieredkv holds rather than at a chunk boundary. The namespace
fingerprint keeps caches of different models, weights, engine settings, dtypes, KV-cache
layouts or TP sizes apart, even when they share one ``disk_path``. A LoRA request's keys also mix in a
digest of the adapter's files, which vLLM's hashes do not cover.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass

# 2: keys are hash prefix + namespace prefix. 3: the namespace covers vLLM's engine settings
# (model config hash, KV-cache dtype, load format, context parallelism) and the weights'
# content identity; LoRA keys mix in the adapter's files. 4: an entry may hold the first n
# blocks of its chunk (keyed by the n-th block) and disk slot headers list its blocks' keys.
FORMAT_VERSION = 4
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
    weights_version: str = ""  # content identity of the weights (or "process-..." without one)
    cache_shape: str = ""
    engine_config: str = ""  # digest of the vLLM settings that change K/V (see vllm_geometry)
    format_version: int = FORMAT_VERSION

    def fingerprint(self) -> bytes:
        """A stable 32-byte digest of every field (same in every process and after restart)."""
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).digest()


def chunk_key(fingerprint: bytes, block_hash: bytes, extra: bytes = b"") -> bytes:
    """Key of one chunk: the chunk's last block hash (24 bytes) + the namespace (8 bytes).

    vLLM's sha256 block hashes are already uniform and cover the whole prefix and its
    ``cache_salt``; concatenating costs ~0.15 us per key where a keyed hash cost ~1 us, which
    matters for 128k-token prompts. Slot headers carry the full fingerprint as well.
    ``extra`` (a LoRA adapter's content digest) is hashed into the first part: those requests
    pay the ~1 us, every other request keeps the plain concatenation.
    """
    if extra:
        return hashlib.sha256(extra + bytes(block_hash)).digest()[:_HASH_PART] + fingerprint[:_NS_PART]
    if len(block_hash) >= _HASH_PART:
        return block_hash[:_HASH_PART] + fingerprint[:_NS_PART]
    return bytes(block_hash).ljust(_HASH_PART, b"\0") + fingerprint[:_NS_PART]


class LazyChunkKeys:
    """Chunk keys of a growing request, derived only as far as someone reads them.

    A lookup that misses at chunk 0 derives one key instead of all of them; keys once made
    are kept, so repeated lookups and store planning never derive a key twice. vLLM may also
    *truncate* the list in place (a streaming session drops the blocks past its computed
    tokens, then appends the next input's): call :meth:`refresh` before each use so keys of
    replaced blocks are derived again rather than served stale.
    """

    __slots__ = ("_fingerprint", "_hashes", "_per_chunk", "_per_block", "_keys", "_extra", "_tail",
                 "_namespace")

    def __init__(
        self, fingerprint: bytes, block_hashes: Sequence[bytes], hashes_per_chunk: int,
        extra: bytes = b"", hashes_per_block: int = 0,
    ) -> None:
        self._fingerprint = fingerprint
        self._hashes = block_hashes  # vLLM's list, which grows as the request does
        self._per_chunk = hashes_per_chunk
        # vLLM block hashes per tieredkv (vLLM) block; 0: only whole-chunk keys exist.
        self._per_block = hashes_per_block
        self._extra = extra  # e.g. the LoRA adapter's content digest (see chunk_key)
        # The key's namespace part, when keys are the plain concatenation (no ``extra``).
        self._namespace = b"" if extra else fingerprint[:_NS_PART]
        self._keys: list[bytes] = []
        self._tail: object = None  # the block hash the last cached key was derived from

    @property
    def block_hashes(self) -> Sequence[bytes]:
        """The list the keys are derived from (vLLM's ``request.block_hashes``)."""
        return self._hashes

    @property
    def extra(self) -> bytes:
        return self._extra

    def refresh(self) -> int:
        """Drop cached keys whose block hash is gone or changed; return how many were dropped.

        O(1) when nothing changed: the block hash behind the last cached key is still the same
        object. Otherwise walk back to the last key that still matches; block hashes are
        chained, so every key before a matching one matches too.
        """
        keys, hashes, per = self._keys, self._hashes, self._per_chunk
        cached = len(keys)
        if not cached:
            return 0
        last = cached * per - 1
        if last < len(hashes) and hashes[last] is self._tail:
            return 0
        keep = cached
        while keep:
            index = keep * per - 1
            if index < len(hashes) and self._derive(hashes[index]) == keys[keep - 1]:
                break
            keep -= 1
        del keys[keep:]
        self._tail = hashes[keep * per - 1] if keep else None
        return cached - keep

    def _derive(self, block_hash: bytes) -> bytes:
        return chunk_key(self._fingerprint, block_hash, self._extra)

    @property
    def block_granular(self) -> bool:
        """Whether :meth:`block_key` exists (the keys know how many hashes make a block)."""
        return self._per_block > 0

    @property
    def num_blocks(self) -> int:
        """Full blocks with a hash (what :meth:`block_key` can name); 0 without block keys."""
        per = self._per_block
        return len(self._hashes) // per if per else 0

    def block_key(self, block: int) -> bytes:
        """Key of block ``block`` (0-based): the key of an entry whose last block it is.

        Not cached: lookups derive a few, stores derive each block once. Always read from the
        current list, so a truncated-and-regrown ``block_hashes`` never yields a stale key.
        """
        block_hash = self._hashes[(block + 1) * self._per_block - 1]
        if self._namespace and len(block_hash) >= _HASH_PART:
            return block_hash[:_HASH_PART] + self._namespace
        return chunk_key(self._fingerprint, block_hash, self._extra)

    def block_keys(self, start: int, stop: int) -> tuple[bytes, ...]:
        """Keys of blocks ``start .. stop-1`` (a stored entry's aliases)."""
        per, hashes = self._per_block, self._hashes
        if not self._extra:
            namespace = self._fingerprint[:_NS_PART]
            out = []
            for b in range(start, stop):
                block_hash = hashes[(b + 1) * per - 1]
                if len(block_hash) >= _HASH_PART:
                    out.append(block_hash[:_HASH_PART] + namespace)
                else:
                    out.append(chunk_key(self._fingerprint, block_hash))
            return tuple(out)
        return tuple(self._derive(hashes[(b + 1) * per - 1]) for b in range(start, stop))

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
        self.refresh()
        keys = self._keys
        stop = min(stop, len(self))
        if stop <= len(keys):
            return keys
        namespace, hashes, per = self._fingerprint[:_NS_PART], self._hashes, self._per_chunk
        append = keys.append
        if self._extra:
            for i in range(len(keys), stop):
                append(self._derive(hashes[(i + 1) * per - 1]))
        else:
            for i in range(len(keys), stop):
                block_hash = hashes[(i + 1) * per - 1]
                if len(block_hash) >= _HASH_PART:  # sha256: 32 bytes, the common case
                    append(block_hash[:_HASH_PART] + namespace)
                else:
                    append(chunk_key(self._fingerprint, block_hash))
        self._tail = hashes[stop * per - 1]
        return keys


def chunk_keys(
    fingerprint: bytes, block_hashes: Sequence[bytes], chunk_blocks: int, start_chunk: int = 0
) -> list[bytes]:
    """Keys of every *full* chunk of a request, from chunk ``start_chunk`` on."""
    keys = LazyChunkKeys(fingerprint, block_hashes, chunk_blocks, hashes_per_block=1)
    return keys.materialize(len(keys))[start_chunk:]


def key_part(key: bytes) -> bytes:
    """The part of a key a disk slot header stores for an alias (the rest is the namespace)."""
    return key[:_HASH_PART]


def key_from_part(part: bytes, fingerprint: bytes) -> bytes:
    """The key :func:`key_part` was taken from, in the namespace ``fingerprint``."""
    return bytes(part) + fingerprint[:_NS_PART]


KEY_PART_BYTES = _HASH_PART
