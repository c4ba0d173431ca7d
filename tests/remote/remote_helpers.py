"""Helpers for the remote-tier tests: keys, payloads and deadlines.

The real redis-server processes live in :mod:`tieredkv.testing.redis_procs` (the benchmarks
start them too); they are re-exported here for the tests that import them from this module.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

from tests.helpers import make_key
from tieredkv.remote.codec import encode, remote_key
from tieredkv.remote.store import RemoteStore
from tieredkv.remote.threaded import ThreadedRemoteStore
from tieredkv.testing.redis_procs import (  # noqa: F401 - re-exported for the tests
    SETUP_HINT,
    RedisClusterProcs,
    RedisServer,
    free_port,
)

FINGERPRINT = hashlib.sha256(b"tieredkv tests/remote namespace").digest()
OTHER_FINGERPRINT = hashlib.sha256(b"another engine's namespace").digest()

# Fast reconnects so outage tests take about a second. Deadlines stay generous here so a
# loaded machine cannot fail a test that is not about deadlines; fault tests pass tight ones.
FAST = {
    "timeout_s": 2.0,
    "connect_timeout_s": 2.0,
    "backoff_initial_s": 0.02,
    "backoff_max_s": 0.2,
    "health_interval_s": 0.5,
}


def payload_for(key: bytes, rank: int, size: int) -> bytes:
    """The bytes ``rank``'s shard of ``key`` holds: derivable anywhere, so checks are exact."""
    seed = hashlib.blake2b(key + rank.to_bytes(4, "little"), digest_size=64).digest()
    return (seed * (size // len(seed) + 1))[:size]


def chunk_items(
    prefix: str, count: int, size: int = 1024, *, rank: int = 0, fingerprint: bytes = FINGERPRINT,
    start: int = 0,
) -> list[tuple[bytes, bytes, bytes]]:
    """``(chunk key, redis key, encoded value)`` for ``count`` chunks."""
    out = []
    for i in range(start, start + count):
        key = make_key(i)
        value = encode(payload_for(key, rank, size), fingerprint=fingerprint, key=key, rank=rank)
        out.append((key, remote_key(fingerprint, rank, key, prefix), value))
    return out


def sent_bytes(servers: RedisServer | RedisClusterProcs) -> int:
    """Bytes the server (every node of a Cluster) has sent to clients, by its own count."""
    nodes = servers.servers if isinstance(servers, RedisClusterProcs) else [servers]
    total = 0
    for node in nodes:
        for line in node.cli("INFO", "stats").splitlines():
            if line.startswith("total_net_output_bytes:"):
                total += int(line.split(":", 1)[1])
    return total


def wait_up(store: ThreadedRemoteStore, timeout_s: float) -> bool:
    """Block until ``store`` is connected; False after ``timeout_s``. Tests only: the engine
    never waits for Redis, it reads ``up`` at each step."""
    deadline = time.monotonic() + timeout_s
    while not store.up and time.monotonic() < deadline:
        time.sleep(0.01)
    return store.up


async def await_up(store: RemoteStore, timeout_s: float) -> bool:
    """:func:`wait_up` for a store on the caller's own event loop."""
    deadline = time.monotonic() + timeout_s
    while not store.up and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return store.up


async def read_command(reader: asyncio.StreamReader) -> list[bytes]:
    """One RESP array of bulk strings (what redis-py sends): for fake servers in tests."""
    count = int((await reader.readuntil(b"\r\n"))[1:-2])
    parts = []
    for _ in range(count):
        size = int((await reader.readuntil(b"\r\n"))[1:-2])
        parts.append((await reader.readexactly(size + 2))[:-2])
    return parts
