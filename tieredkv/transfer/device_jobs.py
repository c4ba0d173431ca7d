"""The device's two moves: store (device blocks -> a host slot) and load (host slots -> device
blocks), each with its own copy lane (:mod:`~tieredkv.transfer.lanes`).

Stores: a store reads device blocks that vLLM may hand to another request as soon as it is
told the store is under way, so every store has a :class:`StoreTicket` from submit to result:
a fence (:meth:`DeviceJobs.fence`, before a forward reuses blocks) cancels a store whose copy
has not started and waits for one that is running. Tickets share the engine's lock, since the
engine settles them together with its own record of pending jobs. Stores run as coroutines on
the engine's event loop, which awaits the d2h lane: the lane thread batches whatever stores
queued up while its previous batch ran.

Loads never read disk: the planner fills a disk or remote hit into a host slot first and only
promises it once that read is verified, so every chunk of a load is in a host slot when it is
submitted. A load never crosses the event loop: while vLLM waits for a load its engine thread
spins on empty steps holding the GIL, and every thread a job crosses waits up to a switch
interval (5 ms) for it. It runs start to end on the h2d lane thread (on its stream, after the
compute mark) or, on CPU, in the caller's own thread: a synchronous load (vLLM calls
``start_load_kv`` before the forward that uses it), or one within the caller's byte budget
(``start_load_kv`` runs after the forward then, so an inline memcpy delays no compute and is
reported a whole step earlier).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from tieredkv.protocol import FailureCause, Job, JobResult, Move
from tieredkv.transfer.backends.base import CopyBackend, Pair, check_pairs, real_blocks, split_holes
from tieredkv.transfer.host_pool import HostPool, SlotGuard
from tieredkv.transfer.kv_views import KVViews
from tieredkv.transfer.lanes import CopyLane, CopyRequest
from tieredkv.transfer.runtime import Entry, Runtime, cancelled

logger = logging.getLogger(__name__)

# Store ticket states (guarded by the engine lock).
QUEUED, RUNNING, DONE, CANCELLED = "queued", "running", "done", "cancelled"


@dataclass(eq=False)
class StoreTicket:
    """What a fence needs to know about a store, from submit to result."""

    entry: Entry
    state: str = QUEUED
    late: bool = False  # a fence gave up waiting: the blocks may have been reused mid-copy
    copied: threading.Event = field(default_factory=threading.Event)


def load_result(job: Job, failure: FailureCause | None, failed_from: int) -> JobResult:
    """A load's result: on failure, every device block of chunk ``failed_from`` onwards
    (the chunks before it are on the device; vLLM recomputes the rest)."""
    if failure is None:
        return JobResult.done(job.job_id)
    failed = tuple(b for chunk in job.src.chunks[failed_from:]  # type: ignore[union-attr]
                   for b in real_blocks(chunk.block_ids))
    return JobResult.fail(job.job_id, failure, failed)


class DeviceJobs:
    """The handlers of :attr:`Move.STORE` and :attr:`Move.LOAD`, and the two copy lanes."""

    def __init__(self, kv: KVViews, host: HostPool, backend: CopyBackend, guard: SlotGuard,
                 runtime: Runtime, lock: threading.Lock, max_batch_pairs: int) -> None:
        self.kv = kv
        self.host = host
        self.backend = backend
        self.chunk_blocks = kv.chunk_blocks_for(host.payload_bytes)
        self._guard = guard
        self._runtime = runtime
        self._lock = lock  # the engine's lock
        self._max_batch_pairs = max_batch_pairs
        self._tickets: dict[int, StoreTicket] = {}
        self._block_tickets: dict[int, set[int]] = {}
        self.d2h: CopyLane | None = None
        self.h2d: CopyLane | None = None

    def start(self) -> None:
        """On the engine's event loop thread, before any job runs: the two lanes."""
        device = self.kv.device
        self.d2h = CopyLane("d2h", device, self._copy_d2h, self._max_batch_pairs,
                            on_death=partial(self._lane_died, "d2h"))
        # Loads call into the h2d lane's thread directly (run_load): no batch function.
        self.h2d = CopyLane("h2d", device, None, self._max_batch_pairs,
                            on_death=partial(self._lane_died, "h2d"))

    def stop_lanes(self) -> None:
        for lane in (self.d2h, self.h2d):
            if lane is not None:
                lane.stop(0.0)

    def _lane_died(self, name: str, cause: BaseException) -> None:
        self._runtime.die(f"the {name} copy lane thread", cause)

    # ================================================================== stores

    def admit_store_locked(self, entry: Entry) -> None:
        """A store was submitted (engine lock held, with its record of pending jobs): a fence
        sees it from now on, and a death or shutdown that fails it settles its ticket."""
        self._tickets[entry.seq] = StoreTicket(entry)
        for block in real_blocks(entry.job.block_ids):
            self._block_tickets.setdefault(block, set()).add(entry.seq)

    def submit_stores(self, entries: list[Entry]) -> None:
        """The stores' copies start on the loop (their tickets were taken at submit)."""
        self._runtime.on_loop(self._start_stores, entries)

    def _start_stores(self, entries: list[Entry]) -> None:
        for entry in entries:
            ticket = self._tickets.get(entry.seq)
            if ticket is None:  # already settled (cancelled at shutdown)
                continue
            self._runtime.spawn(self._store(ticket))

    def settle_locked(self, seq: int) -> None:
        """The store has its result: nothing waits on its blocks any more (engine lock held)."""
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
        for block in real_blocks(ticket.entry.job.block_ids):
            seqs = self._block_tickets.get(block)
            if seqs is not None:
                seqs.discard(ticket.entry.seq)
                if not seqs:
                    del self._block_tickets[block]

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
                "reported failed", ticket.entry.job.job_id, timeout_s,
            )

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

    def _copy_d2h(self, pairs: list[Pair]) -> None:
        """A batch of stores, on the d2h lane thread; none once the engine died (their
        stores are reported failed already)."""
        self._runtime.check_alive()
        self.backend.d2h(self.kv, self.host, pairs)

    async def _store(self, ticket: StoreTicket) -> None:
        entry = ticket.entry
        job = entry.job
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
                pairs, after=entry.mark, start=partial(self._copy_starts, ticket),
                done=partial(self._copy_ended, ticket),
            )
            assert self.d2h is not None
            outcome = await self.d2h.copy(request)
            if outcome is None and not ticket.late:
                moved = len(real_blocks(job.block_ids)) * self.kv.total_block_bytes
                self._runtime.stats.moved(Move.STORE, moved)
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
            self._runtime.finish(entry, result)

    # ================================================================== loads

    def load_bytes(self, job: Job) -> int:
        """Bytes the load moves to the device."""
        return len(job.block_ids) * self.kv.total_block_bytes

    def submit_loads(self, entries: list[Entry]) -> None:
        """Each load inline (a CPU device: a synchronous load, or one within the entry's byte
        budget) or on the h2d lane."""
        cpu = self.kv.device.type == "cpu"
        for entry in entries:
            job = entry.job
            if cpu and (job.src.sync or 0 < self.load_bytes(job) <= entry.inline_bytes):  # type: ignore[union-attr]
                self._run_load(entry, on_lane=False)
                continue
            lane = self.h2d
            if lane is None or self._runtime.closed:
                self._runtime.finish(entry, cancelled(entry.job))
                continue
            call = lane.call(self._run_load, entry, True)
            call.add_done_callback(partial(self._lane_call_done, entry))

    def _lane_call_done(self, entry: Entry, call: Any) -> None:
        """A load the h2d lane never ran (it died) still gets its result."""
        if call.cancelled() or call.exception() is not None:
            self._runtime.finish(entry, cancelled(entry.job))

    def _run_load(self, entry: Entry, on_lane: bool) -> None:
        """Copy the load's chunks, in prefix order, on the h2d lane thread (``on_lane``: on its
        stream, after the entry's mark) or right here in the caller's thread (CPU only)."""
        job = entry.job
        source = job.src
        chunks = source.chunks  # type: ignore[union-attr]
        failure: FailureCause | None = None
        failed_from = len(chunks)
        held: list[int] = []
        try:
            if self._runtime.closed:
                failure, failed_from = FailureCause.CANCELLED, 0
                return
            if source.unserved:  # type: ignore[union-attr] - blocks the planner does not hold
                failure, failed_from = FailureCause.MISSING, 0
                return
            pairs: list[Pair] = []
            for i, chunk in enumerate(chunks):
                runs = split_holes(chunk.host_slot, chunk.first_block, chunk.block_ids)
                try:
                    check_pairs(self.kv, self.host, self.chunk_blocks, runs)
                except ValueError as exc:
                    logger.error("tieredkv: load %d chunk %d rejected: %s", job.job_id, i, exc)
                    failure, failed_from = FailureCause.COPY_ERROR, i
                    break
                if not self._guard.try_read(chunk.host_slot):
                    failure, failed_from = FailureCause.COPY_ERROR, i
                    break
                held.append(chunk.host_slot)
                pairs.extend(runs)
            if not pairs:
                return
            copy = partial(self.backend.h2d, self.kv, self.host, pairs)
            try:
                if on_lane:
                    assert self.h2d is not None
                    self.h2d.run(copy, () if entry.mark is None else (entry.mark,))
                else:
                    copy()
            except Exception as exc:  # noqa: BLE001 - reported as the job's failure
                logger.error("tieredkv: load %d h2d failed: %r", job.job_id, exc)
                failure, failed_from = FailureCause.COPY_ERROR, 0
            else:
                moved = sum(len(ids) for _, _, ids in pairs) * self.kv.total_block_bytes
                self._runtime.stats.moved(Move.LOAD, moved, ops=len(pairs))
        finally:
            for slot in held:
                self._guard.release(slot, False)
            self._runtime.finish(entry, load_result(job, failure, failed_from))
