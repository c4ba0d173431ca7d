"""The journal's bounded backlog and its retry backoff, so a full or failing disk costs neither
unbounded memory nor a busy core.

While writes fail, records keep arriving (slab files are preallocated, so spills go on
succeeding on a full disk). The backlog holds at most ``limit`` records. The record that would
go past it starts an *overflow*: the whole backlog is dropped and every later record is
dropped on arrival, each one counted. Nothing is lost for good: the journal keeps the live
index (every record applied, dropped or not), and its next write is a rebuild of the file
from that index (a compaction). Until the rebuild is durable no flush reports those records
durable, and after it the file says exactly what the dropped records would have said.

Between failed attempts the flusher waits :meth:`RetryBackoff.delay` (doubling from
``first_s`` to ``max_s``) on its wake-up event, so a failing disk costs one attempt per delay;
a caller waiting on the journal (``flush``, ``compact``, ``close``) wakes it at once.

A reset (:class:`Cleared`) makes everything queued before it moot: :meth:`Backlog.clear`
drops it (answering compactions, ending an overflow) and puts the clear first, where it is
never dropped, so a full disk cannot keep it from being written before anything else.
"""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass
from typing import Any

# About 5 MiB of queued records (~170 B each in memory), several seconds of the busiest
# spilling; past it a rebuild (one record per live entry) is the cheaper way back.
BACKLOG_MAX_RECORDS = 1 << 15
RETRY_FIRST_S = 0.05
RETRY_MAX_S = 5.0


@dataclass
class Compaction:
    """A rewrite of the journal as exactly ``entries``; ``done`` answers the caller."""

    entries: dict[bytes, int]
    done: cf.Future[None]


@dataclass
class Cleared:
    """A reset of the journal to no entries; ``dones`` answer the callers waiting for it and
    ``covered`` counts the items recorded up to it (all made moot by it)."""

    dones: list[cf.Future[None]]
    covered: int


class RetryBackoff:
    """Exponential backoff between failed attempts: ``first_s``, doubling, capped at ``max_s``."""

    def __init__(self, first_s: float = RETRY_FIRST_S, max_s: float = RETRY_MAX_S) -> None:
        if not 0 < first_s <= max_s:
            raise ValueError(f"need 0 < first_s <= max_s, got {first_s} and {max_s}")
        self.first_s = first_s
        self.max_s = max_s
        self.failures = 0  # failed attempts since the last success

    @property
    def delay(self) -> float:
        """Seconds to wait before the next attempt (0 while nothing is failing)."""
        if not self.failures:
            return 0.0
        return min(self.max_s, self.first_s * 2.0 ** min(self.failures - 1, 64))

    def failed(self) -> float:
        """Count a failed attempt; the delay before the next one."""
        self.failures += 1
        return self.delay

    def succeeded(self) -> None:
        self.failures = 0


class Backlog:
    """The items waiting for the flusher, at most ``limit`` records (see the module docstring).

    Not thread-safe: the journal calls it under its own lock. ``records`` counts the records
    queued or being written, neither durable nor dropped yet. Compactions are never dropped
    (each holds at most the live index, and at most one is queued per
    ``COMPACT_MIN_RECORDS`` records): during an overflow the rebuild answers them.
    """

    def __init__(self, limit: int = BACKLOG_MAX_RECORDS) -> None:
        if limit < 1:
            raise ValueError(f"the journal backlog limit must be >= 1, got {limit}")
        self.limit = limit
        self.items: list[Any] = []
        self.records = 0
        self.overflowing = False  # records are dropped; the next write is a rebuild
        self.episode = False  # an overflow began and no rebuild has succeeded since
        self.dropped = 0  # records ever dropped
        self.episode_dropped = 0  # records dropped in this episode, not yet in a snapshot
        self._covering = 0  # records dropped that the rebuild being written covers
        self.waiters: list[cf.Future[None]] = []  # compactions the next rebuild answers

    def add(self, item: Any) -> bool:
        """Queue ``item``, or drop it while overflowing; True when this call began an episode."""
        if isinstance(item, Compaction):
            if self.overflowing:
                self.waiters.append(item.done)
            else:
                self.items.append(item)
            return False
        if not self.overflowing and self.records < self.limit:
            self.items.append(item)
            self.records += 1
            return False
        started = not self.episode
        self.overflow()
        self.dropped += 1
        self.episode_dropped += 1
        return started

    def take(self) -> list[Any]:
        """Everything queued, for the flusher to write (still counted until written)."""
        items, self.items = self.items, []
        return items

    def written(self, records: int) -> None:
        self.records -= records

    def clear(self, item: Cleared) -> None:
        """A reset: what is queued is moot (its records are not counted as dropped), the
        overflow ends (the live index is empty) and ``item`` goes first, absorbing a clear
        still pending."""
        answered, self.waiters = self.waiters, []
        for old in self.items:
            if isinstance(old, Compaction):
                answered.append(old.done)
            elif isinstance(old, Cleared):
                item.dones[:0] = old.dones
            else:
                self.records -= 1
        self.items = [item]
        self.overflowing = self.episode = False
        self.episode_dropped = self._covering = 0
        for done in answered:  # superseded: the state they described no longer exists
            done.set_result(None)

    def take_clear(self) -> Cleared | None:
        """The pending reset, if one is first in line (it is written before anything else)."""
        if self.items and isinstance(self.items[0], Cleared):
            return self.items.pop(0)
        return None

    def requeue(self, rest: list[Any]) -> None:
        """Put back what a failed write did not write (dropped instead while overflowing);
        what came before a reset, queued or in ``rest``, is moot and goes, uncounted."""
        pending = bool(self.items) and isinstance(self.items[0], Cleared)
        cut = len(rest) if pending else max(
            (n for n, item in enumerate(rest) if isinstance(item, Cleared)), default=0
        )
        moot, rest = rest[:cut], rest[cut:]
        for item in moot:
            if isinstance(item, Compaction):
                item.done.set_result(None)
            elif isinstance(item, Cleared):  # the reset after it answers its callers
                (rest[0] if rest else self.items[0]).dones[:0] = item.dones
            else:
                self.records -= 1
        if self.overflowing:
            self._drop(rest)
        else:
            self.items[:0] = rest

    def overflow(self) -> None:
        """Drop everything queued (but a pending reset) and every record from now on, until
        the next rebuild."""
        self.overflowing = True
        self.episode = True
        items, self.items = self.items, []
        self._drop(items)

    def rebuilding(self) -> list[cf.Future[None]]:
        """The rebuild took its snapshot: records from now on are queued again (dropped
        anew if it fails). Returns the compactions it answers."""
        self.overflowing = False
        self._covering, self.episode_dropped = self.episode_dropped, 0
        waiters, self.waiters = self.waiters, []
        return waiters

    def rebuild_failed(self) -> None:
        """Back to dropping: what was queued since the snapshot, too; the next rebuild
        covers all of it."""
        self.episode_dropped += self._covering
        self._covering = 0
        self.overflow()

    def rebuilt(self) -> int:
        """A rebuild is durable: the episode ends (unless records were dropped while it was
        written; the next rebuild covers those). Returns the records this one covered."""
        covered, self._covering = self._covering, 0
        self.episode = self.overflowing
        return covered

    def _drop(self, items: list[Any]) -> None:
        for item in items:
            if isinstance(item, Cleared):
                self.items.insert(0, item)  # never dropped: it goes before the rebuild
            elif isinstance(item, Compaction):
                self.waiters.append(item.done)
            else:
                self.records -= 1
                self.dropped += 1
                self.episode_dropped += 1
