"""The bounded read's own reply reader (tieredkv.remote.bounded_read): a hostile or broken
server fails the read with a cause, at once and without reading what it announced; a Cluster
whose slot map went stale still reads the right values (issue #25, point 3).

The hostile servers are small asyncio servers speaking just enough RESP for the store's
handshake; the Cluster is a real one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from redis.asyncio import RedisCluster

from tests.remote.remote_helpers import RedisClusterProcs, chunk_items, read_command
from tieredkv.protocol import FailureCause
from tieredkv.remote.store import Head

OpenStore = Callable[..., Awaitable[Any]]
HUGE = 1 << 40  # announced, never sent: a reader that believed it would wait or allocate


def _server(answer: bytes, *, close: bool = False) -> Callable[..., Awaitable[None]]:
    """A server that answers the handshake and every GETRANGE/EXISTS with ``answer``."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                name = (await read_command(reader))[0].upper()
                if name in (b"GETRANGE", b"EXISTS"):
                    writer.write(answer)
                    await writer.drain()
                    if close:
                        break
                else:
                    writer.write(b"+PONG\r\n" if name == b"PING" else b"+OK\r\n")
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    return handle


@pytest.fixture
async def fake() -> AsyncIterator[Callable[..., Awaitable[str]]]:
    servers: list[asyncio.Server] = []

    async def start(answer: bytes, *, close: bool = False) -> str:
        server = await asyncio.start_server(_server(answer, close=close), "127.0.0.1", 0)
        servers.append(server)
        return f"redis://127.0.0.1:{server.sockets[0].getsockname()[1]}/0"

    yield start
    for server in servers:
        server.close()


@pytest.mark.parametrize("answer", [
    b"$%d\r\n" % HUGE,  # far past the bound, then nothing: refused on the header alone
    b"+OK\r\n",  # not a bulk string
    b"$abc\r\n",  # not a length
    b"$5\r\nabcdefgh\r\n",  # the bytes after the value are not its end
], ids=["announces-more-than-the-bound", "wrong-type", "bad-length", "bad-terminator"])
async def test_a_reply_the_bound_does_not_allow_fails_the_read_at_once(
    answer: bytes, fake: Callable[..., Awaitable[str]], open_store: OpenStore,
) -> None:
    # A long deadline: the read must fail on what it got, not by running out of time.
    store = await open_store(await fake(answer), timeout_s=60.0)
    got = await asyncio.wait_for(store.batch_get_bounded([b"k1", b"k2"], 64), 30.0)
    assert got.values == [None, None]
    assert got.failed == 2 and got.cause is FailureCause.IO_ERROR


async def test_a_server_that_closes_mid_reply_fails_the_read_with_io_error(
    fake: Callable[..., Awaitable[str]], open_store: OpenStore,
) -> None:
    store = await open_store(await fake(b"$40\r\nonly-part", close=True), timeout_s=60.0)
    got = await asyncio.wait_for(store.batch_get_bounded([b"k1"], 64), 30.0)
    assert got.values == [None] and got.cause is FailureCause.IO_ERROR


async def test_a_probe_reply_that_is_not_an_integer_fails_the_probe(
    fake: Callable[..., Awaitable[str]], open_store: OpenStore,
) -> None:
    store = await open_store(await fake(b"$1\r\n1\r\n"), timeout_s=60.0)
    got = await asyncio.wait_for(store.batch_exists([b"k1", b"k2"]), 30.0)
    assert got.values == [False, False] and got.cause is FailureCause.IO_ERROR


async def test_a_stale_cluster_slot_map_still_reads_and_probes_the_right_keys(
    redis_cluster: RedisClusterProcs, open_store: OpenStore, prefix: str,
) -> None:
    store = await open_store(redis_cluster.url)
    items = chunk_items(prefix, 12, size=2048)
    names = [name for _, name, _ in items]
    assert (await store.batch_set([(name, value) for _, name, value in items])).ok
    client, _gen = store._conn.current()  # noqa: SLF001 - the slot map under test
    assert isinstance(client, RedisCluster)
    cache = client.nodes_manager.slots_cache
    primaries = client.get_primaries()
    for name in names[:6]:  # point these keys' slots at a node that does not own them
        slot = client.keyslot(name)
        owner = cache[slot][0]
        cache[slot] = [next(n for n in primaries if n.name != owner.name)]

    absent = names[0] + b"-absent"
    got = await store.batch_get_bounded([*names, absent], len(items[0][2]))
    assert got.ok, got
    assert got.values == [*(Head(value, len(value)) for _, _, value in items), None]
    probed = await store.batch_exists([*names, absent])
    assert probed.ok and probed.values == [True] * len(names) + [False]


def _answering(replies: bytes, piece: int, batch: int = 8) -> Callable[..., Awaitable[None]]:
    """A server that answers each batch of ``batch`` GETRANGEs with ``replies`` (all the
    batch's replies, written as they are, once) in pieces of ``piece`` bytes, each sent on
    its own. (It used to answer every GETRANGE with all of them: the copies after the first
    sometimes arrived with its last reply, and the reader rightly refused them.)"""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        asked = 0
        try:
            while True:
                name = (await read_command(reader))[0].upper()
                if name != b"GETRANGE":
                    writer.write(b"+PONG\r\n" if name == b"PING" else b"+OK\r\n")
                    await writer.drain()
                    continue
                asked += 1
                if asked % batch:
                    continue
                for at in range(0, len(replies), piece):
                    writer.write(replies[at:at + piece])
                    await writer.drain()
                    await asyncio.sleep(0.0005)  # the client takes each piece on its own
                replies_sent.append(len(replies))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    replies_sent: list[int] = []
    return handle


async def _answer_server(replies: bytes, piece: int) -> tuple[str, asyncio.Server]:
    server = await asyncio.start_server(_answering(replies, piece), "127.0.0.1", 0)
    return f"redis://127.0.0.1:{server.sockets[0].getsockname()[1]}/0", server


def _bulk(value: bytes) -> bytes:
    return b"$%d\r\n%s\r\n" % (len(value), value)


def _mixed_replies(size: int) -> tuple[list[bytes], bytes, bytes]:
    """Three whole values of ``size`` bytes, and the replies of a batch of eight GETRANGEs:
    whole, absent, empty, short, an error, whole, a longer value's head, whole."""
    whole = [bytes([i + 1]) * size for i in range(3)]
    longer = b"L" * (size + 1)  # GETRANGE 0 size answers size + 1 bytes of a longer value
    replies = (_bulk(whole[0]) + b"$-1\r\n" + b"$0\r\n\r\n" + _bulk(b"short")
               + b"-ERR not this one\r\n" + _bulk(whole[1]) + _bulk(longer) + _bulk(whole[2]))
    return whole, longer, replies


@pytest.mark.parametrize("piece", [1, 7, 4093, 1 << 20], ids=["bytewise", "7", "4093", "whole"])
async def test_replies_arriving_in_odd_pieces_read_the_same_values(
    piece: int, open_store: OpenStore,
) -> None:
    """Whole values, a shorter one, an absent key, an error and a longer one's head, in one
    answer cut anywhere: each item gets exactly its reply, and the connection stays usable."""
    size = 20_000 if piece > 1 else 300
    whole, longer, replies = _mixed_replies(size)
    url, server = await _answer_server(replies, piece)
    try:
        store = await open_store(url, timeout_s=60.0)
        keys = [b"k%d" % i for i in range(8)]
        for _ in range(2):  # the second batch on the same connection reads as cleanly
            got = await asyncio.wait_for(store.batch_get_bounded(keys, size), 30.0)
            assert got.failed == 1 and got.cause is FailureCause.IO_ERROR  # the error reply
            assert got.values == [Head(whole[0], size), None, None, Head(b"short", 5), None,
                                  Head(whole[1], size), Head(longer[:size], size + 1),
                                  Head(whole[2], size)]
        assert store.stats().went_down == 0
    finally:
        server.close()


@pytest.mark.parametrize("piece", [1, 7, 1 << 20], ids=["bytewise", "7", "whole"])
async def test_error_lines_longer_than_a_value_leave_the_values_after_them_whole(
    piece: int, open_store: OpenStore,
) -> None:
    """A batch's replies share one buffer with room for each to be the longest value the
    bound allows; error lines far longer than that (they take later replies' room) still
    leave every value after them exactly as sent, cut anywhere."""
    size = 40
    values = [bytes([65 + i]) * size for i in range(4)]
    replies = (b"-ERR " + b"a" * 300 + b"\r\n" + b"-ERR " + b"b" * 300 + b"\r\n"
               + _bulk(values[0]) + _bulk(values[1]) + b"-ERR " + b"c" * 5000 + b"\r\n"
               + _bulk(values[2]) + _bulk(b"") + _bulk(values[3]))
    url, server = await _answer_server(replies, piece)
    try:
        store = await open_store(url, timeout_s=60.0)
        keys = [b"k%d" % i for i in range(8)]
        for _ in range(2):
            got = await asyncio.wait_for(store.batch_get_bounded(keys, size), 30.0)
            assert got.failed == 3
            assert got.values == [None, None, Head(values[0], size), Head(values[1], size),
                                  None, Head(values[2], size), None, Head(values[3], size)]
        assert store.stats().went_down == 0
    finally:
        server.close()


async def test_bytes_after_the_last_reply_are_never_the_next_reads_replies(
    fake: Callable[..., Awaitable[str]], open_store: OpenStore,
) -> None:
    """A server that answers more than it was asked is out of step: the bytes it sent after
    a read's last reply are not taken as the next read's replies (that would hand one key
    another's value); the next read starts on a clean connection."""
    store = await open_store(await fake(b"$3\r\nabc\r\n$3\r\nxyz\r\n"), timeout_s=60.0)
    for _ in range(3):
        got = await asyncio.wait_for(store.batch_get_bounded([b"k1"], 3), 30.0)
        assert got.ok and got.values == [Head(b"abc", 3)]
        await asyncio.sleep(0.05)  # the extra reply arrives before the next read


async def test_a_reply_line_that_never_ends_fails_the_read_without_waiting(
    fake: Callable[..., Awaitable[str]], open_store: OpenStore,
) -> None:
    """A line with no end (no length to check yet) is taken up to 64 KiB, then refused: it
    is neither read on without bound nor waited on until the deadline."""
    store = await open_store(await fake(b"$" + b"9" * (1 << 20)), timeout_s=60.0)
    got = await asyncio.wait_for(store.batch_get_bounded([b"k1"], 64 << 20), 30.0)
    assert got.values == [None] and got.cause is FailureCause.IO_ERROR


def _slots(count: int, size: int, guard: int = 64) -> tuple[bytearray, list[memoryview]]:
    """``count`` buffers of ``size`` bytes in one arena, ``guard`` sentinel bytes around each."""
    arena = bytearray(b"\xee") * (guard + count * (size + guard))
    view = memoryview(arena)
    return arena, [view[guard + i * (size + guard):guard + i * (size + guard) + size]
                   for i in range(count)]


@pytest.mark.parametrize("piece", [1, 7, 4093, 1 << 20], ids=["bytewise", "7", "4093", "whole"])
async def test_values_that_fill_a_named_buffer_are_received_straight_into_it(
    piece: int, open_store: OpenStore,
) -> None:
    """The batch of the test above, most keys naming a buffer of their own: a value exactly
    ``into_offset`` + that buffer long is received into it (its head aside), every other
    reply as before, the buffer left as it was; not a byte lands outside a buffer."""
    size, offset = (20_000 if piece > 1 else 300), 96
    whole, longer, replies = _mixed_replies(size)
    url, server = await _answer_server(replies, piece)
    try:
        store = await open_store(url, timeout_s=60.0)
        keys = [b"k%d" % i for i in range(8)]
        for _ in range(2):  # the second batch on the same connection reads as cleanly
            arena, slots = _slots(8, size - offset)
            # No buffer for the nil, the error and the longer value: read with no limit, each
            # may bring in (part of) the value after it, which still ends up in its buffer.
            into = [None if i in (1, 4, 6) else slot for i, slot in enumerate(slots)]
            got = await asyncio.wait_for(store.batch_get_bounded(
                keys, size, into=into, into_offset=offset), 30.0)
            assert got.failed == 1 and got.cause is FailureCause.IO_ERROR  # the error reply
            for i, value in ((0, whole[0]), (5, whole[1]), (7, whole[2])):
                head = got.values[i]
                assert head is not None and head.rest is slots[i] and head.length == size
                assert bytes(head.data) == value[:offset] and bytes(slots[i]) == value[offset:]
            assert got.values[1:5] == [None, None, Head(b"short", 5), None]
            assert got.values[6] == Head(longer[:size], size + 1)
            untouched = b"\xee" * (size - offset)
            assert all(bytes(slots[i]) == untouched for i in (1, 2, 3, 4, 6))
            assert arena.count(b"\xee") == 64 * 9 + 5 * (size - offset)  # guards and the five
        assert store.stats().went_down == 0
    finally:
        server.close()


async def test_a_cluster_read_receives_each_nodes_values_into_their_own_buffers(
    redis_cluster: RedisClusterProcs, open_store: OpenStore, prefix: str,
) -> None:
    store = await open_store(redis_cluster.url)
    items = chunk_items(prefix, 12, size=2048)
    assert (await store.batch_set([(name, value) for _, name, value in items])).ok
    offset, size = 96, len(items[0][2])
    _arena, slots = _slots(len(items), size - offset)
    got = await store.batch_get_bounded([name for _, name, _ in items], size, into=slots,
                                        into_offset=offset)
    assert got.ok
    for (_, _, value), head, slot in zip(items, got.values, slots, strict=True):
        assert head is not None and head.rest is slot
        assert bytes(head.data) + bytes(slot) == value


async def test_no_byte_reaches_a_named_buffer_once_its_read_has_timed_out(
    open_store: OpenStore,
) -> None:
    """A server stalls halfway through a value received into a buffer (a host slot): the read
    times out, and the rest of the value, sent after that, never reaches the buffer (the
    slot is another tenant's by then)."""
    size, offset = 200_000, 100
    value = bytes(range(256)) * (size // 256) + b"z" * (size % 256)
    reply = _bulk(value)
    cut = len(b"$%d\r\n" % size) + offset + 50_000
    go = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                name = (await read_command(reader))[0].upper()
                if name != b"GETRANGE":
                    writer.write(b"+PONG\r\n" if name == b"PING" else b"+OK\r\n")
                    await writer.drain()
                    continue
                writer.write(reply[:cut])
                await writer.drain()
                await go.wait()
                writer.write(reply[cut:])
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        store = await open_store(f"redis://127.0.0.1:{server.sockets[0].getsockname()[1]}/0")
        arena = bytearray(b"\xee") * (size - offset)
        got = await store.batch_get_bounded([b"k"], size, timeout_s=2.0,
                                            into=[memoryview(arena)], into_offset=offset)
        assert got.cause is FailureCause.TIMEOUT
        assert bytes(arena[:50_000]) == value[offset:offset + 50_000]  # it was receiving there
        answered = bytes(arena)
        go.set()
        await asyncio.sleep(0.5)
        assert bytes(arena) == answered
    finally:
        server.close()
