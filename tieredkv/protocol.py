"""The ground floor every layer shares: jobs, their one result type, the step plan, and enums.

One job type, :class:`Job`: bytes from a source place to a destination place (device
blocks, a host slot, a disk slot, a remote shard); the pair of media is its :class:`Move`,
the one name of what it does, and the worker routes it by that pair to one handler. Jobs
travel inside vLLM's connector metadata from the engine-core process to each worker process,
so they are frozen dataclasses of ints, bytes, strs and tuples: cheap to pickle, impossible
to mutate on the way, and never holding a tensor. A job names the request it serves
(``req_id``), stores included.

Block ids are device (vLLM) block ids; slots are host-pool or slab-file slots. Position ``j``
of a host slot holds block ``j`` of its chunk, for every layer (see ``transfer.kv_views``).
The enums are ``StrEnum`` so their values are the names that appear in metrics and configs.

A job's ``rows`` name a device block per row of its slot; :class:`SlotRows` (at the end) is
how those rows are laid out for a model's KV-cache groups, so both halves read a job alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar

# A slot row with no device block (a sliding-window row not kept or filled): never copied.
NO_BLOCK = -1


class Tier(StrEnum):
    """Where a chunk's KV is kept: the workers' host pools, their slab files, the shared store
    (the values: the ``tier`` label of the metrics, the tier names in the stats)."""

    HOST = "host"
    DISK = "disk"
    REMOTE = "remote"


class Medium(StrEnum):
    """Where a job's bytes are: vLLM's device blocks, a host slot, a disk slot, the shared store."""

    DEVICE = "device"
    HOST = "host"
    DISK = "disk"
    REMOTE = "remote"


class Move(StrEnum):
    """A job's (source medium, destination medium) pair: the one name of what a job does.

    The values are the ``kind`` label of the job metrics; :attr:`direction` is the
    ``direction`` label of the byte counters (``d2h`` for a store, ``restore`` for a
    promotion, ...), kept as the dashboards know them."""

    STORE = "store"                 # device -> host
    SPILL = "spill"                 # host -> disk
    PROMOTE = "promote"             # disk -> host
    LOAD = "load"                   # host -> device
    REMOTE_READ = "remote_read"     # remote -> host
    REMOTE_WRITE = "remote_write"   # host -> remote

    @property
    def src(self) -> Medium:
        return _MEDIA[self][0]

    @property
    def dst(self) -> Medium:
        return _MEDIA[self][1]

    @property
    def direction(self) -> str:
        return _DIRECTION.get(self, self.value)

    @property
    def touches_device(self) -> bool:
        return Medium.DEVICE in _MEDIA[self]

    @property
    def brings_up(self) -> bool:
        """A load, promotion or remote read: bytes toward the device, that a request waits for."""
        return self in _BRINGS_UP

    @classmethod
    def between(cls, src: Medium, dst: Medium) -> Move:
        """The move from ``src`` to ``dst``; ValueError for a pair nothing carries."""
        try:
            return _MOVE_OF[(src, dst)]
        except KeyError:
            raise ValueError(f"no transfer moves {src.value} -> {dst.value}") from None


_MEDIA: dict[Move, tuple[Medium, Medium]] = {
    Move.STORE: (Medium.DEVICE, Medium.HOST),
    Move.SPILL: (Medium.HOST, Medium.DISK),
    Move.PROMOTE: (Medium.DISK, Medium.HOST),
    Move.LOAD: (Medium.HOST, Medium.DEVICE),
    Move.REMOTE_READ: (Medium.REMOTE, Medium.HOST),
    Move.REMOTE_WRITE: (Medium.HOST, Medium.REMOTE),
}
_MOVE_OF = {media: move for move, media in _MEDIA.items()}
_DIRECTION = {Move.STORE: "d2h", Move.LOAD: "h2d", Move.PROMOTE: "restore"}
_BRINGS_UP = frozenset({Move.LOAD, Move.PROMOTE, Move.REMOTE_READ})


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


# The failure counters' ``cause`` labels (``dropped`` is counted as its own series).
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
class DeviceBlocks:
    """vLLM's device blocks, in order. :data:`NO_BLOCK` entries are holes (hybrid models: rows
    a sliding window does not need), never copied."""

    block_ids: tuple[int, ...]
    medium: ClassVar[Medium] = Medium.DEVICE


@dataclass(frozen=True)
class HostSlot:
    """One host-pool slot: block ``j`` of its chunk at position ``j``, for every layer."""

    slot: int
    medium: ClassVar[Medium] = Medium.HOST


@dataclass(frozen=True)
class LoadChunk:
    """One chunk of a load: slot positions ``[first_block, first_block + len(block_ids))``
    go to device blocks ``block_ids`` (a hit may start mid-chunk). The chunk is in host slot
    ``host_slot``: a disk or remote hit is filled there before it is loaded."""

    key: bytes
    host_slot: int
    first_block: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class HostChunks:
    """A load's source: its chunks' host slots, in prefix order.

    ``unserved``: the planner found device blocks in the load's range that no stored row
    fills (a hybrid window it did not store): the worker copies nothing and reports every
    block failed, so vLLM recomputes them rather than attend to whatever those blocks held.
    ``sync``: copied inline before the forward of the step that schedules the request (CPU),
    never reported received; a failure is reported as invalid blocks only."""

    chunks: tuple[LoadChunk, ...]
    unserved: bool = False
    sync: bool = False
    medium: ClassVar[Medium] = Medium.HOST


@dataclass(frozen=True)
class DiskSlot:
    """A slot of this rank's slab file. ``aliases``: keys of the entry's other blocks, written
    into the slot header by a spill."""

    slot: int
    aliases: tuple[bytes, ...] = ()
    medium: ClassVar[Medium] = Medium.DISK


@dataclass(frozen=True)
class RemoteShard:
    """This rank's shard of a chunk in the shared store, verified (key, namespace, rank,
    length, checksum) before a byte of a read lands.

    ``rows``: the rows the entry holds, rows 0..rows-1 of every layer (a prompt's tail holds
    fewer than a slot's). A write sends exactly those rows, never the slot's others (they
    hold a previous tenant's bytes; 0: unknown, refused); a read takes a value of exactly
    that many rows (0: a whole slot's). ``holes`` (writes): rows among them the entry leaves
    empty (hybrid: a sliding window's rows it does not keep), written as zeros, never as
    what the slot held. ``supersedes`` (writes): shorter tails of its chunk, to point to it."""

    rows: int = 0
    holes: tuple[int, ...] = ()
    supersedes: tuple[bytes, ...] = ()
    medium: ClassVar[Medium] = Medium.REMOTE


Place = DeviceBlocks | HostSlot | HostChunks | DiskSlot | RemoteShard


@dataclass(frozen=True)
class Job:
    """Move bytes from ``src`` to ``dst``; the pair of media is its :attr:`move`. ``key``:
    the chunk it moves (a load names each chunk's in :class:`HostChunks`); ``req_id``: the
    request it serves, or None for jobs that serve a tier (spills, remote writes). The named
    constructors (:meth:`store`, :meth:`spill`, ...) build the six pairs the worker carries;
    any other pair is refused."""

    job_id: int
    src: Place
    dst: Place
    key: bytes = b""
    req_id: str | None = None
    move: Move = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "move", Move.between(self.src.medium, self.dst.medium))

    @classmethod
    def _made(cls, move: Move, job_id: int, src: Place, dst: Place, key: bytes,
              req_id: str | None = None) -> Job:
        """A job of a pair its named constructor knows, built without a frozen dataclass's
        per-field ``__setattr__`` (a scheduler step makes one per chunk it moves)."""
        job = object.__new__(cls)
        job.__dict__.update(job_id=job_id, src=src, dst=dst, key=key, req_id=req_id, move=move)
        return job

    @property
    def host_slot(self) -> int:
        """The one host slot the job reads or writes (a load has one per chunk: -1)."""
        for place in (self.src, self.dst):
            if isinstance(place, HostSlot):
                return place.slot
        return -1

    @property
    def block_ids(self) -> tuple[int, ...]:
        """The device blocks a store reads or a load writes (holes left out of a load's)."""
        if isinstance(self.src, DeviceBlocks):
            return self.src.block_ids
        if isinstance(self.src, HostChunks):
            return tuple(b for c in self.src.chunks for b in c.block_ids if b != NO_BLOCK)
        return ()

    @classmethod
    def store(cls, job_id: int, key: bytes, host_slot: int, block_ids: tuple[int, ...],
              req_id: str | None = None) -> Job:
        """d2h: device blocks -> host slot (block j -> position j; fewer: a prompt's tail)."""
        return cls._made(Move.STORE, job_id, DeviceBlocks(tuple(block_ids)), HostSlot(host_slot), key, req_id)

    @classmethod
    def spill(cls, job_id: int, key: bytes, host_slot: int, disk_slot: int,
              aliases: tuple[bytes, ...] = ()) -> Job:
        """Host slot -> disk slot, written with a verified header; the host copy stays."""
        return cls._made(Move.SPILL, job_id, HostSlot(host_slot), DiskSlot(disk_slot, tuple(aliases)), key)

    @classmethod
    def promote(cls, job_id: int, key: bytes, disk_slot: int, host_slot: int,
                req_id: str | None = None) -> Job:
        """Disk slot -> host slot, verified before the scheduler may promise it as a hit."""
        return cls._made(Move.PROMOTE, job_id, DiskSlot(disk_slot), HostSlot(host_slot), key, req_id)

    @classmethod
    def load(cls, job_id: int, req_id: str, chunks: tuple[LoadChunk, ...],
             unserved: bool = False, sync: bool = False) -> Job:
        """A request's chunks, in prefix order, each copied host -> device."""
        chunks = tuple(chunks)
        blocks = tuple(b for c in chunks for b in c.block_ids)
        return cls._made(Move.LOAD, job_id, HostChunks(chunks, unserved, sync), DeviceBlocks(blocks), b"", req_id)

    @classmethod
    def remote_read(cls, job_id: int, key: bytes, host_slot: int,
                    req_id: str | None = None, rows: int = 0) -> Job:
        """Shared store -> host slot (``rows``: a tail's, 0: a whole chunk's), promised once
        every rank reported it done."""
        return cls._made(Move.REMOTE_READ, job_id, RemoteShard(rows), HostSlot(host_slot), key, req_id)

    @classmethod
    def remote_write(cls, job_id: int, key: bytes, host_slot: int, rows: int = 0,
                     holes: tuple[int, ...] = (), supersedes: tuple[bytes, ...] = ()) -> Job:
        """Host slot -> shared store, through the store's bounded write queue (a full queue
        or a store that is down drops it: the engine never waits on the network)."""
        shard = RemoteShard(rows, tuple(holes), tuple(supersedes))
        return cls._made(Move.REMOTE_WRITE, job_id, HostSlot(host_slot), shard, key)


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
    failure: FailureCause | None = None
    failed_block_ids: tuple[int, ...] = ()
    # Seconds the job took on the worker, submit to result (merged: the slowest rank's); 0
    # when not known. The cost model times reads no request waited for by it.
    seconds: float = field(default=0.0, compare=False)

    @classmethod
    def done(cls, job_id: int) -> JobResult:
        return cls(job_id, ok=1)

    @classmethod
    def fail(cls, job_id: int, failure: FailureCause,
             failed_block_ids: Iterable[int] = ()) -> JobResult:
        # FailureCause(...) refuses a raw string that is not a cause.
        return cls(job_id, failed=1, failure=FailureCause(failure), failed_block_ids=tuple(sorted(set(failed_block_ids))))

    def merged(self, other: JobResult) -> JobResult:
        """The one merge: ranks add up, the first cause wins, failed blocks unite."""
        assert other.job_id == self.job_id, (self.job_id, other.job_id)
        return JobResult(
            self.job_id, ok=self.ok + other.ok, failed=self.failed + other.failed,
            failure=self.failure or other.failure,
            failed_block_ids=tuple(sorted(set(self.failed_block_ids) | set(other.failed_block_ids))),
            seconds=max(self.seconds, other.seconds))


def merge_results(into: dict[int, JobResult], results: Iterable[JobResult]) -> dict[int, JobResult]:
    """Fold ``results`` into ``into`` by job id (ranks and steps may report one job apart)."""
    for result in results:
        prior = into.get(result.job_id)
        into[result.job_id] = result if prior is None else prior.merged(result)
    return into


@dataclass
class StepPlan:
    """The jobs of one scheduler step (the payload of the connector metadata)."""

    jobs: list[Job] = field(default_factory=list)
    fence_block_ids: list[int] = field(default_factory=list)
    delayed_req_ids: list[str] = field(default_factory=list)
    # The step computes no tokens (requests only wait for loads): the worker may sleep on
    # its own in-flight jobs instead of letting vLLM spin through empty steps.
    compute_idle: bool = False
    step: int = 0  # the scheduler's number, echoed in every worker's output (prefill rate)

    def of(self, move: Move) -> list[Job]:
        """This step's jobs of one move, in the order they were planned."""
        return [job for job in self.jobs if job.move is move]


# ------------------------------------------------- slot rows: where each group's blocks sit
#
# vLLM's hybrid KV-cache manager gives each kind of attention layer its own group of block ids
# (full attention; sliding window). tieredkv keeps one slot per entry holding every group:
# group ``g``'s block ``j`` of the chunk is row ``g * chunk_blocks + j`` of the slot. An entry
# holds the first ``n`` blocks of its chunk (``n = chunk_blocks`` for a whole chunk, fewer for a
# prompt's tail). A full-attention group stores rows ``0 .. n-1``; a sliding-window group only
# the rows a hit ending at the entry's end needs, ``[max(0, n - window_blocks), n)`` (vLLM's
# prefix cache needs exactly ``cdiv(window - 1 + extra, block_size)`` contiguous blocks ending
# at the hit; the chunk before holds its own last ``window_blocks``). So a hybrid hit ends on a
# chunk boundary or exactly where a stored prompt ended, nowhere else. The rows an entry does
# not store are holes (:data:`NO_BLOCK`), never copied. With one full-attention group (every
# model before hybrids) rows are block positions, as they always were.

FULL, SLIDING = "full", "sliding"
NULL_BLOCK = 0  # vLLM's placeholder block id (a sliding window's freed blocks)


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group: ``kind`` FULL or SLIDING; ``window_blocks``: for SLIDING, the blocks
    before a hit's end that the hit needs (0 for FULL: all of them)."""

    kind: str
    window_blocks: int = 0

    def describe(self) -> str:
        return self.kind if self.kind == FULL else f"{self.kind}:{self.window_blocks}"


@dataclass(frozen=True)
class SlotRows:
    """The groups of an engine and the slot rows of their blocks (one chunk of ``chunk_blocks``)."""

    groups: tuple[KVGroup, ...]
    chunk_blocks: int

    @property
    def hybrid(self) -> bool:
        """More than one group, or a sliding window: hits end on chunk boundaries or at an
        entry's end only."""
        return len(self.groups) > 1 or any(g.kind != FULL for g in self.groups)

    @property
    def rows(self) -> int:
        """Rows of one slot: ``chunk_blocks`` per group."""
        return len(self.groups) * self.chunk_blocks

    def describe(self) -> str:
        """For the namespace: settings that change what a slot holds change the fingerprint."""
        return ",".join(g.describe() for g in self.groups)

    def _kept(self, group: KVGroup, j: int, n: int) -> bool:
        """Whether an entry holding ``n`` blocks stores row ``j`` of ``group``."""
        return j < n and (group.kind == FULL or j >= n - group.window_blocks)

    def _held(self, n: int | None) -> int:
        C = self.chunk_blocks
        if n is None:
            return C
        if not 0 < n <= C:
            raise ValueError(f"an entry holds 1..{C} blocks of its chunk, not {n}")
        return n

    def stored_rows(self, n: int | None = None) -> int:
        """Rows an entry of ``n`` blocks (None: a whole chunk) fills: its payload, in blocks
        of one layer (the slot it occupies always has :attr:`rows` rows)."""
        n = self._held(n)
        return sum(n if g.kind == FULL else min(n, g.window_blocks) for g in self.groups)

    def store_rows(
        self, tables: Sequence[Sequence[int]], chunk: int, n: int | None = None
    ) -> tuple[int, ...]:
        """Device block per slot row for storing the first ``n`` blocks (None: all) of chunk
        ``chunk`` (holes: NO_BLOCK)."""
        C, n = self.chunk_blocks, self._held(n)
        rows: list[int] = []
        for group, table in zip(self.groups, tables, strict=True):
            ids = table[chunk * C:(chunk + 1) * C]
            for j in range(C):
                block = ids[j] if j < len(ids) else NULL_BLOCK
                rows.append(block if block != NULL_BLOCK and self._kept(group, j, n) else NO_BLOCK)
        return tuple(rows)

    def empty_rows(self, n: int | None = None) -> tuple[int, ...]:
        """Slot rows an entry of ``n`` blocks (None: whole) never fills: they hold what the
        slot held before, so a remote value of the whole slot carries zeros there."""
        C, n = self.chunk_blocks, self._held(n)
        return tuple(g * C + j for g, group in enumerate(self.groups) for j in range(C)
                     if not self._kept(group, j, n))

    def sliding_blocks(self, rows: Sequence[int]) -> tuple[int, ...]:
        """The real blocks of sliding-window groups among a chunk's ``rows`` (vLLM may free
        and hand them out again while a store still reads them)."""
        C = self.chunk_blocks
        return tuple(
            b for g, group in enumerate(self.groups) if group.kind != FULL
            for b in rows[g * C:(g + 1) * C] if b != NO_BLOCK
        )

    def load_rows(
        self, tables: Sequence[Sequence[int]], chunk: int, lo: int, hi: int, n: int | None = None
    ) -> tuple[int, ...]:
        """Device block per slot row for loading blocks ``[lo, hi)`` (table positions) of chunk
        ``chunk`` from an entry of ``n`` blocks (None: whole): the rows its store kept, where
        vLLM gave a real block (holes: NO_BLOCK)."""
        C, n = self.chunk_blocks, self._held(n)
        rows = [NO_BLOCK] * self.rows
        for g, (group, table) in enumerate(zip(self.groups, tables, strict=True)):
            for pos in range(lo, min(hi, len(table))):
                j = pos - chunk * C
                block = table[pos]
                if block != NULL_BLOCK and self._kept(group, j, n):
                    rows[g * C + j] = block
        return tuple(rows)

    def unserved(
        self, tables: Sequence[Sequence[int]], chunk: int, lo: int, hi: int, n: int | None = None
    ) -> list[int]:
        """Real blocks in ``[lo, hi)`` that no stored row of an entry of ``n`` blocks (None:
        whole) fills (a sliding group's block the store did not keep): a load that left them
        unwritten would poison vLLM's cache."""
        C, n = self.chunk_blocks, self._held(n)
        return [
            table[pos]
            for group, table in zip(self.groups, tables, strict=True)
            for pos in range(lo, min(hi, len(table)))
            if table[pos] != NULL_BLOCK and not self._kept(group, pos - chunk * C, n)
        ]
