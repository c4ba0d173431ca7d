"""The handlers of :attr:`Move.REMOTE_READ` and :attr:`Move.REMOTE_WRITE`: -> :class:`RemoteJobs`.

Neither kind ever blocks the caller. A read takes its host slot for writing (the slot
guard) from submit until its answer was polled and verified, so no load or spill reads a
half-landed slot; a write copies its slot into the store's bounded queue during submit and
reports at once (``done``: queued; ``dropped``: no room or store down). A read's answer is
verified and reported as soon as it arrives (:meth:`RemoteDriver.pump`, on the remote jobs'
landing thread, while the store's thread receives the next batch), so the engine's poll and
idle wait see it like any other job's.

The engine builds a driver only for a worker with a remote tier; without one (no
``remote_url``, or the store failed to build) its own handler fails every remote job
``unavailable``: the scheduler counts it and recomputes.
"""

from __future__ import annotations

import logging
import threading

from tieredkv.protocol import FailureCause, JobResult, Move
from tieredkv.transfer.host_pool import SlotGuard
from tieredkv.transfer.kv_views import KVViews
from tieredkv.transfer.remote_jobs import RemoteJobs, WriteJob
from tieredkv.transfer.runtime import Entry, Runtime

logger = logging.getLogger(__name__)


class RemoteDriver:
    """Runs remote jobs for one engine; thread-safe (submit and pump may race). Neither
    handler needs the engine's event loop: the store has its own thread."""

    def __init__(
        self,
        jobs: RemoteJobs,
        guard: SlotGuard,
        runtime: Runtime,
        payload_bytes: int,
        *,
        chunk_rows: int,
        kv: KVViews | None = None,
    ) -> None:
        self.jobs = jobs
        self._guard = guard
        self._runtime = runtime
        self._payload_bytes = payload_bytes
        self._lock = threading.Lock()
        self._reads: dict[int, Entry] = {}  # job id -> entry
        self._writes_failed_seen = 0
        jobs.on_answer = self.pump
        jobs.slot_rows = chunk_rows
        if kv is not None:  # where each row lies: a tail's rows, an entry's empty rows
            jobs.row_spans = tuple(zip(kv.layer_offsets(chunk_rows), kv.block_bytes, strict=True))

    def submit_reads(self, entries: list[Entry]) -> None:
        """Start the reads, one batch; answers arrive through :meth:`pump`."""
        reads: list[tuple[int, bytes, int, int]] = []
        for entry in entries:
            job = entry.job
            if not self._guard.try_write(job.host_slot):
                self._runtime.finish(entry, JobResult.fail(job.job_id, FailureCause.COPY_ERROR))
                continue
            with self._lock:
                self._reads[job.job_id] = entry
            reads.append((job.job_id, job.key, job.host_slot, job.src.rows))  # type: ignore[union-attr]
        if reads:
            self.jobs.start_reads(reads)

    def submit_writes(self, entries: list[Entry]) -> None:
        """Copy each write's slot into the store's bounded queue; reports at once."""
        writes: list[WriteJob] = []
        by_id: dict[int, Entry] = {}
        for entry in entries:
            job = entry.job
            if not self._guard.try_read(job.host_slot):
                self._runtime.finish(entry, JobResult.fail(job.job_id, FailureCause.COPY_ERROR))
                continue
            by_id[job.job_id] = entry
            shard = job.dst
            writes.append((job.job_id, job.key, job.host_slot, shard.rows,  # type: ignore[union-attr]
                           shard.holes, shard.supersedes))  # type: ignore[union-attr]
        if not writes:
            return
        try:
            results = self.jobs.write(writes)
        finally:
            for _, _, slot, *_ in writes:
                self._guard.release(slot, write=False)
        for result in results:
            if result.ok:
                self._runtime.stats.moved(Move.REMOTE_WRITE, self._payload_bytes)
            self._runtime.finish(by_id[result.job_id], result)

    def pump(self) -> None:
        """Finish every read whose answer arrived (verified values are in their slots)."""
        for result in self.jobs.poll():
            self._settle(result)

    def _settle(self, result: JobResult) -> None:
        with self._lock:
            entry = self._reads.pop(result.job_id, None)
        if entry is None:
            return
        self._guard.release(entry.job.host_slot, write=True)
        if result.ok:
            self._runtime.stats.moved(Move.REMOTE_READ, self._payload_bytes)
        self._runtime.finish(entry, result)

    def gauges(self) -> dict[str, int]:
        """The store's write backlog (items), for the ``remote_write_queue`` gauge."""
        return {"remote_write_queue": self.jobs.store.stats().queue_items}

    def take_writes_failed(self) -> int:
        """Queued writes Redis did not take since the last call (the store's own counter)."""
        total = self.jobs.store.stats().writes_failed
        with self._lock:
            delta, self._writes_failed_seen = total - self._writes_failed_seen, total
        return max(0, delta)

    def close(self, timeout_s: float) -> None:
        """Give queued writes up to half of ``timeout_s`` (when the store is up), then close
        the store; reads it never answered finish ``cancelled`` (slots freed)."""
        if self.jobs.store.up and not self.jobs.flush_writes(timeout_s / 2):
            logger.warning("tieredkv: remote writes still queued at shutdown are dropped")
        for result in self.jobs.close(timeout_s / 2):
            self._settle(result)
