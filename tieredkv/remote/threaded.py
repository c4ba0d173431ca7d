"""The remote store for synchronous callers: its own loop in a daemon thread, futures out.

The scheduler half must never wait on the network. Here every call returns a
``concurrent.futures.Future`` at once (scheduling it costs a ``call_soon_threadsafe``); the
caller polls ``done()`` on later steps. Every future is resolved: with the call's result, or
with a ``cancelled`` :class:`BatchResult` if the store closes first, so no poller waits for
an answer that will never come. :meth:`ThreadedRemoteStore.close` ends within its timeout
even with the server stalled or gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import Future, InvalidStateError
from functools import partial
from typing import Any, TypeVar

from tieredkv.protocol import FailureCause
from tieredkv.remote.results import BatchResult, RemoteStats
from tieredkv.remote.store import Head, RemoteStore
from tieredkv.remote.write_queue import WriteItem
from tieredkv.remote_url import RemoteURL

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ThreadedRemoteStore:
    """A :class:`RemoteStore` on a private event loop thread; thread-safe, non-blocking calls.

    ``store_options`` are :class:`RemoteStore`'s keyword arguments.
    """

    def __init__(
        self, url: RemoteURL, *, thread_name: str = "tieredkv-remote", **store_options: Any
    ) -> None:
        self._store = RemoteStore(url, **store_options)
        self._loop = asyncio.new_event_loop()
        self._lock = threading.Lock()
        self._pending: dict[Future[Any], Callable[[], Any]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(started,), name=thread_name, daemon=True
        )
        self._thread.start()
        if not started.wait(10.0):  # local work only: starting a loop and two tasks
            raise RuntimeError("tieredkv remote tier: its event loop thread did not start")

    def _run(self, started: threading.Event) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._store.start())
            started.set()
            loop.run_forever()
        finally:
            leftovers = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in leftovers:
                task.cancel()
            if leftovers:
                loop.run_until_complete(asyncio.wait(leftovers, timeout=0.5))
            loop.close()

    # -- state -------------------------------------------------------------------------------

    @property
    def store(self) -> RemoteStore:
        """The wrapped store; touch it only from the store's loop (``run``)."""
        return self._store

    @property
    def up(self) -> bool:
        return self._store.up

    def stats(self) -> RemoteStats:
        return self._store.stats()

    def __repr__(self) -> str:
        return f"ThreadedRemoteStore({self._store.url.redacted()}, up={self._store.up})"

    # -- calls -------------------------------------------------------------------------------

    def batch_exists(
        self, keys: Sequence[bytes], *, timeout_s: float | None = None
    ) -> Future[BatchResult[bool]]:
        return self._batch(self._store.batch_exists, keys, timeout_s, False)

    def batch_get(
        self, keys: Sequence[bytes], *, timeout_s: float | None = None
    ) -> Future[BatchResult[bytes | None]]:
        return self._batch(self._store.batch_get, keys, timeout_s, None)

    def batch_get_bounded(
        self, keys: Sequence[bytes], max_len: int, *, timeout_s: float | None = None,
        into: Sequence[memoryview | None] | None = None, into_offset: int = 0,
    ) -> Future[BatchResult[Head | None]]:
        """At most ``max_len`` bytes of each value (see :meth:`RemoteStore.batch_get_bounded`);
        ``into``'s buffers are written on the store's thread until the future is answered
        (past a :meth:`close` whose thread outlived its timeout: until that thread ends)."""
        if max_len < 1:
            raise ValueError(f"max_len must be positive, got {max_len}")
        into = None if into is None else list(into)
        return self._batch(partial(self._store.batch_get_bounded, max_len=max_len, into=into,
                                   into_offset=into_offset), keys, timeout_s, None)

    def batch_set(
        self,
        items: Sequence[tuple[bytes, bytes]],
        *,
        ttl_s: float | None = None,
        timeout_s: float | None = None,
    ) -> Future[BatchResult[bool]]:
        return self._batch(partial(self._store.batch_set, ttl_s=ttl_s), items, timeout_s, False)

    def batch_delete(
        self, keys: Sequence[bytes], *, if_equal: Sequence[bytes] | None = None,
        timeout_s: float | None = None,
    ) -> Future[BatchResult[bool]]:
        expected = None if if_equal is None else list(if_equal)
        return self._batch(partial(self._store.batch_delete, if_equal=expected), keys,
                           timeout_s, False)

    def _batch(
        self, call: Callable[..., Awaitable[BatchResult[T]]], items: Sequence[Any],
        timeout_s: float | None, default: T,
    ) -> Future[BatchResult[T]]:
        """``call(items, timeout_s=...)`` on the store's loop; ``default`` per item, with the
        cause, if it cannot finish. ``items`` is copied now: the caller may reuse its list."""
        items = list(items)
        return self._call(lambda: call(items, timeout_s=timeout_s), len(items), default)

    def submit_writes(self, items: Iterable[WriteItem], ttl_s: float | None = None) -> int:
        """Queue writes without waiting; returns how many were accepted (the rest: dropped)."""
        return self._store.submit_writes(items, ttl_s)

    def flush_writes(self, timeout_s: float) -> Future[bool]:
        """A future that becomes True once queued writes are done (tests, orderly shutdown)."""
        return self._call(lambda: self._store.flush_writes(timeout_s), None, False)

    def run(self, make: Callable[[], Awaitable[T]], default: T) -> Future[T]:
        """Run ``make()`` on the store's loop; the future gets ``default`` if it cannot finish."""
        return self._call(make, None, default)

    def _call(self, make: Callable[[], Awaitable[Any]], count: int | None, default: Any) -> Future[Any]:
        def fallback(cause: FailureCause) -> Any:
            if count is None:
                return default
            return BatchResult([default] * count, cause, count)

        future: Future[Any] = Future()
        with self._lock:
            if self._closed:
                future.set_result(fallback(FailureCause.CANCELLED))
                return future
            self._pending[future] = lambda: fallback(FailureCause.CANCELLED)

        def spawn() -> None:
            task = self._loop.create_task(self._drive(make, future, fallback))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        try:
            self._loop.call_soon_threadsafe(spawn)
        except RuntimeError:  # the loop closed between the check and here
            self._resolve(future, fallback(FailureCause.CANCELLED))
        return future

    async def _drive(
        self,
        make: Callable[[], Awaitable[Any]],
        future: Future[Any],
        fallback: Callable[[FailureCause], Any],
    ) -> None:
        try:
            result = await make()
        except asyncio.CancelledError:
            result = fallback(FailureCause.CANCELLED)
        except Exception:  # noqa: BLE001 - the store does not raise; this is a bug
            logger.exception("tieredkv remote tier: a call raised")
            result = fallback(FailureCause.UNKNOWN)
        self._resolve(future, result)

    def _resolve(self, future: Future[Any], result: Any) -> None:
        """Answer ``future`` unless ``close`` took it first. Outside the lock: its done
        callbacks run here, on the store's thread, and may call the store again."""
        with self._lock:
            owned = self._pending.pop(future, None) is not None
        if owned:
            _answer(future, result)

    # -- shutdown ----------------------------------------------------------------------------

    def close(self, timeout_s: float = 2.0) -> bool:
        """Stop the store and its thread within ~``timeout_s``; resolve every pending future.

        Returns True if the thread ended in time (it is a daemon thread either way).
        """
        with self._lock:
            if self._closed:
                return not self._thread.is_alive()
            self._closed = True
        deadline = time.monotonic() + timeout_s
        if self._thread.is_alive():
            try:
                done = asyncio.run_coroutine_threadsafe(
                    self._store.aclose(timeout_s * 0.5), self._loop
                )
                done.result(timeout=timeout_s * 0.6)
            except Exception:  # noqa: BLE001 - timeout or loop already gone: stop anyway
                pass
            try:
                self._loop.call_soon_threadsafe(self._loop.stop)
            except RuntimeError:
                pass
            self._thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            pending, self._pending = self._pending, {}
        for future, fallback in pending.items():  # taken from _resolve: only answered here
            _answer(future, fallback())
        return not self._thread.is_alive()

    def __enter__(self) -> ThreadedRemoteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _answer(future: Future[Any], result: Any) -> None:
    """Set ``future``'s result unless its caller cancelled it (nothing in tieredkv does; a
    cancelled one must not stop ``close`` answering the others)."""
    with contextlib.suppress(InvalidStateError):
        future.set_result(result)
