"""A rank's raw slab-file I/O and the executor threads that run it.

:class:`FileIO` is the one layer through which slab-file I/O reaches the operating system.
Keeping every syscall of the slab path there means a test can swap in
:class:`tieredkv.testing.faulty_fileio.FaultyFileIO`
and produce ENOSPC, EIO, short reads and writes, bit flips, latency and hangs exactly where it
wants them, against real files, without patching ``os``.

:meth:`FileIO.open` goes through :mod:`tieredkv.disk.private_files`, so every slab-path open
(the slab files, the O_DIRECT probe file) refuses symlinks and anything that is not our own
regular file, with or without injected faults.

:class:`SlabExecutor` drives slab I/O from asyncio on a small, bounded pool of I/O threads.
O_DIRECT needs aligned buffers and positional ``preadv``/``pwritev``, which aiofiles does not
offer, so the worker's event loop hands slab calls to ``io_threads`` threads and awaits them.
This pool is the only place the hot path's disk syscalls run.

The pool is a few lines of our own rather than ``concurrent.futures.ThreadPoolExecutor``
because that one joins its threads at interpreter exit: a single NVMe read stuck in the
kernel would then hang the engine's shutdown. These threads are daemons, a timed-out call
returns to its caller at once, and ``shutdown`` waits only as long as it is told to. Their
loop, :func:`serve_calls`, also runs the worker's copy lanes (:mod:`tieredkv.transfer.lanes`),
for the same reason: a copy stuck on a wedged device must not hang the shutdown either.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import errno
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from tieredkv.disk.errors import SlabError
from tieredkv.disk.format import SlotHeader
from tieredkv.disk.private_files import open_private
from tieredkv.protocol import FailureCause

if TYPE_CHECKING:  # slab.py builds on FileIO: its class is named here for annotations only
    from tieredkv.disk.slab import SlabFile

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _total(bufs: list[memoryview]) -> int:
    return sum(len(b) for b in bufs)


def _advance(bufs: list[memoryview], done: int) -> list[memoryview]:
    """The part of ``bufs`` that remains after the first ``done`` bytes."""
    rest: list[memoryview] = []
    for buf in bufs:
        if done >= len(buf):
            done -= len(buf)
            continue
        rest.append(buf[done:] if done else buf)
        done = 0
    return rest


def _until_done(syscall, fd: int, bufs: list[memoryview], offset: int) -> int:
    """Repeat a positional vector syscall until ``bufs`` are done or it moves 0 bytes."""
    want = _total(bufs)
    done = 0
    while done < want:
        moved = syscall(fd, bufs if done == 0 else _advance(bufs, done), offset + done)
        if moved == 0:
            break
        done += moved
    return done


class FileIO:
    """Positional file I/O on raw descriptors (no Python-level buffering, O_DIRECT-friendly)."""

    def open(self, path: str | os.PathLike[str], flags: int, mode: int = 0o600) -> int:
        """``os.open`` without following a symlink, returning only our own regular file.

        A link at ``path`` raises :class:`~tieredkv.disk.private_files.UntrustedPathError` (a
        ValueError, so it is not mistaken for an I/O failure); nothing is created, truncated or
        opened through it. ``O_NONBLOCK`` makes a FIFO planted there fail the check instead of
        blocking the open; on a regular file it changes nothing.
        """
        return open_private(path, flags | os.O_NONBLOCK, mode)

    def pread_into(self, fd: int, bufs: list[memoryview], offset: int) -> int:
        """Fill ``bufs`` from ``offset``; returns bytes read (less than asked only at EOF).

        A regular file returns a partial read only at end of file or on a signal; looping until
        a read returns 0 separates the two, so a short count always means "the bytes are not
        there".
        """
        return _until_done(os.preadv, fd, bufs, offset)

    def pwrite(self, fd: int, bufs: list[memoryview], offset: int) -> int:
        """Write all of ``bufs`` at ``offset``, looping on partial writes; returns bytes written.

        Returns less than asked only when the kernel accepted nothing more (a write returned 0);
        errors such as ENOSPC or EIO are raised as OSError.
        """
        return _until_done(os.pwritev, fd, bufs, offset)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def fallocate(self, fd: int, length: int) -> None:
        """Reserve ``length`` bytes so later slot writes cannot fail for lack of space."""
        try:
            os.posix_fallocate(fd, 0, length)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            # The filesystem cannot reserve blocks: a sparse file of the right size still works.
            if os.fstat(fd).st_size < length:
                os.ftruncate(fd, length)

    def truncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def advise_random(self, fd: int) -> None:
        """Slots are read whole and at random: readahead into a neighbour's payload is waste."""
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        except OSError:
            pass

    def close(self, fd: int) -> None:
        os.close(fd)

    def unlink(self, path: str | os.PathLike[str]) -> None:
        os.unlink(path)


# -- the executor threads -------------------------------------------------------------------


STOP = object()
"""Put on a :func:`serve_calls` queue to end one thread (after the calls queued before it)."""


def serve_calls(calls: queue.SimpleQueue[Any]) -> None:
    """Run ``(future, fn, args)`` items until :data:`STOP`; every outcome lands in its future.
    The loop of every daemon thread that serves calls: the slab I/O pool and the copy lanes."""
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
