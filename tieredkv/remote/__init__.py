"""The shared remote tier: chunk shards in Redis/Valkey (one node or Redis Cluster).

Modules, one job each:

- :mod:`~tieredkv.remote_url` (floor 1, so the config can use it): ``remote_url``;
- :mod:`~tieredkv.remote.codec`: Redis key names and self-verifying values;
- :mod:`~tieredkv.remote.results`: typed results and failure causes, the stats snapshot;
- :mod:`~tieredkv.remote.write_queue`: the bounded, dropping write queue;
- :mod:`~tieredkv.remote.client`: redis-py client construction and error classification;
- :mod:`~tieredkv.remote.connection`: up/down state, reconnect with backoff, health pings;
- :mod:`~tieredkv.remote.store`: :class:`RemoteStore`, batched async calls with deadlines;
- :mod:`~tieredkv.remote.threaded`: :class:`ThreadedRemoteStore`, the same for sync callers.

``url``, ``codec`` and ``results`` need nothing beyond tieredkv's own dependencies, so config
validation works without the optional ``redis`` client; the store classes are imported on
first use (``pip install 'tieredkv[remote]'``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tieredkv.remote.codec import Rejected, Verified, decode, encode, remote_key
from tieredkv.remote.results import BatchResult, RemoteStats
from tieredkv.remote_url import RemoteURL, parse_remote_url

if TYPE_CHECKING:
    from tieredkv.remote.store import RemoteStore
    from tieredkv.remote.threaded import ThreadedRemoteStore

__all__ = [
    "BatchResult", "Rejected", "RemoteStats", "RemoteStore", "RemoteURL",
    "ThreadedRemoteStore", "Verified", "decode", "encode", "parse_remote_url", "remote_key",
]


def __getattr__(name: str) -> Any:
    """Import the redis-backed classes lazily, with a clear message when redis is missing."""
    if name not in ("RemoteStore", "ThreadedRemoteStore"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        if name == "RemoteStore":
            from tieredkv.remote.store import RemoteStore as found
        else:
            from tieredkv.remote.threaded import ThreadedRemoteStore as found
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "redis":
            raise ModuleNotFoundError(
                "the remote tier needs the redis client: pip install 'tieredkv[remote]'",
                name="redis",
            ) from exc
        raise
    return found
