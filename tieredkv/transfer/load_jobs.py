"""Load jobs (h2d): host slots -> device blocks, start to end in one thread.

A load never reads disk: the planner promotes a disk hit into a host slot first
(:class:`~tieredkv.protocol.PromoteJob`) and only promises it once that read is verified, so
every chunk of a load is in a host slot when the load is submitted.

Why loads skip the event loop: while vLLM waits for a load its engine thread spins on empty
steps holding the GIL, and every thread a job crosses waits up to a switch interval (5 ms) for
it; a host-tier hit had three or four such crossings. A load therefore runs in one thread:
the h2d lane thread (on its stream, after the compute mark) or, on CPU, the caller itself
(see ``TransferEngine.submit``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

from tieredkv.protocol import Direction, FailureCause, JobResult, LoadJob
from tieredkv.transfer.backends.base import Pair, check_pairs, real_blocks, split_holes
from tieredkv.transfer.host_pool import HostPool, SlotGuard
from tieredkv.transfer.kv_views import KVViews
from tieredkv.transfer.lanes import CopyLane
from tieredkv.transfer.transfer_stats import Finish, TransferStats

logger = logging.getLogger(__name__)


def load_result(job: LoadJob, failure: str | None, failed_from: int) -> JobResult:
    """A load's result: on failure, every device block of chunk ``failed_from`` onwards
    (the chunks before it are on the device; vLLM recomputes the rest)."""
    if failure is None:
        return JobResult.done(job.job_id)
    failed = tuple(b for chunk in job.chunks[failed_from:] for b in real_blocks(chunk.block_ids))
    return JobResult.fail(job.job_id, failure, failed)


class LoadJobs:
    """Runs loads, each in the one thread that calls :meth:`run`."""

    def __init__(self, kv: KVViews, host: HostPool, copy_h2d: Callable[[list[Pair]], None],
                 guard: SlotGuard, stats: TransferStats, finish: Finish,
                 closed: Callable[[], bool]) -> None:
        self.kv = kv
        self.host = host
        self._copy_h2d = copy_h2d  # the engine's backend, looked up per copy
        self.chunk_blocks = kv.chunk_blocks_for(host.payload_bytes)
        self._guard = guard
        self._stats = stats
        self._finish = finish
        self._closed = closed  # True once the engine is shut down or dead: run nothing
        self._lane: CopyLane | None = None

    def start(self, lane: CopyLane) -> None:
        """The h2d lane is up (before any load is submitted to it)."""
        self._lane = lane

    def nbytes(self, job: LoadJob) -> int:
        """Bytes the load moves to the device."""
        return len(job.block_ids) * self.kv.total_block_bytes

    def run(self, seq: int, job: LoadJob, t0: float, mark: Any, on_lane: bool) -> None:
        """Copy the load's chunks, in prefix order, on the h2d lane thread (``on_lane``: on its
        stream, after ``mark``) or right here in the caller's thread (CPU only)."""
        chunks = job.chunks
        failure: str | None = None
        failed_from = len(chunks)
        held: list[int] = []
        try:
            if self._closed():
                failure, failed_from = FailureCause.CANCELLED, 0
                return
            if job.unserved:  # blocks the planner does not hold: never report them loaded
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
            try:
                if on_lane:
                    assert self._lane is not None
                    self._lane.run(partial(self._copy_h2d, pairs), () if mark is None else (mark,))
                else:
                    self._copy_h2d(pairs)
            except Exception as exc:  # noqa: BLE001 - reported as the job's failure
                logger.error("tieredkv: load %d h2d failed: %r", job.job_id, exc)
                failure, failed_from = FailureCause.COPY_ERROR, 0
            else:
                moved = sum(len(ids) for _, _, ids in pairs) * self.kv.total_block_bytes
                self._stats.moved(Direction.H2D, moved, ops=len(pairs))
        finally:
            for slot in held:
                self._guard.release(slot, False)
            self._finish(seq, load_result(job, failure, failed_from), t0)
