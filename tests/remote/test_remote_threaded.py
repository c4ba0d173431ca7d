"""The synchronous facade: futures that always resolve, and a close that always ends."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from tests.helpers import HANG_S, finishes
from tests.remote.remote_helpers import FINGERPRINT, RedisServer, chunk_items, free_port, wait_up
from tieredkv.protocol import FailureCause
from tieredkv.remote.codec import decode
from tieredkv.remote.results import BatchResult
from tieredkv.remote.threaded import ThreadedRemoteStore


def test_futures_round_trip(
    deployment: str, open_threaded: Callable[..., ThreadedRemoteStore], prefix: str
) -> None:
    store = open_threaded(deployment)
    assert wait_up(store, 10)
    items = chunk_items(prefix, 64)
    names = [n for _, n, _ in items]
    assert store.batch_set([(n, v) for _, n, v in items[:32]]).result(HANG_S).ok
    assert store.submit_writes([(n, v) for _, n, v in items[32:]]) == 32
    assert store.flush_writes(5).result(6)
    probe = store.batch_exists(names)
    got = store.batch_get(names)
    assert probe.result(HANG_S).values == [True] * 64
    assert all(decode(v, fingerprint=FINGERPRINT, key=k, rank=0).ok
               for (k, _, _), v in zip(items, got.result(HANG_S).values, strict=True))
    assert store.batch_delete(names).result(HANG_S).values == [True] * 64
    assert store.stats().writes_done == 32


def test_down_at_construction_answers_unavailable_and_closes_fast(
    open_threaded: Callable[..., ThreadedRemoteStore],
) -> None:
    store = finishes(lambda: open_threaded(f"redis://127.0.0.1:{free_port()}/0"))
    assert not store.up
    result = store.batch_exists([b"a", b"b"]).result(HANG_S)
    assert result.cause is FailureCause.UNAVAILABLE and result.values == [False, False]
    assert store.submit_writes([(b"a", b"x")]) == 0 and store.stats().writes_dropped == 1
    assert finishes(lambda: store.close(HANG_S))  # True: its thread ended (no store is left running)


def test_close_is_bounded_while_calls_hang_on_a_paused_server(
    fresh_server: Callable[..., RedisServer],
    open_threaded: Callable[..., ThreadedRemoteStore],
    prefix: str,
) -> None:
    server = fresh_server()
    store = open_threaded(server.url)
    assert wait_up(store, 5)
    names = [n for _, n, _ in chunk_items(prefix, 20)]
    server.cli("CLIENT", "PAUSE", "5000", "ALL")
    # Deadlines far beyond close()'s: these are still in flight when it is called.
    pending = [store.batch_get(names, timeout_s=10.0) for _ in range(4)]
    time.sleep(0.1)
    assert not any(f.done() for f in pending)
    # close() gives in-flight calls its own 1 s, not the paused server's 5 s: the CANCELLED
    # results below prove it (not answered, not timed out). Whether its thread also ended
    # inside that second depends on the machine's load, so wait for it to end.
    finishes(lambda: store.close(1.0))
    finishes(lambda: store._thread.join(HANG_S))
    assert not store._thread.is_alive()
    for future in pending:
        # Resolved by close, not answered by the server after its pause, nor by their own
        # deadline: a poller never waits forever.
        result = future.result(0)
        assert result.cause is FailureCause.CANCELLED and result.values == [None] * 20
    after = store.batch_exists(names)
    assert after.done() and after.result().cause is FailureCause.CANCELLED


def test_a_call_made_from_an_answers_callback_is_answered(
    deployment: str, open_threaded: Callable[..., ThreadedRemoteStore], prefix: str
) -> None:
    """A done callback runs on the store's thread, and may start the next call there (the
    transfer layer sends its next read batch so): the store must not hold its lock while it
    runs callbacks (it did: the next call waited for that lock on the one thread that held it,
    and the tier, its close included, hung for good)."""
    store = open_threaded(deployment)
    assert wait_up(store, 10)
    names = [n for _, n, _ in chunk_items(prefix, 4)]
    release = threading.Event()
    gate = store.run(lambda: asyncio.to_thread(release.wait, HANG_S), False)
    then: list[Future[BatchResult[bool]]] = []
    chained = threading.Event()

    def chain(_: Future[bool]) -> None:
        then.append(store.batch_exists(names))
        chained.set()

    gate.add_done_callback(chain)
    release.set()  # answered on the store's thread, after the callback is in place
    assert finishes(lambda: gate.result(HANG_S)) is True
    assert chained.wait(HANG_S), "the callback's call never returned"
    assert finishes(lambda: then[0].result(HANG_S)).values == [False] * 4
    assert finishes(lambda: store.close(HANG_S))
