"""The worker's transfer engine: executes store/spill/promote/load jobs and reports results.

One asyncio event loop runs in a dedicated daemon thread per worker process (started on the
first submit). vLLM's worker thread only ever calls the non-blocking ``submit``/``poll``
(plus ``fence_blocks`` before a forward that reuses freed blocks); every job is a coroutine
on that loop, and a job's bytes move through three kinds of lanes:

- device copies: one :class:`~tieredkv.transfer.lanes.CopyLane` per direction (its own CUDA
  stream and thread), which batches whatever queued up while its previous batch ran;
- disk I/O: the slab executor's bounded thread pool (``io_threads``);
- spills: a bounded queue in front of a few spill workers, so a slow disk drops spills
  (counted) instead of delaying stores or loads.

A load overlaps its stages: disk reads for the next chunks run while earlier chunks go h2d,
and nothing downstream of a failed read is ever copied to the device. Every submitted job
gets exactly one :class:`JobResult`, also when it is cancelled, fenced or shut down.

A transient disk read failure (I/O error, short read, timeout) is retried once before the
job fails; a wrong byte (checksum, key, namespace) or a missing file is not.

If a thread of the engine dies (the loop, at start-up or later; a copy lane; a slab I/O
thread), the engine is dead: every pending job fails at once (``cancelled``; a load names all
of its device blocks), every later job fails inside ``submit``, and :attr:`TransferEngine.error`
says why (its ``__cause__`` is what killed the thread, logged once with its traceback).
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from tieredkv.protocol import (
    FailureCause,
    Job,
    JobResult,
    LoadChunk,
    LoadJob,
    PromoteJob,
    SpillJob,
    StoreJob,
)
from tieredkv.transfer.copy_ops import CopyBackend, check_pairs
from tieredkv.transfer.host_pool import HostPool
from tieredkv.transfer.kv_views import KVViews
from tieredkv.transfer.lanes import CopyLane, CopyRequest, compute_mark
from tieredkv.transfer.slot_guard import SlotGuard

logger = logging.getLogger(__name__)

_MAX_STAGING_BYTES = 256 * 1024 * 1024  # bounds one copy batch (the CUDA staging buffer)
_LATENCY_SAMPLES = 10_000  # per job kind between two take_stats() calls
_DIRECTIONS = ("d2h", "h2d", "spill", "restore")
_JOB_KINDS = ("store", "spill", "promote", "load")

# Store ticket states (guarded by the engine lock).
_QUEUED, _RUNNING, _DONE, _CANCELLED = "queued", "running", "done", "cancelled"

# Disk read failures worth a second read: the bytes may well be there. A checksum, key or
# namespace mismatch says they are not; so does a missing file.
_TRANSIENT_READ_FAILURES = frozenset({"io_error", "short_read", "timeout"})


class EngineDeadError(RuntimeError):
    """The transfer engine can no longer run jobs; ``__cause__`` is what killed it."""


def failure_kind(exc: BaseException) -> str:
    """The failure name of an exception: a SlabError's kind, else a best-effort kind."""
    kind = getattr(exc, "kind", None)
    if kind is not None:
        return str(getattr(kind, "value", kind))
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, FileNotFoundError):
        return "missing"
    return "io_error"


def _kind_of(job: Job) -> str:
    if isinstance(job, StoreJob):
        return "store"
    if isinstance(job, SpillJob):
        return "spill"
    if isinstance(job, PromoteJob):
        return "promote"
    return "load"


def _failed(job: Job, failure: str, failed_block_ids: Sequence[int] = ()) -> JobResult:
    return JobResult.fail(job.job_id, failure, failed_block_ids)


def _transient(exc: BaseException) -> bool:
    """A disk read failure that a second read may not hit again (a SlabError's kind says)."""
    kind = getattr(exc, "kind", None)
    return kind is not None and str(getattr(kind, "value", kind)) in _TRANSIENT_READ_FAILURES


def _noop() -> None:
    pass


@dataclass(eq=False)
class _StoreTicket:
    """What ``fence_blocks`` needs to know about a store, from submit to result."""

    seq: int
    job: StoreJob
    mark: Any  # compute-stream event the copy waits for (CUDA) or None
    state: str = _QUEUED
    late: bool = False  # a fence gave up waiting: the blocks may have been reused mid-copy
    copied: threading.Event = field(default_factory=threading.Event)


class TransferStats:
    """Counters since the last :meth:`take` (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self.bytes = dict.fromkeys(_DIRECTIONS, 0)
        self.ops = dict.fromkeys(_DIRECTIONS, 0)
        self.spills_dropped = 0
        self.failures: Counter[str] = Counter()
        self.reads_retried: Counter[str] = Counter()  # by the first read's failure
        self.reads_recovered = 0  # retried reads that then succeeded
        self.latency: dict[str, list[float]] = {kind: [] for kind in _JOB_KINDS}

    def moved(self, direction: str, nbytes: int, ops: int = 1) -> None:
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
                self.spills_dropped += 1
            elif not result.ok:
                self.failures[result.failure or "unknown"] += 1
            samples = self.latency[kind]
            if seconds is not None and len(samples) < _LATENCY_SAMPLES:
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


class TransferEngine:
    """Moves KV bytes between device blocks, host slots and disk slots, as told."""

    def __init__(
        self,
        kv: KVViews,
        host: HostPool,
        slab: Any | None,
        *,
        backend: CopyBackend,
        io_threads: int = 2,
        spill_queue_depth: int = 64,
        load_timeout_s: float = 30.0,
        slab_executor: Any | None = None,
    ) -> None:
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        if spill_queue_depth < 1:
            raise ValueError(f"spill_queue_depth must be >= 1, got {spill_queue_depth}")
        if load_timeout_s <= 0:
            raise ValueError(f"load_timeout_s must be > 0, got {load_timeout_s}")
        self.kv = kv
        self.host = host
        self.slab = slab
        self.backend = backend
        self.chunk_blocks = kv.chunk_blocks_for(host.payload_bytes)
        self.io_threads = io_threads
        self.spill_queue_depth = spill_queue_depth
        self.load_timeout_s = load_timeout_s
        self._slab_exec = slab_executor
        self._owns_slab_exec = slab_executor is None
        # Leave one I/O thread to reads: a burst of spill writes never queues a load's read
        # behind more than one write.
        self._spill_workers_n = max(1, io_threads - 1)
        self._read_window = max(2, io_threads)  # disk reads a load keeps ahead of its h2d
        self._max_batch_pairs = max(1, min(512, _MAX_STAGING_BYTES // host.payload_bytes))
        self.stats = TransferStats()

        # Shared with the caller's threads, under _lock.
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        self._result_ready = threading.Condition(self._lock)
        self._start_lock = threading.Lock()
        self._seq = itertools.count(1)
        self._pending: dict[int, Job] = {}
        self._results: list[JobResult] = []
        self._tickets: dict[int, _StoreTicket] = {}
        self._block_tickets: dict[int, set[int]] = {}
        self._closed = False
        self._stopped = False
        self._error: EngineDeadError | None = None  # set once, when an engine thread died
        self._device_paused = False  # vLLM sleep mode: the device memory is going away

        # Event-loop side (only touched from the loop thread once it runs).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._guard = SlotGuard()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._spill_queue: asyncio.Queue[tuple[int, SpillJob, float]] | None = None
        self._spill_tasks: list[asyncio.Task[Any]] = []
        self._d2h: CopyLane | None = None
        self._h2d: CopyLane | None = None

    # ================================================================== caller-side API

    def submit(self, jobs: Sequence[Job], *, inline_max_bytes: int = 0) -> None:
        """Queue jobs; returns at once. Thread-safe. Results arrive through :meth:`poll`.

        Loads whose chunks are all in host slots skip the event loop: they run start to end
        on the h2d lane thread, or, on a CPU device when they move at most
        ``inline_max_bytes``, right here in the caller's thread before this returns. Why:
        while vLLM waits for a load its engine thread spins on empty steps holding the GIL,
        and every thread a job crosses waits up to a switch interval (5 ms) for it; a
        host-tier hit had three or four such crossings.
        On CPU vLLM calls ``start_load_kv`` for asynchronous loads *after* the step's
        forward, so an inline copy (a memcpy, GIL released) delays no computation, and the
        load is reported by the same step's ``get_finished``: the request runs one whole step
        earlier than if the copy were still on a lane when the step ended. A big load
        (a long context) would hold the whole engine meanwhile; the caller bounds it.
        """
        jobs = list(jobs)
        if not jobs:
            return
        for job in jobs:
            if not isinstance(job, StoreJob | SpillJob | PromoteJob | LoadJob):
                raise TypeError(f"not a transfer job: {job!r}")
        now = time.monotonic()
        touches_device = any(isinstance(j, StoreJob | LoadJob) for j in jobs)
        mark = compute_mark(self.kv.device) if touches_device else None
        entries = []
        with self._lock:
            closed = self._closed
            paused = self._device_paused
            for job in jobs:
                seq = next(self._seq)
                self._pending[seq] = job
                ticket = None
                if isinstance(job, StoreJob):
                    ticket = _StoreTicket(seq, job, mark)
                    self._tickets[seq] = ticket
                    for block in job.block_ids:
                        self._block_tickets.setdefault(block, set()).add(seq)
                entries.append((seq, job, ticket, now, mark))
        # Shut down: nothing runs. Paused for sleep mode: nothing touches the device.
        accepted = []
        for entry in entries:
            seq, job, _, t0, _ = entry
            if closed or (paused and isinstance(job, StoreJob | LoadJob)):
                self._finish(seq, _failed(job, FailureCause.CANCELLED, _device_ids(job)), t0)
            else:
                accepted.append(entry)
        if not accepted:
            return
        loop = self._ensure_started()
        if self._closed:  # it died (perhaps just now, starting) or shut down: nothing runs
            for seq, job, _, t0, _ in accepted:
                self._finish(seq, _failed(job, FailureCause.CANCELLED, _device_ids(job)), t0)
            return
        inline_budget = inline_max_bytes if self.kv.device.type == "cpu" else 0
        queued = []
        for entry in accepted:
            seq, job, _, t0, mark = entry
            if not (isinstance(job, LoadJob) and all(c.disk_slot is None for c in job.chunks)):
                queued.append(entry)
            elif inline_budget > 0 and self._load_bytes(job) <= inline_budget:
                self._load_host(seq, job, t0, mark, on_lane=False)
            else:
                assert self._h2d is not None
                call = self._h2d.call(self._load_host, seq, job, t0, mark, True)
                call.add_done_callback(partial(self._lane_call_done, seq, job, t0))
        if not queued:
            return
        try:
            loop.call_soon_threadsafe(self._dispatch, queued)
        except RuntimeError:  # the loop stopped under us (shutdown raced this submit)
            for seq, job, _, t0, _ in queued:
                self._finish(seq, _failed(job, FailureCause.CANCELLED, _device_ids(job)), t0)

    def _lane_call_done(self, seq: int, job: LoadJob, t0: float, call: cf.Future[Any]) -> None:
        """A host-tier load the h2d lane never ran (it died) still gets its result."""
        if call.cancelled() or call.exception() is not None:
            self._finish(seq, _failed(job, FailureCause.CANCELLED, _device_ids(job)), t0)

    def _load_bytes(self, job: LoadJob) -> int:
        return sum(len(chunk.block_ids) for chunk in job.chunks) * self.kv.total_block_bytes

    def poll(self) -> list[JobResult]:
        """Results completed since the last poll (non-blocking)."""
        with self._lock:
            results, self._results = self._results, []
        return results

    def wait_for_results(self, timeout_s: float) -> bool:
        """Sleep (GIL released) until a result is ready to poll or nothing is in flight;
        False after ``timeout_s``. For a caller that has nothing else to do meanwhile."""
        with self._result_ready:
            return self._result_ready.wait_for(
                lambda: bool(self._results) or not self._pending, max(0.0, timeout_s)
            )

    def fence_blocks(self, block_ids: Iterable[int], timeout_s: float = 5.0) -> None:
        """Before vLLM reuses ``block_ids``: no store may still read them afterwards.

        Stores not started yet are cancelled (result ``cancelled``); running ones are waited
        for. A store still running at the timeout is reported failed (``cancelled``), since
        its bytes may come from the blocks' next tenant. Returns at once when none match.
        """
        waits: list[_StoreTicket] = []
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
                if ticket.state == _QUEUED:
                    ticket.state = _CANCELLED
                    self._unregister(ticket)
                    ticket.copied.set()
                elif ticket.state == _RUNNING:
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

    def pause_device_jobs(self, timeout_s: float = 10.0) -> bool:
        """Before vLLM releases the device memory (sleep mode): from now on stores and loads
        are cancelled at submit, queued stores are cancelled, and running device copies are
        waited for, up to ``timeout_s``. Spills and promotions (host <-> disk) go on.
        True when no job touches the device any more."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._lock:
            self._device_paused = True
        self.fence_blocks(range(self.kv.num_blocks), timeout_s)

        def device_quiet() -> bool:
            return not any(isinstance(j, StoreJob | LoadJob) for j in self._pending.values())

        with self._result_ready:
            quiet = self._result_ready.wait_for(
                device_quiet, max(0.0, deadline - time.monotonic())
            )
        if not quiet:
            logger.error("tieredkv: device copies still running %.1f s after sleep was "
                         "requested", timeout_s)
        return quiet

    def resume_device_jobs(self) -> None:
        """The device memory is back (wake up): accept stores and loads again."""
        with self._lock:
            self._device_paused = False

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted job has a result; False on timeout."""
        with self._drained:
            return self._drained.wait_for(lambda: not self._pending, timeout_s)

    @property
    def error(self) -> EngineDeadError | None:
        """Why the engine is dead (``__cause__``: what killed its thread); None while it works."""
        return self._error

    def take_stats(self) -> dict[str, Any]:
        """Counters and latency samples since the last call, plus current queue depths."""
        queue = self._spill_queue
        with self._lock:
            in_flight = len(self._pending)
        gauges = {
            "spill_queue": queue.qsize() if queue is not None else 0,
            "d2h_queue": self._d2h.queued if self._d2h is not None else 0,
            "h2d_queue": self._h2d.queued if self._h2d is not None else 0,
            "jobs_in_flight": in_flight,
            "host_slots_in_flight": self._guard.in_flight,
        }
        return self.stats.take(gauges)

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Finish in-flight jobs for up to ``timeout_s``, cancel the rest (each gets a result),
        stop the loop and join its thread. Idempotent; bounded even with a hung disk."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = self._closed = True
            for ticket in self._tickets.values():
                if ticket.state == _QUEUED:
                    ticket.state = _CANCELLED
                    self._unregister(ticket)
                    ticket.copied.set()
        deadline = time.monotonic() + max(0.0, timeout_s)
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None:
            try:
                if self._error is None:  # a dead engine has nothing left to finish
                    future = asyncio.run_coroutine_threadsafe(self._shutdown_async(deadline), loop)
                    future.result(max(0.0, deadline - time.monotonic()) + 1.0)
            except (RuntimeError, cf.TimeoutError, cf.CancelledError) as exc:
                logger.warning("tieredkv: transfer engine shutdown was not clean: %r", exc)
            try:
                loop.call_soon_threadsafe(loop.stop)
            except RuntimeError:
                pass
            thread.join(max(0.0, deadline - time.monotonic()) + 1.0)
            if thread.is_alive():
                logger.warning("tieredkv: transfer loop thread did not stop; abandoning it")
            for lane in (self._d2h, self._h2d):
                if lane is not None:
                    lane.stop(0.0)
            if self._owns_slab_exec and self._slab_exec is not None:
                self._slab_exec.shutdown(wait_s=max(0.0, deadline - time.monotonic()))
        with self._lock:
            leftovers = list(self._pending.items())
        for seq, job in leftovers:
            self._finish(seq, _failed(job, FailureCause.CANCELLED, _device_ids(job)), None)

    # ================================================================== bookkeeping

    def _finish(self, seq: int, result: JobResult, t0: float | None) -> None:
        """Record a job's one result (later attempts for the same job are ignored)."""
        with self._lock:
            job = self._pending.pop(seq, None)
            if job is None:
                return
            self._results.append(result)
            self._result_ready.notify_all()
            ticket = self._tickets.pop(seq, None)
            if ticket is not None:
                self._unregister(ticket)
                ticket.copied.set()
            if not self._pending:
                self._drained.notify_all()
        seconds = None if t0 is None else time.monotonic() - t0
        self.stats.finished(_kind_of(job), result, seconds)

    def _unregister(self, ticket: _StoreTicket) -> None:
        for block in ticket.job.block_ids:
            seqs = self._block_tickets.get(block)
            if seqs is not None:
                seqs.discard(ticket.seq)
                if not seqs:
                    del self._block_tickets[block]

    def _ticket_start(self, ticket: _StoreTicket) -> bool:
        """Lane thread, right before the copy: False if the store was cancelled meanwhile."""
        with self._lock:
            if ticket.state != _QUEUED:
                return False
            ticket.state = _RUNNING
            return True

    def _ticket_done(self, ticket: _StoreTicket, ok: bool) -> None:
        """Lane thread, right after the copy finished: the device blocks are free to reuse."""
        with self._lock:
            ticket.state = _DONE
            self._unregister(ticket)
            ticket.copied.set()

    # ================================================================== death

    def _die(self, where: str, cause: BaseException) -> None:
        """A thread of the engine died (any thread may call this): fail everything, once."""
        if self._mark_dead(where, cause):
            self._fail_pending()

    def _mark_dead(self, where: str, cause: BaseException) -> bool:
        """Refuse every job from now on and log the cause; False if already dead or stopping."""
        with self._lock:
            if self._error is not None or self._stopped:
                return False
            error = EngineDeadError(f"tieredkv transfer engine: {where} died: {cause!r}")
            error.__cause__ = cause
            self._error = error
            self._closed = True
            for ticket in self._tickets.values():
                if ticket.state == _QUEUED:
                    ticket.state = _CANCELLED
                    self._unregister(ticket)
                    ticket.copied.set()
        logger.error(
            "tieredkv: the transfer engine is dead: %s died. Every pending and later job "
            "fails (loads are recomputed, stores are reported finished); KV offloading is off "
            "until the worker restarts", where, exc_info=cause,
        )
        return True

    def _fail_pending(self) -> None:
        """Report every pending job failed; first let a running h2d copy end (bounded), so
        that no copy lands on blocks vLLM recomputes once their load is reported failed.
        (Copies queued behind it do not run: ``_copy_h2d`` refuses them now.)"""
        lane = self._h2d
        if lane is not None and lane.alive and not lane.on_lane_thread():
            try:
                lane.call(_noop).result(timeout=self.load_timeout_s)
            except cf.TimeoutError:
                logger.error("tieredkv: an h2d copy is still running %.1f s after the transfer "
                             "engine died; its load is reported failed anyway", self.load_timeout_s)
            except Exception:  # noqa: BLE001 - the lane died as well: nothing runs on it
                pass
        with self._lock:
            leftovers = list(self._pending.items())
        for seq, job in leftovers:
            self._finish(seq, _failed(job, FailureCause.CANCELLED, _device_ids(job)), None)

    def _lane_died(self, name: str, cause: BaseException) -> None:
        self._die(f"the {name} copy lane thread", cause)

    # ================================================================== event loop

    def _ensure_started(self) -> asyncio.AbstractEventLoop:
        if self._loop is not None:
            return self._loop
        with self._start_lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                ready = threading.Event()
                thread = threading.Thread(
                    target=self._run_loop, args=(loop, ready), name="tieredkv-transfer",
                    daemon=True,
                )
                thread.start()
                ready.wait()
                self._thread = thread
                self._loop = loop
        return self._loop

    def _run_loop(self, loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        try:
            self._setup()
        except BaseException as exc:  # noqa: BLE001 - reported: every job fails, none waits
            self._mark_dead("the transfer loop (starting)", exc)
            ready.set()  # submit() sees the error once this is set
            self._fail_pending()
            for lane in (self._d2h, self._h2d):
                if lane is not None:
                    lane.stop(0.0)
            loop.close()
            return
        ready.set()
        cause: BaseException | None = None
        try:
            loop.run_forever()
        except BaseException as exc:  # noqa: BLE001 - reported below, never silent
            cause = exc
        finally:
            with self._lock:
                stopping = self._stopped
            if not stopping:  # only shutdown() stops the loop
                self._die("the transfer loop thread",
                          cause or RuntimeError("the transfer loop stopped without a shutdown"))
            leftovers = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in leftovers:
                task.cancel()
            try:
                if leftovers:
                    loop.run_until_complete(asyncio.wait(leftovers, timeout=1.0))
            except BaseException as exc:  # noqa: BLE001 - every job has its result already
                logger.debug("tieredkv: cancelling the transfer loop's tasks: %r", exc)
            loop.close()

    def _setup(self) -> None:
        device = self.kv.device
        self._d2h = CopyLane("d2h", device, self._copy_d2h, self._max_batch_pairs,
                             on_death=partial(self._lane_died, "d2h"))
        self._h2d = CopyLane("h2d", device, self._copy_h2d, self._max_batch_pairs,
                             on_death=partial(self._lane_died, "h2d"))
        self._spill_queue = asyncio.Queue(maxsize=self.spill_queue_depth)
        if self.slab is not None:
            if self._slab_exec is None:
                # Imported here: disk-tier modules stay out of GPU-only runs.
                from tieredkv.disk.async_io import SlabExecutor

                self._slab_exec = SlabExecutor(self.io_threads, on_death=self._die)
            loop = asyncio.get_event_loop()
            self._spill_tasks = [
                loop.create_task(self._spill_worker()) for _ in range(self._spill_workers_n)
            ]

    def _copy_d2h(self, pairs: list[tuple[int, int, Sequence[int]]]) -> None:
        self._refuse_if_dead()
        self.backend.d2h(self.kv, self.host, pairs)

    def _copy_h2d(self, pairs: list[tuple[int, int, Sequence[int]]]) -> None:
        self._refuse_if_dead()  # its load is reported failed: vLLM recomputes those blocks
        self.backend.h2d(self.kv, self.host, pairs)

    def _refuse_if_dead(self) -> None:
        error = self._error
        if error is not None:
            raise EngineDeadError(str(error)) from error.__cause__

    def _dispatch(self, entries: list[tuple[int, Job, _StoreTicket | None, float, Any]]) -> None:
        loop = asyncio.get_running_loop()
        for seq, job, ticket, t0, mark in entries:
            if self._closed:
                self._finish(seq, _failed(job, FailureCause.CANCELLED, _device_ids(job)), t0)
                continue
            if isinstance(job, SpillJob):
                self._enqueue_spill(seq, job, t0)
                continue
            if isinstance(job, StoreJob):
                assert ticket is not None
                coro = self._store(seq, job, ticket, t0)
            elif isinstance(job, LoadJob):
                coro = self._load(seq, job, t0, mark)
            else:
                coro = self._promote(seq, job, t0)
            task = loop.create_task(coro)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _release_after(self, slot: int, write: bool, pending: object | None) -> None:
        """Release a slot now, or once a timed-out disk call that still uses it returns."""
        if not isinstance(pending, cf.Future) or pending.done():
            self._guard.release(slot, write)
            return
        loop = asyncio.get_running_loop()
        logger.warning("tieredkv: host slot %d stays reserved until a timed-out disk call returns",
                       slot)

        def _later(_: cf.Future[Any]) -> None:
            try:
                loop.call_soon_threadsafe(self._guard.release, slot, write)
            except RuntimeError:
                pass  # the loop is gone; so is the guard's meaning

        pending.add_done_callback(_later)

    # ------------------------------------------------------------------ stores

    async def _store(self, seq: int, job: StoreJob, ticket: _StoreTicket, t0: float) -> None:
        result = _failed(job, FailureCause.CANCELLED)
        holding = False
        try:
            pairs = [(job.host_slot, 0, job.block_ids)]
            try:
                check_pairs(self.kv, self.host, self.chunk_blocks, pairs)
            except ValueError as exc:
                logger.error("tieredkv: store %d rejected: %s", job.job_id, exc)
                result = _failed(job, FailureCause.COPY_ERROR)
                return
            if ticket.state != _QUEUED:
                return  # fenced before it started
            if not self._guard.try_write(job.host_slot):
                result = _failed(job, FailureCause.COPY_ERROR)
                return
            holding = True
            request = CopyRequest(
                pairs, after=ticket.mark, start=partial(self._ticket_start, ticket),
                done=partial(self._ticket_done, ticket),
            )
            outcome = await self._d2h.copy(request)  # type: ignore[union-attr]
            if outcome is None and not ticket.late:
                self.stats.moved("d2h", len(job.block_ids) * self.kv.total_block_bytes)
                result = JobResult.done(job.job_id)
            elif outcome is None or outcome == FailureCause.CANCELLED:
                result = _failed(job, FailureCause.CANCELLED)
            else:
                result = _failed(job, FailureCause.COPY_ERROR)
        finally:
            if holding:
                self._guard.release(job.host_slot, True)
            with self._lock:
                if ticket.state in (_QUEUED, _RUNNING):
                    ticket.state = _DONE
                self._unregister(ticket)
                ticket.copied.set()
            self._finish(seq, result, t0)

    # ------------------------------------------------------------------ spills

    def _enqueue_spill(self, seq: int, job: SpillJob, t0: float) -> None:
        if self.slab is None:
            self._finish(seq, _failed(job, "missing"), t0)
            return
        assert self._spill_queue is not None
        try:
            self._spill_queue.put_nowait((seq, job, t0))
        except asyncio.QueueFull:
            self._finish(seq, _failed(job, FailureCause.DROPPED), t0)

    async def _spill_worker(self) -> None:
        assert self._spill_queue is not None
        while True:
            seq, job, t0 = await self._spill_queue.get()
            try:
                await self._spill(seq, job, t0)
            finally:
                self._spill_queue.task_done()

    async def _spill(self, seq: int, job: SpillJob, t0: float) -> None:
        result = _failed(job, FailureCause.CANCELLED)
        holding, pending = False, None
        try:
            if not 0 <= job.host_slot < self.host.num_slots:
                result = _failed(job, FailureCause.COPY_ERROR)
                return
            if not self._guard.try_read(job.host_slot):
                result = _failed(job, FailureCause.COPY_ERROR)
                return
            holding = True
            await self._slab_exec.write(
                self.slab, job.disk_slot, job.key, self.host.slot_memoryview(job.host_slot),
                timeout=self.load_timeout_s, aliases=job.aliases,
            )
            self.stats.moved("spill", self.host.payload_bytes)
            result = JobResult.done(job.job_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes a result
            pending = getattr(exc, "pending", None)
            result = _failed(job, failure_kind(exc))
            logger.debug("tieredkv: spill %d failed: %s", job.job_id, exc)
        finally:
            if holding:
                self._release_after(job.host_slot, False, pending)
            self._finish(seq, result, t0)

    # ------------------------------------------------------------------ disk reads

    async def _read_slot(self, key: bytes, disk_slot: int, host_slot: int, deadline: float,
                         retry_s: float | None = None) -> str | None:
        """Read and verify a disk slot into a host slot the caller holds for writing, by
        ``deadline`` (loop time).

        A transient failure (I/O error, short read, timeout) gets one more read, by
        ``deadline`` or, with ``retry_s``, within that long after the failure. A timed-out
        read is read again only once its stuck call has returned (two reads never share a
        slot): this waits for it within the same budget. Retries are counted
        (``reads_retried``, ``reads_recovered``); a failure after them is the job's result.

        Returns None on success or the failure name. On failure the guard is released (or
        kept until a timed-out read really returns); on success the caller still holds it.
        """
        loop = asyncio.get_running_loop()
        pending: Any = None
        try:
            failure, again, pending = await self._read_once(key, disk_slot, host_slot,
                                                            deadline - loop.time())
            if again:
                end = deadline if retry_s is None else loop.time() + retry_s
                if await self._call_returned(pending, end - loop.time()) and loop.time() < end:
                    assert failure is not None
                    self.stats.read_retried(failure)
                    logger.debug("tieredkv: reading disk slot %d again after %s", disk_slot, failure)
                    failure, _, pending = await self._read_once(key, disk_slot, host_slot,
                                                                end - loop.time())
                    if failure is None:
                        self.stats.read_recovered()
        except asyncio.CancelledError:
            self._release_after(host_slot, True, pending)
            raise
        if failure is not None:
            self._release_after(host_slot, True, pending)
            return failure
        self.stats.moved("restore", self.host.payload_bytes)
        return None

    async def _read_once(self, key: bytes, disk_slot: int, host_slot: int,
                         timeout: float) -> tuple[str | None, bool, Any]:
        """One verified read: (failure or None, worth another read, the timed-out call that
        may still write into the slot or None)."""
        try:
            await self._slab_exec.read_into(
                self.slab, disk_slot, key, self.host.slot_memoryview(host_slot),
                timeout=max(0.0, timeout),
            )
        except Exception as exc:  # noqa: BLE001 - every failure becomes a result
            logger.debug("tieredkv: disk slot %d -> host slot %d failed: %s", disk_slot,
                         host_slot, exc)
            return failure_kind(exc), _transient(exc), getattr(exc, "pending", None)
        return None, False, None

    @staticmethod
    async def _call_returned(call: Any, timeout: float) -> bool:
        """Wait up to ``timeout`` for a timed-out disk call to return; True once it has
        (or when there is none)."""
        if not isinstance(call, cf.Future) or call.done():
            return True
        if timeout <= 0:
            return False
        loop = asyncio.get_running_loop()
        returned = asyncio.Event()

        def _wake(_: cf.Future[Any]) -> None:
            try:
                loop.call_soon_threadsafe(returned.set)
            except RuntimeError:
                pass  # the loop is gone

        call.add_done_callback(_wake)
        try:
            await asyncio.wait_for(returned.wait(), timeout)
        except TimeoutError:
            pass
        return call.done()

    async def _promote(self, seq: int, job: PromoteJob, t0: float) -> None:
        result = _failed(job, FailureCause.CANCELLED)
        try:
            if self.slab is None:
                result = _failed(job, "missing")
                return
            if not 0 <= job.host_slot < self.host.num_slots:
                result = _failed(job, FailureCause.COPY_ERROR)
                return
            if not self._guard.try_write(job.host_slot):
                result = _failed(job, FailureCause.COPY_ERROR)
                return
            # Nobody waits on a promotion past the scheduler's own deadline (it then serves
            # what is in memory), so a retry gets a budget of its own: a timed-out read can
            # be read again once its stuck call returned.
            deadline = asyncio.get_running_loop().time() + self.load_timeout_s
            failure = await self._read_slot(job.key, job.disk_slot, job.host_slot, deadline,
                                            retry_s=self.load_timeout_s)
            if failure is None:
                self._guard.release(job.host_slot, True)
                result = JobResult.done(job.job_id)
            else:
                result = _failed(job, failure)
        finally:
            self._finish(seq, result, t0)

    async def _read_chunk(self, chunk: LoadChunk, deadline: float) -> str | None:
        if self.slab is None:
            return "missing"
        if not self._guard.try_write(chunk.host_slot):
            return FailureCause.COPY_ERROR
        # A load was promised: its retry must fit in the load's own deadline.
        return await self._read_slot(chunk.key, chunk.disk_slot, chunk.host_slot,  # type: ignore[arg-type]
                                     deadline)

    # ------------------------------------------------------------------ loads

    async def _load(self, seq: int, job: LoadJob, t0: float, mark: Any) -> None:
        loop = asyncio.get_running_loop()
        chunks = job.chunks
        deadline = loop.time() + self.load_timeout_s
        held: list[tuple[int, bool]] = []  # guards this job releases when it ends
        reads: dict[int, asyncio.Task[str | None]] = {}
        copies: list[asyncio.Task[object]] = []
        loaded = 0  # chunks confirmed on the device, a prefix
        failure: str | None = None
        failed_from = len(chunks)
        try:
            for i, chunk in enumerate(chunks):
                try:
                    check_pairs(self.kv, self.host, self.chunk_blocks,
                                [(chunk.host_slot, chunk.first_block, chunk.block_ids)])
                except ValueError as exc:
                    logger.error("tieredkv: load %d chunk %d rejected: %s", job.job_id, i, exc)
                    failure, failed_from = FailureCause.COPY_ERROR, i
                    break
            valid = failed_from
            launched = 0
            for i in range(valid):
                # Keep the next disk reads running while this chunk waits or goes h2d.
                while launched < min(i + 1 + self._read_window, valid):
                    ahead = chunks[launched]
                    if ahead.disk_slot is not None:
                        reads[launched] = loop.create_task(self._read_chunk(ahead, deadline))
                    launched += 1
                chunk = chunks[i]
                if chunk.disk_slot is not None:
                    read_failure = await reads.pop(i)
                    if read_failure is not None:
                        failure, failed_from = read_failure, i
                        break
                    held.append((chunk.host_slot, True))
                elif self._guard.try_read(chunk.host_slot):
                    held.append((chunk.host_slot, False))
                else:
                    failure, failed_from = FailureCause.COPY_ERROR, i
                    break
                request = CopyRequest([(chunk.host_slot, chunk.first_block, chunk.block_ids)],
                                      after=mark)
                copies.append(loop.create_task(self._h2d.copy(request)))  # type: ignore[union-attr]
            # Every issued copy must be over before the result: a failed block is recomputed
            # into, so a late h2d must not land on it afterwards.
            for i, task in enumerate(copies):
                outcome = await task
                if outcome is None and i == loaded:
                    loaded += 1
                    self.stats.moved("h2d", len(chunks[i].block_ids) * self.kv.total_block_bytes)
                elif outcome is not None and i < failed_from:
                    logger.error("tieredkv: load %d chunk %d h2d failed: %r", job.job_id, i, outcome)
                    failure, failed_from = FailureCause.COPY_ERROR, i
            # Reads launched past a failure: let them end (bounded by the deadline).
            for i, task in list(reads.items()):
                del reads[i]
                if await task is None:
                    self._guard.release(chunks[i].host_slot, True)
        except asyncio.CancelledError:
            failure, failed_from = FailureCause.CANCELLED, min(failed_from, loaded)
            for task in [*reads.values(), *copies]:
                task.cancel()
            raise
        finally:
            for slot, write in held:
                self._guard.release(slot, write)
            self._finish(seq, _load_result(job, failure, failed_from), t0)

    # ------------------------------------------------------------------ host-tier loads

    def _load_host(self, seq: int, job: LoadJob, t0: float, mark: Any, on_lane: bool) -> None:
        """A load whose chunks are all in host slots, start to end in one thread: the h2d
        lane thread (``on_lane``: on its stream, after ``mark``) or the CPU caller itself."""
        chunks = job.chunks
        failure: str | None = None
        failed_from = len(chunks)
        held: list[int] = []
        try:
            if self._closed:
                failure, failed_from = FailureCause.CANCELLED, 0
                return
            pairs: list[tuple[int, int, Sequence[int]]] = []
            for i, chunk in enumerate(chunks):
                pair = (chunk.host_slot, chunk.first_block, chunk.block_ids)
                try:
                    check_pairs(self.kv, self.host, self.chunk_blocks, [pair])
                except ValueError as exc:
                    logger.error("tieredkv: load %d chunk %d rejected: %s", job.job_id, i, exc)
                    failure, failed_from = FailureCause.COPY_ERROR, i
                    break
                if not self._guard.try_read(chunk.host_slot):
                    failure, failed_from = FailureCause.COPY_ERROR, i
                    break
                held.append(chunk.host_slot)
                pairs.append(pair)
            if not pairs:
                return
            try:
                if on_lane:
                    assert self._h2d is not None
                    self._h2d.run(partial(self.backend.h2d, self.kv, self.host, pairs),
                                  () if mark is None else (mark,))
                else:
                    self.backend.h2d(self.kv, self.host, pairs)
            except Exception as exc:  # noqa: BLE001 - reported as the job's failure
                logger.error("tieredkv: load %d h2d failed: %r", job.job_id, exc)
                failure, failed_from = FailureCause.COPY_ERROR, 0
            else:
                moved = sum(len(ids) for _, _, ids in pairs) * self.kv.total_block_bytes
                self.stats.moved("h2d", moved, ops=len(pairs))
        finally:
            for slot in held:
                self._guard.release(slot, False)
            self._finish(seq, _load_result(job, failure, failed_from), t0)

    # ------------------------------------------------------------------ shutdown

    async def _shutdown_async(self, deadline: float) -> None:
        queue = self._spill_queue
        if queue is not None:
            while not queue.empty():
                seq, job, t0 = queue.get_nowait()
                queue.task_done()
                self._finish(seq, _failed(job, FailureCause.CANCELLED), t0)
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending:
                    break
            await asyncio.sleep(0.005)
        tasks = [t for t in (*self._tasks, *self._spill_tasks) if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)


def _load_result(job: LoadJob, failure: str | None, failed_from: int) -> JobResult:
    """A load's result: on failure, every device block of chunk ``failed_from`` onwards
    (the chunks before it are on the device; vLLM recomputes the rest)."""
    if failure is None:
        return JobResult.done(job.job_id)
    failed = tuple(b for chunk in job.chunks[failed_from:] for b in chunk.block_ids)
    return _failed(job, failure, failed)


def _device_ids(job: Job) -> tuple[int, ...]:
    """Device blocks a cancelled job leaves unloaded (loads only report these)."""
    return job.block_ids if isinstance(job, LoadJob) else ()
