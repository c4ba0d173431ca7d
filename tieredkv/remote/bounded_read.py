"""Bounded reads and existence probes with a reply reader of their own: ``GETRANGE key 0
max_len`` (or ``EXISTS key``) per key, one pipeline per node, the replies read straight off
the connection.

Why not redis-py's pipeline: its parser hands each reply through asyncio's stream buffer and
hiredis (the socket's bytes copied into the stream's buffer, out of it, into hiredis's
buffer, then into a new ``bytes``), copies of every value before the one into its host slot;
for chunk values that costs more than the network. Here, for the duration of a read, the
connection's transport delivers into :class:`_BulkReplies` instead of its stream: each reply
is received into a buffer sized for the longest reply the bound allows, its header line's
length checked against the bound *before* anything more is received (a server that
announces more than ``max_len + 1`` bytes is refused and the connection dropped), and the
value is the part of that buffer the socket wrote it into: no copy at all. A whole value's
reply is asked of the socket exactly; only a shorter one (an absent key, an error) can pull
in the start of the next reply, which follows it in the batch's buffer. A caller may
name, per key, a buffer of its own (``into``): a value exactly ``into_offset`` + that buffer's
length long then has those bytes written by the socket straight there (the host slot it is
for), its first ``into_offset`` bytes (its header) in the batch's buffer. For probes
(small replies) the stream is read as it is; a Cluster pipeline in redis-py resolves each
command's routing policy with an await of its own; a probe names hundreds of keys, so
grouping them by slot here is most of its cost saved.

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
import contextlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
from redis import exceptions as rex
from redis.asyncio import Redis, RedisCluster
from redis.asyncio.connection import AbstractConnection, SSLConnection

from tieredkv.remote.client import RemoteClient
from tieredkv.remote.read_buffers import ReadBuffers
from tieredkv.remote.read_turns import ReadTurns


class Received(NamedTuple):
    """A value whose bytes past ``head`` the socket wrote into the caller's ``rest``."""

    head: memoryview
    rest: memoryview


Reply = bytes | memoryview | Received | BaseException
Into = Sequence[memoryview | None]  # per key: the caller's buffer for a value's bytes, or None
_REDIRECTS = (rex.MovedError, rex.AskError, rex.TryAgainError)
LINE_LIMIT = 1 << 16  # the longest reply line (an error's text) taken, as asyncio's streams do
_SNIFF = 32  # a bulk header line ($ + 20 digits + CRLF) fits in this many bytes


class BoundExceeded(rex.InvalidResponse):
    """The server announced a reply longer than the read asked for: the connection is not
    trusted further (it is dropped)."""


async def read_bounded(client: RemoteClient, keys: Sequence[bytes], max_len: int,
                       buffers: ReadBuffers | None = None, turns: ReadTurns | None = None,
                       into: Into | None = None, into_offset: int = 0) -> list[Reply]:
    """``GETRANGE key 0 max_len`` for each key, in key order: the reply (``b""`` for an absent
    key) or the item's error reply; values come in ``buffers`` (default: fresh ones), or as a
    :class:`Received` when ``into`` names a buffer for that key and the value is exactly
    ``into_offset`` + its length long; with ``turns``, a node's part waits its turn. Raises
    on a connection or protocol failure."""
    if into is not None and (len(into) != len(keys) or into_offset < _SNIFF):
        raise ValueError("into: one entry per key, past a header line's bytes")
    return await _run(client, keys, _Getrange(max_len, buffers or ReadBuffers(0), turns,
                                              into, into_offset))


async def exists_each(client: RemoteClient, keys: Sequence[bytes]) -> list[int | BaseException]:
    """``EXISTS key`` for each key (one key per command: no cross-slot multi-key command), in
    key order: 1 or 0, or the item's error reply. Raises on a connection or protocol failure."""
    return await _run(client, keys, _Exists())


class _Getrange:
    def __init__(self, max_len: int, buffers: ReadBuffers, turns: ReadTurns | None,
                 into: Into | None = None, into_offset: int = 0) -> None:
        self.max_len = max_len
        self.buffers = buffers
        self.turns = turns
        self.into, self.into_offset = into, into_offset

    def part(self, indices: list[int]) -> _Getrange:
        """The read of a Cluster node's share of the keys."""
        into = None if self.into is None else [self.into[i] for i in indices]
        return _Getrange(self.max_len, self.buffers, self.turns, into, self.into_offset)

    def pack(self, keys: Sequence[bytes]) -> bytes:
        """The batch's commands as RESP, built in one go (redis-py packs each command
        argument by argument: a sixth of the read's own CPU time at 96 KiB values)."""
        bound = b"%d" % self.max_len
        tail = b"\r\n$1\r\n0\r\n$%d\r\n%s\r\n" % (len(bound), bound)
        return b"".join([b"*4\r\n$8\r\nGETRANGE\r\n$%d\r\n%s%s" % (len(key), key, tail)
                         for key in keys])

    def redo(self, pipe: Any, key: bytes) -> None:
        pipe.getrange(key, 0, self.max_len)

    async def reply(self, conn: AbstractConnection, stream: asyncio.StreamReader) -> Any:
        return await _reply(conn, stream, self.max_len)


class _Exists:
    turns = None  # probes are small: no turns

    def part(self, indices: list[int]) -> _Exists:
        return self

    def pack(self, keys: Sequence[bytes]) -> bytes:
        """The batch's commands as RESP, built in one go."""
        return b"".join([b"*2\r\n$6\r\nEXISTS\r\n$%d\r\n%s\r\n" % (len(key), key)
                         for key in keys])

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
    async with _turn(op, "", len(keys)):
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
        async with _turn(op, node.name, len(indices)):
            conn = node.acquire_connection()
            try:
                got = await _read_on(conn, [keys[i] for i in indices], op.part(indices))
            finally:
                node.release(conn)
        for i, reply in zip(indices, got, strict=True):
            replies[i] = reply

    parts = [asyncio.ensure_future(one(node, indices)) for node, indices in nodes.values()]
    try:
        await asyncio.gather(*parts)
    except BaseException:  # one node failed: the others' parts end too (and give their turns back)
        for part in parts:
            part.cancel()
        await asyncio.gather(*parts, return_exceptions=True)
        raise
    moved = [i for i, reply in enumerate(replies) if isinstance(reply, _REDIRECTS)]
    if moved:  # redis-py follows the redirections and refreshes its slot map
        async with client.pipeline(transaction=False) as pipe:
            for i in moved:
                op.redo(pipe, keys[i])
            again = await pipe.execute(raise_on_error=False)
        for i, reply in zip(moved, again, strict=True):
            replies[i] = reply
    return replies


def _turn(op: _Getrange | _Exists, node: str, count: int) -> contextlib.AbstractAsyncContextManager[Any]:
    """Wait for ``node``'s turn to read ``count`` values (bounded reads with turns), else go
    at once."""
    if not isinstance(op, _Getrange) or op.turns is None:
        return contextlib.nullcontext()
    return op.turns.of(node, count * (op.max_len + 1))


async def _read_on(conn: AbstractConnection, keys: Sequence[bytes], op: _Getrange | _Exists) -> list[Any]:
    """Send the batch's commands on ``conn`` and read their replies; any failure drops ``conn``."""
    try:
        if conn.is_connected and not (_parser_idle(conn) and _open(conn)):
            # Bytes of an earlier reply are pending, or the server closed the connection
            # while it sat in the pool (a Cluster node never checks; redis-py's pool does not
            # with maintenance notifications on, its RESP3 default): start clean rather than
            # send into a socket that will never answer.
            await conn.disconnect()
        packed = [op.pack(keys)]
        if isinstance(op, _Getrange) and not isinstance(conn, SSLConnection):
            return await _read_into_buffers(conn, packed, len(keys), op)
        await conn.send_packed_command(packed, check_health=False)
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


async def _read_into_buffers(conn: AbstractConnection, packed: list[bytes], count: int,
                             op: _Getrange) -> list[Reply]:
    """Send a batch of GETRANGEs on ``conn`` and receive its replies through
    :class:`_BulkReplies`; the connection's own protocol is back in place afterwards."""
    if not conn.is_connected:
        await conn.connect()
    stream: asyncio.StreamReader | None = getattr(conn, "_reader", None)
    writer: asyncio.StreamWriter | None = getattr(conn, "_writer", None)
    if stream is None or writer is None or not _open(conn):
        raise rex.ConnectionError("the connection closed before its replies were read")
    # No await from here to set_protocol: a close the stream has not seen yet reaches
    # _BulkReplies, which fails the batch on it at once.
    transport = writer.transport
    own = transport.get_protocol()
    replies = _BulkReplies(own, count, op.max_len, op.buffers,
                           conn._parser.parse_error,  # type: ignore[union-attr]
                           op.into, op.into_offset)
    transport.set_protocol(replies)
    try:
        if not transport.is_reading():
            transport.resume_reading()  # its stream had paused it; the stream is empty now
        await conn.send_packed_command(packed, check_health=False)
        return await replies.done
    finally:
        transport.set_protocol(own)


class _BulkReplies(asyncio.BufferedProtocol):
    """A batch of GETRANGE replies, received straight into the buffer that holds them.

    Stands in for the connection's stream protocol while one batch is read: the transport
    asks :meth:`get_buffer` where to put the socket's next bytes and hands them over with
    :meth:`buffer_updated`, so a value is written by the socket into the batch's buffer and
    handed out as a view of it. The replies lie one after another in one buffer (one lent
    per batch, not per value: that bookkeeping was a tenth of the read's CPU at 96 KiB),
    with room for each reply to be the longest the bound allows (the header line for
    ``max_len + 1`` bytes, those bytes, CRLF), never more: before a
    reply's header line is parsed the socket is asked for at most a whole value's reply
    (``$max_len``, the value, CRLF), after it for exactly the rest of that reply. A header
    announcing more than ``max_len + 1`` bytes, or a header line longer than such a length
    needs (padded digits would outgrow the buffer), fails the batch before any of it is
    received. Connection events (loss, EOF, write flow control) go on to the stream's protocol too.
    """

    def __init__(self, own: asyncio.BaseProtocol, count: int, max_len: int, buffers: ReadBuffers,
                 parse_error: Callable[[str], BaseException], into: Into | None = None,
                 into_offset: int = 0) -> None:
        self._own = own
        self._count = count
        self._into, self._into_offset = into, into_offset
        self._dest: memoryview | None = None  # the current reply's bytes past its head go here
        self._buffers = buffers
        self._left = count
        self._max_len = max_len
        self._parse_error = parse_error
        self._whole = len(b"$%d\r\n" % max_len) + max_len + 2  # a value's reply, exactly
        # The longest header line allowed (``$-1`` included), and the longest reply.
        self._header_limit = max(len(b"$%d\r\n" % (max_len + 1)), len(b"$-1\r\n"))
        self._size = self._header_limit + max_len + 3
        self._view = buffers.take(self._size * count) if count else memoryview(bytearray())
        self._start = 0  # where the current reply starts in the buffer
        self._filled = 0  # where the bytes received so far end
        self._body = 0  # where the current reply's value starts; 0 until its header is parsed
        self._end = 0  # where the current reply ends (after its CRLF), once its header is parsed
        self._spare = bytearray(4096)  # takes bytes after the last reply (to forward them)
        self.replies: list[Reply] = []
        self.done: asyncio.Future[list[Reply]] = asyncio.get_running_loop().create_future()
        if count == 0:
            self.done.set_result([])

    def get_buffer(self, sizehint: int) -> memoryview | bytearray:
        if self.done.done():
            return self._spare
        if self._end:
            dest = self._dest
            if dest is not None:  # buffer positions [lo, hi) of the reply live in ``dest``
                lo = self._body + self._into_offset
                if lo <= self._filled < lo + len(dest):
                    return dest[self._filled - lo:]
                if self._filled < lo:
                    return self._view[self._filled:lo]
            return self._view[self._filled:self._end]
        if self._filled == len(self._view):  # long error lines took the room of later replies
            self._move(max(2 * (self._filled - self._start), self._size))
        whole = self._start + self._whole
        stop = min(whole, len(self._view)) if self._filled < whole else len(self._view)
        if (self._into is not None and self._into[self._count - self._left] is not None
                and self._filled < self._start + _SNIFF):
            stop = min(stop, self._start + _SNIFF)  # no value byte past its head lands here
        return self._view[self._filled:stop]

    def _move(self, room: int) -> None:
        """Go on in a new buffer with ``room`` bytes for the current reply (its bytes so far
        moved there) and the longest reply's room for each one after it."""
        have, left = self._filled - self._start, self._left - 1
        view = _buffer(max(room, have) + left * self._size)
        view[:have] = self._view[self._start:self._filled]
        shift = self._start
        self._view, self._start, self._filled = view, 0, have
        if self._end:
            self._body, self._end = self._body - shift, self._end - shift

    def buffer_updated(self, nbytes: int) -> None:
        if self.done.done():  # after the batch or its failure: the stream's, unasked for
            if hasattr(self._own, "data_received"):
                self._own.data_received(bytes(self._spare[:nbytes]))
            return
        self._filled += nbytes
        try:
            self._parse()
        except Exception as exc:  # noqa: BLE001 - the reader's failure, raised by its awaiter
            self.done.set_exception(exc)

    def eof_received(self) -> bool | None:
        self._fail(rex.ConnectionError("the server closed the connection mid-reply"))
        return getattr(self._own, "eof_received", lambda: None)()

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(rex.ConnectionError("the connection was lost mid-reply"))
        self._own.connection_lost(exc)

    def pause_writing(self) -> None:
        self._own.pause_writing()

    def resume_writing(self) -> None:
        self._own.resume_writing()

    def _fail(self, exc: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(exc)

    def _parse(self) -> None:
        """Take every reply the buffer holds in full."""
        while self._left:
            if not self._end:
                if not self._header():
                    return
                if not self._end:  # a reply without a value (an error, nil) was taken
                    continue
            if self._filled < self._end:
                return
            view, end, body = self._view, self._end, self._body
            if view[end - 2:end] != b"\r\n":
                raise rex.InvalidResponse("a bulk reply did not end where its length said")
            if self._dest is not None:
                self._take(Received(view[body:body + self._into_offset], self._dest), end)
            else:
                self._take(view[body:end - 2] if end - 2 > body else b"", end)
        if self._filled > self._start:
            raise rex.InvalidResponse("bytes past the last reply")
        self.done.set_result(self.replies)

    def _header(self) -> bool:
        """Parse the current reply's header line; False when it has not all arrived."""
        view, start, filled = self._view, self._start, self._filled - self._start
        line = bytes(view[start:start + min(filled, _SNIFF)])
        eol = line.find(b"\r\n")
        if eol < 0 and filled > _SNIFF:
            line = bytes(view[start:start + min(filled, LINE_LIMIT + 2)])
            eol = line.find(b"\r\n")
        if eol < 0:
            if filled > LINE_LIMIT:
                raise rex.InvalidResponse("a reply line longer than 64 KiB")
            return False
        kind, text = line[:1], line[1:eol]
        if kind == b"-":
            self._take(self._parse_error(text.decode("utf-8", "replace")), start + eol + 2)
            return True
        if kind != b"$":
            raise rex.InvalidResponse(f"unexpected reply type {kind!r} to GETRANGE")
        if eol + 2 > self._header_limit:  # padded digits: the reply would outgrow its buffer
            raise rex.InvalidResponse("a bulk reply's length line is longer than the bound allows")
        try:
            size = int(text)
        except ValueError:
            raise rex.InvalidResponse("a bulk reply's length is not a number") from None
        if size < 0:  # nil: not a GETRANGE answer, but an absent value all the same
            self._take(b"", start + eol + 2)
            return True
        if size > self._max_len + 1:
            raise BoundExceeded(f"a {size}-byte reply to a read bounded to {self._max_len + 1} bytes")
        self._body, self._end = start + eol + 2, start + eol + 4 + size
        if self._into is not None:
            dest = self._into[self._count - self._left]
            self._dest = dest if dest is not None and size == self._into_offset + len(dest) else None
            lo = self._body + self._into_offset
            if self._dest is not None and self._filled > lo:  # came with the reply before it
                got = min(self._filled, self._end - 2) - lo
                self._dest[:got] = view[lo:lo + got]
        if self._end > len(view):  # long error lines before it took its room
            self._move(self._end - start)
        return True

    def _take(self, reply: Reply, end: int) -> None:
        """One reply done: it ended at ``end``, where the next one starts."""
        self.replies.append(reply)
        self._left -= 1
        self._start, self._body, self._end, self._dest = end, 0, 0, None


def _buffer(size: int, keep: memoryview | None = None) -> memoryview:
    """``size`` writable bytes, not zeroed first (the socket writes them), with ``keep``'s
    bytes at the front."""
    view = memoryview(np.empty(size, dtype=np.uint8))
    if keep is not None:
        view[:len(keep)] = keep
    return view


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
    """No bytes of an earlier reply buffered in redis-py's parser (hiredis or Python) or in
    the connection's stream (bytes a server sent after the last reply it owed)."""
    if getattr(getattr(conn, "_reader", None), "_buffer", b""):
        return False
    parser = getattr(conn, "_parser", None)
    reader = getattr(parser, "_reader", None)
    if reader is not None and hasattr(reader, "has_data") and reader.has_data():
        return False
    buffer = getattr(parser, "_buffer", None)
    return not (isinstance(buffer, bytes | bytearray) and len(buffer) > getattr(parser, "_pos", 0))


def _open(conn: AbstractConnection) -> bool:
    """The server has not closed ``conn`` as far as the event loop saw: after an EOF the
    transport stops reading, so a command sent on it would wait for its deadline."""
    stream: asyncio.StreamReader | None = getattr(conn, "_reader", None)
    writer: asyncio.StreamWriter | None = getattr(conn, "_writer", None)
    if stream is None or writer is None:
        return False
    return not (stream.at_eof() or stream.exception() is not None or writer.transport.is_closing())


async def _drop(conn: AbstractConnection) -> None:
    try:
        await asyncio.shield(conn.disconnect(nowait=True))
    except BaseException:  # noqa: BLE001 - already failing; the caller's error is the one to keep
        pass
