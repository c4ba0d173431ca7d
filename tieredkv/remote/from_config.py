"""One place that turns the ``remote_*`` settings into a running store, for both halves."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from tieredkv.config import ConfigError, TieredKVConfig

if TYPE_CHECKING:
    from tieredkv.remote.threaded import ThreadedRemoteStore

logger = logging.getLogger("tieredkv")


def connect_timeout_s(config: TieredKVConfig) -> float:
    """How long one connect attempt (a Cluster's slot map, then PING) may take."""
    return max(1.0, config.remote_timeout_s)


def await_first_connect(store: ThreadedRemoteStore, config: TieredKVConfig) -> bool:
    """Wait until ``store``'s first connect attempt is over (up, or failed); True when up.

    At most one attempt's timeout, and only that long when the server neither answers nor
    refuses: a refused connect ends the wait when the second attempt starts (backoff 50 ms).
    """
    deadline = time.monotonic() + connect_timeout_s(config)
    while not store.up and store.stats().reconnect_attempts < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    return store.up


def open_store(config: TieredKVConfig, *, thread_name: str) -> ThreadedRemoteStore:
    """A :class:`ThreadedRemoteStore` for ``config.remote_url``; it connects in the background.

    Never waits for Redis: a store that is down at start-up is marked down and reconnects
    with backoff, so the engine starts and serves from host and disk meanwhile.
    """
    url = config.remote_url
    assert url is not None, "open_store needs remote_url"
    try:
        from tieredkv.remote.threaded import ThreadedRemoteStore
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "redis":
            raise ConfigError(
                "remote_url",
                "the remote tier needs the redis client: install tieredkv with its 'remote' "
                "extra (pip install '.[remote]' from a checkout, or redis>=6 on its own)",
                value=url.redacted(),
            ) from None
        raise
    timeout = config.remote_timeout_s
    return ThreadedRemoteStore(
        url,
        thread_name=thread_name,
        timeout_s=timeout,
        connect_timeout_s=connect_timeout_s(config),
        write_timeout_s=max(5.0, timeout),
        write_queue_bytes=config.remote_write_queue_bytes,
    )
