"""A bounded, thread-safe FIFO of pending remote writes that drops instead of waiting.

Writes to the shared tier are a bonus: when Redis or the network cannot keep up, the right
answer is to drop and count, never to block the thread that offered them (the engine's) or to
grow without bound. Bounded by entries *and* bytes, since chunk values are megabytes.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from typing import NamedTuple


class WriteEntry(NamedTuple):
    """One value to store: Redis key, encoded value, optional time-to-live in seconds.

    ``then``: ``(key, value)`` pairs to set once this value is stored, each only where its key
    exists (``SET XX``): the pointers that replace the shorter tails it supersedes."""

    key: bytes
    value: bytes
    ttl_s: float | None = None
    then: tuple[tuple[bytes, bytes], ...] = ()


# What a writer offers: ``(key, value)``, or ``(key, value, then)`` (see WriteEntry).
WriteItem = tuple[bytes, bytes] | tuple[bytes, bytes, tuple[tuple[bytes, bytes], ...]]


class BoundedWriteQueue:
    """FIFO with ``max_items``/``max_bytes`` caps; callable from any thread."""

    def __init__(self, max_items: int, max_bytes: int) -> None:
        if max_items < 1 or max_bytes < 1:
            raise ValueError("write queue bounds must be positive")
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._entries: deque[WriteEntry] = deque()
        self._bytes = 0
        self._lock = threading.Lock()

    def offer(self, entries: Iterable[WriteEntry]) -> tuple[int, int]:
        """Append what fits, in order; return ``(accepted, dropped)``. Never blocks.

        Once one entry does not fit, the rest of the batch is dropped too, so a batch is
        always stored as a prefix (the chunks a later lookup can actually use).
        """
        accepted = dropped = 0
        with self._lock:
            full = False
            for entry in entries:
                size = len(entry.value)
                if full or (
                    len(self._entries) >= self.max_items or self._bytes + size > self.max_bytes
                ):
                    full = True
                    dropped += 1
                    continue
                self._entries.append(entry)
                self._bytes += size
                accepted += 1
        return accepted, dropped

    def take(self, max_items: int, max_bytes: int) -> list[WriteEntry]:
        """Pop up to ``max_items`` entries totalling at most ``max_bytes`` (always >= 1 if any)."""
        out: list[WriteEntry] = []
        total = 0
        with self._lock:
            while self._entries and len(out) < max_items:
                size = len(self._entries[0].value)
                if out and total + size > max_bytes:
                    break
                entry = self._entries.popleft()
                self._bytes -= size
                total += size
                out.append(entry)
        return out

    def clear(self) -> int:
        """Drop everything (on close); return how many entries were dropped."""
        with self._lock:
            count = len(self._entries)
            self._entries.clear()
            self._bytes = 0
        return count

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes
