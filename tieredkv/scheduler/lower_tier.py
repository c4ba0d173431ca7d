"""The tiers below host, as the planner sees them: the fill hooks each implements, the disk
tier's index, and the one fill loop that calls the hooks.

Two tiers lie below host, and a chunk of either is used the same way: read back into a host
slot, verified on the workers, and only then promised (the fill path, :class:`Fill`, below).
Both implement :class:`LowerTier`, the few hooks that path calls where the two differ:

* **disk** (:class:`DiskTier`) is owned by this scheduler: an index of its slots (a
  :class:`~tieredkv.scheduler.tier_index.TierIndex`, same rules as the host's), spilled into
  from READY host entries, journaled so that it survives a restart, admitted by sightings. A
  read pins the disk entry; a failed one drops it. The workers verify each slot's header.
* **remote** (:class:`~tieredkv.scheduler.remote_tier.RemoteTier`, Redis/Valkey) is shared:
  other replicas write it and Redis evicts at any moment, so the scheduler keeps no index of
  it, only hints, and a probe decides what a lookup may read (every rank must hold the chunk).
  It is written from host (remote writes), never spilled into.

So the planner has one *indexed* tier below host (``Planner.lower``, a :class:`DiskTier`: a
test may plug in another one under another name) and, optionally, the remote tier beside it.

**The fill path** (:class:`Fill`), the one way to fill a host slot from below: chunks of a
tier below host (a disk promotion, a remote read) read into host slots, verified on the
workers, and only then promised.

A lookup's run of chunks may need some from disk and, past host and disk, some from the
shared remote tier. Both go through :meth:`Fill.plan`, one loop: chunk by chunk it takes a
host slot (WRITING), issues one job from the tier's own hook (:meth:`LowerTier.plan_fill`:
disk pins its entry, the remote tier reads what every rank's probe found) and marks the key
in flight, so that every request sharing the prefix waits for it; the run is cut where a
chunk cannot get a host slot or someone else holds it. :meth:`Fill.complete` is the one completion: once every rank reported,
the tier's hook (disk: unpin, and drop an entry that failed; remote: keep or forget the hint),
then the host entry READY (one copy kept), or aborted and counted by cause.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence

from tieredkv.disk import aliases_kept
from tieredkv.metrics.specs import READ_FAILED, Count, Counts
from tieredkv.protocol import FailureCause, Job, JobResult, Move, StepPlan, Tier
from tieredkv.scheduler.ledger import JobRecord, PlannerParts, RequestState
from tieredkv.scheduler.placement import Placer, count_evictions
from tieredkv.scheduler.tier_index import TierIndex

logger = logging.getLogger(__name__)

# Where a block of a hit comes from (see Fill.block_source).
HOST, PENDING, LOWER = Tier.HOST, "pending", "lower"


class LowerTier(ABC):
    """A tier below host that host slots are filled from: the fill path's per-tier hooks."""

    #: Names the tier in counters (``<name>_read_failed_<cause>``, ``hit_tokens_<name>``, ...)
    #: and in a request's hit sources.
    name: str
    #: The move a fill from this tier is (its completion comes back under it).
    fill_move: Move
    #: The counter of chunks this tier filled into host slots.
    fill_counter: Count

    @abstractmethod
    def fill_aliases(self, key: bytes) -> tuple[bytes, ...] | None:
        """The aliases the host entry filled from ``key`` carries; None: the request's own
        block keys of that chunk (the tier keeps none)."""

    def fill_blocks(self, key: bytes) -> int | None:
        """Blocks of its chunk the entry ``key`` holds when fewer than a chunk (a prompt's
        tail); None: a whole chunk, or the tier's own aliases say (:meth:`fill_aliases`)."""
        return None

    @abstractmethod
    def plan_fill(self, plan: StepPlan, job_id: int, key: bytes, host_slot: int,
                  req_id: str) -> None:
        """Add the job reading ``key`` into ``host_slot`` to this step's ``plan``."""

    @abstractmethod
    def fill_done(self, key: bytes, ok: bool) -> None:
        """Every rank reported the fill of ``key`` (``ok``: verified in every host slot)."""


class Sightings:
    """Admission by sightings (``disk_admission``, ``remote_admission``): a bounded LRU of
    per-key counts; a key seen ``admission`` times (stored, found stored, loaded) is admitted."""

    def __init__(self, admission: int, limit: int) -> None:
        if admission < 1 or limit < 1:
            raise ValueError("sightings: admission and limit must be >= 1")
        self.admission = admission
        self._limit = limit
        self._seen: OrderedDict[bytes, int] = OrderedDict()

    def note(self, key: bytes) -> bool:
        """Count a sighting; True when ``key`` has now been seen often enough."""
        seen = self._seen
        count = seen.pop(key, 0) + 1
        seen[key] = count
        while len(seen) > self._limit:
            seen.popitem(last=False)
        return count >= self.admission

    def admits(self, key: bytes) -> bool:
        return self._seen.get(key, 0) >= self.admission

    def clear(self) -> None:
        self._seen.clear()


class DiskTier(TierIndex, LowerTier):
    """The indexed tier below host: ``num_slots`` disk slots (per rank), journaled by
    ``catalog`` when there is one, admitted by sightings.

    It is the index itself (no forwarding); what it adds: records (an entry is journaled
    written once its spill is done and kept, removed whenever it goes; a reset journals the
    whole tier cleared; start-up restores what the catalog recovered), admission, and the
    fill hooks (a read pins the entry; one that failed drops it, never promised again).
    """

    name = Tier.DISK
    fill_move = Move.PROMOTE
    fill_counter = Count.PROMOTED_CHUNKS

    def __init__(self, num_slots: int, *, policy: str, admission: int, seen_limit: int,
                 catalog=None, supersedes: bool = True) -> None:
        super().__init__(self.name, num_slots, policy)
        self.catalog = catalog
        # False for hybrid models: a shorter entry beside a longer one is kept (it holds the
        # sliding window before its own end, which the longer one lacks).
        self.supersedes = supersedes
        self._sightings = Sightings(admission, seen_limit)
        # What start-up found, for the planner's counters.
        self.recovery_counts = Counts()
        if catalog is not None:
            self._recover(catalog)

    def _recover(self, catalog) -> None:
        aliases = getattr(catalog, "recovered_aliases", {}) or {}
        for key, slot in catalog.recovered.items():
            self.restore(key, slot, aliases.get(key, ()))
        # A crash between a longer entry's journal record and the removal of the shorter one
        # it supersedes leaves both: keep the longer.
        for key in list(catalog.recovered) if self.supersedes else ():
            if key in self and self.covering(key):
                self.remove(key)
                self.recovery_counts[Count.SUPERSEDED, Tier.DISK] += 1
        dropped = getattr(catalog, "dropped_at_recovery", {}) or {}
        self.recovery_counts[Count.DROPPED_AT_RECOVERY] = sum(dropped.values())
        if catalog.recovered:
            logger.info("tieredkv: disk tier recovered %d chunks", len(catalog.recovered))

    # ------------------------------------------------------------------ the index, recorded

    def allocate(
        self, key: bytes, aliases: tuple[bytes, ...] = ()
    ) -> tuple[int, list[tuple[bytes, int]]] | None:
        """:meth:`TierIndex.allocate`; the entries it evicts are recorded removed."""
        allocation = super().allocate(key, aliases)
        if allocation is not None and self.catalog is not None:
            for old_key, _slot in allocation[1]:
                self.catalog.record_removed(old_key)
        return allocation

    def remove(self, key: bytes, *, recorded: bool = True) -> int | None:
        """:meth:`TierIndex.remove`. ``recorded``: it may have been recorded written, so its
        removal is recorded too; False for an entry that never was (nothing to forget)."""
        slot = super().remove(key)
        if recorded and self.catalog is not None:
            self.catalog.record_removed(key)
        return slot

    def clear(self) -> list[tuple[bytes, int]]:
        """Drop every entry and every record (a cache reset), durably before returning: the
        entries are stale now, yet a restart would verify their slots (the catalog logs an
        error, and makes the next start empty, when the journal cannot be reset)."""
        catalog, self.catalog = self.catalog, None  # no record per entry removed
        try:
            dropped = super().clear()
        finally:
            self.catalog = catalog
        if catalog is not None:
            catalog.record_cleared()
        self._sightings.clear()
        return dropped

    def record_written(self, key: bytes) -> None:
        """The READY entry ``key`` is kept: record it (so that it survives a restart)."""
        placement = self.get(key)
        if self.catalog is not None and placement is not None:
            self.catalog.record_written(key, placement.slot)

    @staticmethod
    def kept_aliases(aliases: tuple[bytes, ...]) -> tuple[bytes, ...]:
        """The aliases a copy written here keeps (beyond them only its own key survives a
        restart): the disk package says what one slot's header lists."""
        return aliases_kept(aliases)

    # ------------------------------------------------------------------ admission

    def note_seen(self, key: bytes) -> bool:
        """Count a sighting of ``key``; True when it may now be spilled here."""
        return self._sightings.note(key)

    def admits(self, key: bytes) -> bool:
        """Whether ``key``, just stored in host, should be spilled here now."""
        return self._sightings.admits(key)

    # ------------------------------------------------------------------ fills

    def fill_aliases(self, key: bytes) -> tuple[bytes, ...]:
        entry = self.get(key)
        assert entry is not None
        return entry.aliases

    def plan_fill(self, plan: StepPlan, job_id: int, key: bytes, host_slot: int,
                  req_id: str) -> None:
        entry = self.get(key)
        assert entry is not None
        self.pin(key)
        plan.jobs.append(Job.promote(job_id, key, entry.slot, host_slot, req_id=req_id))

    def fill_done(self, key: bytes, ok: bool) -> None:
        self.unpin(key)
        if not ok:
            self.remove(key)  # nothing that failed is ever promised again

    # ------------------------------------------------------------------ capacity

    def gauges(self) -> dict[str, int]:
        """Capacity and occupancy (``<name>_slots_capacity``, ``<name>_slots_used``,
        ``<name>_entries``)."""
        name = self.name
        return {
            f"{name}_slots_capacity": self.num_slots,
            f"{name}_slots_used": self.used_slots,
            f"{name}_entries": len(self),
        }


class Fill:
    """Plans and completes the reads of lower-tier chunks into host slots (one thread)."""

    def __init__(self, parts: PlannerParts, placer: Placer) -> None:
        self.host = parts.host
        self.lower = parts.lower
        self.remote = parts.remote
        self.counters = parts.counters
        self.chunk_blocks = parts.config.chunk_blocks
        self.block_size = parts.block_size
        self.load_timeout_s = parts.config.load_timeout_s
        self._ledger = parts.ledger
        self._placer = placer
        self._cost = parts.cost
        self._tiers: dict[Move, LowerTier] = {
            tier.fill_move: tier for tier in (parts.lower, parts.remote) if tier is not None
        }
        # key -> its fill job in flight (any request, any tier): whoever finds it here waits.
        self.in_flight: dict[bytes, int] = {}

    def fill_run(
        self, state: RequestState, run: list[bytes], lower_chunks: list[bytes],
        remote_chunks: list[bytes], remote_pos: int, first: int, request_keys: Sequence[bytes],
    ) -> list[bytes]:
        """Fill a lookup's run (chunk ``first`` on): its ``lower_chunks`` from the indexed tier,
        then ``remote_chunks`` (``run[remote_pos:]``) from the remote tier if nothing before
        them was cut. Returns the run, cut where a chunk cannot get a host slot.

        The run's host-resident chunks are pinned meanwhile, so making room for chunk i never
        evicts chunk j < i of the same prefix.
        """
        resident = [key for key in run if self.host.is_ready(key)]
        for key in resident:
            self.host.pin(key)
        try:
            if lower_chunks:
                assert self.lower is not None
                run = self.plan(state, self.lower, run, set(lower_chunks), first, request_keys)
            if remote_chunks and len(run) == remote_pos + len(remote_chunks):
                assert self.remote is not None
                run = self.plan(state, self.remote, run, set(remote_chunks), first, request_keys)
            elif remote_chunks:
                run = run[: min(len(run), remote_pos)]  # a hole before them: they cannot serve
            return run
        finally:
            for key in resident:
                self.host.unpin(key)

    def plan(
        self, state: RequestState, tier: LowerTier, run: list[bytes], wanted: set[bytes],
        first: int, request_keys: Sequence[bytes], background: bool = False,
    ) -> list[bytes]:
        """Bring the ``wanted`` chunks of ``run`` into host slots from ``tier``; the run is cut
        at the first one that cannot get a slot or that someone else holds now.
        ``background``: no request waits for these (an exploration of a declined tier)."""
        host, C = self.host, self.chunk_blocks
        issued: list[int] = []
        for pos, key in enumerate(run):
            if key not in wanted:
                continue
            if key in host or host.is_doomed(key) or key in self.in_flight:
                run = run[:pos]  # never allocate a key twice; someone else holds it now
                break
            aliases = tier.fill_aliases(key)
            if aliases is None:
                chunk = first + pos
                blocks = tier.fill_blocks(key) or C
                aliases = (request_keys.block_keys(chunk * C, chunk * C + blocks - 1)  # type: ignore[attr-defined]
                           if getattr(request_keys, "block_granular", False) else ())
            allocation = host.allocate(key, aliases)
            if allocation is None:
                self.counters[Count.PROMOTE_NO_HOST_SLOT] += 1
                run = run[:pos]
                break
            host_slot, evicted = allocation
            count_evictions(self.counters, Tier.HOST, evicted)
            job_id = self._ledger.issue(tier.fill_move, (key,), state.req_id)
            tier.plan_fill(self._ledger.plan, job_id, key, host_slot, state.req_id)
            self.in_flight[key] = job_id
            state.promote_jobs.add(job_id)
            state.filled[key] = tier.name
            issued.append(job_id)
        if issued:
            if self._cost is not None:
                self._cost.fills_started(tier.name, issued, background)  # one round, timed
            state.promote_rounds += 1
            state.promote_deadline = time.monotonic() + self.load_timeout_s
        return run

    # ------------------------------------------------------------------ sources of a partial chunk

    def usable_blocks(
        self, keys, chunk: int, num_computed_tokens: int, limit: int
    ) -> tuple[int, int, int, bytes] | None:
        """``(base, lo, hi, first key)``: the blocks ``lo..hi`` of ``chunk`` a partial hit of
        this request could end after (past what it computed, before ``limit`` and the chunk's
        end), when some tier holds the first of them; None when no entry can serve (a miss
        costs one key and a dict probe per tier: the caller asks this first, and
        :meth:`partial_source` or :meth:`tail_entry` only with its answer)."""
        C, bs = self.chunk_blocks, self.block_size
        base = chunk * C
        hi = min(C - 1, limit // bs - base, keys.num_blocks - base)
        lo = max(1, num_computed_tokens // bs - base + 1)
        if lo > hi:
            return None
        first_key = keys.block_key(base + lo - 1)
        lower = self.lower
        if not self.host.holds(first_key) and (lower is None or not lower.holds(first_key)):
            return None
        return base, lo, hi, first_key

    def partial_source(
        self, keys, span: tuple[int, int, int, bytes]
    ) -> tuple[bytes, str, int] | None:
        """The entry holding the most leading blocks of ``chunk`` of this request (fewer than
        a whole chunk), as ``(entry key, HOST | PENDING | LOWER, blocks)``, or None.

        An entry holding block ``b`` holds every block of its chunk before ``b`` (chained
        hashes), so "some entry holds block b" is true for the first blocks of a chunk and
        false after. The first block this request could use answers a miss (one key, a dict
        probe per tier); the last one a repeated prompt (its own tail); a binary search
        between them anything else. ``span``: :meth:`usable_blocks`'s answer.
        """
        base, lo, hi, first_key = span
        block_key = keys.block_key
        host = self.host
        source = self.block_source
        if hi > lo:
            key = block_key(base + hi - 1)
            holder = host.ready_holder(key)
            if holder is not None:
                return holder, HOST, hi
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

    def tail_entry(
        self, keys, span: tuple[int, int, int, bytes]
    ) -> tuple[bytes, str, int] | None:
        """Hybrid models: the longest prompt's tail stored in ``chunk`` of this request that
        ends by ``limit`` and past ``num_computed_tokens``, as ``(key, HOST | PENDING | LOWER,
        blocks)``, or None. Only an entry's own end serves a hit (its sliding rows end there),
        so each end is probed. ``span``: :meth:`usable_blocks`'s answer."""
        base, lo, hi, _ = span
        host, lower = self.host, self.lower
        for n in range(hi, lo - 1, -1):
            key = keys.block_key(base + n - 1)
            for tier, kind in ((host, HOST), (lower, LOWER)):
                placement = tier.get(key) if tier is not None else None
                if placement is None or placement.blocks != n:
                    continue  # not a tail of exactly n blocks (or its length was lost)
                if tier is host and host.is_ready(key):
                    return key, HOST, n
                if tier is host and key in self.in_flight:
                    return key, PENDING, n
                if kind == LOWER and tier.is_ready(key) and key not in host and not host.is_doomed(key):
                    return key, LOWER, n
        return None

    def block_source(self, key: bytes, host_checked: bool = False) -> tuple[bytes, str] | None:
        """Where the block named ``key`` can come from: a READY host entry holding it (unless
        the caller just looked), one being promoted, or a READY lower-tier entry to promote."""
        host = self.host
        if not host_checked:
            holder = host.ready_holder(key)
            if holder is not None:
                return holder, HOST
        in_flight = self.in_flight
        if in_flight:
            for holder in host.holders(key):
                if holder in in_flight:
                    return holder, PENDING
        lower = self.lower
        if lower is not None and lower.holds(key):
            for holder in lower.holders(key):
                if lower.is_ready(holder) and holder not in host and not host.is_doomed(holder):
                    return holder, LOWER
        return None

    def complete(self, job: JobRecord, outcome: JobResult) -> None:
        """Every rank reported a fill: the chunk is READY in host, or dropped and counted."""
        (key,) = job.keys
        if self._cost is not None:
            self._cost.fill_done(job.job_id, outcome.seconds)
        if self.in_flight.get(key) == job.job_id:
            del self.in_flight[key]
        tier = self._tiers[job.move]
        tier.fill_done(key, not outcome.failed)
        if outcome.failed:
            self.host.abort(key)
            if self.host.listener is not None:  # KV events: that tier does not serve it
                self.host.listener.entry_gone(tier.name, key)
            self.counters[READ_FAILED[tier.name], outcome.failure or FailureCause.UNKNOWN] += 1
        elif self.host.mark_ready(key):
            self.counters[tier.fill_counter] += 1
            self._placer.keep_one_copy(self.host, key)
