"""Bounded reads and existence probes with a reply reader of their own: ``GETRANGE key 0
max_len`` (or ``EXISTS key``) per key, one pipeline per node, the replies read straight off
the connection's stream.

Why not redis-py's pipeline: its parser hands each reply through hiredis (the socket's bytes
fed into hiredis's buffer, then copied into a new ``bytes``), two copies of every value before
the one into its host slot; for chunk values that costs more than the network. Here each
reply's header line is read, its length checked against the bound *before* anything is read
or allocated (a server that announces more than ``max_len + 1`` bytes is refused and the
connection dropped), and the value is taken from the stream in one piece. For probes, a
Cluster pipeline in redis-py resolves each command's routing policy with an await of its own;
a probe names hundreds of keys, so grouping them by slot here is most of its cost saved.

One node: one connection from the client's pool. A Cluster: the keys grouped by the node that
owns their slot (redis-py's slot map), one connection per node, the nodes read in parallel;
an item that a node redirects (``MOVED``/``ASK``/``TRYAGAIN``, a resharding) is read again
through redis-py's cluster pipeline, which follows redirections and refreshes the map.

Every failure raises (the store turns it into misses with a cause); a connection that saw one
is disconnected, never returned to its pool mid-reply. A reply that is an error fails only its
item (a ``ResponseError`` in its place, as redis-py's ``raise_on_error=False`` gives).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from redis import exceptions as rex
from redis.asyncio import Redis, RedisCluster
from redis.asyncio.connection import AbstractConnection

from tieredkv.remote.client import RemoteClient

Reply = bytes | BaseException
_REDIRECTS = (rex.MovedError, rex.AskError, rex.TryAgainError)


class BoundExceeded(rex.InvalidResponse):
    """The server announced a reply longer than the read asked for: the connection is not
    trusted further (it is dropped)."""


async def read_bounded(client: RemoteClient, keys: Sequence[bytes], max_len: int) -> list[Reply]:
    """``GETRANGE key 0 max_len`` for each key, in key order: the reply (``b""`` for an absent
    key) or the item's error reply. Raises on a connection or protocol failure."""
    return await _run(client, keys, _Getrange(max_len))


async def exists_each(client: RemoteClient, keys: Sequence[bytes]) -> list[int | BaseException]:
    """``EXISTS key`` for each key (one key per command: no cross-slot multi-key command), in
    key order: 1 or 0, or the item's error reply. Raises on a connection or protocol failure."""
    return await _run(client, keys, _Exists())


class _Getrange:
    def __init__(self, max_len: int) -> None:
        self.max_len = max_len

    def command(self, key: bytes) -> tuple[Any, ...]:
        return (b"GETRANGE", key, 0, self.max_len)

    def redo(self, pipe: Any, key: bytes) -> None:
        pipe.getrange(key, 0, self.max_len)

    async def reply(self, conn: AbstractConnection, stream: asyncio.StreamReader) -> Any:
        return await _reply(conn, stream, self.max_len)


class _Exists:
    def command(self, key: bytes) -> tuple[Any, ...]:
        return (b"EXISTS", key)

    def redo(self, pipe: Any, key: bytes) -> None:
        pipe.exists(key)

    async def reply(self, conn: AbstractConnection, stream: asyncio.StreamReader) -> Any:
        line = await stream.readuntil(b"\r\n")
        kind, body = line[:1], line[1:-2]
        if kind == b":":
            try:
                return int(body)
            except ValueError:
                raise rex.InvalidResponse("an integer reply is not a number") from None
        if kind == b"-":
            return conn._parser.parse_error(body.decode("utf-8", "replace"))  # type: ignore[union-attr]
        raise rex.InvalidResponse(f"unexpected reply type {kind!r} to EXISTS")


async def _run(client: RemoteClient, keys: Sequence[bytes], op: _Getrange | _Exists) -> list[Any]:
    if isinstance(client, RedisCluster):
        return await _run_cluster(client, keys, op)
    assert isinstance(client, Redis)
    pool = client.connection_pool
    conn = await pool.get_connection()
    try:
        return await _read_on(conn, keys, op)
    finally:
        await pool.release(conn)


async def _run_cluster(client: RedisCluster, keys: Sequence[bytes], op: _Getrange | _Exists) -> list[Any]:
    nodes: dict[str, tuple[Any, list[int]]] = {}
    manager = client.nodes_manager
    for i, key in enumerate(keys):
        node = manager.get_node_from_slot(client.keyslot(key))
        nodes.setdefault(node.name, (node, []))[1].append(i)
    replies: list[Any] = [None] * len(keys)

    async def one(node: Any, indices: list[int]) -> None:
        conn = node.acquire_connection()
        try:
            got = await _read_on(conn, [keys[i] for i in indices], op)
        finally:
            node.release(conn)
        for i, reply in zip(indices, got, strict=True):
            replies[i] = reply

    await asyncio.gather(*(one(node, indices) for node, indices in nodes.values()))
    moved = [i for i, reply in enumerate(replies) if isinstance(reply, _REDIRECTS)]
    if moved:  # redis-py follows the redirections and refreshes its slot map
        async with client.pipeline(transaction=False) as pipe:
            for i in moved:
                op.redo(pipe, keys[i])
            again = await pipe.execute(raise_on_error=False)
        for i, reply in zip(moved, again, strict=True):
            replies[i] = reply
    return replies


async def _read_on(conn: AbstractConnection, keys: Sequence[bytes], op: _Getrange | _Exists) -> list[Any]:
    """Send the batch's commands on ``conn`` and read their replies; any failure drops ``conn``."""
    try:
        if conn.is_connected and not _parser_idle(conn):
            await conn.disconnect()  # bytes of an earlier reply are pending: start clean
        await conn.send_packed_command(conn.pack_commands([op.command(key) for key in keys]),
                                       check_health=False)
        stream: asyncio.StreamReader | None = getattr(conn, "_reader", None)
        if stream is None:
            raise rex.ConnectionError("the connection closed before its replies were read")
        return [await op.reply(conn, stream) for _ in keys]
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        await _drop(conn)  # the server closed mid-reply, or sent a line past the stream's limit
        raise rex.ConnectionError(f"reading replies failed: {type(exc).__name__}") from exc
    except BaseException:
        await _drop(conn)
        raise


async def _reply(conn: AbstractConnection, stream: asyncio.StreamReader, max_len: int) -> Reply:
    """One reply: a bulk string of at most ``max_len + 1`` bytes, or an error reply."""
    line = await stream.readuntil(b"\r\n")  # at most the stream's limit (64 KiB), else raises
    kind, body = line[:1], line[1:-2]
    if kind == b"$":
        try:
            size = int(body)
        except ValueError:
            raise rex.InvalidResponse("a bulk reply's length is not a number") from None
        if size < 0:  # nil: not a GETRANGE answer, but an absent value all the same
            return b""
        if size > max_len + 1:
            raise BoundExceeded(f"a {size}-byte reply to a read bounded to {max_len + 1} bytes")
        data = await stream.readexactly(size + 2)
        if data[-2:] != b"\r\n":
            raise rex.InvalidResponse("a bulk reply did not end where its length said")
        return memoryview(data)[:size] if size else b""
    if kind == b"-":
        return conn._parser.parse_error(body.decode("utf-8", "replace"))  # type: ignore[union-attr]
    raise rex.InvalidResponse(f"unexpected reply type {kind!r} to GETRANGE")


def _parser_idle(conn: AbstractConnection) -> bool:
    """No bytes of an earlier reply buffered in redis-py's parser (hiredis or Python)."""
    parser = getattr(conn, "_parser", None)
    reader = getattr(parser, "_reader", None)
    if reader is not None and hasattr(reader, "has_data") and reader.has_data():
        return False
    buffer = getattr(parser, "_buffer", None)
    return not (isinstance(buffer, bytes | bytearray) and len(buffer) > getattr(parser, "_pos", 0))


async def _drop(conn: AbstractConnection) -> None:
    try:
        await asyncio.shield(conn.disconnect(nowait=True))
    except BaseException:  # noqa: BLE001 - already failing; the caller's error is the one to keep
        pass
