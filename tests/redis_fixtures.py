"""Redis fixtures for every test folder (a pytest plugin loaded by tests/conftest.py).

Real redis-server processes on loopback ports (``tieredkv.testing.redis_procs``), for tests/remote,
tests/transfer and tests/scheduler.

Nothing is mocked and nothing is skipped: without redis-server (Debian package, installed by
``scripts/setup_env.sh``) or the ``redis`` client every test that needs them fails and says
how to fix it; the pure parsing/codec/queue tests still run.
Shared servers are module-scoped; tests that kill, pause or fill a server get their own.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

try:
    from tests.remote.remote_helpers import FAST, await_up
    from tieredkv.remote.store import RemoteStore
except ModuleNotFoundError as exc:  # pragma: no cover - an environment problem, not a skip
    # Without the client (the GPU machines have none) every other test still collects and
    # runs; a test that asks for a Redis fixture fails in _require_client with the fix.
    if exc.name != "redis":
        raise
    RemoteStore = None  # type: ignore[assignment,misc]
from tieredkv.remote_url import parse_remote_url
from tieredkv.testing.redis_procs import SETUP_HINT, RedisClusterProcs, RedisServer


def _require_client() -> None:
    if RemoteStore is None:
        pytest.fail(f"the redis Python client is missing: pip install 'redis>=5' ({SETUP_HINT})")


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterProcs]:
    cluster = RedisClusterProcs(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def fresh_server(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Factory for a server this test alone uses (to kill, pause or fill); stopped after."""
    servers: list[RedisServer] = []

    def make(*args: str, start: bool = True, port: int | None = None) -> RedisServer:
        server = RedisServer(tmp_path / f"s{len(servers)}", port, args)
        servers.append(server)
        return server.start() if start else server

    yield make
    for server in servers:
        if server.proc is not None and server.proc.poll() is None:
            os.kill(server.proc.pid, signal.SIGCONT)  # a test may have left it stopped
        server.stop()


@pytest.fixture
def prefix() -> str:
    """A key prefix of this test's own, so tests sharing a server never see each other."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def open_store() -> AsyncIterator[Callable[..., Awaitable[Any]]]:
    """Factory: a started :class:`RemoteStore` for a URL (FAST deadlines unless overridden)."""
    _require_client()
    stores: list[Any] = []

    async def make(url: str | Any, *, wait: bool = True, **options: Any) -> Any:
        parsed = parse_remote_url(url) if isinstance(url, str) else url
        store = RemoteStore(parsed, **{**FAST, **options})
        stores.append(store)
        await store.start()
        if wait:
            assert await await_up(store, 10), f"store did not come up: {store.stats()}"
        return store

    yield make
    for store in stores:
        await store.aclose(1.0)


@pytest.fixture(params=["single", "cluster"])
def redis_deployment(request: pytest.FixtureRequest) -> RedisServer | RedisClusterProcs:
    """The shared single node or the shared 3-master Cluster."""
    return request.getfixturevalue("redis_server" if request.param == "single" else "redis_cluster")


@pytest.fixture
def deployment(redis_deployment: RedisServer | RedisClusterProcs) -> str:
    """The URL of a shared single node or of the shared 3-master Cluster."""
    return redis_deployment.url


@pytest.fixture
def open_threaded() -> Iterator[Callable[..., Any]]:
    """Factory: a :class:`ThreadedRemoteStore` for a URL (FAST deadlines unless overridden)."""
    _require_client()
    from tieredkv.remote.threaded import ThreadedRemoteStore

    stores: list[ThreadedRemoteStore] = []

    def make(url: str, **options: Any) -> ThreadedRemoteStore:
        store = ThreadedRemoteStore(parse_remote_url(url), **{**FAST, **options})
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close(1.0)
