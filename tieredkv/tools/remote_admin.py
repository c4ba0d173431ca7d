"""What an operator does by hand with a shared tier: see what it holds, empty part of it.

vLLM's ``reset_prefix_cache`` never flushes the shared Redis (other replicas serve from it),
so emptying it is an operator's decision: ``tieredkv remote URL --purge``. Keys are found
with ``SCAN MATCH {prefix}:*`` on every primary (never ``KEYS``, which blocks Redis), grouped
by namespace (the 16 hex digits each engine logs as its fingerprint) and rank.

The prefix is matched literally: its glob characters are escaped in the pattern (the config
refuses them anyway), and every key the scan returns is parsed and its prefix (and, for a
purge of one namespace, its namespace) compared before it is counted or deleted, so a purge
never reaches another prefix's keys.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tieredkv.remote_url import RemoteURL

_KEY = re.compile(rb"^(?P<prefix>[^:]+):(?P<ns>[0-9a-f]{16}):r(?P<rank>\d+):\{[0-9a-f]{64}\}$")
NAMESPACE = re.compile(r"[0-9a-f]{16}")
SCAN_COUNT = 1000
_GLOB = frozenset(b"*?[]\\")


@dataclass
class TierReport:
    """What a prefix holds: keys by namespace and rank, their bytes, and the server's figures."""

    keys: Counter[tuple[str, int]] = field(default_factory=Counter)
    value_bytes: int = 0
    other_keys: int = 0  # under the prefix but not named like a tieredkv shard
    server: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        namespaces: dict[str, dict[str, int]] = {}
        for (ns, rank), count in sorted(self.keys.items()):
            namespaces.setdefault(ns, {})[f"r{rank}"] = count
        return {"namespaces": namespaces, "keys": sum(self.keys.values()),
                "value_bytes": self.value_bytes, "other_keys": self.other_keys,
                "server": self.server}


def connect(url: RemoteURL, timeout_s: float = 5.0) -> Any:
    """A synchronous redis-py client (Cluster-aware) for ``url``."""
    import redis

    common = {"username": url.username, "password": url.password, "ssl": url.tls,
              "socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    if url.cluster:
        from redis.cluster import ClusterNode, RedisCluster

        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in url.nodes], **common)
    return redis.Redis(host=url.host, port=url.port, db=url.db, **common)


def _primaries(client: Any) -> list[Any]:
    """One client per primary (a Cluster) or the client itself (one node)."""
    if hasattr(client, "get_primaries"):
        return [client.get_redis_connection(node) for node in client.get_primaries()]
    return [client]


def glob_escape(text: bytes) -> bytes:
    """``text`` as a Redis glob pattern that matches exactly itself."""
    return b"".join(b"\\" + bytes([c]) if c in _GLOB else bytes([c]) for c in text)


def _scan(client: Any, prefix: str, namespace: str | None = None) -> Iterator[tuple[Any, bytes]]:
    """(node, key) for every key under ``prefix:`` (``prefix:namespace:``), matched literally."""
    head = f"{prefix}:" + (f"{namespace}:" if namespace is not None else "")
    pattern = glob_escape(head.encode("utf-8")) + b"*"
    for node in _primaries(client):
        for key in node.scan_iter(match=pattern, count=SCAN_COUNT):
            yield node, key


def _shard(key: bytes, prefix: str, namespace: str | None = None) -> re.Match[bytes] | None:
    """The parsed shard name when ``key`` is a tieredkv shard of ``prefix`` (and ``namespace``)."""
    match = _KEY.match(key)
    if match is None or match["prefix"] != prefix.encode("utf-8"):
        return None
    if namespace is not None and match["ns"] != namespace.encode("ascii"):
        return None
    return match


def report(client: Any, prefix: str, *, sizes: bool = True) -> TierReport:
    """Count the shards under ``prefix`` (and, with ``sizes``, their value bytes)."""
    out = TierReport()
    for node, key in _scan(client, prefix):
        match = _shard(key, prefix)
        if match is None:
            out.other_keys += 1
            continue
        out.keys[(match["ns"].decode(), int(match["rank"]))] += 1
        if sizes:
            out.value_bytes += int(node.strlen(key) or 0)
    infos = [node.info() for node in _primaries(client)]
    out.server = {name: sum(int(i.get(name, 0) or 0) for i in infos)
                  for name in ("used_memory", "maxmemory", "evicted_keys")}
    return out


def purge(client: Any, prefix: str, namespace: str | None = None, batch: int = 500) -> int:
    """Delete the tieredkv shards under ``prefix`` (one ``namespace`` only, if given).

    Only keys whose parsed prefix (and namespace) are exactly the ones asked for are deleted.
    """
    if namespace is not None and not NAMESPACE.fullmatch(namespace):
        raise ValueError("a namespace is 16 lowercase hex digits (as each engine logs it)")
    deleted = 0
    pending: dict[int, tuple[Any, list[bytes]]] = {}
    for node, key in _scan(client, prefix, namespace):
        if _shard(key, prefix, namespace) is None:
            continue
        _node, keys = pending.setdefault(id(node), (node, []))
        keys.append(key)
        if len(keys) >= batch:
            deleted += _delete(node, keys)
            keys.clear()
    for node, keys in pending.values():
        if keys:
            deleted += _delete(node, keys)
    return deleted


def _delete(node: Any, keys: list[bytes]) -> int:
    # One key per DEL: a Cluster node refuses a multi-key DEL across hash slots.
    pipe = node.pipeline(transaction=False)
    for key in keys:
        pipe.unlink(key)
    return sum(int(n) for n in pipe.execute())
