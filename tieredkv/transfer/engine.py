"""The worker's transfer engine: routes each job by its move to one handler, reports results.

vLLM's worker thread only ever calls the non-blocking ``submit``/``poll`` (plus
``fence_blocks`` before a forward that reuses freed blocks). A job's
:class:`~tieredkv.protocol.Move` (its source and destination media) picks its one handler,
and the handler picks the thread that runs it:

- store (device -> host) and load (host -> device), :mod:`~tieredkv.transfer.device_jobs`:
  a store is a coroutine on the engine's event loop (one daemon thread, started on the first
  job that needs it) awaiting the d2h copy lane, which batches whatever queued up while its
  previous batch ran; a load never crosses the loop: start to end on the h2d lane thread, or
  inline in the caller's thread on CPU (see ``device_jobs``);
- spill (host -> disk) and promote (disk -> host), :mod:`~tieredkv.transfer.disk_jobs`:
  coroutines on the event loop awaiting the slab executor's bounded pool of I/O threads;
  spills pass a bounded queue, so a slow disk drops them (counted) instead of delaying others;
- remote read and write (host <-> remote), :mod:`~tieredkv.transfer.remote_driver`: sent
  from the store's own thread, landed (verified, copied into host slots) on the remote
  jobs' landing thread. Without a remote tier on this worker there is no driver: the engine
  fails each remote job ``unavailable`` itself (the scheduler counts it and recomputes).

Handlers see the engine only as a :class:`~tieredkv.transfer.runtime.Runtime`.
Every submitted job gets exactly one :class:`JobResult`, also when it is cancelled, fenced or
shut down.

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
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import replace
from typing import Any

from tieredkv.protocol import FailureCause, Job, JobResult, Medium, Move
from tieredkv.transfer.backends.base import CopyBackend
from tieredkv.transfer.device_jobs import DeviceJobs
from tieredkv.transfer.disk_jobs import DiskJobs
from tieredkv.transfer.host_pool import HostPool, SlotGuard
from tieredkv.transfer.kv_views import KVViews
from tieredkv.transfer.lanes import compute_mark
from tieredkv.transfer.remote_driver import RemoteDriver
from tieredkv.transfer.remote_jobs import RemoteJobs
from tieredkv.transfer.runtime import Entry, Handler, TransferStats, cancelled

logger = logging.getLogger(__name__)

_MAX_STAGING_BYTES = 256 * 1024 * 1024  # bounds one copy batch (the CUDA staging buffer)

class EngineDeadError(RuntimeError):
    """The transfer engine can no longer run jobs; ``__cause__`` is what killed it."""


def _noop() -> None:
    pass


class TransferEngine:
    """Moves KV bytes between device blocks, host slots, disk slots and the shared store,
    as told; it is the :class:`~tieredkv.transfer.runtime.Runtime` of its handlers."""

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
        remote: RemoteJobs | None = None,
    ) -> None:
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        if spill_queue_depth < 1:
            raise ValueError(f"spill_queue_depth must be >= 1, got {spill_queue_depth}")
        if load_timeout_s <= 0:
            raise ValueError(f"load_timeout_s must be > 0, got {load_timeout_s}")
        self.kv = kv
        self.load_timeout_s = load_timeout_s  # the disk handler's deadline, and a fence's
        self.stats = TransferStats()

        # Shared with the caller's threads, under _lock.
        self._lock = threading.Lock()
        self._result_ready = threading.Condition(self._lock)
        self._start_lock = threading.Lock()
        self._seq = itertools.count(1)
        self._pending: dict[int, Job] = {}  # seq -> job
        self._results: list[JobResult] = []
        self._closed = False
        self._stopped = False
        self._error: EngineDeadError | None = None  # set once, when an engine thread died
        self._device_paused = False  # vLLM sleep mode: the device memory is going away

        # One handler per move; every handler takes host slots through one guard.
        self._guard = SlotGuard()
        self._device = DeviceJobs(
            kv, host, backend, self._guard, self, self._lock,
            max_batch_pairs=max(1, min(512, _MAX_STAGING_BYTES // host.payload_bytes)))
        self._disk = DiskJobs(host, slab, self._guard, self, io_threads=io_threads,
                              spill_queue_depth=spill_queue_depth, timeout_s=load_timeout_s)
        self._remote = None if remote is None else RemoteDriver(
            remote, self._guard, self, host.payload_bytes, chunk_rows=self._device.chunk_blocks, kv=kv)
        remote_reads = self._unavailable if self._remote is None else self._remote.submit_reads
        remote_writes = self._unavailable if self._remote is None else self._remote.submit_writes
        # Handlers that never block come first: an inline load holds the caller's thread.
        self._routes: dict[Move, Handler] = {
            Move.REMOTE_READ: remote_reads,
            Move.PROMOTE: self._disk.submit_promotions,
            Move.SPILL: self._disk.submit_spills,
            Move.REMOTE_WRITE: remote_writes,
            Move.STORE: self._device.submit_stores,
            Move.LOAD: self._device.submit_loads,
        }

        # The event loop, started on the first job that needs it.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task[Any]] = set()  # stores and promotions (loop thread)

    # ================================================================== caller-side API

    @property
    def backend(self) -> CopyBackend:
        """The device<->host copy backend (looked up per copy: tests swap it)."""
        return self._device.backend

    @backend.setter
    def backend(self, backend: CopyBackend) -> None:
        self._device.backend = backend

    def submit(self, jobs: Sequence[Job], *, inline_max_bytes: int = 0) -> None:
        """Queue jobs; returns at once. Thread-safe. Results arrive through :meth:`poll`.

        Each job goes to its move's handler. ``inline_max_bytes``: on a CPU device, a load
        that moves at most this much runs here in the caller's thread (see ``device_jobs``;
        a big load would hold the engine meanwhile: the caller bounds it).
        """
        jobs = list(jobs)
        if not jobs:
            return
        for job in jobs:
            if not isinstance(job, Job):
                raise TypeError(f"not a transfer job: {job!r}")
        now = time.monotonic()
        mark = compute_mark(self.kv.device) if any(j.move.touches_device for j in jobs) else None
        routed: dict[Move, list[Entry]] = {}
        refused: list[Entry] = []
        with self._lock:
            closed, paused = self._closed, self._device_paused
            for job in jobs:
                seq = next(self._seq)
                self._pending[seq] = job
                entry = Entry(seq, job, now, mark, inline_max_bytes)
                # Shut down: nothing runs. Paused for sleep mode: nothing touches the device.
                if closed or (paused and job.move.touches_device):
                    refused.append(entry)
                else:
                    routed.setdefault(job.move, []).append(entry)
                    if job.move is Move.STORE:
                        self._device.admit_store_locked(entry)
        for entry in refused:
            self.finish(entry, cancelled(entry.job))
        if any(Medium.REMOTE not in (move.src, move.dst) for move in routed):
            self.ensure_started()  # the loop, lanes and I/O threads; dead: these jobs fail
        for move, handler in self._routes.items():
            if move in routed:
                handler(routed[move])

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
                lambda: bool(self._results) or not self._pending, max(0.0, timeout_s))

    def fence_blocks(self, block_ids: Iterable[int], timeout_s: float = 5.0) -> None:
        """Before vLLM reuses ``block_ids``: no store may still read them afterwards.

        Stores not started yet are cancelled (result ``cancelled``); running ones are waited
        for. A store still running at the timeout is reported failed (``cancelled``), since
        its bytes may come from the blocks' next tenant. Returns at once when none match.
        """
        self._device.fence(block_ids, timeout_s)

    def pause_device_jobs(self, timeout_s: float = 10.0) -> bool:
        """Before vLLM releases the device memory (sleep mode): from now on stores and loads
        are cancelled at submit, queued stores are cancelled, and running device copies are
        waited for, up to ``timeout_s``. Spills and promotions (host <-> disk) go on.
        True when no job touches the device any more."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._lock:
            self._device_paused = True
        self.fence_blocks(range(self.kv.num_blocks), timeout_s)

        with self._result_ready:
            quiet = self._result_ready.wait_for(
                lambda: not any(j.move.touches_device for j in self._pending.values()),
                max(0.0, deadline - time.monotonic()))
        if not quiet:
            logger.error("tieredkv: device copies still running %.1f s after sleep was "
                         "requested", timeout_s)
        return quiet

    def resume_device_jobs(self) -> None:
        """The device memory is back (wake up): accept stores and loads again."""
        with self._lock:
            self._device_paused = False

    @property
    def error(self) -> EngineDeadError | None:
        """Why the engine is dead (``__cause__``: what killed its thread); None while it works."""
        return self._error

    def take_stats(self) -> dict[str, Any]:
        """Counters and latency samples since the last call, plus current queue depths."""
        with self._lock:
            in_flight = len(self._pending)
        gauges = {
            "spill_queue": self._disk.queued_spills,
            "d2h_queue": self._device.d2h.queued if self._device.d2h is not None else 0,
            "h2d_queue": self._device.h2d.queued if self._device.h2d is not None else 0,
            "jobs_in_flight": in_flight,
            "host_slots_in_flight": self._guard.in_flight,
            **(self._remote.gauges() if self._remote is not None else {}),
        }
        writes_failed = self._remote.take_writes_failed() if self._remote is not None else 0
        return {**self.stats.take(gauges), "remote_writes_failed": writes_failed}

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Finish in-flight jobs for up to ``timeout_s``, cancel the rest (each gets a result),
        stop the loop and join its thread. Idempotent; bounded even with a hung disk."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = self._closed = True
            self._device.cancel_queued_locked()
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
            self._device.stop_lanes()
            self._disk.stop(wait_s=max(0.0, deadline - time.monotonic()))
        if self._remote is not None:
            self._remote.close(max(0.1, deadline - time.monotonic()))
        with self._lock:
            leftovers = list(self._pending.items())
        for seq, job in leftovers:
            self._finish(seq, cancelled(job), None)

    def _unavailable(self, entries: list[Entry]) -> None:
        """The remote moves' handler without a remote tier on this worker (no ``remote_url``,
        or the store failed to build): each job fails ``unavailable``."""
        for entry in entries:
            self.finish(entry, JobResult.fail(entry.job.job_id, FailureCause.UNAVAILABLE))

    # ================================================================== the handlers' runtime

    @property
    def closed(self) -> bool:
        """Shut down or dead: a job that has not started does not start."""
        return self._closed

    def finish(self, entry: Entry, result: JobResult) -> None:
        """Record a job's one result (later attempts for the same job are ignored)."""
        self._finish(entry.seq, result, entry.t0)

    def _finish(self, seq: int, result: JobResult, t0: float | None) -> None:
        seconds = None if t0 is None else time.monotonic() - t0
        if seconds is not None:
            result = replace(result, seconds=seconds)
        with self._lock:
            job = self._pending.pop(seq, None)
            if job is None:
                return
            self._results.append(result)
            self._result_ready.notify_all()
            self._device.settle_locked(seq)
        self.stats.finished(job.move, result, seconds)

    def on_loop(self, start: Callable[[list[Entry]], None], entries: list[Entry]) -> None:
        """Call ``start(entries)`` on the event loop thread (started now if need be); jobs it
        cannot take (the engine closed first) get ``cancelled``."""
        loop = self.ensure_started()
        if self._closed:  # it died (perhaps just now, starting) or shut down: nothing runs
            self._cancel(entries)
            return
        try:
            loop.call_soon_threadsafe(self._start_on_loop, start, entries)
        except RuntimeError:  # the loop stopped under us (shutdown raced this submit)
            self._cancel(entries)

    def _start_on_loop(self, start: Callable[[list[Entry]], None], entries: list[Entry]) -> None:
        if self._closed:
            self._cancel(entries)
        else:
            start(entries)

    def _cancel(self, entries: list[Entry]) -> None:
        for entry in entries:
            self.finish(entry, cancelled(entry.job))

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """A task of the event loop, kept until it ends (call on the loop thread)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def check_alive(self) -> None:
        error = self._error
        if error is not None:
            raise EngineDeadError(str(error)) from error.__cause__

    # ================================================================== death

    def die(self, where: str, cause: BaseException) -> None:
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
            self._device.cancel_queued_locked()
        logger.error(
            "tieredkv: the transfer engine is dead: %s died. Every pending and later job "
            "fails (loads are recomputed, stores are reported finished); KV offloading is off "
            "until the worker restarts", where, exc_info=cause,
        )
        return True

    def _fail_pending(self) -> None:
        """Report every pending job failed; first let a running load end (bounded), so that
        no copy lands on blocks vLLM recomputes once their load is reported failed. (Loads
        queued behind it do not copy: they see the engine closed.)"""
        lane = self._device.h2d
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
            self._finish(seq, cancelled(job), None)

    # ================================================================== event loop

    def ensure_started(self) -> asyncio.AbstractEventLoop:
        """The event loop, and with it the handlers' threads (started once)."""
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
            self._device.stop_lanes()
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
                self.die("the transfer loop thread",
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
        """On the loop thread: the device's copy lanes, then the disk's I/O threads."""
        self._device.start()
        self._disk.start()

    async def _shutdown_async(self, deadline: float) -> None:
        self._disk.cancel_queued_spills()
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending:
                    break
            await asyncio.sleep(0.005)
        tasks = [t for t in (*self._tasks, *self._disk.workers) if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
