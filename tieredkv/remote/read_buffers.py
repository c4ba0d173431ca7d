"""The bounded reads' receive buffers: one per batch, reused once every view of it is gone.

A value is a view of the buffer the socket wrote it into (:mod:`tieredkv.remote.bounded_read`),
and its reader holds it until the value has landed; a fresh buffer per read would cost its
page faults every time.
"""

from __future__ import annotations

import mmap
import threading
import time
import weakref

import numpy as np

# Receive buffers kept for reuse, at most. The pool never holds more than the reads once held
# at the same time (the transfer layer's: 128 MiB of values out, plus the batch landing).
IDLE_BUFFER_BYTES = 512 << 20
BUFFER_IDLE_S = 60.0  # no read for this long: the kept buffers are freed


class ReadBuffers:
    """Receive buffers for bounded reads (one per batch), each reused once every view of the
    values it holds is gone.

    A value is a view of the buffer the socket wrote it into, and its reader holds it until
    the value has landed; a fresh buffer per value would cost its page faults on every read.
    A buffer is lent as a numpy view of a kept array: when the last memoryview derived from
    that view is released, the view dies and the array comes back here (up to ``idle_bytes``
    kept; the rest are freed; all of them once reads stop for a while,
    :meth:`release_if_idle`). New buffers are anonymous mappings, not ``np.empty``: numpy
    advises huge pages for large arrays, and a huge-page fault can stall in compaction (300 ms
    for 128 MiB seen here); a mapping also goes back to the system the moment it is freed.
    """

    def __init__(self, idle_bytes: int = IDLE_BUFFER_BYTES) -> None:
        self._idle_limit = idle_bytes
        self._idle: dict[int, list[np.ndarray]] = {}
        self._idle_bytes = 0
        self._lent = 0  # bytes asked for by the reads holding a buffer now
        self._peak = 0  # the most ever asked at once (since idle): the kept total's bound
        self._last_take = time.monotonic()
        self._lock = threading.RLock()  # given back on whichever thread drops the last view

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    def take(self, size: int) -> memoryview:
        """``size`` writable bytes (not zeroed: the socket writes them): a slice of the
        smallest kept buffer that holds them and is at most twice as big (batches differ in
        size: a prompt's last, a Cluster node's share), else of a new one."""
        with self._lock:
            self._last_take = time.monotonic()
            fits = [n for n, free in self._idle.items() if free and size <= n <= 2 * size]
            kept = self._idle[min(fits)].pop() if fits else None
            if kept is not None:
                self._idle_bytes -= kept.nbytes
            self._lent += size
            self._peak = max(self._peak, self._lent)
        if kept is None:
            kept = np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)
        lent = kept[:size]
        weakref.finalize(lent, self._give_back, kept, size).atexit = False
        return memoryview(lent)

    def release_if_idle(self, idle_s: float) -> int:
        """Free the kept buffers if none was taken for ``idle_s`` seconds (a tier that stopped
        reading gives its memory back); the bytes freed."""
        with self._lock:
            if time.monotonic() - self._last_take < idle_s:
                return 0
            freed, self._idle, self._idle_bytes = self._idle_bytes, {}, 0
            self._peak = self._lent
        return freed

    def _give_back(self, kept: np.ndarray, size: int) -> None:
        """Kept for reuse while the kept total stays within the most bytes reads ever asked
        for at once (and ``idle_bytes``), smaller kept buffers freed first to make room."""
        n = kept.nbytes
        with self._lock:
            self._lent -= size
            limit = min(self._idle_limit, self._peak)
            while self._idle_bytes + n > limit:
                smaller = [size for size, free in self._idle.items() if free and size < n]
                if not smaller:
                    return  # freed
                self._idle[min(smaller)].pop()
                self._idle_bytes -= min(smaller)
            self._idle.setdefault(n, []).append(kept)
            self._idle_bytes += n
