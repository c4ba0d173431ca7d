"""Store jobs (d2h): device blocks -> one host slot, batched on the d2h copy lane.

A store reads device blocks that vLLM may hand to another request as soon as it is told the
store is under way, so every store has a :class:`StoreTicket` from submit to result: a fence
(``TransferEngine.fence_blocks``, before a forward reuses blocks) cancels a store whose copy
has not started and waits for one that is running. Tickets share the engine's lock, since the
engine registers and settles them together with its own record of pending jobs.

Stores run as coroutines on the engine's event loop, which awaits the lane: the lane thread
batches whatever stores queued up while its previous batch ran.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from tieredkv.protocol import Direction, FailureCause, JobResult, StoreJob
from tieredkv.transfer.backends.base import check_pairs, real_blocks, split_holes
from tieredkv.transfer.host_pool import HostPool, SlotGuard
from tieredkv.transfer.kv_views import KVViews
from tieredkv.transfer.lanes import CopyLane, CopyRequest
from tieredkv.transfer.transfer_stats import Finish, TransferStats

logger = logging.getLogger(__name__)

# Store ticket states (guarded by the engine lock).
QUEUED, RUNNING, DONE, CANCELLED = "queued", "running", "done", "cancelled"

@dataclass(eq=False)
class StoreTicket:
    """What a fence needs to know about a store, from submit to result."""

    seq: int
    job: StoreJob
    mark: Any  # compute-stream event the copy waits for (CUDA) or None
    state: str = QUEUED
    late: bool = False  # a fence gave up waiting: the blocks may have been reused mid-copy
    copied: threading.Event = field(default_factory=threading.Event)


class StoreJobs:
    """Runs stores on the d2h lane and keeps their tickets for fences."""

    def __init__(self, kv: KVViews, host: HostPool, guard: SlotGuard, stats: TransferStats,
                 lock: threading.Lock, finish: Finish) -> None:
        self.kv = kv
        self.host = host
        self.chunk_blocks = kv.chunk_blocks_for(host.payload_bytes)
        self._guard = guard
        self._stats = stats
        self._lock = lock  # the engine's lock
        self._finish = finish
        self._tickets: dict[int, StoreTicket] = {}
        self._block_tickets: dict[int, set[int]] = {}
        self._lane: CopyLane | None = None

    def start(self, lane: CopyLane) -> None:
        """The d2h lane is up (the engine's event loop thread, before any store runs)."""
        self._lane = lane

    # ------------------------------------------------------------------ tickets (engine lock held)

    def add_locked(self, seq: int, job: StoreJob, mark: Any) -> StoreTicket:
        """A store was submitted: from now on a fence on its blocks sees it."""
        ticket = StoreTicket(seq, job, mark)
        self._tickets[seq] = ticket
        for block in real_blocks(job.block_ids):
            self._block_tickets.setdefault(block, set()).add(seq)
        return ticket

    def settle_locked(self, seq: int) -> None:
        """The store has its result: nothing waits on its blocks any more."""
        ticket = self._tickets.pop(seq, None)
        if ticket is not None:
            self._unregister(ticket)
            ticket.copied.set()

    def cancel_queued_locked(self) -> None:
        """Shut down or dead: no store that has not started copying will start."""
        for ticket in self._tickets.values():
            if ticket.state == QUEUED:
                ticket.state = CANCELLED
                self._unregister(ticket)
                ticket.copied.set()

    def _unregister(self, ticket: StoreTicket) -> None:
        for block in real_blocks(ticket.job.block_ids):
            seqs = self._block_tickets.get(block)
            if seqs is not None:
                seqs.discard(ticket.seq)
                if not seqs:
                    del self._block_tickets[block]

    # ------------------------------------------------------------------ fences

    def fence(self, block_ids: Iterable[int], timeout_s: float) -> None:
        """See ``TransferEngine.fence_blocks``."""
        waits: list[StoreTicket] = []
        with self._lock:
            if not self._block_tickets:
                return
            seqs: set[int] = set()
            for block in block_ids:
                found = self._block_tickets.get(block)
                if found:
                    seqs.update(found)
            for seq in seqs:
                ticket = self._tickets.get(seq)
                if ticket is None:
                    continue
                if ticket.state == QUEUED:
                    ticket.state = CANCELLED
                    self._unregister(ticket)
                    ticket.copied.set()
                elif ticket.state == RUNNING:
                    waits.append(ticket)
        if not waits:
            return
        deadline = time.monotonic() + max(0.0, timeout_s)
        for ticket in waits:
            if ticket.copied.wait(max(0.0, deadline - time.monotonic())):
                continue
            with self._lock:
                if not ticket.copied.is_set():
                    ticket.late = True
            logger.error(
                "tieredkv: store %d still copying blocks after a %.1f s fence; it will be "
                "reported failed", ticket.job.job_id, timeout_s,
            )

    # ------------------------------------------------------------------ lane thread hooks

    def _copy_starts(self, ticket: StoreTicket) -> bool:
        """Lane thread, right before the copy: False if the store was cancelled meanwhile."""
        with self._lock:
            if ticket.state != QUEUED:
                return False
            ticket.state = RUNNING
            return True

    def _copy_ended(self, ticket: StoreTicket, ok: bool) -> None:
        """Lane thread, right after the copy finished: the device blocks are free to reuse."""
        with self._lock:
            ticket.state = DONE
            self._unregister(ticket)
            ticket.copied.set()

    # ------------------------------------------------------------------ the job (event loop)

    async def run(self, seq: int, job: StoreJob, ticket: StoreTicket, t0: float) -> None:
        result = JobResult.fail(job.job_id, FailureCause.CANCELLED)
        holding = False
        try:
            pairs = split_holes(job.host_slot, 0, job.block_ids)
            try:
                check_pairs(self.kv, self.host, self.chunk_blocks, pairs)
            except ValueError as exc:
                logger.error("tieredkv: store %d rejected: %s", job.job_id, exc)
                result = JobResult.fail(job.job_id, FailureCause.COPY_ERROR)
                return
            if ticket.state != QUEUED:
                return  # fenced before it started
            if not self._guard.try_write(job.host_slot):
                result = JobResult.fail(job.job_id, FailureCause.COPY_ERROR)
                return
            holding = True
            request = CopyRequest(
                pairs, after=ticket.mark, start=partial(self._copy_starts, ticket),
                done=partial(self._copy_ended, ticket),
            )
            assert self._lane is not None
            outcome = await self._lane.copy(request)
            if outcome is None and not ticket.late:
                moved = len(real_blocks(job.block_ids)) * self.kv.total_block_bytes
                self._stats.moved(Direction.D2H, moved)
                result = JobResult.done(job.job_id)
            elif outcome is None or outcome == FailureCause.CANCELLED:
                result = JobResult.fail(job.job_id, FailureCause.CANCELLED)
            else:
                result = JobResult.fail(job.job_id, FailureCause.COPY_ERROR)
        finally:
            if holding:
                self._guard.release(job.host_slot, True)
            with self._lock:
                if ticket.state in (QUEUED, RUNNING):
                    ticket.state = DONE
                self._unregister(ticket)
                ticket.copied.set()
            self._finish(seq, result, t0)
