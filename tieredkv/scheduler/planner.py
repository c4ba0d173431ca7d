"""The scheduler half's brain: every placement decision, made once, shipped as concrete jobs.

The planner owns the host and disk indexes. It turns lookups into promises, allocations into
load jobs, newly computed chunks into store jobs, finished stores into spills, and worker
results back into index state. It never touches KV bytes and never imports vLLM: the
connector feeds it plain data (request ids, chunk keys, device block ids, token counts).

Rules it keeps:
* Only ``READY`` host chunks are promised. Disk chunks are first promoted into host slots
  (verified by checksum on the worker) while the lookup answers ``None``.
* Every slot a job touches is pinned in its index until every rank reported the job.
* A failed job drops its entry; nothing that failed is ever promised again.
* Allocation failure is a miss, never a wait.
* Hits end at the last block held, not at a chunk boundary: an entry holds the first ``n``
  blocks of one chunk (``n`` = ``chunk_blocks`` for a whole chunk, fewer for a prompt's tail)
  and is found by the key of any block it holds (see ``TierIndex``). Within a tier, an entry
  whose blocks another READY entry holds too is dropped once that entry is ready
  (``superseded_host``/``superseded_disk``): a tail that grows leaves one copy, not two.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tieredkv.config import TieredKVConfig
from tieredkv.disk.format import MAX_HEADER_ALIASES
from tieredkv.protocol import (
    JobKind,
    JobResult,
    LoadChunk,
    LoadJob,
    PromoteJob,
    SpillJob,
    StepPlan,
    StoreJob,
)
from tieredkv.scheduler.tier_index import TierIndex

logger = logging.getLogger(__name__)

MAX_PROMOTE_ROUNDS = 3


@dataclass
class _Job:
    kind: JobKind
    keys: tuple[bytes, ...]
    req_id: str | None
    remaining: int
    outcome: JobResult | None = None  # every rank's report so far, merged
    # load jobs: device block ids per chunk, to map failed blocks back to keys
    chunk_blocks: tuple[tuple[int, ...], ...] = ()
    started: float = field(default_factory=time.monotonic)


@dataclass
class _PendingHit:
    start_token: int
    end_token: int
    first_chunk: int
    keys: list[bytes]  # pinned host keys, chunk first_chunk + i
    disk_keys: set[bytes]
    num_tokens: int = 0
    epoch: int = 0
    partial: bool = False  # the last key holds only part of its chunk's blocks for this hit


@dataclass
class _Request:
    req_id: str
    block_ids: list[int] = field(default_factory=list)
    next_store_chunk: int = 0
    store_jobs: set[int] = field(default_factory=set)
    promote_jobs: set[int] = field(default_factory=set)
    promoted_keys: set[bytes] = field(default_factory=set)
    promote_rounds: int = 0
    promote_deadline: float = 0.0
    load_job: int | None = None
    pending_hit: _PendingHit | None = None
    hit_tokens: dict[str, int] = field(default_factory=dict)
    finished: bool = False
    looked_up: bool = False


class Planner:
    """Scheduler-side index owner and job planner (one per engine)."""

    def __init__(
        self,
        config: TieredKVConfig,
        *,
        block_size: int,
        num_host_slots: int,
        num_disk_slots: int = 0,
        world_size: int = 1,
        catalog=None,
    ) -> None:
        self.config = config = config.resolved(block_size)
        self.block_size = block_size
        self.chunk_blocks = config.chunk_blocks
        self.chunk_tokens = block_size * config.chunk_blocks
        self.world_size = world_size
        self.host = TierIndex("host", num_host_slots, config.eviction)
        self.disk = TierIndex("disk", num_disk_slots, config.eviction) if num_disk_slots else None
        self.catalog = catalog
        self.counters: Counter[str] = Counter()
        # Bumped whenever a pinned host entry may have been removed (reset, failed load):
        # a cached pending hit from an older epoch is recomputed.
        self._epoch = 0
        self._reported: Counter[str] = Counter()
        self._job_ids = itertools.count(1)
        self._jobs: dict[int, _Job] = {}
        self._requests: dict[str, _Request] = {}
        self._plan = StepPlan()
        self._completers = {
            JobKind.STORE: self._complete_store,
            JobKind.SPILL: self._complete_spill,
            JobKind.PROMOTE: self._complete_promote,
            JobKind.LOAD: self._complete_load,
        }
        self._spill_queue: OrderedDict[bytes, None] = OrderedDict()
        self._promotions: dict[bytes, int] = {}  # key -> promote job in flight (any request)
        self._seen: OrderedDict[bytes, int] = OrderedDict()
        self._seen_limit = max(1024, 4 * (num_host_slots + num_disk_slots))
        if catalog is not None and self.disk is not None:
            aliases = getattr(catalog, "recovered_aliases", {}) or {}
            for key, slot in catalog.recovered.items():
                self.disk.restore(key, slot, aliases.get(key, ()))
            # A crash between a longer entry's journal record and the removal of the shorter
            # one it supersedes leaves both: keep the longer.
            for key in list(catalog.recovered):
                if key in self.disk and self.disk.covering(key):
                    self._drop_superseded(self.disk, key)
            dropped = getattr(catalog, "dropped_at_recovery", {}) or {}
            self.counters["dropped_at_recovery"] = sum(dropped.values())
            if catalog.recovered:
                logger.info("tieredkv: disk tier recovered %d chunks", len(catalog.recovered))

    # ------------------------------------------------------------------ requests

    def _request(self, req_id: str) -> _Request:
        state = self._requests.get(req_id)
        if state is None:
            state = self._requests[req_id] = _Request(req_id)
        return state

    def set_block_ids(self, req_id: str, block_ids: Sequence[int], replace: bool) -> None:
        """Track the request's device blocks (group 0), as the scheduler output reports them."""
        state = self._request(req_id)
        if replace:
            state.block_ids = list(block_ids)
        else:
            state.block_ids.extend(block_ids)

    # ------------------------------------------------------------------ lookups

    def lookup(
        self, req_id: str, keys: Sequence[bytes], num_computed_tokens: int, num_tokens: int
    ) -> int | None:
        """Tokens beyond ``num_computed_tokens`` that can be loaded from the host tier.

        Returns None while disk chunks of the hit are being promoted into host slots. Pins the
        promised host chunks until :meth:`on_alloc` turns them into a load (or they are let go).
        """
        state = self._request(req_id)
        cached = state.pending_hit
        if (
            cached is not None
            and cached.epoch == self._epoch
            and cached.start_token == num_computed_tokens
            and cached.num_tokens == num_tokens
        ):
            # Asked again in the same state: the pinned chunks cannot have gone anywhere.
            return cached.end_token - num_computed_tokens
        if cached is not None:
            self._release_hit(state)
        if state.load_job is not None:
            return 0
        limit = (num_tokens - 1) // self.block_size * self.block_size
        first = num_computed_tokens // self.chunk_tokens
        host_ready = self.host.is_ready
        disk_ready = self.disk.is_ready if self.disk is not None else None
        disk_chunks: list[bytes] = []
        pending = False
        last = min(len(keys), -(-limit // self.chunk_tokens))
        request_keys = keys  # the keys object (block keys too); ``keys`` may become its list
        materialize = getattr(keys, "materialize", None)
        head = materialize(first + 1) if materialize is not None and first < last else keys
        if first < last and host_ready(head[first]):  # one key derived to tell a miss
            # A hit: derive the keys in one batch, then scan the resident run in one loop.
            if materialize is not None:
                keys = materialize(last)
            resident = self.host.ready_prefix(keys, first, last)
            run = list(keys[first : first + resident])
        else:
            run = []
        i = first + len(run)
        promotions = self._promotions
        while i < last:
            key = keys[i]
            if host_ready(key):
                run.append(key)
            elif key in promotions:
                # Being promoted, for this request or another one sharing the prefix: wait.
                pending = True
                run.append(key)
            elif self.host.present(key):
                break  # being stored right now: not loadable yet, and not promotable
            elif disk_ready is not None and disk_ready(key):
                disk_chunks.append(key)
                run.append(key)
            else:
                break
            i += 1
        # The run of whole chunks ends at chunk i: the hit may go on into chunk i, up to the
        # last of its blocks some entry holds (this prompt's tail, or a chunk of another
        # prompt sharing these blocks).
        partial_key: bytes | None = None
        partial_blocks = 0
        if i * self.chunk_tokens < limit and getattr(request_keys, "block_granular", False):
            found = self._partial_source(request_keys, i, num_computed_tokens, limit)
            if found is not None:
                partial_key, kind, partial_blocks = found
                run.append(partial_key)
                if kind == "disk":
                    disk_chunks.append(partial_key)
                elif kind == "pending":
                    pending = True
        timed_out = False
        if state.promote_deadline or disk_chunks or pending:
            now = time.monotonic()
            timed_out = bool(state.promote_deadline) and now > state.promote_deadline
            if timed_out and (pending or disk_chunks):
                logger.warning("tieredkv: promotion for %s timed out; serving what is in memory",
                               req_id)
                state.promote_rounds = MAX_PROMOTE_ROUNDS
            if disk_chunks and state.promote_rounds < MAX_PROMOTE_ROUNDS:
                run = self._promote(state, run, disk_chunks)
            if not timed_out and any(key in promotions for key in run):
                if not state.promote_deadline:
                    state.promote_deadline = now + self.config.load_timeout_s
                return None
        if not state.looked_up:
            # Counted once per request, when it gets its answer (not each "ask me later").
            state.looked_up = True
            self.counters["lookups"] += 1
            self.counters["lookup_tokens"] += max(0, limit - num_computed_tokens)
        if disk_chunks or pending:
            # Only the leading READY host chunks can be promised.
            ready: list[bytes] = []
            for key in run:
                if not host_ready(key):
                    break
                ready.append(key)
        else:
            ready = run
        partial = partial_key is not None and bool(ready) and ready[-1] == partial_key
        if partial:
            end_block = (first + len(ready) - 1) * self.chunk_blocks + partial_blocks
        else:
            end_block = (first + len(ready)) * self.chunk_blocks
        end = min(end_block * self.block_size, limit)
        hit = max(0, end - num_computed_tokens)
        if hit == 0:
            return 0
        self.host.pin_all(ready)
        promoted = state.promoted_keys
        state.pending_hit = _PendingHit(
            num_computed_tokens, end, first, ready,
            disk_keys=promoted.intersection(ready) if promoted else set(),
            num_tokens=num_tokens, epoch=self._epoch, partial=partial,
        )
        return hit

    def _partial_source(
        self, keys, chunk: int, num_computed_tokens: int, limit: int
    ) -> tuple[bytes, str, int] | None:
        """The entry holding the most leading blocks of ``chunk`` of this request (fewer than
        a whole chunk), as ``(entry key, "host" | "pending" | "disk", blocks)``, or None.

        An entry holding block ``b`` holds every block of its chunk before ``b`` (chained
        hashes), so "some entry holds block b" is true for the first blocks of a chunk and
        false after. The first block this request could use answers a miss (one key, a dict
        probe per tier); the last one a repeated prompt (its own tail); a binary search
        between them anything else.
        """
        C, bs = self.chunk_blocks, self.block_size
        base = chunk * C
        hi = min(C - 1, limit // bs - base, keys.num_blocks - base)
        lo = num_computed_tokens // bs - base + 1
        if lo < 1:
            lo = 1
        if lo > hi:
            return None
        block_key = keys.block_key
        first_key = block_key(base + lo - 1)
        host, disk = self.host, self.disk
        if not host.holds(first_key) and (disk is None or not disk.holds(first_key)):
            return None
        source = self._block_source
        if hi > lo:
            key = block_key(base + hi - 1)
            holder = host.ready_holder(key)
            if holder is not None:
                return holder, "host", hi
            found = source(key, host_checked=True)
            if found is not None:
                return found[0], found[1], hi
        best = source(first_key)
        if best is None:
            return None
        good, bad = lo, hi
        while bad - good > 1:
            mid = (good + bad) // 2
            found = source(block_key(base + mid - 1))
            if found is None:
                bad = mid
            else:
                good, best = mid, found
        return best[0], best[1], good

    def _block_source(self, key: bytes, host_checked: bool = False) -> tuple[bytes, str] | None:
        """Where the block named ``key`` can come from: a READY host entry holding it (unless
        the caller just looked), one being promoted, or a READY disk entry to promote."""
        host = self.host
        if not host_checked:
            holder = host.ready_holder(key)
            if holder is not None:
                return holder, "host"
        promotions = self._promotions
        if promotions:
            for holder in host.holders(key):
                if holder in promotions:
                    return holder, "pending"
        disk = self.disk
        if disk is not None and disk.holds(key):
            for holder in disk.holders(key):
                if disk.is_ready(holder) and holder not in host and not host.is_doomed(holder):
                    return holder, "disk"
        return None

    def _promote(self, state: _Request, run: list[bytes], disk_chunks: list[bytes]) -> list[bytes]:
        """Queue disk -> host promotions for the disk chunks of a run; trims the run on a miss.

        The run's host-resident chunks are pinned meanwhile, so making room for chunk i never
        evicts chunk j < i of the same prefix.
        """
        resident = [key for key in run if self.host.is_ready(key)]
        for key in resident:
            self.host.pin(key)
        try:
            return self._promote_run(state, run, disk_chunks)
        finally:
            for key in resident:
                self.host.unpin(key)

    def _promote_run(self, state: _Request, run: list[bytes], disk_chunks: list[bytes]) -> list[bytes]:
        issued = False
        for pos, key in enumerate(run):
            if key not in disk_chunks:
                continue
            if key in self.host or self.host.is_doomed(key) or key in self._promotions:
                return run[:pos]  # never allocate a key twice; someone else holds it now
            disk_entry = self.disk.get(key)
            allocation = self.host.allocate(key, disk_entry.aliases)
            if allocation is None:
                self.counters["promote_no_host_slot"] += 1
                if issued:
                    state.promote_rounds += 1
                    state.promote_deadline = time.monotonic() + self.config.load_timeout_s
                return run[:pos]
            host_slot, evicted = allocation
            self._count_evictions("host", evicted)
            disk_slot = disk_entry.slot
            self.disk.pin(key)
            job_id = self._new_job(JobKind.PROMOTE, (key,), state.req_id)
            self._plan.promotes.append(PromoteJob(job_id, key, disk_slot, host_slot, req_id=state.req_id))
            self._promotions[key] = job_id
            state.promote_jobs.add(job_id)
            state.promoted_keys.add(key)
            issued = True
        if issued:
            state.promote_rounds += 1
            state.promote_deadline = time.monotonic() + self.config.load_timeout_s
        return run

    def _release_hit(self, state: _Request) -> None:
        hit = state.pending_hit
        if hit is None:
            return
        for key in hit.keys:
            self.host.unpin(key)
        state.pending_hit = None

    def on_alloc(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """vLLM allocated device blocks: turn the pending hit into a load job."""
        state = self._request(req_id)
        state.block_ids = list(block_ids)
        hit = state.pending_hit
        if hit is None or num_external_tokens <= 0:
            self._release_hit(state)
            return
        state.pending_hit = None
        start_block = hit.start_token // self.block_size
        end_block = (hit.start_token + num_external_tokens) // self.block_size
        chunks: list[LoadChunk] = []
        keep: list[bytes] = []
        for offset, key in enumerate(hit.keys):
            chunk = hit.first_chunk + offset
            lo = max(chunk * self.chunk_blocks, start_block)
            hi = min((chunk + 1) * self.chunk_blocks, end_block)
            if lo >= hi:
                self.host.unpin(key)
                continue
            keep.append(key)
            chunks.append(
                LoadChunk(
                    key=key,
                    host_slot=self.host.get(key).slot,
                    first_block=lo - chunk * self.chunk_blocks,
                    block_ids=tuple(block_ids[lo:hi]),
                )
            )
        if not chunks:
            return
        if hit.partial and keep[-1] == hit.keys[-1]:
            self.counters["partial_hits"] += 1  # a hit that ended inside a chunk
        job_id = self._new_job(JobKind.LOAD, tuple(keep), req_id)
        self._jobs[job_id].chunk_blocks = tuple(c.block_ids for c in chunks)
        self._plan.loads.append(LoadJob(job_id, req_id, tuple(chunks)))
        state.load_job = job_id
        tokens = end_block * self.block_size - hit.start_token
        disk_tokens = sum(
            len(c.block_ids) * self.block_size for c in chunks if c.key in hit.disk_keys
        )
        state.hit_tokens = {"disk": disk_tokens, "host": tokens - disk_tokens}
        self.counters["hit_tokens_host"] += tokens - disk_tokens
        self.counters["hit_tokens_disk"] += disk_tokens
        for key in keep:
            self.host.touch(key)
            self._note_seen(key)

    def hit_tokens(self, req_id: str) -> dict[str, int]:
        state = self._requests.get(req_id)
        return dict(state.hit_tokens) if state else {}

    # ------------------------------------------------------------------ stores

    def plan_stores(
        self, req_id: str, keys: Sequence[bytes], storable_tokens: int, tail: bool = False
    ) -> None:
        """Store every full chunk below ``storable_tokens`` not stored yet; with ``tail``, also
        the full blocks after the last full chunk, as an entry holding part of its chunk.

        ``tail`` is for the end of a prompt (and, with ``store_generated``, of a request):
        a tail stored on every step would be stored again each time it grows by a block.
        """
        state = self._request(req_id)
        C = self.chunk_blocks
        n_chunks = min(storable_tokens // self.chunk_tokens, len(keys))
        n_chunks = min(n_chunks, len(state.block_ids) // C)
        granular = getattr(keys, "block_granular", False)
        for chunk in range(state.next_store_chunk, n_chunks):
            key = keys[chunk]
            if key in self.host or self.host.is_doomed(key):
                # Another request computed the same prefix: it is hot, keep it resident.
                self.host.touch(key)
                self._note_seen(key)
                continue
            if self.disk is not None and (key in self.disk):
                self.disk.touch(key)
                self._note_seen(key)
                continue
            aliases = keys.block_keys(chunk * C, chunk * C + C - 1) if granular else ()  # type: ignore[attr-defined]
            self._store(state, key, aliases, state.block_ids[chunk * C : (chunk + 1) * C])
        state.next_store_chunk = max(state.next_store_chunk, n_chunks)
        if tail and granular and n_chunks == state.next_store_chunk:
            held = min(storable_tokens // self.block_size, len(state.block_ids),
                       keys.num_blocks)  # type: ignore[attr-defined]
            count = held - n_chunks * C
            if 0 < count < C:
                self._store_tail(state, keys, n_chunks, count)

    def _store_tail(self, state: _Request, keys, chunk: int, count: int) -> None:
        """Store the first ``count`` blocks of ``chunk`` unless an entry already holds them."""
        base = chunk * self.chunk_blocks
        key = keys.block_key(base + count - 1)
        for index in (self.host, self.disk):
            if index is None:
                continue
            if index.holds(key) or index.is_doomed(key):
                # Held already (this prompt's tail stored before, or a longer entry).
                for holder in index.holders(key):
                    index.touch(holder)
                self._note_seen(key)
                return
        self._store(state, key, keys.block_keys(base, base + count - 1),
                    state.block_ids[base : base + count])
        self.counters["stored_partial_chunks"] += 1

    def _store(self, state: _Request, key: bytes, aliases: tuple[bytes, ...],
               blocks: Sequence[int]) -> None:
        allocation = self.host.allocate(key, aliases)
        if allocation is None:
            self.counters["store_skipped_host_full"] += 1
            return
        slot, evicted = allocation
        self._count_evictions("host", evicted)
        blocks = tuple(blocks)
        job_id = self._new_job(JobKind.STORE, (key,), state.req_id)
        self._jobs[job_id].chunk_blocks = (blocks,)
        self._plan.stores.append(StoreJob(job_id, key, slot, blocks, req_id=state.req_id))
        state.store_jobs.add(job_id)
        self._note_seen(key)

    def finish_tail(self, req_id: str, keys: Sequence[bytes], storable_tokens: int) -> None:
        """A request finished normally: store what its last steps computed (generated text
        included, with ``store_generated``) before its blocks are freed. Not for a request
        whose blocks are gone (preempted) or still being loaded into."""
        state = self._requests.get(req_id)
        if state is None or state.load_job is not None or not state.block_ids:
            return
        self.plan_stores(req_id, keys, storable_tokens, tail=True)

    # ------------------------------------------------------------------ lifecycle

    def preempted(self, req_id: str) -> None:
        """vLLM freed the request's blocks: fence in-flight stores that read them."""
        state = self._requests.get(req_id)
        self.counters["preemptions"] += 1
        if state is None:
            return
        for job_id in state.store_jobs:
            for blocks in self._jobs[job_id].chunk_blocks:
                self._plan.fence_block_ids.extend(blocks)
        state.block_ids = []

    def finished(self, req_id: str) -> bool:
        """The request finished; True when its blocks must wait for in-flight stores."""
        state = self._requests.get(req_id)
        if state is None:
            return False
        self._release_hit(state)
        state.finished = True
        if state.load_job is not None:
            # vLLM frees blocks of a request aborted during its load itself, later.
            self._maybe_forget(state)
            return False
        if state.store_jobs:
            self._plan.delayed_req_ids.append(req_id)
            return True
        self._maybe_forget(state)
        return False

    def _maybe_forget(self, state: _Request) -> None:
        if state.finished and not (state.store_jobs or state.promote_jobs or state.load_job):
            self._requests.pop(state.req_id, None)

    def reset(self) -> None:
        """Empty both tiers (weights changed or an operator asked); safe with jobs in flight."""
        for state in self._requests.values():
            self._release_hit(state)
            state.next_store_chunk = 0
        self._epoch += 1
        self.host.clear()
        if self.disk is not None:
            self.disk.clear()
        if self.catalog is not None:
            self.catalog.record_cleared()
        self._spill_queue.clear()
        self._seen.clear()
        self.counters["resets"] += 1
        logger.info("tieredkv: cache reset: both tiers emptied")

    # ------------------------------------------------------------------ steps

    def take_plan(self) -> StepPlan:
        """This step's jobs; queued spills get their disk slots now."""
        self._plan_spills()
        plan, self._plan = self._plan, StepPlan()
        return plan

    def _plan_spills(self) -> None:
        if self.disk is None:
            self._spill_queue.clear()
            return
        while self._spill_queue:
            key, _ = self._spill_queue.popitem(last=False)
            if not self.host.is_ready(key) or self.disk.holds(key) or self.disk.is_doomed(key):
                continue  # on disk already (or a longer entry there holds its blocks)
            placement = self.host.get(key)
            assert placement is not None
            allocation = self.disk.allocate(key, placement.aliases)
            if allocation is None:
                self.counters["spill_skipped_disk_full"] += 1
                continue
            disk_slot, evicted = allocation
            self._count_evictions("disk", evicted)
            for old_key, _slot in evicted:
                if self.catalog is not None:
                    self.catalog.record_removed(old_key)
            self.host.pin(key)
            job_id = self._new_job(JobKind.SPILL, (key,), None)
            # The slot header lists the entry's block keys, so a restart finds them again
            # (beyond what one header page holds, only the entry's own key survives it).
            header_aliases = placement.aliases if len(placement.aliases) <= MAX_HEADER_ALIASES else ()
            self._plan.spills.append(
                SpillJob(job_id, key, placement.slot, disk_slot, aliases=header_aliases)
            )

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
            self._completers[job.kind](job_id, job, job.outcome)

    def _complete_store(self, job_id: int, job: _Job, outcome: JobResult) -> None:
        (key,) = job.keys
        if outcome.failed:
            self.host.abort(key)
            self.counters[f"store_failed_{outcome.failure or 'unknown'}"] += 1
        elif self.host.mark_ready(key):
            self.counters["stored_chunks"] += 1
            if self._settle(self.host, key) and self._admit_to_disk(key):
                self._spill_queue[key] = None
        self._detach(job_id, job)

    def _complete_spill(self, job_id: int, job: _Job, outcome: JobResult) -> None:
        (key,) = job.keys
        self.host.unpin(key)
        assert self.disk is not None
        if outcome.failed:
            self.disk.abort(key)
            self.counters[f"spill_failed_{outcome.failure or 'unknown'}"] += 1
            return
        slot = self.disk.get(key)
        if self.disk.mark_ready(key):
            self.counters["spilled_chunks"] += 1
            if self.disk.covering(key):
                # A longer entry reached the disk first: this one is redundant there.
                self.disk.remove(key)
                self.counters["superseded_disk"] += 1
                return
            if self.catalog is not None and slot is not None:
                self.catalog.record_written(key, slot.slot)
            self._settle(self.disk, key)

    def _complete_promote(self, job_id: int, job: _Job, outcome: JobResult) -> None:
        (key,) = job.keys
        if self._promotions.get(key) == job_id:
            del self._promotions[key]
        assert self.disk is not None
        self.disk.unpin(key)
        if outcome.failed:
            self.host.abort(key)
            self._drop_disk(key, outcome.failure)
        elif self.host.mark_ready(key):
            self.counters["promoted_chunks"] += 1
            self._settle(self.host, key)
        self._detach(job_id, job)

    def _complete_load(self, job_id: int, job: _Job, outcome: JobResult) -> None:
        failed_blocks = set(outcome.failed_block_ids)
        if outcome.failed:
            self.counters[f"load_failed_{outcome.failure or 'unknown'}"] += 1  # per load
        for key, blocks in zip(job.keys, job.chunk_blocks, strict=True):
            self.host.unpin(key)
            if outcome.failed and failed_blocks.intersection(blocks):
                self.host.remove(key)
                self._epoch += 1
                self.counters["chunks_dropped_by_failed_loads"] += 1
        self._detach(job_id, job)

    def _detach(self, job_id: int, job: _Job) -> None:
        state = self._requests.get(job.req_id) if job.req_id else None
        if state is None:
            return
        state.store_jobs.discard(job_id)
        state.promote_jobs.discard(job_id)
        if state.load_job == job_id:
            state.load_job = None
        self._maybe_forget(state)

    def _settle(self, index: TierIndex, key: bytes) -> bool:
        """``key`` just became READY in ``index``: keep one copy of its blocks in this tier.

        A longer READY entry holding all of its blocks makes it redundant (dropped, False);
        otherwise the shorter entries whose blocks it holds are dropped (a prompt's tail that
        grew: the next turn of a chat stored the whole chunk or a longer tail). A dropped
        entry still being read keeps its slot until the read ends (doomed). True: kept.
        """
        if index.covering(key):
            self._drop_superseded(index, key)
            return False
        placement = index.get(key)
        if placement is not None:
            for alias in placement.aliases:
                if alias in index:
                    self._drop_superseded(index, alias)
        return True

    def _drop_superseded(self, index: TierIndex, key: bytes) -> None:
        placement = index.get(key)
        if placement is None:
            return
        index.remove(key)
        if index is self.host:
            if placement.pins:
                self._epoch += 1  # a cached pending hit may name it: recompute that hit
            self.counters["superseded_host"] += 1
        else:
            if self.catalog is not None:
                self.catalog.record_removed(key)
            self.counters["superseded_disk"] += 1

    def _drop_disk(self, key: bytes, failure: str | None) -> None:
        assert self.disk is not None
        self.disk.remove(key)
        if self.catalog is not None:
            self.catalog.record_removed(key)
        self.counters[f"disk_read_failed_{failure or 'unknown'}"] += 1

    # ------------------------------------------------------------------ helpers

    def _new_job(self, kind: JobKind, keys: tuple[bytes, ...], req_id: str | None) -> int:
        job_id = next(self._job_ids)
        self._jobs[job_id] = _Job(kind, keys, req_id, remaining=self.world_size)
        return job_id

    def _count_evictions(self, tier: str, evicted: Iterable[tuple[bytes, int]]) -> None:
        for _ in evicted:
            self.counters[f"evictions_{tier}"] += 1

    def _note_seen(self, key: bytes) -> None:
        count = self._seen.pop(key, 0) + 1
        self._seen[key] = count
        while len(self._seen) > self._seen_limit:
            self._seen.popitem(last=False)
        if (
            self.disk is not None
            and count >= self.config.disk_admission
            and self.host.is_ready(key)
            and key not in self.disk
        ):
            self._spill_queue[key] = None

    def _admit_to_disk(self, key: bytes) -> bool:
        if self.disk is None:
            return False
        if self._seen.get(key, 0) >= self.config.disk_admission:
            return True
        self.counters["disk_admission_rejected"] += 1
        return False

    def take_counter_deltas(self) -> dict[str, int]:
        """Counter increments since the last call (vLLM's stats path carries deltas)."""
        deltas = {k: v - self._reported.get(k, 0) for k, v in self.counters.items()}
        self._reported = Counter(self.counters)
        return {k: v for k, v in deltas.items() if v}

    def gauges(self) -> dict[str, int]:
        """Current occupancy, for usage-vs-capacity panels."""
        disk = self.disk
        return {
            "host_slots_capacity": self.host.num_slots,
            "host_slots_used": self.host.used_slots,
            "host_slots_pinned": self.host.pinned_count,
            "host_entries": len(self.host),
            "disk_slots_capacity": disk.num_slots if disk else 0,
            "disk_slots_used": disk.used_slots if disk else 0,
            "disk_entries": len(disk) if disk else 0,
            "requests_waiting_on_load": sum(
                1 for r in self._requests.values() if r.load_job is not None or r.promote_jobs
            ),
            "jobs_in_flight": len(self._jobs),
        }

    @property
    def pending_jobs(self) -> int:
        return len(self._jobs)

    def has_pending_work(self) -> bool:
        return bool(self._jobs or self._spill_queue)
