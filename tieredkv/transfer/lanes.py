"""Copy lanes: one per direction, each a dedicated CUDA stream plus one thread that issues and
awaits its copies, with batching of whatever queued up while the previous batch ran.

Ordering: a store reads blocks the forward pass just wrote. :func:`compute_mark` records an
event on the compute (current) stream in the thread that ran the forward, at submission; the
d2h stream waits on that event before gathering, so the copy sees the final values without
stalling the compute stream or the host.

Completion without busy-spinning: the lane thread blocks in ``event.synchronize()`` on an
event created with ``blocking=True`` (cudaEventBlockingSync: the thread sleeps on an OS
primitive instead of polling the GPU), and the blocking call releases the GIL. The asyncio
loop awaits the d2h lane thread's future, so it keeps serving disk I/O and other jobs
meanwhile; a load runs on the h2d lane thread start to end (``TransferEngine.submit``).
One thread per direction keeps a direction's batches in order and lets its staging buffers
be reused without locks; d2h and h2d still overlap, each on its own stream.

On CPU there are no streams or events: the lane thread runs the copies synchronously.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import ctypes
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from tieredkv.protocol import FailureCause
from tieredkv.transfer.backends.base import Pair

logger = logging.getLogger(__name__)

T = TypeVar("T")


STOP = object()
"""Put on a :func:`serve_calls` queue to end one thread (after the calls queued before it)."""


def serve_calls(calls: queue.SimpleQueue[Any]) -> None:
    """Run ``(future, fn, args)`` items until :data:`STOP`; every outcome lands in its future.
    The loop of every daemon thread that serves calls: the copy lanes and the slab I/O pool
    (:class:`~tieredkv.transfer.disk_jobs.SlabExecutor`)."""
    while True:
        item = calls.get()
        if item is STOP:
            return
        future, fn, args = item
        if not future.set_running_or_notify_cancel():
            continue
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the waiter, never lost in the thread
            future.set_exception(exc)
        else:
            future.set_result(result)



def compute_mark(device: torch.device) -> torch.cuda.Event | None:
    """Where the compute stream is now; a d2h copy ordered after it sees the forward's writes.

    Call from the thread that issued the forward (vLLM's worker thread): the "current stream"
    is per thread. ``None`` on CPU, where the forward is over when control returns.
    """
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _single_threaded_ops() -> None:
    """Make torch ops issued from *this* thread run on this thread only.

    The CPU model runner keeps every core busy with its own OpenMP team; a copy lane that
    opened a second team would oversubscribe those cores and make both slower and jittery.
    ``torch.set_num_threads`` cannot be used for this: it also changes the count every thread
    created later starts with. ``omp_set_num_threads`` only sets the calling thread's
    OpenMP ICV. A first torch op initialises this thread's torch state before we change it.
    """
    torch.zeros(1).add_(1)
    try:
        ctypes.CDLL(None).omp_set_num_threads(1)
    except (OSError, AttributeError):  # no OpenMP in this process: nothing to contain
        pass


class LaneDeadError(RuntimeError):
    """A call was handed to a lane thread that has died; ``__cause__`` is why it died."""


class LaneThread:
    """One daemon thread running submitted calls in order.

    Not ``ThreadPoolExecutor``: that one joins its threads at interpreter exit, so one copy
    stuck on a wedged device would hang the whole engine's shutdown.

    If the thread dies (anything but :meth:`stop` ending it), every call still queued and
    every later one fails at once with :class:`LaneDeadError`, and ``on_death(exc)`` runs in
    the dying thread. The call it was running when it died is lost: its owner must not wait
    for that future alone.
    """

    def __init__(self, name: str, initializer: Callable[[], None] | None = None,
                 on_death: Callable[[BaseException], None] | None = None) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._initializer = initializer
        self._on_death = on_death
        self._lock = threading.Lock()
        self._stopping = False
        self.death: LaneDeadError | None = None
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    @property
    def name(self) -> str:
        return self._thread.name

    @property
    def alive(self) -> bool:
        return self.death is None and self._thread.is_alive()

    def is_current(self) -> bool:
        return threading.current_thread() is self._thread

    def _work(self) -> None:
        if self._initializer is not None:
            try:
                self._initializer()
            except Exception:  # noqa: BLE001 - a lane without its tuning still copies correctly
                logger.exception("tieredkv: copy lane initialiser failed")
        cause: BaseException
        try:
            serve_calls(self._queue)
        except BaseException as exc:  # noqa: BLE001 - a dead lane is reported, never silent
            cause = exc
        else:
            with self._lock:
                if self._stopping:
                    return
            cause = RuntimeError(f"{self.name} ended without being stopped")
        self._died(cause)

    def _died(self, cause: BaseException) -> None:
        error = LaneDeadError(f"tieredkv copy lane thread {self.name} died: {cause!r}")
        error.__cause__ = cause
        with self._lock:
            self.death = error
        # Nothing will run what is queued: fail it now (submit() fails later calls itself).
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not STOP and item[0].set_running_or_notify_cancel():
                item[0].set_exception(error)
        if self._on_death is not None:
            try:
                self._on_death(cause)
            except Exception:  # noqa: BLE001 - the owner's handler must not hide the death
                logger.exception("tieredkv: handling the death of %s failed", self.name)
        else:
            logger.error("tieredkv: copy lane thread %s died", self.name, exc_info=cause)

    def submit(self, fn: Callable[..., T], *args: Any) -> cf.Future[T]:
        future: cf.Future[T] = cf.Future()
        with self._lock:
            dead = self.death
            if dead is None:
                self._queue.put((future, fn, args))
                return future
        future.set_running_or_notify_cancel()
        future.set_exception(dead)
        return future

    def stop(self, wait_s: float = 0.0) -> bool:
        """Stop after the calls already queued; True if the thread ended within ``wait_s``."""
        with self._lock:
            self._stopping = True
            self._queue.put(STOP)
        self._thread.join(max(0.0, wait_s))
        return not self._thread.is_alive()


@dataclass(eq=False)
class CopyRequest:
    """Some pairs to copy for one job, and the job's hooks into the lane thread.

    ``start`` runs in the lane thread right before the batch is issued; returning False skips
    the request (it was cancelled while queued). ``done`` runs there right after the copy has
    completed (True) or failed (False), before the event loop hears of it, so a fence waiting
    on it wakes as early as possible.
    """

    pairs: list[Pair]
    after: torch.cuda.Event | None = None
    start: Callable[[], bool] | None = None
    done: Callable[[bool], None] | None = None
    nbytes: int = 0
    outcome: object = field(default=None, init=False)


class CopyLane:
    """A direction (``d2h`` or ``h2d``): stream, thread, and batching of queued requests.

    ``copy_fn`` copies one batch for :meth:`copy`; a lane without one (the h2d lane: loads
    call into its thread with :meth:`call` and :meth:`run`) batches nothing.
    """

    def __init__(
        self,
        name: str,
        device: torch.device,
        copy_fn: Callable[[list[Pair]], None] | None,
        max_batch_pairs: int = 512,
        on_death: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.name = name
        self.device = device
        self._copy_fn = copy_fn
        self.max_batch_pairs = max(1, max_batch_pairs)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        init = self._init_cuda if device.type == "cuda" else _single_threaded_ops
        self._thread = LaneThread(f"tieredkv-{name}", init, on_death)
        self._pending: list[tuple[CopyRequest, asyncio.Future[object]]] = []
        self._draining = False

    def _init_cuda(self) -> None:
        torch.cuda.set_device(self.device)

    @property
    def queued(self) -> int:
        return len(self._pending)

    @property
    def alive(self) -> bool:
        """False once the lane thread has died (see :class:`LaneThread`)."""
        return self._thread.alive

    def on_lane_thread(self) -> bool:
        """True when called from this lane's own thread."""
        return self._thread.is_current()

    def call(self, fn: Callable[..., T], *args: Any) -> cf.Future[T]:
        """Run ``fn(*args)`` on the lane thread, in order with its batches (any thread)."""
        return self._thread.submit(fn, *args)

    # ------------------------------------------------------------------ lane thread

    def run(self, fn: Callable[[], T], after: Sequence[torch.cuda.Event] = ()) -> T:
        """Run ``fn`` (which issues copies) on this lane's stream and wait for them to finish."""
        if self.stream is None:
            return fn()
        with torch.cuda.stream(self.stream):
            for event in after:
                self.stream.wait_event(event)
            result = fn()
            done = torch.cuda.Event(blocking=True)
            done.record(self.stream)
        done.synchronize()  # sleeps (blocking sync), GIL released
        return result

    def _run_batch(self, requests: list[CopyRequest]) -> None:
        live = []
        for request in requests:
            if request.start is None or request.start():
                live.append(request)
            else:
                request.outcome = FailureCause.CANCELLED
        if not live:
            return
        pairs = [pair for request in live for pair in request.pairs]
        after: list[torch.cuda.Event] = []
        for request in live:
            if request.after is not None and all(request.after is not e for e in after):
                after.append(request.after)
        copy_fn = self._copy_fn
        assert copy_fn is not None, f"the {self.name} lane has no batch copy"
        ok = True
        try:
            self.run(lambda: copy_fn(pairs), after)
        except Exception as exc:  # noqa: BLE001 - reported per job as copy_error
            ok = False
            logger.error("tieredkv: %s copy of %d chunk(s) failed: %r", self.name, len(pairs), exc)
            for request in live:
                request.outcome = exc
        for request in live:
            if request.done is not None:
                request.done(ok)

    # ------------------------------------------------------------------ event loop

    async def copy(self, request: CopyRequest) -> object:
        """Copy ``request.pairs``; returns None when done, ``FailureCause.CANCELLED`` if skipped, or the
        exception the copy raised (never raises it: the caller reports it)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[object] = loop.create_future()
        self._pending.append((request, future))
        if not self._draining:
            self._draining = True
            loop.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        try:
            while self._pending:
                batch: list[tuple[CopyRequest, asyncio.Future[object]]] = []
                count = 0
                while self._pending and (not batch or count + len(self._pending[0][0].pairs)
                                         <= self.max_batch_pairs):
                    item = self._pending.pop(0)
                    batch.append(item)
                    count += len(item[0].pairs)
                requests = [request for request, _ in batch]
                try:
                    await asyncio.wrap_future(self._thread.submit(self._run_batch, requests))
                except Exception as exc:  # noqa: BLE001 - the lane thread itself broke
                    for request in requests:
                        request.outcome = exc
                for request, future in batch:
                    if not future.done():
                        future.set_result(request.outcome)
        finally:
            self._draining = False

    def stop(self, wait_s: float = 0.0) -> bool:
        return self._thread.stop(wait_s)
