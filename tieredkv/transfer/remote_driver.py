"""The transfer engine's remote path: remote read and write jobs -> :class:`RemoteJobs`.

Neither kind ever blocks the caller. A read takes its host slot for writing (the slot
guard) from submit until its answer was polled and verified, so no load or spill reads a
half-landed slot; a write copies its slot into the store's bounded queue during submit and
reports at once (``done``: queued; ``dropped``: no room or store down). A read's answer is
verified and reported as soon as it arrives (:meth:`RemoteDriver.pump`, on the store's thread),
so the engine's poll and idle wait see it like any other job's.

Without a remote tier on this worker (no ``remote_url``, or the store failed to build), every
remote job fails ``unavailable``: the scheduler counts it and recomputes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from tieredkv.protocol import Direction, FailureCause, JobResult, RemoteReadJob, RemoteWriteJob
from tieredkv.transfer.host_pool import SlotGuard
from tieredkv.transfer.kv_views import KVViews
from tieredkv.transfer.remote_jobs import RemoteJobs, WriteJob
from tieredkv.transfer.transfer_stats import Finish, TransferStats

logger = logging.getLogger(__name__)

RemoteJob = RemoteReadJob | RemoteWriteJob
# (submission seq, job, submit time)
RemoteEntry = tuple[int, RemoteJob, float]
# The engine's entries: (submission seq, job, store ticket, submit time, compute mark).
EngineEntry = tuple[int, Any, Any, float, Any]


class RemoteDriver:
    """Runs remote jobs for one engine; thread-safe (submit and pump may race)."""

    def __init__(
        self,
        jobs: RemoteJobs | None,
        guard: SlotGuard,
        stats: TransferStats,
        finish: Finish,
        payload_bytes: int,
        *,
        chunk_rows: int,
        kv: KVViews | None = None,
    ) -> None:
        self.jobs = jobs
        self._guard = guard
        self._stats = stats
        self._finish = finish
        self._payload_bytes = payload_bytes
        self._lock = threading.Lock()
        self._reads: dict[int, tuple[int, RemoteReadJob, float]] = {}  # job id -> entry
        self._writes_failed_seen = 0
        if jobs is not None:
            jobs.on_answer = self.pump
            jobs.slot_rows = chunk_rows  # a write must cover every row of its slot
            if kv is not None:  # where each row lies, to blank an entry's empty rows
                jobs.row_spans = tuple(zip(kv.layer_offsets(chunk_rows), kv.block_bytes,
                                           strict=True))

    def take(self, entries: list[EngineEntry]) -> list[EngineEntry]:
        """Submit the remote jobs among the engine's ``entries``; return the others."""
        remote = [(e[0], e[1], e[3]) for e in entries if isinstance(e[1], RemoteReadJob | RemoteWriteJob)]
        if not remote:
            return entries
        self.submit(remote)  # type: ignore[arg-type]
        return [e for e in entries if not isinstance(e[1], RemoteReadJob | RemoteWriteJob)]

    def submit(self, entries: Sequence[RemoteEntry]) -> None:
        """Start the reads (one batch) and queue the writes; never waits on the network."""
        if self.jobs is None:
            for seq, job, t0 in entries:
                self._finish(seq, JobResult.fail(job.job_id, FailureCause.UNAVAILABLE), t0)
            return
        reads: list[tuple[int, bytes, int]] = []
        writes: list[WriteJob] = []
        write_entries: dict[int, tuple[int, RemoteWriteJob, float]] = {}
        for seq, job, t0 in entries:
            if isinstance(job, RemoteReadJob):
                if not self._guard.try_write(job.host_slot):
                    self._finish(seq, JobResult.fail(job.job_id, FailureCause.COPY_ERROR), t0)
                    continue
                with self._lock:
                    self._reads[job.job_id] = (seq, job, t0)
                reads.append((job.job_id, job.key, job.host_slot))
            else:
                if not self._guard.try_read(job.host_slot):
                    self._finish(seq, JobResult.fail(job.job_id, FailureCause.COPY_ERROR), t0)
                    continue
                write_entries[job.job_id] = (seq, job, t0)
                writes.append((job.job_id, job.key, job.host_slot, job.rows, job.holes))
        if reads:
            self.jobs.start_reads(reads)  # answers arrive through pump (on_answer)
        if writes:
            try:
                results = self.jobs.write(writes)
            finally:
                for _, _, slot, _, _ in writes:
                    self._guard.release(slot, write=False)
            for result in results:
                seq, job, t0 = write_entries[result.job_id]
                if result.ok:
                    self._stats.moved(Direction.REMOTE_WRITE, self._payload_bytes)
                self._finish(seq, result, t0)

    def pump(self) -> None:
        """Finish every read whose answer arrived (verified values are in their slots)."""
        if self.jobs is None:
            return
        for result in self.jobs.poll():
            self._settle(result)

    def _settle(self, result: JobResult) -> None:
        with self._lock:
            entry = self._reads.pop(result.job_id, None)
        if entry is None:
            return
        seq, job, t0 = entry
        self._guard.release(job.host_slot, write=True)
        if result.ok:
            self._stats.moved(Direction.REMOTE_READ, self._payload_bytes)
        self._finish(seq, result, t0)

    def gauges(self) -> dict[str, int]:
        """The store's write backlog (items), for the ``remote_write_queue`` gauge."""
        if self.jobs is None:
            return {}
        return {"remote_write_queue": self.jobs.store.stats().queue_items}

    def take_writes_failed(self) -> int:
        """Queued writes Redis did not take since the last call (the store's own counter)."""
        if self.jobs is None:
            return 0
        total = self.jobs.store.stats().writes_failed
        with self._lock:
            delta, self._writes_failed_seen = total - self._writes_failed_seen, total
        return max(0, delta)

    def close(self, timeout_s: float) -> None:
        """Give queued writes up to half of ``timeout_s`` (when the store is up), then close
        the store; reads it never answered finish ``cancelled`` (slots freed)."""
        if self.jobs is None:
            return
        if self.jobs.store.up and not self.jobs.flush_writes(timeout_s / 2):
            logger.warning("tieredkv: remote writes still queued at shutdown are dropped")
        for result in self.jobs.close(timeout_s / 2):
            self._settle(result)
