"""What the scheduler tracks in flight: every job, the request it serves, and the step plan
being built; each request's state and the epoch that invalidates cached hits; and
:class:`PlannerParts`, what the planner's parts share (the ledger among them).

A job is issued once (an id, the keys it names, the request it serves, one report expected
from every rank) and appended to this step's :class:`StepPlan`. :meth:`JobLedger.apply` folds
the ranks' reports in; once every rank has reported a job, its completion handler, chosen by
its :class:`~tieredkv.protocol.Move` in the table the planner installs, brings the indexes up to date, and the
job is detached from its request (which is forgotten when finished with nothing in flight).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tieredkv.config import TieredKVConfig
from tieredkv.metrics.specs import Counts
from tieredkv.protocol import JobResult, Move, SlotRows, StepPlan
from tieredkv.scheduler.tier_index import TierIndex

if TYPE_CHECKING:  # PlannerParts' annotations only: the fill path (lower_tier) imports this
    from tieredkv.scheduler.lower_tier import DiskTier
    from tieredkv.scheduler.policies import CostModel
    from tieredkv.scheduler.remote_tier import RemoteTier

logger = logging.getLogger(__name__)
@dataclass(slots=True)
class PendingHit:
    """A lookup's answer, its host chunks pinned until vLLM allocates blocks for it."""

    start_token: int
    end_token: int
    first_chunk: int
    keys: list[bytes]  # pinned host keys, chunk first_chunk + i
    # Those filled from a tier below host for this request -> that tier's name.
    sources: dict[bytes, str] = field(default_factory=dict)
    num_tokens: int = 0
    epoch: int = 0
    partial: bool = False  # the last key holds only part of its chunk's blocks for this hit
    partial_blocks: int = 0  # hybrid: a partial hit's last entry holds exactly these blocks


@dataclass(slots=True)
class RequestState:
    req_id: str
    block_ids: list[int] = field(default_factory=list)  # group 0's device blocks
    # Hybrid models: every KV-cache group's device blocks (group_ids[0] is block_ids).
    group_ids: list[list[int]] = field(default_factory=list)
    next_store_chunk: int = 0
    store_jobs: set[int] = field(default_factory=set)
    promote_jobs: set[int] = field(default_factory=set)  # fills (promotions, remote reads)
    filled: dict[bytes, str] = field(default_factory=dict)  # key -> tier filled from, for it
    remote_done: bool = False  # the remote tier was asked (answered, read, or gave up)
    promote_rounds: int = 0
    promote_deadline: float = 0.0
    load_job: int | None = None
    pending_hit: PendingHit | None = None
    hit_tokens: dict[str, int] = field(default_factory=dict)
    finished: bool = False
    looked_up: bool = False
    # A load found blocks it does not hold from this chunk on (hybrid): later hits end before it.
    hit_chunk_limit: int | None = None
    # The last lookups' answer was a miss in this state (see Lookup.lookup): asked again in it,
    # the answer is the same without a scan. ``()``: one miss, not stamped yet.
    miss_stamp: tuple | None = None

    def new_lookup(self) -> None:
        """Preempted, the request is looked up again from its first token once resumed: that
        lookup gets a deadline, promotion rounds and a remote probe of its own (the first
        one's deadline, long past, would cut its promotions short)."""
        self.promote_deadline = 0.0
        self.promote_rounds = 0
        self.remote_done = False
        self.filled = {}
        self.miss_stamp = None

    @property
    def tables(self) -> list[list[int]]:
        """Every group's device blocks (one group: just ``block_ids``)."""
        return self.group_ids or [self.block_ids]

    def set_tables(self, tables: list[list[int]]) -> None:
        self.group_ids = tables if len(tables) > 1 else []
        self.block_ids = tables[0] if tables else []

    @property
    def waiting_on_load(self) -> bool:
        return self.load_job is not None or bool(self.promote_jobs)


class RequestTable:
    """Every request the planner tracks; one is forgotten once finished with no job left."""

    def __init__(self) -> None:
        self._states: dict[str, RequestState] = {}

    def get(self, req_id: str | None) -> RequestState | None:
        return self._states.get(req_id) if req_id is not None else None

    def ensure(self, req_id: str) -> RequestState:
        state = self._states.get(req_id)
        if state is None:
            state = self._states[req_id] = RequestState(req_id)
        return state

    def maybe_forget(self, state: RequestState) -> None:
        if state.finished and not (state.store_jobs or state.promote_jobs or state.load_job):
            self._states.pop(state.req_id, None)

    def __iter__(self) -> Iterator[RequestState]:
        return iter(self._states.values())


class HitEpoch:
    """Bumped whenever a pinned host entry may have been removed (reset, failed load, a
    superseded entry): a cached pending hit from an older epoch is recomputed."""

    def __init__(self) -> None:
        self.value = 0

    def bump(self) -> None:
        self.value += 1


@dataclass(slots=True)
class JobRecord:
    job_id: int
    move: Move
    keys: tuple[bytes, ...]
    req_id: str | None
    remaining: int  # ranks yet to report
    outcome: JobResult | None = None  # every rank's report so far, merged
    # store and load jobs: device block ids per chunk (fences; failed blocks -> keys)
    chunk_blocks: tuple[tuple[int, ...], ...] = ()
    started: float = field(default_factory=time.monotonic)
    sliding: tuple[int, ...] = ()  # a store's sliding-window source blocks (hybrid models)


# Called once every rank has reported the job, with the merged outcome.
CompletionHandler = Callable[[JobRecord, JobResult], None]


class JobLedger:
    """Jobs in flight (one planner), each awaited from ``world_size`` ranks."""

    def __init__(self, world_size: int, requests: RequestTable) -> None:
        self.world_size = world_size
        self._requests = requests
        self._ids = itertools.count(1)
        self._jobs: dict[int, JobRecord] = {}
        self._handlers: dict[Move, CompletionHandler] = {}
        self.plan = StepPlan()
        # Hybrid models: sliding-window blocks that in-flight stores read (block -> stores).
        self.sliding_sources: Counter[int] = Counter()

    def set_handlers(self, handlers: Mapping[Move, CompletionHandler]) -> None:
        """Install the completion table: one handler for every :class:`Move`."""
        missing = [move.value for move in Move if move not in handlers]
        if missing:
            raise ValueError(f"tieredkv: no completion handler for moves {missing}")
        self._handlers = dict(handlers)

    # ------------------------------------------------------------------ issuing

    def issue(
        self,
        move: Move,
        keys: tuple[bytes, ...],
        req_id: str | None,
        chunk_blocks: tuple[tuple[int, ...], ...] = (),
        sliding: tuple[int, ...] = (),
    ) -> int:
        """Record a new job; the caller adds it to :attr:`plan` under the id returned.
        ``sliding``: a store's sliding-window source blocks (see :attr:`sliding_sources`)."""
        job_id = next(self._ids)
        self._jobs[job_id] = JobRecord(
            job_id, move, keys, req_id, remaining=self.world_size, chunk_blocks=chunk_blocks,
            sliding=sliding,
        )
        if sliding:  # hybrid stores only (Counter.update costs even when empty)
            self.sliding_sources.update(sliding)
        return job_id

    def take_plan(self) -> StepPlan:
        plan, self.plan = self.plan, StepPlan()
        return plan

    def fence_stores(self, state: RequestState) -> None:
        """The request's blocks were freed: this step fences the blocks its stores read."""
        for job_id in state.store_jobs:
            for blocks in self._jobs[job_id].chunk_blocks:
                self.plan.fence_block_ids.extend(b for b in blocks if b >= 0)

    def __len__(self) -> int:
        return len(self._jobs)

    def bringing_up(self) -> bool:
        """Whether a load, promotion or remote read (bytes a request waits for) is in flight."""
        return any(job.move.brings_up for job in self._jobs.values())

    # ------------------------------------------------------------------ results

    def apply(self, results: Iterable[JobResult]) -> None:
        """Fold the ranks' reports in; a job completes once every rank has reported it."""
        for result in results:
            job_id = result.job_id
            job = self._jobs.get(job_id)
            if job is None:
                logger.debug("tieredkv: result for unknown job %d ignored", job_id)
                continue
            job.outcome = result if job.outcome is None else job.outcome.merged(result)
            job.remaining -= result.ok + result.failed
            if job.remaining > 0:
                continue
            del self._jobs[job_id]
            for block in job.sliding:  # this store's blocks only, not the whole counter
                left = self.sliding_sources[block] - 1
                if left > 0:
                    self.sliding_sources[block] = left
                else:
                    del self.sliding_sources[block]
            self._handlers[job.move](job, job.outcome)
            self._detach(job)

    def _detach(self, job: JobRecord) -> None:
        state = self._requests.get(job.req_id) if job.req_id else None
        if state is None:
            return
        state.store_jobs.discard(job.job_id)
        state.promote_jobs.discard(job.job_id)
        if state.load_job == job.job_id:
            state.load_job = None
        self._requests.maybe_forget(state)


@dataclass(frozen=True)
class PlannerParts:
    """The state :class:`~tieredkv.scheduler.lookup.Lookup`, the
    :class:`~tieredkv.scheduler.lower_tier.Fill` and :class:`~tieredkv.scheduler.placement.Placer`
    all read and update (one scheduler thread): one object instead of ten arguments."""

    config: TieredKVConfig
    block_size: int
    host: TierIndex
    lower: DiskTier | None  # the indexed tier below host
    requests: RequestTable
    ledger: JobLedger
    epoch: HitEpoch
    counters: Counts
    remote: RemoteTier | None = None
    slot_rows: SlotRows | None = None  # None: one full-attention group
    cost: CostModel | None = None  # None: every lower-tier hit is taken
