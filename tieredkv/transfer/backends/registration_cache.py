"""What a backend derives once per (KV caches, host pool) pair, held only while both live.

Why not a dict keyed by ``id()``: the id of a dead object is handed to the next one, so a new
registration could get a dead one's entry (its views or raw pointers, i.e. freed or stale
memory), and every entry would keep its KV caches' memory alive for the backend's life.
Entries here are keyed weakly by the :class:`KVViews` and :class:`HostPool` objects
themselves: an entry goes when either does, and a value must not refer back to them.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

from tieredkv.transfer.host_pool import HostPool
from tieredkv.transfer.kv_views import KVViews

T = TypeVar("T")


def _host_signature(host: HostPool) -> tuple[int, int]:
    """What an entry read off the pool: a closed pool has another buffer."""
    return host.buffer.data_ptr(), host.buffer.numel()


class RegistrationCache(Generic[T]):
    """``build(dev, host)``, computed once per live pair (thread-safe: both lanes use it)."""

    def __init__(self, build: Callable[[KVViews, HostPool], T]) -> None:
        self._build = build
        self._by_dev: weakref.WeakKeyDictionary[
            KVViews, weakref.WeakKeyDictionary[HostPool, tuple[tuple[int, int], T]]
        ] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def get(self, dev: KVViews, host: HostPool) -> T:
        signature = _host_signature(host)
        with self._lock:
            per_host = self._by_dev.get(dev)
            if per_host is None:
                per_host = self._by_dev[dev] = weakref.WeakKeyDictionary()
            entry = per_host.get(host)
            if entry is None or entry[0] != signature:
                entry = per_host[host] = (signature, self._build(dev, host))
            return entry[1]

    def __len__(self) -> int:
        """Live entries (for tests and diagnostics)."""
        with self._lock:
            return sum(len(per_host) for per_host in list(self._by_dev.values()))
