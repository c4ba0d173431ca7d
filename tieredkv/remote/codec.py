"""How one chunk shard is stored in Redis: its key name and its self-describing value.

The remote tier is shared by every replica, so a value must prove what it is before a byte of
it may reach a host slot: which namespace, which chunk key, which TP rank, how long, and a
checksum of the payload (the same xxh3_64 as the disk tier, from ``tieredkv.disk.format``).
Fixed little-endian ``struct`` fields only: nothing read from Redis is ever unpickled.

Value format (little-endian)::

    offset size  field
         0    8  magic              b"TKVREMT1"
         8    2  format version     FORMAT_VERSION
        10    2  flags              0 (reserved)
        12    4  TP rank            whose shard the payload is
        16   32  namespace fingerprint
        48   32  key                the chunk key (tieredkv.keys.chunk_key)
        80    8  payload length
        88    8  payload checksum   xxh3_64 of the payload
        96    4  header checksum    crc32 of bytes 0..95
       100    n  payload

Unlike a disk slot the header is not padded to 4 KiB: Redis memory is paid per byte, and
values are not read with O_DIRECT.

A pointer replaces a prompt's tail once a longer entry of its chunk (the whole chunk, or a
longer tail) is stored: Redis then holds one copy of those blocks, and a prompt ending at the
tail still finds them, one more round trip away. A pointer is never a value's payload; it is
told apart by its magic, is as strictly checked, and names only a key of its own namespace
and rank. Pointer format (little-endian)::

    offset size  field
         0    8  magic              b"TKVREMP1"
         8    2  format version     FORMAT_VERSION
        10    2  flags              0 (reserved)
        12    4  TP rank
        16   32  namespace fingerprint
        48   32  key                the tail's key (its last block's)
        80   32  target key         the longer entry's key, in the same chunk
       112    4  target rows        rows of every layer the target value holds (0: a whole slot)
       116    4  header checksum    crc32 of bytes 0..115

Redis key: ``{prefix}:{fingerprint[:8] hex}:r{rank}:{{{key hex}}}``. The braces are a Redis
Cluster hash tag on the chunk key: every rank's shard of one chunk lands in the same slot
(one node can answer "do all ranks have it?"), while different chunks spread over the
cluster. The namespace and rank in the name make another engine's shards plain misses; the
header still catches anything copied or corrupted under a right-looking name.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from tieredkv.disk.format import payload_checksum
from tieredkv.keys import FINGERPRINT_BYTES, KEY_BYTES
from tieredkv.protocol import FailureCause
from tieredkv.remote_url import DEFAULT_KEY_PREFIX, check_prefix

MAGIC = b"TKVREMT1"
POINTER_MAGIC = b"TKVREMP1"
FORMAT_VERSION = 1
DEFAULT_PREFIX = DEFAULT_KEY_PREFIX
NAMESPACE_HEX_CHARS = 16  # 8 bytes of the fingerprint in the key name; all 32 in the header

_FIELDS = struct.Struct(f"<8sHHI{FINGERPRINT_BYTES}s{KEY_BYTES}sQQ")
_CRC = struct.Struct("<I")
HEADER_BYTES = _FIELDS.size + _CRC.size
_POINTER = struct.Struct(f"<8sHHI{FINGERPRINT_BYTES}s{KEY_BYTES}s{KEY_BYTES}sI")
POINTER_BYTES = _POINTER.size + _CRC.size
_MAX_RANK = 2**32 - 1
_MAX_ROWS = 2**32 - 1


@dataclass(frozen=True, slots=True)
class Verified:
    """A value that proved to hold exactly the asked-for shard; ``payload`` views the value."""

    payload: memoryview

    @property
    def ok(self) -> bool:
        return True


@dataclass(frozen=True, slots=True)
class Rejected:
    """A value that must not be used; ``cause`` is the counter to bump, ``detail`` says why."""

    cause: FailureCause
    detail: str

    @property
    def ok(self) -> bool:
        return False


Decoded = Verified | Rejected


@dataclass(frozen=True, slots=True)
class Pointer:
    """A tail's key now names ``target``, a longer entry of its chunk holding ``rows`` rows of
    every layer (0: a whole slot); the tail's rows are its leading ones."""

    target: bytes
    rows: int


def _check_ids(fingerprint: bytes, key: bytes, rank: int) -> None:
    if len(fingerprint) != FINGERPRINT_BYTES:
        raise ValueError(f"fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}")
    if len(key) != KEY_BYTES:
        raise ValueError(f"key must be {KEY_BYTES} bytes, got {len(key)}")
    if not 0 <= rank <= _MAX_RANK:
        raise ValueError(f"rank must be in 0..{_MAX_RANK}, got {rank}")


class RemoteKeyNames:
    """Redis key names of one rank's shards in one namespace; ids checked once, not per key.

    A probe names world_size x 500+ keys per prompt on the scheduler thread, so the fixed
    head ``{prefix}:{namespace}:r{rank}:`` is built once and only the chunk key varies.
    """

    __slots__ = ("_head",)

    def __init__(self, fingerprint: bytes, rank: int, prefix: str = DEFAULT_PREFIX) -> None:
        _check_ids(fingerprint, bytes(KEY_BYTES), rank)
        check_prefix(prefix)
        ns = fingerprint.hex()[:NAMESPACE_HEX_CHARS]
        self._head = f"{prefix}:{ns}:r{rank}:".encode("ascii")

    def __call__(self, key: bytes) -> bytes:
        if len(key) != KEY_BYTES:
            raise ValueError(f"key must be {KEY_BYTES} bytes, got {len(key)}")
        return b"%s{%s}" % (self._head, key.hex().encode("ascii"))


def remote_key(fingerprint: bytes, rank: int, key: bytes, prefix: str = DEFAULT_PREFIX) -> bytes:
    """The Redis key of ``rank``'s shard of chunk ``key`` in namespace ``fingerprint``."""
    return RemoteKeyNames(fingerprint, rank, prefix)(key)


def encode(payload: bytes | bytearray | memoryview, *, fingerprint: bytes, key: bytes, rank: int) -> bytes:
    """Header + payload as one ``bytes`` value (one copy of the payload, which Redis needs)."""
    _check_ids(fingerprint, key, rank)
    view = memoryview(payload).cast("B")
    header = bytearray(HEADER_BYTES)
    _FIELDS.pack_into(
        header, 0, MAGIC, FORMAT_VERSION, 0, rank, fingerprint, key, len(view),
        payload_checksum(view),
    )
    _CRC.pack_into(header, _FIELDS.size, zlib.crc32(memoryview(header)[: _FIELDS.size]))
    return b"".join((header, view))


def value_bytes(payload_len: int) -> int:
    """How long the value of a ``payload_len``-byte payload is (what a reader asks for)."""
    return HEADER_BYTES + payload_len


def decode(
    value: bytes | bytearray | memoryview | None,
    *,
    fingerprint: bytes,
    key: bytes,
    rank: int,
    expected_len: int | None = None,
    value_len: int | None = None,
    payload: memoryview | None = None,
) -> Decoded:
    """Verify ``value`` against what was asked for; never raises on bad data.

    ``value_len``: the value's length in Redis when ``value`` is only its first bytes (a
    bounded read); bytes past what was read count as trailing bytes. ``payload``: the bytes
    past ``value``'s header when they were received elsewhere (a host slot); ``value`` is
    then the header alone.

    Causes: no value: ``missing``; shorter than its header or than the length it declares:
    ``short_read``; bad magic, header checksum, payload checksum or trailing bytes:
    ``checksum``; another format version, another namespace, or a length other than the
    engine's geometry gives (``expected_len``): ``wrong_namespace``; another chunk key or
    another TP rank: ``wrong_key``.
    """
    if value is None:
        return Rejected(FailureCause.MISSING, "no value")
    view = memoryview(value).cast("B")
    if payload is not None:
        if len(view) != HEADER_BYTES:
            return Rejected(FailureCause.SHORT_READ, f"a header of {len(view)} bytes")
        view_len = HEADER_BYTES + len(payload)
    else:
        view_len = len(view)
    total = view_len if value_len is None else max(view_len, value_len)
    if len(view) < HEADER_BYTES:
        return Rejected(FailureCause.SHORT_READ, f"{len(view)} bytes, header needs {HEADER_BYTES}")
    magic, version, _flags, v_rank, v_fp, v_key, length, checksum = _FIELDS.unpack_from(view)
    if magic != MAGIC:
        return Rejected(FailureCause.CHECKSUM, "bad magic (not a tieredkv value)")
    (stored_crc,) = _CRC.unpack_from(view, _FIELDS.size)
    if zlib.crc32(view[: _FIELDS.size]) != stored_crc:
        return Rejected(FailureCause.CHECKSUM, "header checksum mismatch")
    if version != FORMAT_VERSION:
        return Rejected(
            FailureCause.WRONG_NAMESPACE, f"format version {version}, expected {FORMAT_VERSION}"
        )
    if v_fp != fingerprint:
        return Rejected(FailureCause.WRONG_NAMESPACE, "value belongs to another namespace")
    if v_key != key:
        return Rejected(FailureCause.WRONG_KEY, "value holds another chunk key")
    if v_rank != rank:
        return Rejected(FailureCause.WRONG_KEY, f"value holds rank {v_rank}'s shard, not {rank}'s")
    if expected_len is not None and length != expected_len:
        return Rejected(
            FailureCause.WRONG_NAMESPACE, f"payload length {length}, this engine expects {expected_len}"
        )
    payload = view[HEADER_BYTES:] if payload is None else memoryview(payload).cast("B")
    if len(payload) < length:
        return Rejected(FailureCause.SHORT_READ, f"payload has {len(payload)} of {length} bytes")
    if total - HEADER_BYTES > length:
        return Rejected(FailureCause.CHECKSUM,
                        f"{total - HEADER_BYTES - length} unexpected trailing bytes")
    if payload_checksum(payload) != checksum:
        return Rejected(FailureCause.CHECKSUM, "payload checksum mismatch")
    return Verified(payload)


def encode_pointer(*, fingerprint: bytes, key: bytes, rank: int, target: bytes, rows: int) -> bytes:
    """The value that replaces tail ``key`` once ``target`` (``rows`` rows, 0: whole) holds
    its blocks."""
    _check_ids(fingerprint, key, rank)
    _check_ids(fingerprint, target, rank)
    if not 0 <= rows <= _MAX_ROWS or target == key:
        raise ValueError(f"a pointer must name another entry and 0.. rows, got {rows}")
    head = _POINTER.pack(POINTER_MAGIC, FORMAT_VERSION, 0, rank, fingerprint, key, target, rows)
    return head + _CRC.pack(zlib.crc32(head))


def is_pointer(value: bytes | bytearray | memoryview | None) -> bool:
    """Whether ``value`` claims to be a pointer (its magic; :func:`decode_pointer` checks it)."""
    return value is not None and bytes(memoryview(value)[:8]) == POINTER_MAGIC


def decode_pointer(
    value: bytes | bytearray | memoryview, *, fingerprint: bytes, key: bytes, rank: int,
    value_len: int | None = None,
) -> Pointer | Rejected:
    """Verify a pointer read under ``key``; never raises on bad data. Causes as
    :func:`decode`'s (a pointer naming itself is ``wrong_key``)."""
    view = memoryview(value).cast("B")
    total = len(view) if value_len is None else max(len(view), value_len)
    if total != POINTER_BYTES or len(view) < POINTER_BYTES:
        return Rejected(FailureCause.CHECKSUM, f"pointer of {total} bytes, not {POINTER_BYTES}")
    magic, version, flags, v_rank, v_fp, v_key, target, rows = _POINTER.unpack_from(view)
    (stored_crc,) = _CRC.unpack_from(view, _POINTER.size)
    if magic != POINTER_MAGIC or zlib.crc32(view[: _POINTER.size]) != stored_crc:
        return Rejected(FailureCause.CHECKSUM, "pointer checksum mismatch")
    if version != FORMAT_VERSION or flags:
        return Rejected(FailureCause.WRONG_NAMESPACE, f"pointer format version {version} "
                        f"flags {flags}, expected {FORMAT_VERSION} and 0")
    if v_fp != fingerprint:
        return Rejected(FailureCause.WRONG_NAMESPACE, "pointer belongs to another namespace")
    if v_key != key or v_rank != rank or target == key:
        return Rejected(FailureCause.WRONG_KEY, "pointer of another key or rank")
    return Pointer(bytes(target), rows)


def next_hop(
    value: bytes | bytearray | memoryview, *, fingerprint: bytes, key: bytes, rank: int,
    rows: int, slot_rows: int, value_len: int | None = None,
) -> Pointer | Rejected:
    """The entry to read next where a tail of ``rows`` rows (of a slot's ``slot_rows``) was
    asked for and a pointer came back, or why it cannot serve (``missing``: a whole chunk's
    key, or a pointer to no more rows). Rows grow strictly along a chain, so it ends: two
    writers racing may leave a tail pointing at a tail that a whole chunk superseded since."""
    pointer = decode_pointer(value, fingerprint=fingerprint, key=key, rank=rank,
                             value_len=value_len)
    if isinstance(pointer, Rejected):
        return pointer
    if not 0 < rows < slot_rows or not (
            pointer.rows in (0, slot_rows) or rows < pointer.rows < slot_rows):
        return Rejected(FailureCause.MISSING, f"a pointer to {pointer.rows} rows for {rows}")
    return pointer
