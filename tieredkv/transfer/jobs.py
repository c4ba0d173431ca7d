"""The jobs the scheduler half sends to every worker, and the results the workers send back.

They travel inside vLLM's connector metadata from the engine-core process to each worker
process, so they are plain frozen dataclasses of ints, bytes, strs and tuples: cheap to
pickle, impossible to mutate on the way, and never holding a tensor.

Block ids are device (vLLM) block ids; slots are host-pool or slab-file slots. Position ``j``
of a host slot holds block ``j`` of its chunk, for every layer (see ``kv_views``).
"""

from __future__ import annotations

from dataclasses import dataclass

# Failure names the engine produces itself; disk failures use ``FailureKind`` values.
CANCELLED = "cancelled"  # fenced, shut down, or never started
COPY_ERROR = "copy_error"  # a device<->host copy raised, or a host slot was still in flight
DROPPED = "dropped"  # a spill found the bounded spill queue full


@dataclass(frozen=True)
class StoreJob:
    """d2h: device blocks ``block_ids`` -> host slot ``host_slot`` (block j -> position j).

    Fewer ids than ``chunk_blocks``: a prompt's tail; the slot's other positions are unused."""

    job_id: int
    key: bytes
    host_slot: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class SpillJob:
    """Host slot -> disk slot (written with a verified header; the host copy stays).

    ``aliases``: keys of the entry's other blocks, written into the slot header."""

    job_id: int
    key: bytes
    host_slot: int
    disk_slot: int
    aliases: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class PromoteJob:
    """Disk slot -> host slot, verified before the scheduler may promise it as a hit."""

    job_id: int
    key: bytes
    disk_slot: int
    host_slot: int


@dataclass(frozen=True)
class LoadChunk:
    """One chunk of a load: slot positions ``[first_block, first_block + len(block_ids))``
    go to device blocks ``block_ids`` (a hit may start mid-chunk). With ``disk_slot`` set the
    chunk is first read (verified) from disk into ``host_slot``."""

    key: bytes
    host_slot: int
    first_block: int
    block_ids: tuple[int, ...]
    disk_slot: int | None = None


@dataclass(frozen=True)
class LoadJob:
    """A request's chunks, in prefix order; disk reads and h2d copies overlap across chunks."""

    job_id: int
    req_id: str
    chunks: tuple[LoadChunk, ...]

    @property
    def block_ids(self) -> tuple[int, ...]:
        return tuple(b for chunk in self.chunks for b in chunk.block_ids)


Job = StoreJob | SpillJob | PromoteJob | LoadJob


@dataclass(frozen=True)
class JobResult:
    """What happened to one job.

    ``failure`` is a ``FailureKind`` value or one of ``cancelled``/``copy_error``/``dropped``.
    For a failed load, ``failed_block_ids`` are exactly the device blocks of the chunks that
    did not load: the failed chunk and every chunk after it (a prefix with a hole is useless,
    so nothing after a failure is copied to the device).
    """

    job_id: int
    ok: bool
    failure: str | None = None
    failed_block_ids: tuple[int, ...] = ()
