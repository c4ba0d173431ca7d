"""The remote tier's client side: batched, deadline-bound calls to Redis/Valkey or a Cluster.

Every call is one pipeline (one round trip; on a Cluster redis-py splits it per node and
sends the parts in parallel) under ``asyncio.wait_for``, and every outcome is a
:class:`~tieredkv.remote.results.BatchResult`: a dead, paused or partitioned server reads as
misses with a cause, never as an exception or a hang. Connection state is explicit
(:mod:`tieredkv.remote.connection`): the store starts *down*, comes up once a handshake
succeeds, reconnects with capped backoff; a call that times out or loses its connection marks
it down, and while down calls answer at once with ``unavailable``. Writes:
:meth:`RemoteStore.batch_set` (awaited, for tests and tools), :meth:`submit_writes` (fire and
forget, any thread: a bounded queue drained by writer tasks; drops and counts). Everything
here runs on one event loop; :mod:`tieredkv.remote.threaded` gives it a thread of its own and
hands out ``concurrent.futures.Future`` objects to synchronous callers.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

from redis.exceptions import ResponseError

from tieredkv.protocol import FailureCause
from tieredkv.remote.bounded_read import Into, Received, exists_each, read_bounded
from tieredkv.remote.client import RemoteClient, classify
from tieredkv.remote.connection import ConnectionKeeper, KeeperTimings
from tieredkv.remote.read_buffers import BUFFER_IDLE_S, ReadBuffers
from tieredkv.remote.read_turns import READ_BYTES_PER_NODE, ReadTurns
from tieredkv.remote.results import BatchResult, RemoteStats
from tieredkv.remote.write_queue import BoundedWriteQueue, WriteEntry, WriteItem
from tieredkv.remote_url import RemoteURL

logger = logging.getLogger(__name__)

T = TypeVar("T")
Fill = Callable[[Any], object]  # adds the batch's commands to a pipeline
Run = Callable[[RemoteClient], Awaitable[list[Any]]]  # sends a batch, returns one reply per item


def _exists(reply: Any) -> bool:
    return bool(reply)


_DELETE_IF_EQUAL = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


def _value(reply: Any) -> bytes | None:
    return reply if reply is None else bytes(reply)


class Head(NamedTuple):
    """A value read with a bound: at most its first ``max_len`` bytes, and its length.

    ``length`` is the value's length when it is at most ``max_len``; ``max_len + 1`` when it
    is longer (the read asks for one byte more than the bound to tell): a miss for the caller.
    ``data`` is the reply itself (a view of it when cut): never a copy. ``rest``: the value's
    bytes past ``data``, received into the caller's buffer (``into``); else ``data`` is all."""

    data: bytes | memoryview
    length: int
    rest: memoryview | None = None


def _bounded_head(max_len: int) -> Callable[[Any], Head | None]:
    """A ``GETRANGE key 0 max_len`` reply (at most ``max_len + 1`` bytes) -> its head; None
    when absent or empty (Redis answers both with an empty string, and neither is a value)."""

    def convert(reply: Any) -> Head | None:
        if isinstance(reply, Received):
            return Head(reply.head, len(reply.head) + len(reply.rest), reply.rest)
        if not reply:
            return None
        length = len(reply)
        if length > max_len:
            return Head(memoryview(reply)[:max_len], length)
        return Head(reply, length)

    return convert


def _per_node(reply: Any) -> bool:
    """A Cluster's INFO answered per node ({node: {...}}) rather than merged."""
    return isinstance(reply, dict) and bool(reply) and all(isinstance(v, dict) for v in reply.values())


def _ttl_ms(ttl_s: float | None) -> int | None:
    return None if ttl_s is None else max(1, int(ttl_s * 1000))


@dataclass(frozen=True)
class StoreOptions:
    """A store's deadlines, reconnect backoff and background writes (queue bounds, batches,
    writer tasks), in seconds, items and bytes; :class:`RemoteStore` takes them as keywords."""

    timeout_s: float = 0.5
    connect_timeout_s: float = 1.0
    socket_timeout_s: float = 10.0
    backoff_initial_s: float = 0.05
    backoff_max_s: float = 5.0
    health_interval_s: float = 5.0
    write_queue_items: int = 4096
    write_queue_bytes: int = 256 << 20
    write_batch_items: int = 64
    write_batch_bytes: int = 32 << 20
    write_timeout_s: float = 5.0
    writers: int = 2
    latency_samples: int = 256


class RemoteStore:
    """Batched get/set/exists/delete against one Redis deployment; never raises, never hangs.

    Construct anywhere (no network), then ``await start()`` on the loop that will use it.
    Per-call deadlines default to ``timeout_s``; background writes use ``write_timeout_s``.
    ``options`` are :class:`StoreOptions`' fields.
    """

    def __init__(self, url: RemoteURL, **options: Any) -> None:
        opts = self._options = StoreOptions(**options)
        if min(opts.timeout_s, opts.write_timeout_s) <= 0 or opts.writers < 1:
            raise ValueError("remote tier: timeouts must be positive and writers >= 1")
        self._conn = ConnectionKeeper(url, KeeperTimings(
            ping_timeout_s=opts.timeout_s, connect_timeout_s=opts.connect_timeout_s,
            socket_timeout_s=opts.socket_timeout_s, backoff_initial_s=opts.backoff_initial_s,
            backoff_max_s=opts.backoff_max_s, health_interval_s=opts.health_interval_s,
        ), latency_samples=opts.latency_samples)
        self._url = url
        self.timeout_s = opts.timeout_s
        self._queue = BoundedWriteQueue(opts.write_queue_items, opts.write_queue_bytes)
        self._read_buffers = ReadBuffers()  # values land in reused buffers (bounded_read)
        self._read_turns = ReadTurns(READ_BYTES_PER_NODE)  # bounded reads on the wire per node

        self._closing = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake_writers = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._inflight_writes = 0

        self._lock = threading.Lock()  # counters are read from other threads
        self._calls: Counter[str] = Counter()
        self._failed_calls: Counter[str] = Counter()
        self._failures: Counter[str] = Counter()
        self._round_trips = 0
        self._writes = Counter[str]()
        self._probe_latency: deque[float] = deque(maxlen=opts.latency_samples)

    # -- state -------------------------------------------------------------------------------

    @property
    def url(self) -> RemoteURL:
        return self._url

    @property
    def up(self) -> bool:
        """True while the last handshake or call succeeded; False until the first connect."""
        return self._conn.up

    def __repr__(self) -> str:
        return f"RemoteStore({self._url.redacted()}, up={self.up})"

    def stats(self) -> RemoteStats:
        """A consistent snapshot of every counter (any thread)."""
        conn = self._conn
        with self._lock, conn.lock:
            return RemoteStats(
                up=conn.up,
                calls=dict(self._calls),
                failed_calls=dict(self._failed_calls),
                failures=dict(self._failures),
                round_trips=self._round_trips,
                went_down=conn.went_down,
                reconnect_attempts=conn.reconnect_attempts,
                reconnects=conn.reconnects,
                writes_submitted=self._writes["submitted"],
                writes_dropped=self._writes["dropped"],
                writes_done=self._writes["done"],
                writes_failed=self._writes["failed"],
                tails_superseded=self._writes["superseded"],
                queue_items=len(self._queue),
                queue_bytes=self._queue.nbytes,
                probe_latency_s=tuple(self._probe_latency),
                ping_latency_s=tuple(conn.ping_latency),
            )

    async def start(self) -> None:
        """Start the connector and writer tasks on the running loop; no network wait, no raise."""
        if self._tasks or self._closing:
            return
        self._loop = asyncio.get_running_loop()
        self._conn.start()
        for i in range(self._options.writers):
            self._tasks.append(asyncio.create_task(self._writer(), name=f"tieredkv-remote-write-{i}"))
        self._tasks.append(asyncio.create_task(self._release_buffers(), name="tieredkv-remote-buffers"))
        if len(self._queue):
            self._wake_writers.set()

    async def _release_buffers(self) -> None:
        """The read buffers kept for reuse are freed once reads stop for a while."""
        while True:
            await asyncio.sleep(BUFFER_IDLE_S)
            self._read_buffers.release_if_idle(BUFFER_IDLE_S)

    async def aclose(self, timeout_s: float = 2.0) -> None:
        """Stop tasks, drop queued writes (counted), close connections; ends within ~timeout_s."""
        if self._closing:
            return
        self._closing = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout_s / 4)
        dropped = self._queue.clear()
        with self._lock:
            self._writes["dropped"] += dropped
        await self._conn.aclose(timeout_s * 3 / 4)

    async def server_info(self, timeout_s: float | None = None) -> dict[str, int] | None:
        """``used_memory``, ``maxmemory`` and ``evicted_keys`` of the deployment (summed over
        a Cluster's primaries), from ``INFO``; None while down or on any error (metrics only)."""
        client, _gen = self._conn.current()
        if client is None:
            return None
        try:
            async with asyncio.timeout(self.timeout_s if timeout_s is None else timeout_s):
                if self._url.cluster:
                    replies = await client.info(target_nodes="primaries")  # type: ignore[call-arg]
                    infos = list(replies.values()) if _per_node(replies) else [replies]
                else:
                    infos = [await client.info()]
            return {name: sum(int(info.get(name, 0) or 0) for info in infos)
                    for name in ("used_memory", "maxmemory", "evicted_keys")}
        except Exception as exc:  # noqa: BLE001 - a gauge that misses one refresh, not a failure
            logger.debug("tieredkv remote tier: INFO failed: %s", self._url.scrub(repr(exc)))
            return None

    # -- batched calls -----------------------------------------------------------------------

    async def batch_exists(
        self, keys: Sequence[bytes], *, timeout_s: float | None = None
    ) -> BatchResult[bool]:
        """Which keys exist, in one round trip (the scheduler's probe)."""
        result = await self._batch(
            "exists", len(keys), None, _exists, False, timeout_s,
            run=lambda client: exists_each(client, keys),
        )
        if result.ok and keys:
            with self._lock:
                self._probe_latency.append(result.latency_s)
        return result

    async def batch_get(
        self, keys: Sequence[bytes], *, timeout_s: float | None = None
    ) -> BatchResult[bytes | None]:
        """Whole values (``None`` = absent or failed) in one round trip, however big: for
        tests and tools. Reads of chunk values use :meth:`batch_get_bounded`."""
        return await self._batch(
            "get", len(keys), lambda pipe: [pipe.get(k) for k in keys], _value, None, timeout_s
        )

    async def batch_get_bounded(
        self, keys: Sequence[bytes], max_len: int, *, timeout_s: float | None = None,
        into: Into | None = None, into_offset: int = 0,
    ) -> BatchResult[Head | None]:
        """At most ``max_len`` bytes of each value, and its length, in one round trip.

        One ``GETRANGE key 0 max_len`` per key: Redis clamps the range to the value, so a
        value of at most ``max_len`` bytes comes back whole and a longer one as ``max_len + 1``
        bytes, which says it is longer (:class:`Head`). Whatever anyone wrote into Redis, no
        more than ``max_len + 1`` bytes per key cross the network or are held here; a value of
        another length is the caller's miss. One command per key (no ``STRLEN``): half the
        commands of a read, and the engine's ACL needs no ``+strlen``. The worker's reads use
        this, never :meth:`batch_get`. ``into``: see :func:`read_bounded`."""
        if max_len < 1:
            raise ValueError(f"max_len must be positive, got {max_len}")
        return await self._batch(
            "get", len(keys), None, _bounded_head(max_len), None, timeout_s,
            run=lambda client: read_bounded(client, keys, max_len, self._read_buffers,
                                            self._read_turns, into, into_offset),
        )

    async def batch_set(
        self,
        items: Sequence[tuple[bytes, bytes]],
        *,
        ttl_s: float | None = None,
        timeout_s: float | None = None,
    ) -> BatchResult[bool]:
        """Store ``(key, value)`` pairs in one round trip; ``values[i]`` says whether it stuck."""
        entries = [WriteEntry(k, v, ttl_s) for k, v in items]
        return await self._set_entries("set", entries, timeout_s)

    async def batch_delete(
        self, keys: Sequence[bytes], *, if_equal: Sequence[bytes] | None = None,
        timeout_s: float | None = None,
    ) -> BatchResult[bool]:
        """Delete keys in one round trip (one command per key: a Cluster never sees a
        cross-slot one); ``values[i]``: it was deleted. ``if_equal``: only a key that still
        holds that value (a one-key Lua compare-and-delete: another writer's value stays)."""
        def fill(pipe: Any) -> None:
            for i, key in enumerate(keys):
                if if_equal is None:
                    pipe.delete(key)
                else:
                    pipe.eval(_DELETE_IF_EQUAL, 1, key, if_equal[i])

        return await self._batch("delete", len(keys), fill, _exists, False, timeout_s)

    async def _set_entries(
        self, op: str, entries: Sequence[WriteEntry], timeout_s: float | None, xx: bool = False
    ) -> BatchResult[bool]:
        """``xx``: set each only where its key exists (a pointer never creates a key)."""
        def fill(pipe: Any) -> None:
            for entry in entries:
                pipe.set(entry.key, entry.value, px=_ttl_ms(entry.ttl_s), xx=xx)

        return await self._batch(op, len(entries), fill, _exists, False, timeout_s)

    async def _batch(
        self,
        op: str,
        count: int,
        fill: Fill | None,
        convert: Callable[[Any], T],
        default: T,
        timeout_s: float | None,
        run: Run | None = None,
    ) -> BatchResult[T]:
        """``fill`` adds one command per item to a pipeline, or ``run`` sends the batch its
        own way (the bounded read's reader); ``convert`` gets an item's reply."""
        with self._lock:
            self._calls[op] += 1
        if count == 0:
            return BatchResult([])
        client, gen = self._conn.current()
        if self._closing:
            return self._failed(op, count, default, FailureCause.CANCELLED)
        if client is None:
            return self._failed(op, count, default, FailureCause.UNAVAILABLE)
        started = time.monotonic()
        try:
            replies = await asyncio.wait_for(
                self._execute(client, fill, run), self.timeout_s if timeout_s is None else timeout_s
            )
        except asyncio.CancelledError:
            self._failed(op, count, default, FailureCause.CANCELLED)
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes a result
            cause, unusable = classify(exc)
            if self._closing:  # aclose() closed the connection under this call
                cause, unusable = FailureCause.CANCELLED, False
            if cause is FailureCause.UNKNOWN:
                logger.exception("tieredkv remote tier: unexpected error in %s", op)
            elif unusable:
                self._conn.mark_down(gen, cause, exc)
            return self._failed(op, count, default, cause, time.monotonic() - started)
        latency = time.monotonic() - started
        return self._convert(op, gen, replies, count, convert, default, latency)

    async def _execute(self, client: RemoteClient, fill: Fill | None, run: Run | None) -> list[Any]:
        if run is not None:
            with self._lock:
                self._round_trips += 1
            return await run(client)
        assert fill is not None
        async with client.pipeline(transaction=False) as pipe:
            fill(pipe)
            with self._lock:
                self._round_trips += 1
            return await pipe.execute(raise_on_error=False)

    def _convert(
        self,
        op: str,
        gen: int,
        replies: list[Any],
        count: int,
        convert: Callable[[Any], T],
        default: T,
        latency: float,
    ) -> BatchResult[T]:
        """Per-item replies to values; an error reply fails only its item."""
        if len(replies) != count:
            logger.error("tieredkv remote tier: %s got %d replies for %d keys", op, len(replies), count)
            return self._failed(op, count, default, FailureCause.UNKNOWN, latency)
        values: list[T] = []
        first: FailureCause | None = None
        failed = 0
        causes: Counter[str] = Counter()
        for reply in replies:
            if not isinstance(reply, BaseException):
                values.append(convert(reply))
                continue
            cause, unusable = classify(reply)
            # An error *reply* (OOM, CLUSTERDOWN for one slot range) means a server
            # answered: the item fails, the store stays up for the other items.
            if unusable and not isinstance(reply, ResponseError):
                self._conn.mark_down(gen, cause, reply)
            first = first or cause
            failed += 1
            causes[cause.value] += 1
            values.append(default)
        if failed:
            with self._lock:
                self._failed_calls[op] += 1
                self._failures.update(causes)
        return BatchResult(values, first, failed, latency)

    def _failed(
        self, op: str, count: int, default: T, cause: FailureCause, latency: float = 0.0
    ) -> BatchResult[T]:
        with self._lock:
            self._failed_calls[op] += 1
            self._failures[cause.value] += count
        return BatchResult([default] * count, cause, count, latency)

    # -- background writes -------------------------------------------------------------------

    def submit_writes(self, items: Iterable[WriteItem], ttl_s: float | None = None) -> int:
        """Queue ``(key, value)`` or ``(key, value, then)`` writes from any thread (``then``:
        see :class:`WriteEntry`); return how many were accepted.

        Never blocks: what does not fit the queue, or arrives while the store is down or
        closing, is dropped and counted (``writes_dropped``).
        """
        entries = [WriteEntry(item[0], item[1], ttl_s, *item[2:]) for item in items]
        if not entries:
            return 0
        if self.up and not self._closing:
            accepted, dropped = self._queue.offer(entries)
        else:
            accepted, dropped = 0, len(entries)
        with self._lock:
            self._writes["submitted"] += len(entries)
            self._writes["dropped"] += dropped
        if accepted:
            self._wake(self._wake_writers)
        return accepted

    async def flush_writes(self, timeout_s: float) -> bool:
        """Wait until the write queue is empty and no write is in flight (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while len(self._queue) or self._inflight_writes:
            if time.monotonic() >= deadline or self._closing:
                return False
            await asyncio.sleep(0.005)
        return True

    async def _writer(self) -> None:
        while True:
            batch = self._queue.take(self._options.write_batch_items, self._options.write_batch_bytes)
            if not batch:
                self._wake_writers.clear()
                if not len(self._queue):  # re-check: an offer may have raced the clear
                    await self._wake_writers.wait()
                continue
            self._inflight_writes += len(batch)
            try:
                await self._write(batch)
            finally:
                self._inflight_writes -= len(batch)

    async def _write(self, batch: list[WriteEntry]) -> None:
        """Store one batch, then the pointers of the entries that stuck: a pointer must never
        name a value that is not stored."""
        timeout_s = self._options.write_timeout_s
        result = await self._set_entries("write", batch, timeout_s)
        done = sum(result.values)
        with self._lock:
            self._writes["done"] += done
            self._writes["failed"] += len(batch) - done
        then = [WriteEntry(key, value, entry.ttl_s) for entry, stored in
                zip(batch, result.values, strict=True) if stored for key, value in entry.then]
        if then:
            replaced = await self._set_entries("supersede", then, timeout_s, xx=True)
            with self._lock:
                self._writes["superseded"] += sum(replaced.values)

    def _wake(self, event: asyncio.Event) -> None:
        """Set ``event`` from whichever thread we are on."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            event.set()
            return
        try:
            loop.call_soon_threadsafe(event.set)
        except RuntimeError:  # loop closed meanwhile
            pass
