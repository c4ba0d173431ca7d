"""Connections the server closed (review s9, R1 and R2): a read on a connection the server
closed while it sat idle in the pool (Redis ``timeout``, ``CLIENT KILL``, a node restart)
reconnects first and succeeds, instead of waiting out its deadline and marking the store
down as a timeout; a close in the middle of a read fails it as a connection error, not a
timeout. And a malformed bulk header (a length with padding digits) is refused as a protocol
error, not handed to the socket as an empty buffer.

Real servers, killed or stopped for real; deadlines are long only so that a regression fails
instead of hanging, never measured.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from redis import exceptions as rex
from redis.asyncio import Redis

from tests.remote.remote_helpers import RedisClusterProcs, RedisServer, chunk_items, read_command
from tieredkv.protocol import FailureCause
from tieredkv.remote.bounded_read import read_bounded
from tieredkv.remote.store import Head

OpenStore = Callable[..., Awaitable[Any]]
LONG = 20.0  # a deadline no correct read comes near: reaching it is the failure under test
QUIET = {"timeout_s": LONG, "health_interval_s": 600.0}  # no ping finds the dead socket first


def _kill_clients(servers: RedisServer | RedisClusterProcs) -> None:
    """Close every client connection on every node, as the server's idle ``timeout`` does."""
    nodes = servers.servers if isinstance(servers, RedisClusterProcs) else [servers]
    for node in nodes:
        node.cli("CLIENT", "KILL", "TYPE", "normal")


@pytest.mark.parametrize("op", ["get_bounded", "exists"])
async def test_a_connection_the_server_closed_while_idle_is_replaced_before_the_next_read(
    op: str, redis_deployment: RedisServer | RedisClusterProcs, open_store: OpenStore,
    prefix: str,
) -> None:
    store = await open_store(redis_deployment.url, **QUIET)
    items = chunk_items(prefix, 12, size=2048)
    names = [name for _, name, _ in items]
    size = len(items[0][2])
    assert (await store.batch_set([(name, value) for _, name, value in items])).ok
    want = [Head(value, size) for _, _, value in items]
    assert (await store.batch_get_bounded(names, size)).values == want  # connections pooled

    _kill_clients(redis_deployment)
    await asyncio.sleep(0.2)  # the server's close reaches the idle connections' streams

    if op == "get_bounded":
        got = await asyncio.wait_for(store.batch_get_bounded(names, size), 2 * LONG)
        assert got.ok, got
        assert got.values == want
    else:
        probed = await asyncio.wait_for(store.batch_exists(names), 2 * LONG)
        assert probed.ok, probed
        assert probed.values == [True] * len(names)
    assert store.stats().went_down == 0


async def test_a_server_gone_in_the_middle_of_a_read_fails_it_as_a_connection_error(
    fresh_server: Callable[..., RedisServer], open_store: OpenStore, prefix: str,
) -> None:
    """The batch is sent to a stopped server, which then dies without answering: the read
    fails on the closed connection (IO_ERROR), not when its deadline runs out (TIMEOUT)."""
    server = fresh_server()
    store = await open_store(server.url, **QUIET)
    items = chunk_items(prefix, 4, size=2048)
    names = [name for _, name, _ in items]
    assert (await store.batch_set([(name, value) for _, name, value in items])).ok
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    read = asyncio.create_task(store.batch_get_bounded(names, len(items[0][2])))
    await asyncio.sleep(0.2)  # the batch is sent; no answer comes from a stopped server
    assert not read.done()
    os.kill(server.proc.pid, signal.SIGKILL)
    got = await asyncio.wait_for(read, 2 * LONG)
    assert got.values == [None] * len(names)
    assert got.cause is FailureCause.IO_ERROR


def _padded_header_server(value: bytes) -> Callable[..., Awaitable[None]]:
    """Answers the handshake with +OK and each GETRANGE with ``value`` under a bulk header
    whose length has 60 leading zeros (the same number, in a line longer than any allowed)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                parts = await read_command(reader)
                if parts[0].upper() == b"GETRANGE":
                    writer.write(b"$" + b"0" * 60 + b"%d\r\n%s\r\n" % (len(value), value))
                else:
                    writer.write(b"+OK\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return handle


@pytest.mark.parametrize("max_len", [40, 100_000])
async def test_a_bulk_header_longer_than_the_bound_allows_is_refused(
    max_len: int, caplog: pytest.LogCaptureFixture,
) -> None:
    """A header line longer than the longest length the bound allows is refused as a
    protocol error; the socket is never asked to fill an empty buffer (asyncio's fatal
    error, reported as a lost connection)."""
    server = await asyncio.start_server(_padded_header_server(b"v" * 40), "127.0.0.1", 0)
    client = Redis(host="127.0.0.1", port=server.sockets[0].getsockname()[1])
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            with pytest.raises(rex.InvalidResponse, match="length line"):
                await asyncio.wait_for(read_bounded(client, [b"k1"], max_len), LONG)
        assert not [r for r in caplog.records if r.name == "asyncio"]
    finally:
        await client.aclose()
        server.close()
