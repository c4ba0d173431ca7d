"""The worker's transfer engine: executes store/spill/promote/load jobs and reports results.

vLLM's worker thread only ever calls the non-blocking ``submit``/``poll`` (plus
``fence_blocks`` before a forward that reuses freed blocks). Each job kind has one path:

- store (d2h, :mod:`~tieredkv.transfer.store_jobs`): a coroutine on the engine's event loop
  (one daemon thread, started on the first submit) awaiting the d2h copy lane, which batches
  whatever queued up while its previous batch ran;
- spill (host -> disk) and promote (disk -> host, :mod:`~tieredkv.transfer.disk_jobs`):
  coroutines on the event loop awaiting the slab executor's bounded pool of I/O threads;
  spills pass a bounded queue, so a slow disk drops them (counted) instead of delaying others;
- load (h2d, :mod:`~tieredkv.transfer.load_jobs`): never on the event loop (see
  :meth:`TransferEngine.submit` for why): start to end on the h2d lane thread, or inline in
  the caller's thread on CPU. A load's chunks are all in host slots;
- remote read and write (:mod:`~tieredkv.transfer.remote_driver`): on the store's own thread.

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
from collections.abc import Coroutine, Iterable, Sequence
from functools import partial
from typing import Any

from tieredkv.protocol import (
    FailureCause,
    Job,
    JobResult,
    LoadJob,
    PromoteJob,
    SpillJob,
    StoreJob,
)
from tieredkv.transfer.backends.base import CopyBackend, Pair
from tieredkv.transfer.disk_jobs import DiskJobs
from tieredkv.transfer.host_pool import HostPool, SlotGuard
from tieredkv.transfer.kv_views import KVViews
from tieredkv.transfer.lanes import CopyLane, compute_mark
from tieredkv.transfer.load_jobs import LoadJobs
from tieredkv.transfer.remote_driver import RemoteDriver
from tieredkv.transfer.remote_jobs import RemoteJobs
from tieredkv.transfer.store_jobs import StoreJobs, StoreTicket
from tieredkv.transfer.transfer_stats import TransferStats, job_kind

logger = logging.getLogger(__name__)

_MAX_STAGING_BYTES = 256 * 1024 * 1024  # bounds one copy batch (the CUDA staging buffer)

# (submission seq, job, store ticket or None, submit time, compute mark)
_Entry = tuple[int, Job, StoreTicket | None, float, Any]


class EngineDeadError(RuntimeError):
    """The transfer engine can no longer run jobs; ``__cause__`` is what killed it."""


def _cancelled(job: Job) -> JobResult:
    """A job that will not run; a load names every device block it leaves unloaded."""
    block_ids = job.block_ids if isinstance(job, LoadJob) else ()
    return JobResult.fail(job.job_id, FailureCause.CANCELLED, block_ids)


def _noop() -> None:
    pass


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
        remote: RemoteJobs | None = None,
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
        self._max_batch_pairs = max(1, min(512, _MAX_STAGING_BYTES // host.payload_bytes))
        self.stats = TransferStats()

        # Shared with the caller's threads, under _lock.
        self._lock = threading.Lock()
        self._result_ready = threading.Condition(self._lock)
        self._start_lock = threading.Lock()
        self._seq = itertools.count(1)
        self._pending: dict[int, Job] = {}
        self._results: list[JobResult] = []
        self._closed = False
        self._stopped = False
        self._error: EngineDeadError | None = None  # set once, when an engine thread died
        self._device_paused = False  # vLLM sleep mode: the device memory is going away

        # One runner per job kind; all of them take host slots through one guard.
        self._guard = SlotGuard()
        self._stores = StoreJobs(kv, host, self._guard, self.stats, self._lock, self._finish)
        self._loads = LoadJobs(kv, host, self._copy_h2d, self._guard, self.stats, self._finish,
                               closed=self._is_closed)
        self._disk = DiskJobs(host, slab, self._guard, self.stats, self._finish,
                              io_threads=io_threads, spill_queue_depth=spill_queue_depth,
                              timeout_s=load_timeout_s, on_death=self._die)
        self._remote = RemoteDriver(remote, self._guard, self.stats, self._finish,
                                    host.payload_bytes, chunk_rows=self.chunk_blocks, kv=kv)

        # Threads, started with the event loop on the first submit.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task[Any]] = set()  # stores and promotions (loop thread)
        self._d2h: CopyLane | None = None
        self._h2d: CopyLane | None = None

    # ================================================================== caller-side API

    def submit(self, jobs: Sequence[Job], *, inline_max_bytes: int = 0) -> None:
        """Queue jobs; returns at once. Thread-safe. Results arrive through :meth:`poll`.

        Loads skip the event loop: they run on the h2d lane thread, or, on a CPU device when
        they move at most ``inline_max_bytes``, here in the caller's thread. Why: while vLLM
        waits for a load its engine thread spins on empty steps holding the GIL, and each
        thread a job crosses waits up to a switch interval (5 ms) for it. On CPU vLLM calls
        ``start_load_kv`` *after* the step's forward, so an inline copy (a memcpy, GIL
        released) delays no computation and is reported by the same step's ``get_finished``,
        a whole step earlier. A big load would hold the engine meanwhile: the caller bounds it.
        """
        jobs = list(jobs)
        if not jobs:
            return
        for job in jobs:
            if not isinstance(job, Job):
                raise TypeError(f"not a transfer job: {job!r}")
        now = time.monotonic()
        touches_device = any(isinstance(j, StoreJob | LoadJob) for j in jobs)
        mark = compute_mark(self.kv.device) if touches_device else None
        entries: list[_Entry] = []
        with self._lock:
            closed = self._closed
            paused = self._device_paused
            for job in jobs:
                seq = next(self._seq)
                self._pending[seq] = job
                ticket = None
                if isinstance(job, StoreJob):
                    ticket = self._stores.add_locked(seq, job, mark)
                entries.append((seq, job, ticket, now, mark))
        # Shut down: nothing runs. Paused for sleep mode: nothing touches the device.
        accepted = []
        for entry in entries:
            seq, job, _, t0, _ = entry
            if closed or (paused and isinstance(job, StoreJob | LoadJob)):
                self._finish(seq, _cancelled(job), t0)
            else:
                accepted.append(entry)
        accepted = self._remote.take(accepted)  # remote jobs: the store's thread, not the loop
        if not accepted:
            return
        loop = self._ensure_started()
        if self._closed:  # it died (perhaps just now, starting) or shut down: nothing runs
            for seq, job, _, t0, _ in accepted:
                self._finish(seq, _cancelled(job), t0)
            return
        inline_budget = inline_max_bytes if self.kv.device.type == "cpu" else 0
        queued = []
        for entry in accepted:
            seq, job, _, t0, mark = entry
            if not isinstance(job, LoadJob):
                queued.append(entry)  # stores, spills, promotions: the event loop
            elif inline_budget > 0 and self._loads.nbytes(job) <= inline_budget:
                self._loads.run(seq, job, t0, mark, on_lane=False)
            else:
                assert self._h2d is not None
                call = self._h2d.call(self._loads.run, seq, job, t0, mark, True)
                call.add_done_callback(partial(self._lane_call_done, seq, job, t0))
        if not queued:
            return
        try:
            loop.call_soon_threadsafe(self._dispatch, queued)
        except RuntimeError:  # the loop stopped under us (shutdown raced this submit)
            for seq, job, _, t0, _ in queued:
                self._finish(seq, _cancelled(job), t0)

    def _lane_call_done(self, seq: int, job: LoadJob, t0: float, call: cf.Future[Any]) -> None:
        """A load the h2d lane never ran (it died) still gets its result."""
        if call.cancelled() or call.exception() is not None:
            self._finish(seq, _cancelled(job), t0)

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
        self._stores.fence(block_ids, timeout_s)

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
                lambda: not any(isinstance(j, StoreJob | LoadJob) for j in self._pending.values()),
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
            "d2h_queue": self._d2h.queued if self._d2h is not None else 0,
            "h2d_queue": self._h2d.queued if self._h2d is not None else 0,
            "jobs_in_flight": in_flight,
            "host_slots_in_flight": self._guard.in_flight,
            **self._remote.gauges(),
        }
        return {**self.stats.take(gauges), "remote_writes_failed": self._remote.take_writes_failed()}

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Finish in-flight jobs for up to ``timeout_s``, cancel the rest (each gets a result),
        stop the loop and join its thread. Idempotent; bounded even with a hung disk."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = self._closed = True
            self._stores.cancel_queued_locked()
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
            self._disk.stop(wait_s=max(0.0, deadline - time.monotonic()))
        self._remote.close(max(0.1, deadline - time.monotonic()))
        with self._lock:
            leftovers = list(self._pending.items())
        for seq, job in leftovers:
            self._finish(seq, _cancelled(job), None)

    # ================================================================== bookkeeping

    def _finish(self, seq: int, result: JobResult, t0: float | None) -> None:
        """Record a job's one result (later attempts for the same job are ignored)."""
        with self._lock:
            job = self._pending.pop(seq, None)
            if job is None:
                return
            self._results.append(result)
            self._result_ready.notify_all()
            self._stores.settle_locked(seq)
        seconds = None if t0 is None else time.monotonic() - t0
        self.stats.finished(job_kind(job), result, seconds)

    def _is_closed(self) -> bool:
        """Shut down or dead: a job that has not started does not start."""
        return self._closed

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
            self._stores.cancel_queued_locked()
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
            self._finish(seq, _cancelled(job), None)

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
        """On the loop thread: the two copy lanes, then each job kind's runner."""
        device = self.kv.device
        self._d2h = CopyLane("d2h", device, self._copy_d2h, self._max_batch_pairs,
                             on_death=partial(self._lane_died, "d2h"))
        # Loads call into the h2d lane's thread directly (LoadJobs.run): no batch function.
        self._h2d = CopyLane("h2d", device, None, self._max_batch_pairs,
                             on_death=partial(self._lane_died, "h2d"))
        self._stores.start(self._d2h)
        self._loads.start(self._h2d)
        self._disk.start()

    def _copy_d2h(self, pairs: list[Pair]) -> None:
        """A batch of stores, on the d2h lane thread."""
        self._refuse_if_dead()  # its stores are reported failed already
        self.backend.d2h(self.kv, self.host, pairs)

    def _copy_h2d(self, pairs: list[Pair]) -> None:
        """A load's chunks, on the h2d lane thread or inline in the caller's (LoadJobs.run)."""
        self.backend.h2d(self.kv, self.host, pairs)

    def _refuse_if_dead(self) -> None:
        error = self._error
        if error is not None:
            raise EngineDeadError(str(error)) from error.__cause__

    def _dispatch(self, entries: list[_Entry]) -> None:
        """On the loop thread: start each store, spill and promotion (loads never come here)."""
        loop = asyncio.get_running_loop()
        for seq, job, ticket, t0, _ in entries:
            if self._closed:
                self._finish(seq, _cancelled(job), t0)
                continue
            coro: Coroutine[Any, Any, None]
            if isinstance(job, SpillJob):
                self._disk.enqueue_spill(seq, job, t0)  # its worker runs it
                continue
            if isinstance(job, StoreJob):
                assert ticket is not None
                coro = self._stores.run(seq, job, ticket, t0)
            else:
                assert isinstance(job, PromoteJob), job
                coro = self._disk.promote(seq, job, t0)
            task = loop.create_task(coro)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

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
