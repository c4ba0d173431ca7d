"""Fault injection for end-to-end tests and soak runs, off unless ``TIEREDKV_FAULTS`` is set.

Real vLLM runs cannot reach into a worker process to break things, so the worker half reads
one environment variable holding JSON, for example::

    TIEREDKV_FAULTS='{"fail_loads": 1, "store_delay_s": 0.05}'

* ``fail_loads``: the next N host -> device copies of load jobs fail (after their promise);
* ``store_delay_s``: every device -> host store copy first sleeps this long (stores in flight
  at preemption time);
* ``disk_read_delay_s``: every read of the worker's slab file first sleeps this long (a slow
  disk), while the file ``disk_read_delay_while`` exists when that is given (the fault is
  removed by deleting it).

Disk faults are injected with :class:`tieredkv.testing.faulty_fileio.FaultyFileIO` instead.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from tieredkv.disk.private_files import FileIO
from tieredkv.protocol import FailureCause
from tieredkv.transfer.backends.base import CopyBackend, Pair
from tieredkv.transfer.host_pool import HostPool
from tieredkv.transfer.kv_views import KVViews

logger = logging.getLogger("tieredkv")

ENV_VAR = "TIEREDKV_FAULTS"
_KNOWN = {"fail_loads", "store_delay_s", "disk_read_delay_s", "disk_read_delay_while"}


class InjectedFault(RuntimeError):
    """A deliberate failure; its ``kind`` is what the failure counters record."""

    kind = FailureCause.INJECTED


def faults_from_env() -> dict[str, Any]:
    raw = os.environ.get(ENV_VAR)
    if not raw:
        return {}
    faults = json.loads(raw)
    unknown = set(faults) - _KNOWN
    if unknown:
        raise ValueError(f"{ENV_VAR}: unknown fault(s) {sorted(unknown)}; known: {sorted(_KNOWN)}")
    logger.warning("tieredkv: FAULT INJECTION ACTIVE: %s", faults)
    return faults


class FaultInjectingBackend(CopyBackend):
    """Wraps a real copy backend; fails or slows copies as configured."""

    def __init__(self, inner: CopyBackend, fail_loads: int = 0, store_delay_s: float = 0.0) -> None:
        self.inner = inner
        self.name = f"{inner.describe()}+faults"
        self._fail_loads = int(fail_loads)
        self._store_delay_s = float(store_delay_s)
        self._lock = threading.Lock()

    def d2h(self, dev: KVViews, host: HostPool, pairs: Sequence[Pair]) -> None:
        if self._store_delay_s:
            time.sleep(self._store_delay_s)
        self.inner.d2h(dev, host, pairs)

    def h2d(self, dev: KVViews, host: HostPool, pairs: Sequence[Pair]) -> None:
        with self._lock:
            fail = self._fail_loads > 0
            if fail:
                self._fail_loads -= 1
        if fail:
            raise InjectedFault("injected load failure (TIEREDKV_FAULTS)")
        self.inner.h2d(dev, host, pairs)


class SlowReads(FileIO):
    """The slab file's reads throttled: each first sleeps ``seconds`` (while ``flag`` exists,
    when given)."""

    def __init__(self, seconds: float, flag: str | None = None) -> None:
        super().__init__()
        self._seconds = seconds
        self._flag = flag

    def pread_into(self, fd: int, bufs: list[memoryview], offset: int) -> int:
        if self._flag is None or os.path.exists(self._flag):
            time.sleep(self._seconds)
        return super().pread_into(fd, bufs, offset)


def disk_io_from_env() -> FileIO | None:
    """The slab file's I/O with ``disk_read_delay_s`` applied, or None (no disk fault)."""
    faults = faults_from_env()
    seconds = float(faults.get("disk_read_delay_s", 0.0))
    return SlowReads(seconds, faults.get("disk_read_delay_while")) if seconds > 0 else None


def maybe_inject(backend: CopyBackend) -> CopyBackend:
    faults = faults_from_env()
    if not faults.get("fail_loads") and not faults.get("store_delay_s"):
        return backend
    return FaultInjectingBackend(
        backend, fail_loads=int(faults.get("fail_loads", 0)),
        store_delay_s=float(faults.get("store_delay_s", 0.0)),
    )
