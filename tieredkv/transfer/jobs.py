"""Jobs the scheduler ships to workers: plain, picklable dataclasses (no tensors)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StoreJob:
    """d2h: device blocks -> one host slot (block j of the chunk -> position j in the slot)."""

    job_id: int
    key: bytes
    host_slot: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class SpillJob:
    """Host slot -> disk slot, with header and checksum."""

    job_id: int
    key: bytes
    host_slot: int
    disk_slot: int


@dataclass(frozen=True)
class PromoteJob:
    """Disk slot -> host slot, verified before anything may promise it."""

    job_id: int
    key: bytes
    disk_slot: int
    host_slot: int


@dataclass(frozen=True)
class LoadChunk:
    """Blocks [first_block, first_block + len(block_ids)) of a chunk -> device blocks."""

    key: bytes
    host_slot: int
    first_block: int
    block_ids: tuple[int, ...]
    disk_slot: int | None = None


@dataclass(frozen=True)
class LoadJob:
    job_id: int
    req_id: str
    chunks: tuple[LoadChunk, ...]


@dataclass(frozen=True)
class JobResult:
    job_id: int
    ok: bool
    failure: str | None = None
    failed_block_ids: tuple[int, ...] = ()
