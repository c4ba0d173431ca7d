"""Disk jobs: spill (host slot -> disk slot) and promote (disk slot -> host slot).

The handlers of :attr:`Move.SPILL` and :attr:`Move.PROMOTE`. Both run as coroutines on the
engine's event loop, which awaits the slab executor's bounded
pool of I/O threads (``io_threads``), so a slow or hung disk never holds a copy lane or vLLM's
thread. Spills go through a bounded queue in front of a few spill workers: a slow disk drops
spills (counted) instead of delaying stores, loads or promotions.

A transient read failure (I/O error, short read, timeout) is read again once before the
promotion fails; a wrong byte (checksum, key, namespace) or a missing file is not. A timed-out
disk call may still write into (or read from) its host slot: the slot stays reserved until that
call really returns, so it can never corrupt the slot's next tenant.

:class:`SlabExecutor` is that pool. O_DIRECT needs aligned buffers and positional
``preadv``/``pwritev``, which aiofiles does not offer, so the event loop hands slab calls to
``io_threads`` threads and awaits them; it is the only place the hot path's disk syscalls run.
It is a few lines of our own rather than ``concurrent.futures.ThreadPoolExecutor`` because that
one joins its threads at interpreter exit: a single NVMe read stuck in the kernel would then
hang the engine's shutdown. Its threads are daemons running the copy lanes' loop
(:func:`~tieredkv.transfer.lanes.serve_calls`), a timed-out call returns to its caller at once,
and ``shutdown`` waits only as long as it is told to.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from tieredkv.disk.errors import SlabError
from tieredkv.protocol import FailureCause, JobResult, Move
from tieredkv.transfer.host_pool import HostPool, SlotGuard
from tieredkv.transfer.lanes import STOP, serve_calls
from tieredkv.transfer.runtime import Entry, Runtime

if TYPE_CHECKING:  # the slab's classes, for annotations only
    from tieredkv.disk.format import SlotHeader
    from tieredkv.disk.slab import SlabFile

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Disk read failures worth a second read: the bytes may well be there. A checksum, key or
# namespace mismatch says they are not; so does a missing file.
_TRANSIENT_READ_FAILURES = frozenset(
    {FailureCause.IO_ERROR, FailureCause.SHORT_READ, FailureCause.TIMEOUT})


def failure_kind(exc: BaseException) -> FailureCause:
    """The failure cause of an exception: a SlabError's kind, else a best-effort cause."""
    kind = getattr(exc, "kind", None)
    if kind is not None:
        try:
            return FailureCause(str(getattr(kind, "value", kind)))
        except ValueError:
            return FailureCause.IO_ERROR
    if isinstance(exc, TimeoutError):
        return FailureCause.TIMEOUT
    if isinstance(exc, FileNotFoundError):
        return FailureCause.MISSING
    return FailureCause.IO_ERROR


def _transient(exc: BaseException) -> bool:
    """A disk read failure that a second read may not hit again (a SlabError's kind says)."""
    return getattr(exc, "kind", None) is not None and failure_kind(exc) in _TRANSIENT_READ_FAILURES


class DiskJobs:
    """Spills and promotions of one engine; without a slab (no disk tier) both fail ``missing``."""

    def __init__(
        self,
        host: HostPool,
        slab: Any | None,
        guard: SlotGuard,
        runtime: Runtime,
        *,
        io_threads: int,
        spill_queue_depth: int,
        timeout_s: float,
    ) -> None:
        self.host = host
        self.slab = slab
        self.io_threads = io_threads
        self.spill_queue_depth = spill_queue_depth
        self.timeout_s = timeout_s  # a spill's write; a promotion's read and its retry, each
        self._guard = guard
        self._runtime = runtime
        self._stats = runtime.stats
        # Leave one I/O thread to reads: a burst of spill writes never queues a promotion's
        # read behind more than one write.
        self._spill_workers_n = max(1, io_threads - 1)
        self._executor: SlabExecutor | None = None
        self._spill_queue: asyncio.Queue[Entry] | None = None
        self._spill_workers: list[asyncio.Task[Any]] = []

    def start(self) -> None:
        """On the engine's event loop thread, before any disk job arrives."""
        self._spill_queue = asyncio.Queue(maxsize=self.spill_queue_depth)
        if self.slab is None:
            return
        self._executor = SlabExecutor(self.io_threads, on_death=self._runtime.die)
        loop = asyncio.get_event_loop()
        self._spill_workers = [
            loop.create_task(self._spill_worker()) for _ in range(self._spill_workers_n)
        ]

    @property
    def queued_spills(self) -> int:
        queue = self._spill_queue
        return queue.qsize() if queue is not None else 0

    @property
    def workers(self) -> list[asyncio.Task[Any]]:
        return self._spill_workers

    def cancel_queued_spills(self) -> None:
        """Shutting down: spills not started yet are cancelled (event loop thread)."""
        queue = self._spill_queue
        if queue is None:
            return
        while not queue.empty():
            entry = queue.get_nowait()
            queue.task_done()
            self._runtime.finish(entry, JobResult.fail(entry.job.job_id, FailureCause.CANCELLED))

    def stop(self, wait_s: float) -> None:
        """Stop the I/O threads, waiting up to ``wait_s`` for calls still running."""
        if self._executor is not None:
            self._executor.shutdown(wait_s=wait_s)

    # ------------------------------------------------------------------ spills

    def submit_spills(self, entries: list[Entry]) -> None:
        self._runtime.on_loop(self._enqueue_spills, entries)

    def _enqueue_spills(self, entries: list[Entry]) -> None:
        """On the loop: into the bounded spill queue; a full queue drops the spill."""
        for entry in entries:
            job = entry.job
            if self.slab is None:
                self._runtime.finish(entry, JobResult.fail(job.job_id, FailureCause.MISSING))
                continue
            assert self._spill_queue is not None
            try:
                self._spill_queue.put_nowait(entry)
            except asyncio.QueueFull:
                self._runtime.finish(entry, JobResult.fail(job.job_id, FailureCause.DROPPED))

    async def _spill_worker(self) -> None:
        assert self._spill_queue is not None
        while True:
            entry = await self._spill_queue.get()
            try:
                await self._spill(entry)
            finally:
                self._spill_queue.task_done()

    def _hold(self, slot: int, write: bool) -> bool:
        """Take host ``slot`` for a job that reads it (a spill) or fills it (``write``: a
        promotion); False when it is out of range or another job holds it: ``copy_error``."""
        take = self._guard.try_write if write else self._guard.try_read
        return 0 <= slot < self.host.num_slots and take(slot)

    async def _spill(self, entry: Entry) -> None:
        job = entry.job
        disk = job.dst
        result = JobResult.fail(job.job_id, FailureCause.CANCELLED)
        holding, pending = False, None
        try:
            if not self._hold(job.host_slot, write=False):
                result = JobResult.fail(job.job_id, FailureCause.COPY_ERROR)
                return
            holding = True
            assert self._executor is not None
            await self._executor.write(
                self.slab, disk.slot, job.key, self.host.slot_memoryview(job.host_slot),
                timeout=self.timeout_s, aliases=disk.aliases,  # type: ignore[union-attr]
            )
            self._stats.moved(Move.SPILL, self.host.payload_bytes)
            result = JobResult.done(job.job_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes a result
            pending = getattr(exc, "pending", None)
            result = JobResult.fail(job.job_id, failure_kind(exc))
            logger.debug("tieredkv: spill %d failed: %s", job.job_id, exc)
        finally:
            if holding:
                self._release_after(job.host_slot, False, pending)
            self._runtime.finish(entry, result)

    # ------------------------------------------------------------------ promotions

    def submit_promotions(self, entries: list[Entry]) -> None:
        self._runtime.on_loop(self._start_promotions, entries)

    def _start_promotions(self, entries: list[Entry]) -> None:
        for entry in entries:
            self._runtime.spawn(self._promote(entry))

    async def _promote(self, entry: Entry) -> None:
        job = entry.job
        result = JobResult.fail(job.job_id, FailureCause.CANCELLED)
        try:
            if self.slab is None:
                result = JobResult.fail(job.job_id, FailureCause.MISSING)
                return
            if not self._hold(job.host_slot, write=True):
                result = JobResult.fail(job.job_id, FailureCause.COPY_ERROR)
                return
            # Nobody waits on a promotion past the scheduler's own deadline (it then serves
            # what is in memory), so a retry gets a budget of its own: a timed-out read can
            # be read again once its stuck call returned.
            deadline = asyncio.get_running_loop().time() + self.timeout_s
            failure = await self._read_slot(job.key, job.src.slot,  # type: ignore[union-attr]
                                            job.host_slot, deadline, retry_s=self.timeout_s)
            if failure is None:
                self._guard.release(job.host_slot, True)
                result = JobResult.done(job.job_id)
            else:
                result = JobResult.fail(job.job_id, failure)
        finally:
            self._runtime.finish(entry, result)

    async def _read_slot(self, key: bytes, disk_slot: int, host_slot: int, deadline: float,
                         retry_s: float | None = None) -> FailureCause | None:
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
                    self._stats.read_retried(failure)
                    logger.debug("tieredkv: reading disk slot %d again after %s", disk_slot, failure)
                    failure, _, pending = await self._read_once(key, disk_slot, host_slot,
                                                                end - loop.time())
                    if failure is None:
                        self._stats.read_recovered()
        except asyncio.CancelledError:
            self._release_after(host_slot, True, pending)
            raise
        if failure is not None:
            self._release_after(host_slot, True, pending)
            return failure
        self._stats.moved(Move.PROMOTE, self.host.payload_bytes)
        return None

    async def _read_once(self, key: bytes, disk_slot: int, host_slot: int,
                         timeout: float) -> tuple[FailureCause | None, bool, Any]:
        """One verified read: (failure or None, worth another read, the timed-out call that
        may still write into the slot or None)."""
        assert self._executor is not None
        try:
            await self._executor.read_into(
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


# ------------------------------------------------------------------ the slab I/O pool


class SlabExecutor:
    """Runs :class:`SlabFile` calls on ``io_threads`` daemon threads for an asyncio caller.

    Timeouts: a call that does not finish in ``timeout`` seconds raises
    ``SlabError(timeout)`` in the caller immediately. If it had not started yet it is cancelled;
    if it is running (a hung device), its thread keeps the buffer it was given until the
    kernel returns, so the error's ``pending`` future says when ``out``/``payload`` may be
    reused: a host slot must stay reserved until then, or a late read would overwrite the next
    tenant's bytes.
    """

    def __init__(
        self, io_threads: int = 2, name: str = "tieredkv-io",
        on_death: Callable[[str, BaseException], None] | None = None,
    ) -> None:
        """``on_death(thread description, exception)`` hears of a thread that dies: the call it
        was running is lost (its caller would wait for its timeout) and the pool is a thread
        short, so the owner fails what depends on it instead."""
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        self.io_threads = io_threads
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._inflight: set[cf.Future[Any]] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._on_death = on_death
        self.timeouts = 0
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(io_threads)
        ]
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        try:
            serve_calls(self._queue)
        except BaseException as exc:
            if self._on_death is None:
                raise
            self._on_death(f"the slab I/O thread {threading.current_thread().name}", exc)

    def submit(self, fn: Callable[..., T], *args: Any) -> cf.Future[T]:
        """Queue ``fn(*args)`` on the pool (also usable without asyncio)."""
        future: cf.Future[T] = cf.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("SlabExecutor is shut down")
            self._inflight.add(future)
        future.add_done_callback(self._forget)
        self._queue.put((future, fn, args))
        return future

    def _forget(self, future: cf.Future[Any]) -> None:
        with self._lock:
            self._inflight.discard(future)

    async def _run(self, what: str, slab: SlabFile, slot: int, timeout: float | None,
                   fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[T] = loop.create_future()
        future = self.submit(fn, *args)

        def _transfer(done: cf.Future[T]) -> None:
            if waiter.done():
                return
            if done.cancelled():
                waiter.cancel()
            elif (exc := done.exception()) is not None:
                waiter.set_exception(exc)
            else:
                waiter.set_result(done.result())

        def _on_done(done: cf.Future[T]) -> None:
            try:
                loop.call_soon_threadsafe(_transfer, done)
            except RuntimeError:
                pass  # the loop is gone; nobody is waiting any more

        future.add_done_callback(_on_done)
        try:
            return await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            future.cancel()  # succeeds only if it had not started
            self.timeouts += 1
            raise SlabError(
                FailureCause.TIMEOUT, f"{what} did not finish in {timeout:g} s",
                slot=slot, path=slab.path, pending=future,
            ) from None
        except asyncio.CancelledError:
            future.cancel()
            raise

    async def write(
        self, slab: SlabFile, slot: int, key: bytes, payload: memoryview,
        timeout: float | None = None, aliases: tuple[bytes, ...] = (),
    ) -> None:
        """``slab.write_slot`` on the pool; raises :class:`SlabError` on failure or timeout."""
        await self._run("write", slab, slot, timeout, slab.write_slot, slot, key, payload, aliases)

    async def read_into(
        self, slab: SlabFile, slot: int, key: bytes, out: memoryview,
        timeout: float | None = None,
    ) -> SlotHeader:
        """``slab.read_slot_into`` on the pool; a hung read fails ``timeout`` on time."""
        return await self._run("read", slab, slot, timeout, slab.read_slot_into, slot, key, out)

    async def read_header(
        self, slab: SlabFile, slot: int, key: bytes | None = None, timeout: float | None = None,
    ) -> SlotHeader:
        return await self._run("read header", slab, slot, timeout, slab.read_header, slot, key)

    @property
    def in_flight(self) -> int:
        """Calls queued or running (timed-out calls still stuck in the kernel included)."""
        with self._lock:
            return len(self._inflight)

    def shutdown(self, wait_s: float = 5.0) -> bool:
        """Cancel queued calls, wait up to ``wait_s`` for running ones; True if all finished.

        Threads still stuck after that are daemons and are abandoned, never joined forever.
        """
        with self._lock:
            if self._closed:
                pending = list(self._inflight)
            else:
                self._closed = True
                pending = list(self._inflight)
        for future in pending:
            future.cancel()
        for _ in self._threads:
            self._queue.put(STOP)
        deadline = time.monotonic() + max(0.0, wait_s)
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            logger.warning("tieredkv: %d I/O thread(s) still blocked at shutdown: %s",
                           len(stuck), ", ".join(stuck))
        return not stuck
