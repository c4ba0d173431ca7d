"""Where a disk tier keeps things: the file names under ``disk_path`` and a slab's slot geometry.

The one place that knows them. Everything else (the disk tier itself, both connector halves,
the ``tieredkv`` command, tests and benchmarks) asks here instead of building a name or a
stride of its own, so the scheduler half's slot arithmetic and the workers' files cannot
drift apart. Plain Python, nothing imported: the scheduler half and the command use it
without pulling in the disk tier's I/O.

``<disk_path>/`` holds::

    lock            the scheduler half's lock (one engine per disk_path)
    manifest.json   what the tier was built for (namespace, slot geometry, world size)
    journal.bin     the key -> slot index, appended as chunks are written and removed
    rank{r}.lock    worker ``r``'s lock, taken before it opens its slab file
    rank{r}.slab    worker ``r``'s slab file: slot ``i`` starts at ``i * slot_stride``

A slot is a ``HEADER_BYTES`` header (see :mod:`tieredkv.disk.format`) followed by the
payload padded to ``PAGE_BYTES``, so every slot and every payload starts page-aligned
(O_DIRECT).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for the annotation only: this module stays import-free at run time
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
