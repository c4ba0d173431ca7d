"""Where a disk tier's slots are and what a slot's header holds: file names, slot geometry, and
the on-disk format of one slab slot.

The one place that knows them. Everything else (the disk tier itself, both connector halves,
the ``tieredkv`` command, tests and benchmarks) asks here instead of building a name, a stride
or a header of its own, so the scheduler half's slot arithmetic and the workers' files cannot
drift apart.

``<disk_path>/`` holds::

    lock            the scheduler half's lock (one engine per disk_path)
    manifest.json   what the tier was built for (namespace, slot geometry, world size)
    journal.bin     the key -> slot index, appended as chunks are written and removed
    rank{r}.lock    worker ``r``'s lock, taken before it opens its slab file
    rank{r}.slab    worker ``r``'s slab file: slot ``i`` starts at ``i * slot_stride``

A slot is a ``HEADER_BYTES`` header followed by the payload padded to ``PAGE_BYTES``, so every
slot and every payload starts page-aligned (O_DIRECT).

Every slot says what it holds (namespace fingerprint, key, length) and how to check it
(payload checksum, header checksum), so a read can prove its bytes are the ones asked for
without trusting any index. Fixed little-endian ``struct`` fields only: nothing on disk is
ever unpickled or otherwise interpreted as code.

Header format (all little-endian), padded with zeros to ``HEADER_BYTES`` (one page)::

    offset size  field
         0    8  magic              b"TKVSLAB1"
         8    2  format version     FORMAT_VERSION
        10    2  flags              0 (reserved)
        12   32  namespace fingerprint
        44   32  key                the key of the last block the slot holds
        76    8  payload length     bytes that count (padding excluded)
        84    8  payload checksum   xxh3_64 of the payload bytes
        92    8  write sequence     increasing per writer, for forensics
       100    2  alias count A      keys of the entry's other blocks listed below
       102    2  reserved           0
       104    4  header checksum    crc32 of bytes 0..103, then of the alias table
       108 24*A  alias table        the first 24 bytes of each alias key (the last 8 are the
                                    namespace's), the chunk's first block first

An entry holds the first ``A + 1`` blocks of its chunk (a whole chunk, or a prompt's tail):
the aliases let a restarted engine find a hit that ends inside it. The payload is always
the whole slot (positions past the entry's blocks hold whatever the host slot held before),
and the checksum covers exactly the payload written, so partial entries verify like whole
ones. Version 1 had no alias fields (its checksum sat at offset 100); its slots read as
``wrong_namespace``.
"""

from __future__ import annotations

import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from tieredkv.disk.errors import SlabError
from tieredkv.keys import FINGERPRINT_BYTES, KEY_BYTES, KEY_PART_BYTES, key_from_part, key_part
from tieredkv.protocol import FailureCause

if TYPE_CHECKING:  # for the annotation only
    from tieredkv.config import TieredKVConfig

PAGE_BYTES = 4096
HEADER_BYTES = 4096  # one page: the payload that follows stays page-aligned

LOCK_NAME = "lock"
MANIFEST_NAME = "manifest.json"
JOURNAL_NAME = "journal.bin"
SLAB_GLOB = "rank*.slab"
_SLAB_NAME = re.compile(r"^rank(\d+)\.slab$")


# -- slot geometry ---------------------------------------------------------------------------


def align_up(value: int, alignment: int = PAGE_BYTES) -> int:
    """Round up to a multiple of ``alignment``: host slots and disk payloads are padded alike,
    so a host slot goes straight to an O_DIRECT read or write (the one definition; torch-free)."""
    return (value + alignment - 1) // alignment * alignment


def slot_stride(payload_bytes: int) -> int:
    """Bytes one slot occupies in a slab file: the header plus the page-padded payload."""
    return HEADER_BYTES + align_up(payload_bytes)


def slot_offset(slot: int, stride: int) -> int:
    """Where slot ``slot`` (its header) starts in a slab file of slots ``stride`` bytes apart."""
    return slot * stride


def payload_offset(slot: int, stride: int) -> int:
    """Where slot ``slot``'s payload starts in a slab file of slots ``stride`` bytes apart."""
    return slot * stride + HEADER_BYTES


def slot_counts(config: TieredKVConfig, payload_bytes: int, world_size: int) -> tuple[int, int]:
    """Host and disk slots per rank. Both connector halves ask here (the scheduler half sizes
    its index, each worker its host pool and slab file), so neither imports the other."""
    host = config.host_bytes_per_rank(world_size) // align_up(payload_bytes)
    disk = 0
    if config.has_disk:
        disk = config.disk_bytes_per_rank(world_size) // slot_stride(payload_bytes)
    return host, disk


# -- file names ------------------------------------------------------------------------------


def slab_name(rank: int) -> str:
    """The file name of rank ``rank``'s slab file."""
    return f"rank{rank}.slab"


def slab_path(disk_path: Path | str, rank: int) -> Path:
    """Where rank ``rank`` keeps its slab file."""
    return Path(disk_path) / slab_name(rank)


def slab_rank(name: str) -> int | None:
    """The rank a slab file name belongs to (``rank3.slab`` -> 3); None for any other name."""
    match = _SLAB_NAME.match(name)
    return int(match.group(1)) if match else None


def slab_files(disk_path: Path | str) -> list[Path]:
    """Every ``rank*.slab`` under ``disk_path``, by rank (names without a rank number last)."""

    def rank(path: Path) -> int:
        found = slab_rank(path.name)
        return found if found is not None else 1 << 30

    return sorted(Path(disk_path).glob(SLAB_GLOB), key=rank)


def rank_lock_name(rank: int) -> str:
    """The lock file worker ``rank`` holds while its slab file is open (see ``DiskLock``)."""
    return f"rank{rank}.lock"


def lock_path(disk_path: Path | str) -> Path:
    """The scheduler half's lock file (one engine per ``disk_path``)."""
    return Path(disk_path) / LOCK_NAME


def manifest_path(disk_path: Path | str) -> Path:
    return Path(disk_path) / MANIFEST_NAME


def journal_path(disk_path: Path | str) -> Path:
    return Path(disk_path) / JOURNAL_NAME


# -- slot header ----------------------------------------------------------------------------

MAGIC = b"TKVSLAB1"
FORMAT_VERSION = 2
_FIELDS = struct.Struct(f"<8sHH{FINGERPRINT_BYTES}s{KEY_BYTES}sQQQHH")
_CRC = struct.Struct("<I")
HEADER_USED = _FIELDS.size + _CRC.size  # the fixed part; the alias table follows
MAX_HEADER_ALIASES = (HEADER_BYTES - HEADER_USED) // KEY_PART_BYTES
_V1_FIELDS = 100  # version 1: crc32 of bytes 0..99 at offset 100
_ZEROS = bytes(HEADER_BYTES)


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
    aliases: tuple[bytes, ...] = ()  # full alias keys (rebuilt with the fingerprint)


def aliases_kept(aliases: tuple[bytes, ...]) -> tuple[bytes, ...]:
    """The aliases a slot written for an entry with ``aliases`` lists in its header: all of
    them when they fit one header page, else none (a restart then finds only the entry's own
    key). The scheduler asks this before it plans a spill, so it never sees the format."""
    return aliases if len(aliases) <= MAX_HEADER_ALIASES else ()


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
    aliases: tuple[bytes, ...] = (),
) -> None:
    """Write a complete header (padding zeroed) into the first ``HEADER_BYTES`` of ``buf``.

    Used with a reusable page-aligned buffer, so an O_DIRECT write needs no allocation.
    ``aliases`` are full keys in the namespace ``fingerprint``; at most
    ``MAX_HEADER_ALIASES``.
    """
    _check_ids(fingerprint, key)
    if len(aliases) > MAX_HEADER_ALIASES:
        raise ValueError(f"{len(aliases)} aliases do not fit a header (at most {MAX_HEADER_ALIASES})")
    table = b"".join(_alias_part(alias, fingerprint) for alias in aliases)
    buf[:HEADER_BYTES] = _ZEROS
    _FIELDS.pack_into(
        buf, 0, MAGIC, FORMAT_VERSION, flags, fingerprint, key, payload_len, checksum, sequence,
        len(aliases), 0,
    )
    view = memoryview(buf)
    view[HEADER_USED : HEADER_USED + len(table)] = table
    crc = zlib.crc32(table, zlib.crc32(view[: _FIELDS.size]))
    _CRC.pack_into(buf, _FIELDS.size, crc)


def _alias_part(alias: bytes, fingerprint: bytes) -> bytes:
    if len(alias) != KEY_BYTES or key_from_part(key_part(alias), fingerprint) != alias:
        raise ValueError("an alias must be a key in the header's namespace")
    return key_part(alias)


def pack_header(**fields: Any) -> bytes:
    """A complete ``HEADER_BYTES``-long header; takes :func:`pack_header_into`'s keywords."""
    buf = bytearray(HEADER_BYTES)
    pack_header_into(buf, **fields)
    return bytes(buf)


def unpack_header(buf: memoryview | bytes, *, slot: int | None = None, path: object = None) -> SlotHeader:
    """Parse and self-check a header; raises :class:`SlabError` when it cannot be trusted.

    A header that is all zeros was never written (or was invalidated): ``missing``. Anything
    else with a bad magic or a bad header checksum is corruption: ``checksum``. A header
    written by another format version cannot be interpreted: ``wrong_namespace``.
    """
    whole = memoryview(buf)
    view = whole[:HEADER_USED]
    if len(view) < HEADER_USED:
        raise SlabError(FailureCause.SHORT_READ, f"header has {len(view)} bytes", slot=slot, path=path)
    (magic, version, flags, fingerprint, key, length, checksum, sequence, count,
     _reserved) = _FIELDS.unpack_from(view)
    if magic != MAGIC:
        if not any(view):
            raise SlabError(FailureCause.MISSING, "slot is empty", slot=slot, path=path)
        raise SlabError(FailureCause.CHECKSUM, f"bad magic {magic!r}", slot=slot, path=path)
    (stored_crc,) = _CRC.unpack_from(view, _FIELDS.size)
    end = HEADER_USED + count * KEY_PART_BYTES
    table = whole[HEADER_USED:end]
    if count > MAX_HEADER_ALIASES or len(table) != end - HEADER_USED or (
        zlib.crc32(table, zlib.crc32(view[: _FIELDS.size])) != stored_crc
    ):
        (v1_crc,) = _CRC.unpack_from(view, _V1_FIELDS)
        if version != FORMAT_VERSION and zlib.crc32(view[:_V1_FIELDS]) == v1_crc:
            raise SlabError(  # an intact header of an older format
                FailureCause.WRONG_NAMESPACE,
                f"format version {version}, expected {FORMAT_VERSION}", slot=slot, path=path,
            )
        raise SlabError(FailureCause.CHECKSUM, "header checksum mismatch", slot=slot, path=path)
    if version != FORMAT_VERSION:
        raise SlabError(
            FailureCause.WRONG_NAMESPACE,
            f"format version {version}, expected {FORMAT_VERSION}", slot=slot, path=path,
        )
    aliases = tuple(
        key_from_part(table[i : i + KEY_PART_BYTES], fingerprint)
        for i in range(0, len(table), KEY_PART_BYTES)
    )
    return SlotHeader(version, flags, fingerprint, key, length, checksum, sequence, aliases)
