"""The ground floor every layer shares: jobs, their one result type, the step plan, and enums.

Jobs travel inside vLLM's connector metadata from the engine-core process to each worker
process, so they are plain frozen dataclasses of ints, bytes, strs and tuples: cheap to
pickle, impossible to mutate on the way, and never holding a tensor. Every job names the
request it serves (``req_id``), stores included.

Block ids are device (vLLM) block ids; slots are host-pool or slab-file slots. Position ``j``
of a host slot holds block ``j`` of its chunk, for every layer (see ``transfer.kv_views``).

The enums are ``StrEnum`` so their values are the names that appear in metrics and configs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

# A slot row with no device block: a row of a sliding-window group that a store did not keep,
# or a load does not fill. Never copied (see ``tieredkv.kv_groups``).
NO_BLOCK = -1


class Tier(StrEnum):
    """Where a chunk's KV is kept: the workers' host pools, their slab files, the shared store.

    The values are the ``tier`` label of the metrics and the tier names in the stats."""

    HOST = "host"
    DISK = "disk"
    REMOTE = "remote"


class JobKind(StrEnum):
    """What a job moves: device->host, host->disk, disk->host, host->device, and host<->remote."""

    STORE = "store"
    SPILL = "spill"
    PROMOTE = "promote"
    LOAD = "load"
    REMOTE_READ = "remote_read"
    REMOTE_WRITE = "remote_write"


class Direction(StrEnum):
    """Byte counters' directions (``bytes_total{direction=...}``)."""

    D2H = "d2h"
    H2D = "h2d"
    SPILL = "spill"
    RESTORE = "restore"
    REMOTE_READ = "remote_read"
    REMOTE_WRITE = "remote_write"


class FailureCause(StrEnum):
    """Every reason a job or tier call did not deliver (values appear in metrics)."""

    IO_ERROR = "io_error"              # the disk or network said no
    SHORT_READ = "short_read"          # a slot file ended early
    CHECKSUM = "checksum"              # bytes came back, but not the bytes written
    WRONG_KEY = "wrong_key"            # a slot held another chunk
    MISSING = "missing"                # the slot or file is gone
    TIMEOUT = "timeout"                # no answer within the deadline
    NO_SPACE = "no_space"              # full disk, quota, or Redis maxmemory
    WRONG_NAMESPACE = "wrong_namespace"  # written under other model/settings
    COPY_ERROR = "copy_error"          # a device<->host copy raised, or a slot was in flight
    CANCELLED = "cancelled"            # fenced, shut down, or never started
    INJECTED = "injected"              # a test fault (tieredkv.testing)
    UNKNOWN = "unknown"                # a job reported no cause (a bug: logged)
    DROPPED = "dropped"                # a spill found the bounded spill queue full
    UNAVAILABLE = "unavailable"        # the remote tier is known to be down: no network call


# The ``cause`` label set of the failure counters (``dropped`` is counted as its own series).
FAILURE_CAUSES: tuple[str, ...] = tuple(
    c.value for c in FailureCause if c not in (FailureCause.DROPPED, FailureCause.UNAVAILABLE)
)


class PolicyName(StrEnum):
    """Eviction policies a tier index can use (config key ``eviction``)."""

    LRU = "lru"
    ARC = "arc"


class BackendName(StrEnum):
    """Device<->host copy backends (config key ``copy_backend``)."""

    AUTO = "auto"
    NATIVE = "native"
    TORCH = "torch"
    CUPY = "cupy"
    VLLM = "vllm"


@dataclass(frozen=True)
class StoreJob:
    """d2h: device blocks ``block_ids`` -> host slot ``host_slot`` (block j -> position j).

    Fewer ids than ``chunk_blocks``: a prompt's tail; the slot's other positions are unused.
    :data:`NO_BLOCK` entries are holes (hybrid models: rows a sliding window does not need)."""

    job_id: int
    key: bytes
    host_slot: int
    block_ids: tuple[int, ...]
    req_id: str | None = None  # the request whose blocks these are (vLLM's finished_sending)


@dataclass(frozen=True)
class SpillJob:
    """Host slot -> disk slot (written with a verified header; the host copy stays).

    ``aliases``: keys of the entry's other blocks, written into the slot header."""

    job_id: int
    key: bytes
    host_slot: int
    disk_slot: int
    aliases: tuple[bytes, ...] = ()
    req_id: str | None = None  # spills serve the tier, not a request: always None


@dataclass(frozen=True)
class PromoteJob:
    """Disk slot -> host slot, verified before the scheduler may promise it as a hit."""

    job_id: int
    key: bytes
    disk_slot: int
    host_slot: int
    req_id: str | None = None  # the request whose lookup asked for it


@dataclass(frozen=True)
class RemoteReadJob:
    """Shared remote tier -> host slot: this rank's shard of chunk ``key``, verified (key,
    namespace, rank, length, checksum) before a byte lands; the scheduler promises it only
    after every rank reported it done."""

    job_id: int
    key: bytes
    host_slot: int
    req_id: str | None = None  # the request whose lookup asked for it


@dataclass(frozen=True)
class RemoteWriteJob:
    """Host slot -> shared remote tier. The worker copies the shard into the store's bounded
    write queue at once (the slot is free again when it reports); a full queue or a store
    that is down drops it (``dropped``), so the engine never waits on the network."""

    job_id: int
    key: bytes
    host_slot: int
    req_id: str | None = None  # writes serve the tier, not a request: always None
    # Slot rows the entry holds (rows 0..rows-1). The worker writes a slot only when this is
    # every row it has: other rows hold a previous tenant's bytes (0: unknown, refused).
    rows: int = 0
    # Rows among them the entry leaves empty (hybrid: a sliding window's rows it does not
    # keep, never copied into the slot): written as zeros, never as what the slot held.
    holes: tuple[int, ...] = ()


@dataclass(frozen=True)
class LoadChunk:
    """One chunk of a load: slot positions ``[first_block, first_block + len(block_ids))``
    go to device blocks ``block_ids`` (a hit may start mid-chunk). The chunk is in host slot
    ``host_slot``: a disk hit is promoted there (:class:`PromoteJob`) before it is loaded."""

    key: bytes
    host_slot: int
    first_block: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class LoadJob:
    """A request's chunks, in prefix order, each copied host -> device."""

    job_id: int
    req_id: str
    chunks: tuple[LoadChunk, ...]
    # The planner found device blocks in the load's range that no stored row fills (a hybrid
    # window it did not store): the worker copies nothing and reports every block failed, so
    # vLLM recomputes them rather than attend to whatever those blocks held.
    unserved: bool = False

    @property
    def block_ids(self) -> tuple[int, ...]:
        """The device blocks the load writes (holes left out)."""
        return tuple(b for chunk in self.chunks for b in chunk.block_ids if b != NO_BLOCK)


Job = StoreJob | SpillJob | PromoteJob | LoadJob | RemoteReadJob | RemoteWriteJob


@dataclass(frozen=True)
class JobResult:
    """What happened to one job: one rank's report, or several merged (:meth:`merged`).

    ``ok``/``failed`` count ranks. ``failure`` is a :class:`FailureCause` value (the first one
    reported). For a failed load, ``failed_block_ids`` are exactly the device blocks of the
    chunks that did not load: the failed chunk and every chunk after it (a prefix with a hole
    is useless, so nothing after a failure is copied to the device).
    """

    job_id: int
    ok: int = 0
    failed: int = 0
    failure: str | None = None
    failed_block_ids: tuple[int, ...] = ()

    @classmethod
    def done(cls, job_id: int) -> JobResult:
        return cls(job_id, ok=1)

    @classmethod
    def fail(cls, job_id: int, failure: str, failed_block_ids: Iterable[int] = ()) -> JobResult:
        return cls(job_id, failed=1, failure=failure, failed_block_ids=tuple(sorted(set(failed_block_ids))))

    def merged(self, other: JobResult) -> JobResult:
        """The one merge: ranks add up, the first cause wins, failed blocks unite."""
        assert other.job_id == self.job_id, (self.job_id, other.job_id)
        return JobResult(
            self.job_id,
            ok=self.ok + other.ok,
            failed=self.failed + other.failed,
            failure=self.failure or other.failure,
            failed_block_ids=tuple(sorted(set(self.failed_block_ids) | set(other.failed_block_ids))),
        )


def merge_results(into: dict[int, JobResult], results: Iterable[JobResult]) -> dict[int, JobResult]:
    """Fold ``results`` into ``into`` by job id (ranks and steps may report one job apart)."""
    for result in results:
        prior = into.get(result.job_id)
        into[result.job_id] = result if prior is None else prior.merged(result)
    return into


@dataclass
class StepPlan:
    """The jobs of one scheduler step (the payload of the connector metadata)."""

    stores: list[StoreJob] = field(default_factory=list)
    spills: list[SpillJob] = field(default_factory=list)
    promotes: list[PromoteJob] = field(default_factory=list)
    loads: list[LoadJob] = field(default_factory=list)
    remote_reads: list[RemoteReadJob] = field(default_factory=list)
    remote_writes: list[RemoteWriteJob] = field(default_factory=list)
    fence_block_ids: list[int] = field(default_factory=list)
    delayed_req_ids: list[str] = field(default_factory=list)
    # The step computes no tokens (requests only wait for loads): the worker may sleep on
    # its own in-flight jobs instead of letting vLLM spin through empty steps.
    compute_idle: bool = False
