"""What the planner needs from a tier below host (disk today, a remote store later).

A lower tier is reached only through the host tier: a chunk gets there by a spill from a READY
host entry, and comes back by a promotion into a host slot before it is ever loaded. Its
entries follow the same rules as the host's :class:`~tieredkv.scheduler.tier_index.TierIndex`
(WRITING -> READY, pinned while a copy reads or writes them, a removed pinned entry is doomed
until the copy ends, an entry is keyed by its last block and found by any block it holds).

The planner calls exactly the methods below and nothing else, so a new tier is one subclass:
no change to lookup, placement or the ledger. :class:`~tieredkv.scheduler.disk_tier.DiskTier`
is the first one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from tieredkv.scheduler.tier_index import Placement


class LowerTier(ABC):
    """One tier below host, as the planner sees it (one thread: the scheduler's)."""

    #: Names the tier in counters (``evictions_<name>``, ``hit_tokens_<name>``, ...) and in a
    #: request's hit sources.
    name: str
    #: The most alias keys a copy written to this tier keeps (more: only its own key survives
    #: a restart, see :meth:`record_written`).
    max_aliases: int

    # ------------------------------------------------------------------ lookup

    @abstractmethod
    def is_ready(self, key: bytes) -> bool:
        """Whether the entry keyed ``key`` is READY (can be promoted)."""

    @abstractmethod
    def holds(self, key: bytes) -> bool:
        """Whether a live entry (any state) holds the block ``key`` names."""

    @abstractmethod
    def holders(self, key: bytes) -> list[bytes]:
        """Keys of the live entries (any state) holding the block ``key`` names."""

    @abstractmethod
    def covering(self, key: bytes) -> list[bytes]:
        """READY entries other than ``key``'s own that hold every block of ``key``'s entry."""

    @abstractmethod
    def get(self, key: bytes) -> Placement | None:
        """A snapshot of the live entry keyed ``key`` (its slot and aliases), or None."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether a live entry is keyed ``key``."""

    @abstractmethod
    def is_doomed(self, key: bytes) -> bool:
        """Whether a removed copy of ``key`` still holds a slot (``key`` cannot be written)."""

    @abstractmethod
    def touch(self, key: bytes) -> None:
        """Record a use of ``key`` in the eviction policy; unknown keys are ignored."""

    # ------------------------------------------------------------------ placement

    @abstractmethod
    def allocate(
        self, key: bytes, aliases: tuple[bytes, ...]
    ) -> tuple[int, list[tuple[bytes, int]]] | None:
        """A WRITING slot for ``key``: ``(slot, evicted)``, or None when the tier is full of
        pinned entries. Evicted entries are forgotten by the tier (records included)."""

    @abstractmethod
    def mark_ready(self, key: bytes) -> bool:
        """A write finished; False when the entry was removed meanwhile (do not advertise)."""

    @abstractmethod
    def abort(self, key: bytes) -> None:
        """A write failed: the entry is dropped."""

    @abstractmethod
    def pin(self, key: bytes) -> None:
        """Hold a READY entry for a read (a promotion)."""

    @abstractmethod
    def unpin(self, key: bytes) -> None:
        """Release a read pin."""

    @abstractmethod
    def remove(self, key: bytes, *, recorded: bool = True) -> None:
        """Drop ``key``. ``recorded``: it may have been recorded written, so its removal is
        recorded too; False for an entry that never was (nothing to forget)."""

    @abstractmethod
    def clear(self) -> None:
        """Drop every entry and every record (a cache reset)."""

    # ------------------------------------------------------------------ admission

    @abstractmethod
    def note_seen(self, key: bytes) -> bool:
        """Count a sighting of ``key`` (stored, found stored, loaded); True when it has now
        been seen often enough to be admitted."""

    @abstractmethod
    def admits(self, key: bytes) -> bool:
        """Whether ``key``, just stored in host, should be spilled here now (False: the
        planner counts ``<name>_admission_rejected``)."""

    # ------------------------------------------------------------------ records

    @abstractmethod
    def record_written(self, key: bytes) -> None:
        """The READY entry ``key`` is kept: record it (so that it survives a restart)."""

    # ------------------------------------------------------------------ capacity

    @abstractmethod
    def gauges(self) -> dict[str, int]:
        """Capacity and occupancy (``<name>_slots_capacity``, ``<name>_slots_used``,
        ``<name>_entries``)."""
