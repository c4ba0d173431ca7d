"""Outages are results: a killed, paused, absent or misconfigured server never hangs a caller."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.remote.remote_helpers import (
    FINGERPRINT,
    RedisClusterProcs,
    RedisServer,
    await_up,
    chunk_items,
    free_port,
)
from tieredkv.protocol import FailureCause
from tieredkv.remote.codec import decode
from tieredkv.remote_url import parse_remote_url

OpenStore = Callable[..., Awaitable[Any]]
TIMEOUT = 0.5  # the deadline under test
# Bounds no healthy run comes near, used only so a hang fails the test instead of stalling it;
# what is asserted is how a call ended (its cause) and in what order things happened.
HANG_S = 30.0
PAUSE_MS = 5000  # CLIENT PAUSE: far past TIMEOUT, so only the client's deadline can end a call
# Connects keep FAST's generous deadline: a Cluster handshake is several round trips.
TIGHT = {"timeout_s": TIMEOUT}
FAILED = {FailureCause.IO_ERROR, FailureCause.TIMEOUT, FailureCause.UNAVAILABLE}


async def until(condition: Callable[[], bool], within_s: float = HANG_S) -> None:
    """Wait for ``condition``; ``within_s`` only turns a wait that never ends into a failure."""
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "the condition never came true"
        await asyncio.sleep(0.01)


async def test_down_at_start_then_recovers(
    fresh_server: Callable[..., RedisServer], open_store: OpenStore, prefix: str
) -> None:
    server = fresh_server(start=False, port=free_port())
    store = await open_store(server.url, wait=False, **TIGHT)  # nothing listens: no exception
    assert not store.up
    round_trips = store.stats().round_trips
    result = await store.batch_exists([n for _, n, _ in chunk_items(prefix, 10)])
    assert result.cause is FailureCause.UNAVAILABLE and result.values == [False] * 10
    assert store.stats().round_trips == round_trips  # answered without touching the network
    await asyncio.sleep(1.0)
    attempts = store.stats().reconnect_attempts
    assert attempts <= 30, attempts  # with backoff (capped at 0.2 s here), not a busy loop
    await until(lambda: store.stats().reconnect_attempts >= 3)  # and retrying
    server.start()
    assert await await_up(store, HANG_S)
    items = chunk_items(prefix, 10)
    assert (await store.batch_set([(n, v) for _, n, v in items])).ok
    assert all((await store.batch_exists([n for _, n, _ in items])).values)
    assert store.stats().failures["unavailable"] == 10


async def test_sigkill_mid_use_then_restart(
    fresh_server: Callable[..., RedisServer], open_store: OpenStore, prefix: str
) -> None:
    server = fresh_server()
    store = await open_store(server.url, **TIGHT)
    items = chunk_items(prefix, 200, size=8192)
    names = [n for _, n, _ in items]
    assert (await store.batch_set([(n, v) for _, n, v in items])).ok

    outcomes: list[tuple[float, FailureCause | None]] = []
    stop = asyncio.Event()

    outcomes: list[tuple[bool, FailureCause | None]] = []  # (after the kill, cause)
    killed = False

    async def hammer() -> None:
        while not stop.is_set():
            result = await asyncio.wait_for(store.batch_get(names), HANG_S)  # a hang fails
            outcomes.append((killed, result.cause))
            await asyncio.sleep(0)

    task = asyncio.create_task(hammer())
    await until(lambda: len(outcomes) >= 2)
    server.kill()
    killed = True
    await until(lambda: sum(after for after, _ in outcomes) >= 3)  # calls kept ending after it
    stop.set()
    await asyncio.wait_for(task, HANG_S)

    assert outcomes[0][1] is None  # it was serving before the kill
    # Every call after the kill ended, each with its cause (the first may have been answered
    # before the kill): none waited for the dead server.
    after = [cause for was_after, cause in outcomes if was_after]
    assert len(after) >= 3 and all(cause in FAILED for cause in after[1:]), outcomes
    assert not store.up and store.stats().went_down >= 1

    server.start()  # same port, empty (no persistence)
    assert await await_up(store, HANG_S)
    got = await store.batch_get(names)
    assert got.ok and got.values == [None] * 200  # gone with the old process: misses
    assert {decode(v, fingerprint=FINGERPRINT, key=k, rank=0).cause  # type: ignore[union-attr]
            for (k, _, _), v in zip(items, got.values, strict=True)} == {FailureCause.MISSING}
    assert (await store.batch_set([(n, v) for _, n, v in items])).ok
    assert store.stats().reconnects >= 2


async def test_client_pause_times_out_without_hanging(
    fresh_server: Callable[..., RedisServer], open_store: OpenStore, prefix: str
) -> None:
    server = fresh_server()
    store = await open_store(server.url, **TIGHT)
    items = chunk_items(prefix, 50)
    names = [n for _, n, _ in items]
    assert (await store.batch_set([(n, v) for _, n, v in items])).ok

    server.cli("CLIENT", "PAUSE", str(PAUSE_MS), "ALL")
    paused_at = time.monotonic()
    # The server answers nothing for PAUSE_MS: a call that waited for it would come back with
    # the values, so a TIMEOUT is the call's own deadline firing first.
    result = await asyncio.wait_for(store.batch_get(names), HANG_S)
    assert result.cause is FailureCause.TIMEOUT and result.values == [None] * 50
    assert not store.up
    round_trips = store.stats().round_trips
    assert (await store.batch_exists(names)).cause is FailureCause.UNAVAILABLE
    assert store.stats().round_trips == round_trips  # known down: no second wait on the server

    assert await await_up(store, HANG_S)
    # A lower bound set by the server's pause (no load can make it fail): the store came back
    # because the pause ended, not before.
    assert time.monotonic() - paused_at >= PAUSE_MS / 1000 * 0.9
    got = await store.batch_get(names)
    assert got.ok and all(decode(v, fingerprint=FINGERPRINT, key=k, rank=0).ok
                          for (k, _, _), v in zip(items, got.values, strict=True))


async def test_password_never_logged(
    fresh_server: Callable[..., RedisServer],
    open_store: OpenStore,
    prefix: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real, wrong = "Real-Pass-4f9b2c", "Wrong-Pass-8d1e7a"
    server = fresh_server("--requirepass", real)
    caplog.set_level(logging.DEBUG)

    bad = await open_store(
        parse_remote_url(f"redis://:{wrong}@127.0.0.1:{server.port}/0"), wait=False
    )
    # Wait for the failed connect to be logged (the bound only turns a hang into a failure).
    await until(lambda: "not reachable" in caplog.text)
    assert not bad.up
    assert "***" in caplog.text

    monkeypatch.setenv("TKV_TEST_REDIS_PASSWORD", real)
    url = parse_remote_url(
        f"redis://127.0.0.1:{server.port}/0", password_env="TKV_TEST_REDIS_PASSWORD"
    )
    good = await open_store(url)
    items = chunk_items(prefix, 5)
    assert (await good.batch_set([(n, v) for _, n, v in items])).ok

    server.kill()  # an outage logs too
    await good.batch_get([n for _, n, _ in items])
    await asyncio.sleep(0.1)
    text = caplog.text + repr(bad) + repr(good) + repr(good.stats()) + repr(url) + str(url)
    for secret in (real, wrong):
        assert secret not in text
    assert "is down" in caplog.text


@pytest.mark.redis  # starts a Cluster of its own (the guard in tests/conftest.py checks)
async def test_cluster_master_killed_then_restarted(
    tmp_path: Path, open_store: OpenStore, prefix: str
) -> None:
    cluster = RedisClusterProcs(tmp_path).start()
    try:
        store = await open_store(cluster.url, **TIGHT)
        items = chunk_items(prefix, 100)
        names = [n for _, n, _ in items]
        assert (await store.batch_set([(n, v) for _, n, v in items])).ok

        victim = cluster.servers[1]
        victim.kill()
        result = await asyncio.wait_for(store.batch_get(names), HANG_S)  # ends, with a cause
        assert result.cause in FAILED and not store.up

        victim.start()  # same port and nodes-P.conf: it rejoins as the same node
        cluster.wait_ok(10)
        assert await await_up(store, 5)
        got = await store.batch_get(names)
        assert got.ok
        survivors = sum(v is not None for v in got.values)
        assert 0 < survivors < 100  # the other masters kept theirs; the victim's are misses
    finally:
        cluster.stop()
