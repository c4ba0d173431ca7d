"""The disk tier as the planner sees it: a :class:`TierIndex` of disk slots, the
:class:`~tieredkv.disk.catalog.DiskCatalog` journaling it, and disk admission.

* Records: an entry is journaled written once its spill is done and kept, and journaled
  removed whenever it goes (evicted, superseded, failed to read back); a reset journals the
  whole tier cleared. At start-up the entries the catalog recovered are restored.
* Admission: with ``disk_admission`` N, a chunk is spilled once it has been seen N times
  (stored, found stored by another request, loaded); the sightings of the most recent keys are
  remembered, a bounded number of them.
"""

from __future__ import annotations

import logging
from collections import Counter

from tieredkv.disk.format import MAX_HEADER_ALIASES
from tieredkv.scheduler.lower_tier import LowerTier
from tieredkv.scheduler.sightings import Sightings
from tieredkv.scheduler.tier_index import Placement, TierIndex

logger = logging.getLogger(__name__)

EMPTY_DISK_GAUGES = {"disk_slots_capacity": 0, "disk_slots_used": 0, "disk_entries": 0}


class DiskTier(LowerTier):
    """``num_slots`` disk slots (per rank), journaled by ``catalog`` when there is one."""

    name = "disk"
    max_aliases = MAX_HEADER_ALIASES  # what one slot header page lists

    def __init__(
        self,
        num_slots: int,
        *,
        policy: str,
        admission: int,
        seen_limit: int,
        catalog=None,
    ) -> None:
        self.index = TierIndex("disk", num_slots, policy)
        self.catalog = catalog
        self._sightings = Sightings(admission, seen_limit)
        # What start-up found, for the planner's counters.
        self.recovery_counts: Counter[str] = Counter()
        if catalog is not None:
            self._recover(catalog)

    def _recover(self, catalog) -> None:
        index = self.index
        aliases = getattr(catalog, "recovered_aliases", {}) or {}
        for key, slot in catalog.recovered.items():
            index.restore(key, slot, aliases.get(key, ()))
        # A crash between a longer entry's journal record and the removal of the shorter one
        # it supersedes leaves both: keep the longer.
        for key in list(catalog.recovered):
            if key in index and index.covering(key):
                self.remove(key)
                self.recovery_counts["superseded_disk"] += 1
        dropped = getattr(catalog, "dropped_at_recovery", {}) or {}
        self.recovery_counts["dropped_at_recovery"] = sum(dropped.values())
        if catalog.recovered:
            logger.info("tieredkv: disk tier recovered %d chunks", len(catalog.recovered))

    # ------------------------------------------------------------------ lookup

    def is_ready(self, key: bytes) -> bool:
        return self.index.is_ready(key)

    def holds(self, key: bytes) -> bool:
        return self.index.holds(key)

    def holders(self, key: bytes) -> list[bytes]:
        return self.index.holders(key)

    def covering(self, key: bytes) -> list[bytes]:
        return self.index.covering(key)

    def get(self, key: bytes) -> Placement | None:
        return self.index.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self.index

    def is_doomed(self, key: bytes) -> bool:
        return self.index.is_doomed(key)

    def touch(self, key: bytes) -> None:
        self.index.touch(key)

    # ------------------------------------------------------------------ placement

    def allocate(
        self, key: bytes, aliases: tuple[bytes, ...]
    ) -> tuple[int, list[tuple[bytes, int]]] | None:
        allocation = self.index.allocate(key, aliases)
        if allocation is not None and self.catalog is not None:
            for old_key, _slot in allocation[1]:
                self.catalog.record_removed(old_key)
        return allocation

    def mark_ready(self, key: bytes) -> bool:
        return self.index.mark_ready(key)

    def abort(self, key: bytes) -> None:
        self.index.abort(key)

    def pin(self, key: bytes) -> None:
        self.index.pin(key)

    def unpin(self, key: bytes) -> None:
        self.index.unpin(key)

    def remove(self, key: bytes, *, recorded: bool = True) -> None:
        self.index.remove(key)
        if recorded and self.catalog is not None:
            self.catalog.record_removed(key)

    def clear(self) -> None:
        self.index.clear()
        if self.catalog is not None:
            self.catalog.record_cleared()
        self._sightings.clear()

    # ------------------------------------------------------------------ admission

    def note_seen(self, key: bytes) -> bool:
        return self._sightings.note(key)

    def admits(self, key: bytes) -> bool:
        return self._sightings.admits(key)

    # ------------------------------------------------------------------ records

    def record_written(self, key: bytes) -> None:
        placement = self.index.get(key)
        if self.catalog is not None and placement is not None:
            self.catalog.record_written(key, placement.slot)

    # ------------------------------------------------------------------ capacity

    def gauges(self) -> dict[str, int]:
        index, name = self.index, self.name
        return {
            f"{name}_slots_capacity": index.num_slots,
            f"{name}_slots_used": index.used_slots,
            f"{name}_entries": len(index),
        }
