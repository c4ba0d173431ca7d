"""The remote tier's connection state: up or down, and getting back up with backoff.

One job: always know whether the server is usable, without ever making a caller wait for it.
The keeper starts *down*; its connector task builds a fresh client, proves it with a
handshake and only then swaps it in (capped, jittered exponential backoff between failed
attempts). Calls report failures through :meth:`ConnectionKeeper.mark_down`; each swap bumps
a generation number so that a late failure of an old client cannot take down a new one. An
idle keeper pings now and then so ``up`` does not go stale.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections import deque
from dataclasses import dataclass

from tieredkv.protocol import FailureCause
from tieredkv.remote.client import RemoteClient, classify, close_client, handshake, make_client
from tieredkv.remote_url import RemoteURL

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KeeperTimings:
    """How long a keeper waits for what, in seconds; checked once, here."""

    ping_timeout_s: float
    connect_timeout_s: float
    socket_timeout_s: float
    backoff_initial_s: float
    backoff_max_s: float
    health_interval_s: float

    def __post_init__(self) -> None:
        if min(self.ping_timeout_s, self.connect_timeout_s, self.backoff_initial_s,
               self.health_interval_s) <= 0:
            raise ValueError("remote tier timeouts, backoff and health interval must be positive")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("remote tier: need backoff_max_s >= backoff_initial_s")


class ConnectionKeeper:
    """Owns the current client, the ``up`` flag and the reconnect loop (one event loop)."""

    def __init__(self, url: RemoteURL, timings: KeeperTimings, *, latency_samples: int = 256) -> None:
        self.url = url
        self.timings = timings

        self._client: RemoteClient | None = None
        self._gen = 0
        self._up = False
        self._closing = False
        self._need_connect = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._side_tasks: set[asyncio.Task[None]] = set()

        self.lock = threading.Lock()  # guards the counters below (read from other threads)
        self.went_down = 0
        self.reconnect_attempts = 0
        self.reconnects = 0
        self.ping_latency: deque[float] = deque(maxlen=latency_samples)

    @property
    def up(self) -> bool:
        return self._up

    def current(self) -> tuple[RemoteClient | None, int]:
        """``(client, generation)`` to run a call on; the client is None until first connect."""
        return (self._client if self._up else None), self._gen

    def start(self) -> None:
        """Start the connector on the running loop (idempotent)."""
        if self._task is None and not self._closing:
            self._need_connect.set()
            self._task = asyncio.create_task(self._connector(), name="tieredkv-remote-connect")

    async def aclose(self, timeout_s: float) -> None:
        """Stop reconnecting and close every client within ~``timeout_s``."""
        self._closing = True
        self._up = False
        tasks = [t for t in (self._task, *self._side_tasks) if t is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s / 2)
        client, self._client = self._client, None
        if client is not None:
            await close_client(client, timeout_s / 2)

    def mark_down(self, gen: int, cause: FailureCause, exc: BaseException) -> None:
        """A call on generation ``gen`` found the server unusable: go down, reconnect."""
        if gen != self._gen or not self._up or self._closing:
            return
        self._up = False
        with self.lock:
            self.went_down += 1
        logger.warning(
            "tieredkv remote tier %s is down (%s: %s); lookups miss until it is back, "
            "retrying with backoff up to %.1fs",
            self.url.redacted(), cause.value, self.describe(exc), self.timings.backoff_max_s,
        )
        self._need_connect.set()

    def describe(self, exc: BaseException) -> str:
        """An exception as text that is safe to log (password scrubbed)."""
        return self.url.scrub(f"{type(exc).__name__}: {exc}")

    async def _connector(self) -> None:
        delay = self.timings.backoff_initial_s
        failures = 0
        while not self._closing:
            if self._up:
                try:
                    await asyncio.wait_for(self._need_connect.wait(), self.timings.health_interval_s)
                except TimeoutError:
                    await self._health_check()
                continue
            self._need_connect.clear()
            if await self._try_connect(log_failure=failures == 0):
                delay, failures = self.timings.backoff_initial_s, 0
                continue
            failures += 1
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, self.timings.backoff_max_s)

    async def _try_connect(self, *, log_failure: bool) -> bool:
        with self.lock:
            self.reconnect_attempts += 1
        client = make_client(
            self.url, socket_timeout_s=self.timings.socket_timeout_s,
            connect_timeout_s=self.timings.connect_timeout_s,
        )
        started = time.monotonic()
        try:
            await asyncio.wait_for(handshake(client), self.timings.connect_timeout_s)
        except asyncio.CancelledError:
            await close_client(client, 0.2)
            raise
        except Exception as exc:  # noqa: BLE001 - a failed connect is a state, not an error
            (logger.warning if log_failure else logger.debug)(
                "tieredkv remote tier %s not reachable (%s); retrying with backoff",
                self.url.redacted(), self.describe(exc),
            )
            self._close_later(client)
            return False
        latency = time.monotonic() - started
        old, self._client = self._client, client
        self._gen += 1
        self._up = True
        with self.lock:
            self.reconnects += 1
            self.ping_latency.append(latency)
        logger.info(
            "tieredkv remote tier %s is up (%s, handshake %.1f ms)",
            self.url.redacted(), "cluster" if self.url.cluster else "single node", latency * 1e3,
        )
        if old is not None:
            self._close_later(old)
        return True

    async def _health_check(self) -> None:
        client, gen = self.current()
        if client is None:
            return
        started = time.monotonic()
        try:
            await asyncio.wait_for(client.ping(), self.timings.ping_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            cause, _ = classify(exc)
            self.mark_down(gen, cause, exc)
            return
        with self.lock:
            self.ping_latency.append(time.monotonic() - started)

    def _close_later(self, client: RemoteClient) -> None:
        task = asyncio.create_task(close_client(client, self.timings.connect_timeout_s))
        self._side_tasks.add(task)
        task.add_done_callback(self._side_tasks.discard)
