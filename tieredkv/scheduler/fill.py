"""One way to fill a host slot from below: chunks of a tier below host (a disk promotion, a
remote read) read into host slots, verified on the workers, and only then promised.

A lookup's run of chunks may need some from disk and, past host and disk, some from the
shared remote tier. Both go through :meth:`Fill.plan`, one loop: chunk by chunk it takes a
host slot (WRITING), issues one job from the tier's own hook
(:meth:`~tieredkv.scheduler.lower_tier.LowerTier.plan_fill`: disk pins its entry, the remote
tier reads what every rank's probe found) and marks the key in flight, so that every request
sharing the prefix waits for it; the run is cut where a chunk cannot get a host slot or
someone else holds it. :meth:`Fill.complete` is the one completion: once every rank reported,
the tier's hook (disk: unpin, and drop an entry that failed; remote: keep or forget the hint),
then the host entry READY (one copy kept), or aborted and counted by cause.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from tieredkv.metrics.specs import READ_FAILED, Count
from tieredkv.protocol import FailureCause, JobKind, JobResult, Tier
from tieredkv.scheduler.ledger import JobRecord, PlannerParts
from tieredkv.scheduler.lower_tier import LowerTier
from tieredkv.scheduler.placement import Placer, count_evictions
from tieredkv.scheduler.requests import RequestState


class Fill:
    """Plans and completes the reads of lower-tier chunks into host slots (one thread)."""

    def __init__(self, parts: PlannerParts, placer: Placer) -> None:
        self.host = parts.host
        self.lower = parts.lower
        self.remote = parts.remote
        self.counters = parts.counters
        self.chunk_blocks = parts.config.chunk_blocks
        self.load_timeout_s = parts.config.load_timeout_s
        self._ledger = parts.ledger
        self._placer = placer
        self._tiers: dict[JobKind, LowerTier] = {
            tier.fill_kind: tier for tier in (parts.lower, parts.remote) if tier is not None
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
        first: int, request_keys: Sequence[bytes],
    ) -> list[bytes]:
        """Bring the ``wanted`` chunks of ``run`` into host slots from ``tier``; the run is cut
        at the first one that cannot get a slot or that someone else holds now."""
        host, C = self.host, self.chunk_blocks
        issued = False
        for pos, key in enumerate(run):
            if key not in wanted:
                continue
            if key in host or host.is_doomed(key) or key in self.in_flight:
                run = run[:pos]  # never allocate a key twice; someone else holds it now
                break
            aliases = tier.fill_aliases(key)
            if aliases is None:
                chunk = first + pos
                aliases = (request_keys.block_keys(chunk * C, chunk * C + C - 1)  # type: ignore[attr-defined]
                           if getattr(request_keys, "block_granular", False) else ())
            allocation = host.allocate(key, aliases)
            if allocation is None:
                self.counters[Count.PROMOTE_NO_HOST_SLOT] += 1
                run = run[:pos]
                break
            host_slot, evicted = allocation
            count_evictions(self.counters, Tier.HOST, evicted)
            job_id = self._ledger.issue(tier.fill_kind, (key,), state.req_id)
            tier.plan_fill(self._ledger.plan, job_id, key, host_slot, state.req_id)
            self.in_flight[key] = job_id
            state.promote_jobs.add(job_id)
            state.filled[key] = tier.name
            issued = True
        if issued:
            state.promote_rounds += 1
            state.promote_deadline = time.monotonic() + self.load_timeout_s
        return run

    def complete(self, job: JobRecord, outcome: JobResult) -> None:
        """Every rank reported a fill: the chunk is READY in host, or dropped and counted."""
        (key,) = job.keys
        if self.in_flight.get(key) == job.job_id:
            del self.in_flight[key]
        tier = self._tiers[job.kind]
        tier.fill_done(key, not outcome.failed)
        if outcome.failed:
            self.host.abort(key)
            self.counters[READ_FAILED[tier.name], outcome.failure or FailureCause.UNKNOWN] += 1
        elif self.host.mark_ready(key):
            self.counters[tier.fill_counter] += 1
            self._placer.keep_one_copy(self.host, key)
