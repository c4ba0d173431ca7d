"""The store the engine's halves open from their config: a new scheduler's first connect."""

from __future__ import annotations

import threading

import pytest

from tieredkv.config import TieredKVConfig
from tieredkv.remote import from_config
from tieredkv.remote.from_config import await_first_connect, open_store
from tieredkv.testing.redis_procs import RedisClusterProcs, free_port


def test_first_connect_to_a_cluster_is_awaited(redis_cluster: RedisClusterProcs) -> None:
    """vLLM looks up its first requests right after building the scheduler: a Cluster's
    handshake (slot map, then PING) must be over by then, or they miss a warm Redis."""
    config = TieredKVConfig.from_dict({"remote_url": redis_cluster.url, "remote_timeout_s": 0.2})
    store = open_store(config, thread_name="test-first-connect")
    try:
        assert await_first_connect(store, config) is True
        assert store.up
    finally:
        store.close(1.0)


def test_refused_first_connect_does_not_hold_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    config = TieredKVConfig.from_dict({"remote_url": f"redis://127.0.0.1:{free_port()}/0"})
    store = open_store(config, thread_name="test-first-connect")
    # A connect timeout no run reaches: the wait can only end because the refused attempt is
    # over (the second one started), not because the timeout ran out.
    monkeypatch.setattr(from_config, "connect_timeout_s", lambda _config: 600.0)
    answered: list[bool] = []
    try:
        waiter = threading.Thread(target=lambda: answered.append(await_first_connect(store, config)))
        waiter.start()
        waiter.join(60)  # only so a wait for the timeout fails instead of hanging
        assert not waiter.is_alive(), "await_first_connect waited for the connect timeout"
        assert answered == [False]
        assert store.stats().reconnect_attempts >= 2
    finally:
        store.close(1.0)
