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
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from tieredkv.protocol import FailureCause
from tieredkv.remote_url import RemoteURL

logger = logging.getLogger(__name__)

CLIENT_NAME = "tieredkv"
RemoteClient = Redis | RedisCluster


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
    }
    if url.cluster:
        nodes = [ClusterNode(host, port) for host, port in url.nodes]
        return RedisCluster(startup_nodes=nodes, **common)
    return Redis(host=url.host, port=url.port, db=url.db, **common)


async def handshake(client: RemoteClient) -> None:
    """Prove the client can talk: load the Cluster's slot map, then PING (raises on failure)."""
    if isinstance(client, RedisCluster):
        await client.initialize()
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
