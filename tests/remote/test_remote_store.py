"""RemoteStore against real servers: batched round trips, misses, writes, eviction, OOM."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis
from redis.asyncio.connection import Connection

from tests.remote.remote_helpers import (
    FINGERPRINT,
    OTHER_FINGERPRINT,
    RedisClusterProcs,
    RedisServer,
    chunk_items,
    make_key,
    payload_for,
)
from tieredkv.protocol import FailureCause
from tieredkv.remote import bounded_read
from tieredkv.remote.codec import Rejected, Verified, decode, encode, remote_key

OpenStore = Callable[..., Awaitable[Any]]


@pytest.fixture
def count_sends(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts pipelined writes to sockets: redis-py's pipelines (``pack_commands``) and the
    bounded reader's (its ops' ``pack``), one per pipeline per node.

    Single commands (a new connection's CLIENT SETNAME and the like) are not counted.
    """
    sends = [0]

    def counted(owner: Any, name: str) -> None:
        original = getattr(owner, name)

        def counting(self: Any, commands: Any) -> Any:
            sends[0] += 1
            return original(self, commands)

        monkeypatch.setattr(owner, name, counting)

    counted(Connection, "pack_commands")
    counted(bounded_read._Getrange, "pack")  # noqa: SLF001 - the reader's own pipeline
    counted(bounded_read._Exists, "pack")  # noqa: SLF001
    return sends


async def test_round_trip_500_chunks_one_pipeline(
    deployment: str, open_store: OpenStore, prefix: str, count_sends: list[int]
) -> None:
    store = await open_store(deployment)
    items = chunk_items(prefix, 500, size=2048)
    names = [name for _, name, _ in items]
    nodes = 3 if "cluster" in deployment else 1

    for call in (
        lambda: store.batch_exists(names),
        lambda: store.batch_set([(name, value) for _, name, value in items]),
        lambda: store.batch_exists(names),
        lambda: store.batch_get(names),
    ):
        trips, sends = store.stats().round_trips, count_sends[0]
        result = await call()
        assert result.ok, result
        assert len(result.values) == 500
        assert store.stats().round_trips == trips + 1
        assert 1 <= count_sends[0] - sends <= nodes  # one write per node, not per key
        last = result

    assert all(decode(v, fingerprint=FINGERPRINT, key=k, rank=0, expected_len=2048).ok
               for (k, _, _), v in zip(items, last.values, strict=True))
    assert all((await store.batch_exists(names)).values)
    stats = store.stats()
    assert stats.failures == {} and stats.probe_latency_s and stats.up


async def test_cluster_spreads_chunks_over_nodes(
    redis_cluster: RedisClusterProcs, open_store: OpenStore, prefix: str
) -> None:
    store = await open_store(redis_cluster.url)
    items = chunk_items(prefix, 300, size=256)
    assert (await store.batch_set([(n, v) for _, n, v in items])).ok
    per_node = []
    for server in redis_cluster.servers:
        with redis.Redis(port=server.port) as direct:
            per_node.append(sum(1 for _ in direct.scan_iter(match=f"{prefix}:*", count=1000)))
    assert sum(per_node) == 300
    assert sum(1 for n in per_node if n) > 1, per_node


async def test_other_rank_or_namespace_is_a_miss(
    deployment: str, open_store: OpenStore, prefix: str
) -> None:
    store = await open_store(deployment)
    mine = chunk_items(prefix, 20, rank=0)
    assert (await store.batch_set([(n, v) for _, n, v in mine])).ok
    keys = [k for k, _, _ in mine]
    for fp, rank in ((FINGERPRINT, 1), (OTHER_FINGERPRINT, 0)):
        names = [remote_key(fp, rank, k, prefix) for k in keys]
        assert (await store.batch_exists(names)).values == [False] * 20
        got = await store.batch_get(names)
        assert got.ok and got.values == [None] * 20
        assert {decode(v, fingerprint=fp, key=k, rank=rank).cause for k, v in  # type: ignore[union-attr]
                zip(keys, got.values, strict=True)} == {FailureCause.MISSING}


async def test_values_under_a_wrong_name_are_rejected(
    redis_server: RedisServer, open_store: OpenStore, prefix: str
) -> None:
    """A value copied (or mis-written) under another rank's or namespace's name never passes."""
    store = await open_store(redis_server.url)
    key = make_key(7)
    rank0 = encode(payload_for(key, 0, 512), fingerprint=FINGERPRINT, key=key, rank=0)
    foreign = encode(payload_for(key, 0, 512), fingerprint=OTHER_FINGERPRINT, key=key, rank=0)
    rank1_name = remote_key(FINGERPRINT, 1, key, prefix)
    ns_name = remote_key(FINGERPRINT, 0, key, prefix)
    other_chunk_name = remote_key(FINGERPRINT, 0, make_key(8), prefix)
    assert (await store.batch_set(
        [(rank1_name, rank0), (ns_name, foreign), (other_chunk_name, rank0)]
    )).ok
    got = (await store.batch_get([rank1_name, ns_name, other_chunk_name])).values
    checks = [
        decode(got[0], fingerprint=FINGERPRINT, key=key, rank=1),
        decode(got[1], fingerprint=FINGERPRINT, key=key, rank=0),
        decode(got[2], fingerprint=FINGERPRINT, key=make_key(8), rank=0),
    ]
    assert [c.cause for c in checks if isinstance(c, Rejected)] == [
        FailureCause.WRONG_KEY, FailureCause.WRONG_NAMESPACE, FailureCause.WRONG_KEY,
    ]


async def test_delete_ttl_and_empty_batches(
    redis_server: RedisServer, open_store: OpenStore, prefix: str
) -> None:
    store = await open_store(redis_server.url)
    items = chunk_items(prefix, 6)
    names = [n for _, n, _ in items]
    assert (await store.batch_set([(n, v) for _, n, v in items[:3]])).ok
    assert (await store.batch_set([(n, v) for _, n, v in items[3:]], ttl_s=0.2)).ok
    deleted = await store.batch_delete(names[:2] + [remote_key(FINGERPRINT, 0, make_key(999), prefix)])
    assert deleted.ok and deleted.values == [True, True, False]
    await asyncio.sleep(0.35)
    assert (await store.batch_exists(names)).values == [False, False, True, False, False, False]
    for empty in (store.batch_exists([]), store.batch_get([]), store.batch_set([]), store.batch_delete([])):
        result = await empty
        assert result.ok and result.values == []


async def test_background_writes_land(
    deployment: str, open_store: OpenStore, prefix: str
) -> None:
    store = await open_store(deployment, write_batch_items=16)
    items = chunk_items(prefix, 100)
    assert store.submit_writes([(n, v) for _, n, v in items]) == 100
    assert await store.flush_writes(5)
    assert all((await store.batch_exists([n for _, n, _ in items])).values)
    stats = store.stats()
    assert (stats.writes_submitted, stats.writes_done, stats.writes_dropped) == (100, 100, 0)
    assert stats.queue_items == 0 and stats.queue_bytes == 0


async def test_full_write_queue_drops_and_counts(
    redis_server: RedisServer, open_store: OpenStore, prefix: str
) -> None:
    store = await open_store(redis_server.url, write_queue_items=8, write_queue_bytes=1 << 20)
    items = chunk_items(prefix, 30)
    # submit_writes never awaits, so writers cannot drain between these calls.
    accepted = store.submit_writes([(n, v) for _, n, v in items[:20]])
    accepted += store.submit_writes([(n, v) for _, n, v in items[20:]])
    assert accepted == 8
    stats = store.stats()
    assert (stats.writes_submitted, stats.writes_dropped, stats.queue_items) == (30, 22, 8)
    assert await store.flush_writes(5)
    exists = (await store.batch_exists([n for _, n, _ in items])).values
    assert exists == [True] * 8 + [False] * 22  # the accepted prefix, in order
    assert store.stats().writes_done == 8


async def test_lru_eviction_reads_as_misses(
    fresh_server: Callable[..., RedisServer], open_store: OpenStore, prefix: str
) -> None:
    server = fresh_server("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
    store = await open_store(server.url)
    items = chunk_items(prefix, 120, size=64 << 10)  # 7.5 MiB of values into 4 MB
    for i in range(0, 120, 10):
        assert (await store.batch_set([(n, v) for _, n, v in items[i:i + 10]])).ok
    got = await store.batch_get([n for _, n, _ in items])
    assert got.ok
    results = [decode(v, fingerprint=FINGERPRINT, key=k, rank=0, expected_len=64 << 10)
               for (k, _, _), v in zip(items, got.values, strict=True)]
    hits = sum(isinstance(r, Verified) for r in results)
    misses = [r.cause for r in results if isinstance(r, Rejected)]
    assert 0 < hits < 120
    assert set(misses) == {FailureCause.MISSING}
    assert store.up


async def test_noeviction_oom_is_no_space_not_down(
    fresh_server: Callable[..., RedisServer], open_store: OpenStore, prefix: str
) -> None:
    server = fresh_server("--maxmemory", "3mb", "--maxmemory-policy", "noeviction")
    store = await open_store(server.url)
    items = chunk_items(prefix, 80, size=64 << 10)
    results = [await store.batch_set([(n, v) for _, n, v in items[i:i + 10]]) for i in range(0, 80, 10)]
    refused = [r for r in results if not r.ok]
    assert refused and {r.cause for r in refused} == {FailureCause.NO_SPACE}
    stored = sum(sum(r.values) for r in results)
    assert 0 < stored < 80
    assert store.up  # a full server answers: it is not an outage
    assert store.stats().failures.get("no_space", 0) == 80 - stored
