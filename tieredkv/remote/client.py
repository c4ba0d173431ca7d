"""Building, checking and closing redis-py asyncio clients, and naming what their errors mean.

The store treats a client as disposable: each (re)connect builds a fresh one, proves it with
a handshake, and only then swaps it in, so no half-initialised Cluster topology or poisoned
connection survives an outage. redis-py's own retries are turned off: the store already has
a deadline per call and a reconnect loop with backoff, and hidden retries would only spend
the caller's deadline.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from redis import exceptions as rex
from redis.asyncio import Redis, RedisCluster
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.connection import Connection, SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from tieredkv.protocol import FailureCause
from tieredkv.remote_url import RemoteURL

logger = logging.getLogger(__name__)

CLIENT_NAME = "tieredkv"
RemoteClient = Redis | RedisCluster
# Writes hand the socket at most this much at a time, and wait for it to drain past this.
WRITE_SLICE_BYTES = 1 << 20
WRITE_HIGH_WATER_BYTES = 2 << 20
READ_SIZE_BYTES = 1 << 20


class _SlicedWrites:
    """Send a pipeline in 1 MiB slices, draining as it goes.

    redis-py's asyncio connection hands a whole pipeline to ``StreamWriter.writelines``,
    which (CPython 3.11) joins it into one ``bytes`` and leaves the unsent rest in a
    ``bytearray`` that is shifted after every partial ``send``: time grows with the square of
    the pipeline (16 chunks of 8 MiB: a 128 MiB buffer shifted hundreds of times). Slices
    keep the transport's buffer at a few MiB, so each shift is cheap and nothing is joined.
    """

    _writer: asyncio.StreamWriter

    async def _send_packed_command(self, command: Any) -> None:
        writer = self._writer
        transport = writer.transport
        for piece in command:
            view = memoryview(piece)
            for start in range(0, len(view), WRITE_SLICE_BYTES):
                writer.write(view[start:start + WRITE_SLICE_BYTES])
                if transport.get_write_buffer_size() >= WRITE_HIGH_WATER_BYTES:
                    await writer.drain()
        await writer.drain()

    async def _connect(self) -> None:
        # asyncio's StreamReader pauses the socket whenever it holds more than twice its limit
        # (64 KiB by default) and resumes it on the next read: for a MiB-sized reply that is a
        # pause and a resume per 256 KiB received. Let it hold a read's worth instead.
        await super()._connect()  # type: ignore[misc]
        reader = getattr(self, "_reader", None)
        if isinstance(reader, asyncio.StreamReader):
            reader._limit = READ_SIZE_BYTES  # noqa: SLF001 - no public setter


class SlicedConnection(_SlicedWrites, Connection):
    pass


class SlicedSSLConnection(_SlicedWrites, SSLConnection):
    pass


def make_client(
    url: RemoteURL, *, socket_timeout_s: float, connect_timeout_s: float
) -> RemoteClient:
    """A client for ``url`` (no network yet); ``socket_timeout_s`` is only a backstop."""
    common: dict[str, Any] = {
        "username": url.username,
        "password": url.password,
        "ssl": url.tls,
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": connect_timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "client_name": CLIENT_NAME,
        # Chunk values are MiBs: read them in big pieces, not redis-py's 64 KiB default.
        "socket_read_size": READ_SIZE_BYTES,
    }
    sliced = SlicedSSLConnection if url.tls else SlicedConnection
    if url.cluster:
        nodes = [ClusterNode(host, port) for host, port in url.nodes]
        cluster = RedisCluster(startup_nodes=nodes, **common)
        # Nodes discovered later are built from connection_kwargs; the seeds exist already.
        cluster.nodes_manager.connection_kwargs["connection_class"] = sliced
        for node in cluster.nodes_manager.startup_nodes.values():
            node.connection_class = sliced
        return cluster
    client = Redis(host=url.host, port=url.port, db=url.db, **common)
    client.connection_pool.connection_class = sliced
    return client


async def handshake(client: RemoteClient) -> None:
    """Prove the client can talk: load the Cluster's slot map, then PING (raises on failure).

    A Cluster PINGs every primary: each gets its connection now, not in the first probe, which
    would otherwise pay for them against its deadline (``remote_timeout_s``)."""
    if isinstance(client, RedisCluster):
        await client.initialize()
        await client.ping(target_nodes=RedisCluster.PRIMARIES)  # type: ignore[call-arg]
        return
    await client.ping()


async def close_client(client: RemoteClient, timeout_s: float) -> None:
    """Close ``client``'s connections within ``timeout_s``; never raises."""
    closer = getattr(client, "aclose", None) or client.close  # aclose: redis-py >= 5.0.1
    try:
        await asyncio.wait_for(closer(), timeout_s)
    except asyncio.CancelledError:
        raise
    except BaseException as exc:  # noqa: BLE001 - closing is best effort
        logger.debug("closing a remote-tier client failed: %s", type(exc).__name__)


def classify(exc: BaseException) -> tuple[FailureCause, bool]:
    """``(cause, server_unusable)`` for an exception a call or a pipeline item produced.

    ``server_unusable`` marks the store down (reconnect with backoff); a plain error reply
    (e.g. OOM under ``noeviction``) means the server is there and answering.
    """
    if isinstance(exc, TimeoutError | rex.TimeoutError):  # asyncio's and redis-py's
        return FailureCause.TIMEOUT, True
    if isinstance(exc, rex.ClusterDownError | rex.TryAgainError):
        return FailureCause.IO_ERROR, True
    if isinstance(exc, rex.ResponseError):
        if isinstance(exc, rex.OutOfMemoryError) or str(exc).startswith("OOM"):
            return FailureCause.NO_SPACE, False
        return FailureCause.IO_ERROR, False
    if isinstance(exc, rex.RedisError | rex.RedisClusterException | OSError):
        return FailureCause.IO_ERROR, True
    return FailureCause.UNKNOWN, False
