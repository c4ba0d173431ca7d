"""remote_throughput's raw redis-py side: ``redis.asyncio`` pipelines on an event loop of
their own, with tieredkv's concurrency (``clients`` batches in flight, one pipeline each).

This is what tieredkv's store is built on, minus tieredkv: no deadline, no bounded read, no
decode, no copy into a slot; replies are only length-checked. It reads with the same socket
read size as tieredkv's client (a larger one than redis-py's default, so the baseline is
not handicapped), and the caller times a pass across the same thread hop tieredkv's
synchronous callers pay.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.cluster import ClusterNode

from benchmarks.remote.workload import CALL_TIMEOUT_S, BenchError, Case
from tieredkv.remote.client import READ_SIZE_BYTES


class AsyncRedisPy:
    """A ``redis.asyncio`` client (one node, or a Cluster seeded with ``ports``) on a thread."""

    def __init__(self, ports: Sequence[int], cluster: bool) -> None:
        self.cluster = cluster
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bench-redis-py",
                                        daemon=True)
        self._thread.start()
        self._client: Redis | RedisCluster = self._run(self._make(list(ports)))

    async def _make(self, ports: list[int]) -> Redis | RedisCluster:
        if self.cluster:
            client: Redis | RedisCluster = RedisCluster(
                startup_nodes=[ClusterNode("127.0.0.1", p) for p in ports],
                socket_read_size=READ_SIZE_BYTES)
            await client.initialize()
            await client.ping(target_nodes=RedisCluster.PRIMARIES)  # type: ignore[call-arg]
        else:
            client = Redis(port=ports[0], socket_read_size=READ_SIZE_BYTES)
            await client.ping()
        return client

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(CALL_TIMEOUT_S)

    def run_pass(self, case: Case, op: str, clients: int) -> float:
        """Seconds to move ``case``'s items for ``op`` with ``clients`` pipelines in flight."""
        start = time.perf_counter()
        self._run(self._pass(case, op, clients))
        return time.perf_counter() - start

    async def _pass(self, case: Case, op: str, clients: int) -> None:
        names, values, n, size = case.names, case.values, case.items, case.shard.value_bytes
        todo = iter(case.batches(op))
        client = self._client

        async def worker() -> None:
            for indices in todo:  # one iterator shared by the workers (one thread)
                pipe = client.pipeline(transaction=False)
                for i in indices:
                    if op == "set":
                        pipe.set(names[i], values[i])
                    elif op == "get":
                        pipe.get(names[i])
                    else:
                        pipe.exists(names[i % n])
                replies = await pipe.execute()
                if op == "get" and any(r is None or len(r) != size for r in replies):
                    raise BenchError("redis-py get: a value is missing or has the wrong size")
                if op != "get" and not all(replies):
                    raise BenchError(f"redis-py {op}: an item was not stored / not found")

        await asyncio.gather(*(worker() for _ in range(clients)))

    def close(self) -> None:
        closer = getattr(self._client, "aclose", None) or self._client.close
        try:
            self._run(closer())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)
