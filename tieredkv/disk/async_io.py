"""Slab I/O driven from asyncio on a small, bounded pool of I/O threads.

O_DIRECT needs aligned buffers and positional ``preadv``/``pwritev``, which aiofiles does not
offer, so the worker's event loop hands slab calls to ``io_threads`` threads and awaits them.
This pool is the only place the hot path's disk syscalls run.

The pool is a few lines of our own rather than ``concurrent.futures.ThreadPoolExecutor``
because that one joins its threads at interpreter exit: a single NVMe read stuck in the
kernel would then hang the engine's shutdown. These threads are daemons, a timed-out call
returns to its caller at once, and ``shutdown`` waits only as long as it is told to.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from tieredkv.daemon_calls import STOP, serve_calls
from tieredkv.disk.errors import SlabError
from tieredkv.disk.format import SlotHeader
from tieredkv.disk.slab import SlabFile
from tieredkv.protocol import FailureCause

logger = logging.getLogger(__name__)

T = TypeVar("T")



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
