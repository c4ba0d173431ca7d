"""A per-host-slot in-flight map: many readers or one writer, refused rather than waited for.

The scheduler's index pins every slot a job touches, so a conflict here is a bug upstream (or
a disk read that timed out but is still writing into its slot). Either way the engine must
not let a second job write a slot that another job is still reading or writing: the guard
refuses the late job, which then fails with ``copy_error`` instead of corrupting bytes that
are, or are about to be, served. Thread-safe: the event loop, the h2d lane thread (host-tier
loads go there directly) and the worker thread (inline loads) all take slots.
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger(__name__)


class SlotGuard:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._readers: dict[int, int] = {}
        self._writers: set[int] = set()

    def try_read(self, slot: int) -> bool:
        with self._lock:
            if slot not in self._writers:
                self._readers[slot] = self._readers.get(slot, 0) + 1
                return True
        return self._refuse(slot, "read", "a job is writing it")

    def try_write(self, slot: int) -> bool:
        with self._lock:
            if slot in self._writers:
                why = "another job is writing it"
            elif self._readers.get(slot):
                why = "a job is reading it"
            else:
                self._writers.add(slot)
                return True
        return self._refuse(slot, "write", why)

    def release(self, slot: int, write: bool) -> None:
        with self._lock:
            if write:
                self._writers.discard(slot)
                return
            count = self._readers.get(slot, 0) - 1
            if count > 0:
                self._readers[slot] = count
            else:
                self._readers.pop(slot, None)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._writers) + len(self._readers)

    def _refuse(self, slot: int, what: str, why: str) -> bool:
        logger.error(
            "tieredkv: refused to %s host slot %d while %s (the slot would be corrupted); "
            "the job fails with copy_error", what, slot, why,
        )
        return False
