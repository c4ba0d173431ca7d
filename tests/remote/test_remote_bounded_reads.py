"""Bounded reads against real servers (issue #23, 5): a value is never read past the length
asked for, whatever someone planted in Redis.

What crosses the network is measured on the server side, by its own ``total_net_output_bytes``
(every node of a Cluster), not by the client under test.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from tests.remote.remote_helpers import (
    FINGERPRINT,
    RedisClusterProcs,
    RedisServer,
    chunk_items,
    sent_bytes,
)
from tieredkv.remote.codec import Verified, decode
from tieredkv.remote.store import Head

OpenStore = Callable[..., Awaitable[Any]]
PLANTED = 32 << 20  # far more than any value asked for here
SIZE = 4096


@pytest.fixture
def servers(redis_deployment: RedisServer | RedisClusterProcs) -> RedisServer | RedisClusterProcs:
    """The shared single node or the shared 3-master Cluster (tests/redis_fixtures.py)."""
    return redis_deployment


async def test_a_planted_big_value_costs_at_most_the_asked_length(
    servers: RedisServer | RedisClusterProcs, open_store: OpenStore, prefix: str,
) -> None:
    store = await open_store(servers.url)
    items = chunk_items(prefix, 3, size=SIZE)
    (key0, name0, value0), (_, big, _), (_, junk, good) = items
    want = len(value0)
    assert (await store.batch_set([
        (name0, value0),
        (big, value0 + bytes(PLANTED)),  # a well-formed value with 32 MiB of trailing bytes
        (junk, b"\x00" * PLANTED),  # not a tieredkv value at all
    ])).ok
    absent = items[0][1] + b"-absent"

    before = sent_bytes(servers)
    got = await store.batch_get_bounded([name0, big, junk, absent], want)
    sent = sent_bytes(servers) - before

    assert got.ok, got
    assert sent < 1 << 20, f"{sent} bytes sent for four reads of {want} bytes at most"
    assert got.values[0] == Head(value0, want)
    # A longer value: its head, and one byte more than asked for, which says "longer".
    assert got.values[1] == Head(value0, want + 1)
    assert got.values[2] == Head(bytes(want), want + 1)
    assert got.values[3] is None
    verified = decode(got.values[0].data, fingerprint=FINGERPRINT, key=key0, rank=0,
                      expected_len=SIZE, value_len=got.values[0].length)
    assert isinstance(verified, Verified)

    # The measure sees a whole read: the unbounded read of the same value sends it all.
    before = sent_bytes(servers)
    assert (await store.batch_get([junk])).values == [b"\x00" * PLANTED]
    assert sent_bytes(servers) - before >= PLANTED


async def test_bounded_reads_of_a_batch_answer_one_value_per_key_in_order(
    servers: RedisServer | RedisClusterProcs, open_store: OpenStore, prefix: str,
) -> None:
    store = await open_store(servers.url)
    items = chunk_items(prefix, 40, size=SIZE)
    assert (await store.batch_set([(name, value) for _, name, value in items])).ok
    calls = store.stats().calls.get("get", 0)
    got = await store.batch_get_bounded([name for _, name, _ in items], len(items[0][2]))
    assert got.ok and got.failed == 0
    assert got.values == [Head(value, len(value)) for _, _, value in items]
    assert store.stats().calls["get"] == calls + 1  # one call, counted once (not per command)


async def test_a_key_of_another_type_fails_only_its_item(
    redis_server: RedisServer, open_store: OpenStore, prefix: str,
) -> None:
    store = await open_store(redis_server.url)
    (_, name, value), (_, other, _) = chunk_items(prefix, 2, size=SIZE)
    assert (await store.batch_set([(name, value)])).ok
    redis_server.cli("RPUSH", other.decode(), "x")
    got = await store.batch_get_bounded([other, name], len(value))
    assert got.values == [None, Head(value, len(value))]
    assert got.failed == 1 and got.cause is not None
    assert store.up  # an error reply is the item's, not the server's


async def test_a_bound_below_one_byte_is_refused(redis_server: RedisServer,
                                                 open_store: OpenStore) -> None:
    store = await open_store(redis_server.url)
    with pytest.raises(ValueError, match="max_len"):
        await store.batch_get_bounded([b"k"], 0)


# The README's ACL for tieredkv's own user: exactly the commands the engine sends (no
# STRLEN: a bounded read is one GETRANGE per key).
ENGINE_ACL = ("on", ">acl-test-password", "~tkv:*", "resetchannels", "-@all", "+@connection",
              "+exists", "+getrange", "+set", "+del", "+info", "+cluster|slots")


async def test_the_engines_calls_work_under_the_readmes_acl(
    servers: RedisServer | RedisClusterProcs, open_store: OpenStore,
) -> None:
    nodes = servers.servers if isinstance(servers, RedisClusterProcs) else [servers]
    for node in nodes:
        node.cli("ACL", "SETUSER", "tieredkv-acl-test", "reset", *ENGINE_ACL)
    scheme, rest = servers.url.split("://", 1)
    store = await open_store(f"{scheme}://tieredkv-acl-test:acl-test-password@{rest}")
    items = chunk_items("tkv", 8, size=SIZE)
    names = [name for _, name, _ in items]
    assert (await store.batch_set([(name, value) for _, name, value in items], ttl_s=60)).ok
    assert (await store.batch_exists(names)).values == [True] * 8
    got = await store.batch_get_bounded(names, len(items[0][2]))
    assert got.ok, got
    assert got.values == [Head(value, len(value)) for _, _, value in items]
    assert await store.server_info() is not None
    assert (await store.batch_delete(names)).values == [True] * 8


async def test_a_value_held_is_never_overwritten_by_later_reads(
    servers: RedisServer | RedisClusterProcs, open_store: OpenStore, prefix: str,
) -> None:
    """Read buffers are reused (bounded_read.ReadBuffers), but only once every view of the
    value they hold is gone: values a caller still holds, or only a slice of, stay intact
    while other reads land, and each value is still exactly what was stored."""
    store = await open_store(servers.url)
    first, second = chunk_items(prefix, 4, size=SIZE), chunk_items(prefix, 4, size=SIZE, start=4)
    assert (await store.batch_set([(name, value) for _, name, value in first + second])).ok
    want = len(first[0][2])
    held = (await store.batch_get_bounded([name for _, name, _ in first], want)).values
    sliced = [memoryview(head.data)[100:] for head in held]  # only a view of each kept
    del held
    for _ in range(3):  # reads that would reuse the first values' buffers were they free
        again = await store.batch_get_bounded([name for _, name, _ in second], want)
        assert again.ok and [h.data for h in again.values] == [v for _, _, v in second]
        del again
    assert [bytes(view) for view in sliced] == [value[100:] for _, _, value in first]
