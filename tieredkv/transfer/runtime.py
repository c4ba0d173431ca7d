"""What every job handler of the transfer engine shares: the submitted :class:`Entry`, the
:class:`Runtime` the engine offers its handlers, and the counters they all report to.

The engine routes each job by its :class:`~tieredkv.protocol.Move` (its source and
destination media) to one :data:`Handler`; a handler decides which thread runs the job and
reports its one result through :meth:`Runtime.finish`. Handlers see the engine only through
:class:`Runtime`, never its private state.

Thread-safe: every job kind finishes on a thread of its own (the event loop, the h2d lane,
the remote jobs' landing thread, or vLLM's worker thread for an inline load).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from tieredkv.protocol import FailureCause, Job, JobResult, Move

LATENCY_SAMPLES = 10_000  # per move between two take() calls


@dataclass(frozen=True, slots=True)
class Entry:
    """One submitted job: its engine sequence number, submit time and compute mark."""

    seq: int
    job: Job
    t0: float
    mark: Any = None  # compute-stream event a device copy waits for (CUDA), else None
    # Bytes the caller lets this job copy in its own thread (a CPU load), 0: never inline.
    inline_bytes: int = 0


class Runtime(Protocol):
    """The engine as its handlers see it."""

    stats: TransferStats

    @property
    def closed(self) -> bool:
        """Shut down or dead: a job that has not started does not start."""

    def finish(self, entry: Entry, result: JobResult) -> None:
        """Record the job's one result (later results for the same job are ignored)."""

    def on_loop(self, start: Callable[[list[Entry]], None], entries: list[Entry]) -> None:
        """Call ``start(entries)`` on the event loop thread; jobs it cannot take (the engine
        closed first) get ``cancelled``."""

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as a task of the event loop (call on the loop thread)."""

    def die(self, where: str, cause: BaseException) -> None:
        """A thread of the engine died: every job fails from now on."""

    def check_alive(self) -> None:
        """Raise if the engine died: a copy it was about to make is reported failed already."""


# The one handler of a move: takes the move's entries from submit, never blocks on I/O.
Handler = Callable[[list[Entry]], None]


def cancelled(job: Job) -> JobResult:
    """A job that will not run; a load names every device block it leaves unloaded."""
    return JobResult.fail(job.job_id, FailureCause.CANCELLED,
                          job.block_ids if job.move is Move.LOAD else ())


class TransferStats:
    """Counters since the last :meth:`take` (thread-safe): bytes and operations per move,
    failures, disk-read retries and per-job latency samples."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        directions = [move.direction for move in Move]
        self.bytes = dict.fromkeys(directions, 0)
        self.ops = dict.fromkeys(directions, 0)
        self.spills_dropped = 0
        self.failures: Counter[str] = Counter()
        self.reads_retried: Counter[str] = Counter()  # by the first read's failure
        self.reads_recovered = 0  # retried reads that then succeeded
        self.latency: dict[str, list[float]] = {move.value: [] for move in Move}

    def moved(self, move: Move, nbytes: int, ops: int = 1) -> None:
        with self._lock:
            self.bytes[move.direction] += nbytes
            self.ops[move.direction] += ops

    def read_retried(self, failure: FailureCause) -> None:
        with self._lock:
            self.reads_retried[failure] += 1

    def read_recovered(self) -> None:
        with self._lock:
            self.reads_recovered += 1

    def finished(self, move: Move, result: JobResult, seconds: float | None) -> None:
        with self._lock:
            if result.failure == FailureCause.DROPPED:
                if move is Move.SPILL:  # remote writes dropped: the scheduler counts them
                    self.spills_dropped += 1
            elif not result.ok:
                self.failures[result.failure or FailureCause.UNKNOWN] += 1
            samples = self.latency[move.value]
            if seconds is not None and len(samples) < LATENCY_SAMPLES:
                samples.append(seconds)

    def take(self, gauges: dict[str, int]) -> dict[str, Any]:
        with self._lock:
            snapshot = {
                "bytes": dict(self.bytes),
                "ops": dict(self.ops),
                "spills_dropped": self.spills_dropped,
                "failures": {str(k): v for k, v in self.failures.items()},
                "reads_retried": {str(k): v for k, v in self.reads_retried.items()},
                "reads_recovered": self.reads_recovered,
                "latency_s": {kind: list(v) for kind, v in self.latency.items()},
                "queue_depths": dict(gauges),
            }
            self._reset()
        return snapshot
