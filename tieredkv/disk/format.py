"""On-disk format of one slab slot: a 4 KiB self-describing header, then the payload.

Every slot says what it holds (namespace fingerprint, key, length) and how to check it
(payload checksum, header checksum), so a read can prove its bytes are the ones asked for
without trusting any index. Fixed little-endian ``struct`` fields only: nothing on disk is
ever unpickled or otherwise interpreted as code.

Header layout (all little-endian), padded with zeros to ``HEADER_BYTES``::

    offset size  field
         0    8  magic              b"TKVSLAB1"
         8    2  format version     FORMAT_VERSION
        10    2  flags              0 (reserved)
        12   32  namespace fingerprint
        44   32  key
        76    8  payload length     bytes that count (padding excluded)
        84    8  payload checksum   xxh3_64 of the payload bytes
        92    8  write sequence     increasing per writer, for forensics
       100    4  header checksum    crc32 of bytes 0..99
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import xxhash

from tieredkv.disk.errors import FailureKind, SlabError
from tieredkv.keys import FINGERPRINT_BYTES, KEY_BYTES

MAGIC = b"TKVSLAB1"
FORMAT_VERSION = 1
PAGE_BYTES = 4096
HEADER_BYTES = 4096

_FIELDS = struct.Struct(f"<8sHH{FINGERPRINT_BYTES}s{KEY_BYTES}sQQQ")
_CRC = struct.Struct("<I")
HEADER_USED = _FIELDS.size + _CRC.size
_ZEROS = bytes(HEADER_BYTES)


def align_up(value: int, alignment: int = PAGE_BYTES) -> int:
    """Round up to a multiple of ``alignment``.

    Same rule as ``tieredkv.host_tier.align_up``; repeated here so that the disk tier and the
    ``tieredkv`` command do not import torch just to round a number.
    """
    return (value + alignment - 1) // alignment * alignment


def slot_stride(payload_bytes: int) -> int:
    """Bytes one slot occupies in a slab file: the header plus the 4 KiB-padded payload."""
    return HEADER_BYTES + align_up(payload_bytes)


@dataclass(frozen=True)
class SlotHeader:
    """What a slot's header claims; believed only after :func:`unpack_header` checked it."""

    version: int
    flags: int
    fingerprint: bytes
    key: bytes
    payload_len: int
    checksum: int
    sequence: int


def payload_checksum(data: memoryview | bytes) -> int:
    """xxh3_64 of the payload: about 30 GB/s, cheap next to the I/O it protects."""
    return xxhash.xxh3_64_intdigest(data)


def _check_ids(fingerprint: bytes, key: bytes) -> None:
    if len(fingerprint) != FINGERPRINT_BYTES:
        raise ValueError(f"fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}")
    if len(key) != KEY_BYTES:
        raise ValueError(f"key must be {KEY_BYTES} bytes, got {len(key)}")


def pack_header_into(
    buf: memoryview | bytearray,
    *,
    fingerprint: bytes,
    key: bytes,
    payload_len: int,
    checksum: int,
    sequence: int,
    flags: int = 0,
) -> None:
    """Write a complete header (padding zeroed) into the first ``HEADER_BYTES`` of ``buf``.

    Used with a reusable page-aligned buffer, so an O_DIRECT write needs no allocation.
    """
    _check_ids(fingerprint, key)
    buf[:HEADER_BYTES] = _ZEROS
    _FIELDS.pack_into(
        buf, 0, MAGIC, FORMAT_VERSION, flags, fingerprint, key, payload_len, checksum, sequence
    )
    crc = zlib.crc32(memoryview(buf)[: _FIELDS.size])
    _CRC.pack_into(buf, _FIELDS.size, crc)


def pack_header(
    *,
    fingerprint: bytes,
    key: bytes,
    payload_len: int,
    checksum: int,
    sequence: int,
    flags: int = 0,
) -> bytes:
    """A complete ``HEADER_BYTES``-long header."""
    buf = bytearray(HEADER_BYTES)
    pack_header_into(
        buf, fingerprint=fingerprint, key=key, payload_len=payload_len,
        checksum=checksum, sequence=sequence, flags=flags,
    )
    return bytes(buf)


def unpack_header(buf: memoryview | bytes, *, slot: int | None = None, path: object = None) -> SlotHeader:
    """Parse and self-check a header; raises :class:`SlabError` when it cannot be trusted.

    A header that is all zeros was never written (or was invalidated): ``missing``. Anything
    else with a bad magic or a bad header checksum is corruption: ``checksum``. A header
    written by another format version cannot be interpreted: ``wrong_namespace``.
    """
    view = memoryview(buf)[:HEADER_USED]
    if len(view) < HEADER_USED:
        raise SlabError(FailureKind.SHORT_READ, f"header has {len(view)} bytes", slot=slot, path=path)
    magic, version, flags, fingerprint, key, length, checksum, sequence = _FIELDS.unpack_from(view)
    if magic != MAGIC:
        if not any(view):
            raise SlabError(FailureKind.MISSING, "slot is empty", slot=slot, path=path)
        raise SlabError(FailureKind.CHECKSUM, f"bad magic {magic!r}", slot=slot, path=path)
    (stored_crc,) = _CRC.unpack_from(view, _FIELDS.size)
    if zlib.crc32(view[: _FIELDS.size]) != stored_crc:
        raise SlabError(FailureKind.CHECKSUM, "header checksum mismatch", slot=slot, path=path)
    if version != FORMAT_VERSION:
        raise SlabError(
            FailureKind.WRONG_NAMESPACE,
            f"format version {version}, expected {FORMAT_VERSION}", slot=slot, path=path,
        )
    return SlotHeader(version, flags, fingerprint, key, length, checksum, sequence)
