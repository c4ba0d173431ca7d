"""The transfer engine's counters: bytes and operations per direction, failures, disk-read
retries and per-job latency samples, taken (and reset) by each stats report.

Thread-safe: every job kind finishes on a thread of its own (the event loop, the h2d lane,
or vLLM's worker thread for an inline load).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from tieredkv.protocol import (
    Direction,
    FailureCause,
    Job,
    JobKind,
    JobResult,
    LoadJob,
    PromoteJob,
    RemoteReadJob,
    RemoteWriteJob,
    SpillJob,
    StoreJob,
)

LATENCY_SAMPLES = 10_000  # per job kind between two take() calls
DIRECTIONS = tuple(d.value for d in Direction)
JOB_KINDS = tuple(k.value for k in JobKind)

# How a job hands its one result to the engine: (submission seq, result, submit time or None).
Finish = Callable[[int, JobResult, float | None], None]

# A job's kind, as the latency samples name it.
_KIND_OF_JOB: dict[type, str] = {
    StoreJob: JobKind.STORE.value,
    SpillJob: JobKind.SPILL.value,
    PromoteJob: JobKind.PROMOTE.value,
    LoadJob: JobKind.LOAD.value,
    RemoteReadJob: JobKind.REMOTE_READ.value,
    RemoteWriteJob: JobKind.REMOTE_WRITE.value,
}


def job_kind(job: Job) -> str:
    """The job's :class:`JobKind` value (``store``, ``spill``, ...)."""
    for job_type, kind in _KIND_OF_JOB.items():
        if isinstance(job, job_type):
            return kind
    raise TypeError(f"not a transfer job: {job!r}")


class TransferStats:
    """Counters since the last :meth:`take` (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self.bytes = dict.fromkeys(DIRECTIONS, 0)
        self.ops = dict.fromkeys(DIRECTIONS, 0)
        self.spills_dropped = 0
        self.failures: Counter[str] = Counter()
        self.reads_retried: Counter[str] = Counter()  # by the first read's failure
        self.reads_recovered = 0  # retried reads that then succeeded
        self.latency: dict[str, list[float]] = {kind: [] for kind in JOB_KINDS}

    def moved(self, direction: Direction, nbytes: int, ops: int = 1) -> None:
        with self._lock:
            self.bytes[direction] += nbytes
            self.ops[direction] += ops

    def read_retried(self, failure: str) -> None:
        with self._lock:
            self.reads_retried[failure] += 1

    def read_recovered(self) -> None:
        with self._lock:
            self.reads_recovered += 1

    def finished(self, kind: str, result: JobResult, seconds: float | None) -> None:
        with self._lock:
            if result.failure == FailureCause.DROPPED:
                if kind == JobKind.SPILL:  # remote writes dropped: the scheduler counts them
                    self.spills_dropped += 1
            elif not result.ok:
                self.failures[result.failure or "unknown"] += 1
            samples = self.latency[kind]
            if seconds is not None and len(samples) < LATENCY_SAMPLES:
                samples.append(seconds)

    def take(self, gauges: dict[str, int]) -> dict[str, Any]:
        with self._lock:
            snapshot = {
                "bytes": dict(self.bytes),
                "ops": dict(self.ops),
                "spills_dropped": self.spills_dropped,
                "failures": dict(self.failures),
                "reads_retried": dict(self.reads_retried),
                "reads_recovered": self.reads_recovered,
                "latency_s": {kind: list(v) for kind, v in self.latency.items()},
                "queue_depths": dict(gauges),
            }
            self._reset()
        return snapshot
