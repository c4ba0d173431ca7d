"""The tiers below host, as the planner sees them: what fills a host slot from below, and the
disk tier's index.

Two tiers lie below host, and a chunk of either is used the same way: read back into a host
slot, verified on the workers, and only then promised (the fill path,
:mod:`~tieredkv.scheduler.fill`). Both implement :class:`LowerTier`, the few hooks that path
calls where the two differ:

* **disk** (:class:`DiskTier`) is owned by this scheduler: an index of its slots (a
  :class:`~tieredkv.scheduler.tier_index.TierIndex`, same rules as the host's), spilled into
  from READY host entries, journaled so that it survives a restart, admitted by sightings. A
  read pins the disk entry; a failed one drops it. The workers verify each slot's header.
* **remote** (:class:`~tieredkv.scheduler.remote_tier.RemoteTier`, Redis/Valkey) is shared:
  other replicas write it and Redis evicts at any moment, so the scheduler keeps no index of
  it, only hints, and a probe decides what a lookup may read (every rank must hold the chunk).
  It is written from host (remote writes), never spilled into.

So the planner has one *indexed* tier below host (``Planner.lower``, a :class:`DiskTier`: a
test may plug in another one under another name) and, optionally, the remote tier beside it.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import OrderedDict

from tieredkv.disk import aliases_kept
from tieredkv.metrics.specs import Count, Counts
from tieredkv.protocol import JobKind, PromoteJob, StepPlan, Tier
from tieredkv.scheduler.tier_index import TierIndex

logger = logging.getLogger(__name__)


class LowerTier(ABC):
    """A tier below host that host slots are filled from: the fill path's per-tier hooks."""

    #: Names the tier in counters (``<name>_read_failed_<cause>``, ``hit_tokens_<name>``, ...)
    #: and in a request's hit sources.
    name: str
    #: The job kind a fill from this tier is (its completion comes back under it).
    fill_kind: JobKind
    #: The counter of chunks this tier filled into host slots.
    fill_counter: Count

    @abstractmethod
    def fill_aliases(self, key: bytes) -> tuple[bytes, ...] | None:
        """The aliases the host entry filled from ``key`` carries; None: the request's own
        block keys of that chunk (the tier keeps none)."""

    @abstractmethod
    def plan_fill(self, plan: StepPlan, job_id: int, key: bytes, host_slot: int,
                  req_id: str) -> None:
        """Add the job reading ``key`` into ``host_slot`` to this step's ``plan``."""

    @abstractmethod
    def fill_done(self, key: bytes, ok: bool) -> None:
        """Every rank reported the fill of ``key`` (``ok``: verified in every host slot)."""


class Sightings:
    """Admission by sightings (``disk_admission``, ``remote_admission``): a bounded LRU of
    per-key counts; a key seen ``admission`` times (stored, found stored, loaded) is admitted."""

    def __init__(self, admission: int, limit: int) -> None:
        if admission < 1 or limit < 1:
            raise ValueError("sightings: admission and limit must be >= 1")
        self.admission = admission
        self._limit = limit
        self._seen: OrderedDict[bytes, int] = OrderedDict()

    def note(self, key: bytes) -> bool:
        """Count a sighting; True when ``key`` has now been seen often enough."""
        seen = self._seen
        count = seen.pop(key, 0) + 1
        seen[key] = count
        while len(seen) > self._limit:
            seen.popitem(last=False)
        return count >= self.admission

    def admits(self, key: bytes) -> bool:
        return self._seen.get(key, 0) >= self.admission

    def clear(self) -> None:
        self._seen.clear()


class DiskTier(TierIndex, LowerTier):
    """The indexed tier below host: ``num_slots`` disk slots (per rank), journaled by
    ``catalog`` when there is one, admitted by sightings.

    It is the index itself (no forwarding); what it adds: records (an entry is journaled
    written once its spill is done and kept, removed whenever it goes; a reset journals the
    whole tier cleared; start-up restores what the catalog recovered), admission, and the
    fill hooks (a read pins the entry; one that failed drops it, never promised again).
    """

    name = Tier.DISK
    fill_kind = JobKind.PROMOTE
    fill_counter = Count.PROMOTED_CHUNKS

    def __init__(self, num_slots: int, *, policy: str, admission: int, seen_limit: int,
                 catalog=None) -> None:
        super().__init__(self.name, num_slots, policy)
        self.catalog = catalog
        self._sightings = Sightings(admission, seen_limit)
        # What start-up found, for the planner's counters.
        self.recovery_counts = Counts()
        if catalog is not None:
            self._recover(catalog)

    def _recover(self, catalog) -> None:
        aliases = getattr(catalog, "recovered_aliases", {}) or {}
        for key, slot in catalog.recovered.items():
            self.restore(key, slot, aliases.get(key, ()))
        # A crash between a longer entry's journal record and the removal of the shorter one
        # it supersedes leaves both: keep the longer.
        for key in list(catalog.recovered):
            if key in self and self.covering(key):
                self.remove(key)
                self.recovery_counts[Count.SUPERSEDED, Tier.DISK] += 1
        dropped = getattr(catalog, "dropped_at_recovery", {}) or {}
        self.recovery_counts[Count.DROPPED_AT_RECOVERY] = sum(dropped.values())
        if catalog.recovered:
            logger.info("tieredkv: disk tier recovered %d chunks", len(catalog.recovered))

    # ------------------------------------------------------------------ the index, recorded

    def allocate(
        self, key: bytes, aliases: tuple[bytes, ...] = ()
    ) -> tuple[int, list[tuple[bytes, int]]] | None:
        """:meth:`TierIndex.allocate`; the entries it evicts are recorded removed."""
        allocation = super().allocate(key, aliases)
        if allocation is not None and self.catalog is not None:
            for old_key, _slot in allocation[1]:
                self.catalog.record_removed(old_key)
        return allocation

    def remove(self, key: bytes, *, recorded: bool = True) -> int | None:
        """:meth:`TierIndex.remove`. ``recorded``: it may have been recorded written, so its
        removal is recorded too; False for an entry that never was (nothing to forget)."""
        slot = super().remove(key)
        if recorded and self.catalog is not None:
            self.catalog.record_removed(key)
        return slot

    def clear(self) -> list[tuple[bytes, int]]:
        """Drop every entry and every record (a cache reset), durably before returning: the
        entries are stale now, yet a restart would verify their slots (the catalog logs an
        error, and makes the next start empty, when the journal cannot be reset)."""
        catalog, self.catalog = self.catalog, None  # no record per entry removed
        try:
            dropped = super().clear()
        finally:
            self.catalog = catalog
        if catalog is not None:
            catalog.record_cleared()
        self._sightings.clear()
        return dropped

    def record_written(self, key: bytes) -> None:
        """The READY entry ``key`` is kept: record it (so that it survives a restart)."""
        placement = self.get(key)
        if self.catalog is not None and placement is not None:
            self.catalog.record_written(key, placement.slot)

    @staticmethod
    def kept_aliases(aliases: tuple[bytes, ...]) -> tuple[bytes, ...]:
        """The aliases a copy written here keeps (beyond them only its own key survives a
        restart): the disk package says what one slot's header lists."""
        return aliases_kept(aliases)

    # ------------------------------------------------------------------ admission

    def note_seen(self, key: bytes) -> bool:
        """Count a sighting of ``key``; True when it may now be spilled here."""
        return self._sightings.note(key)

    def admits(self, key: bytes) -> bool:
        """Whether ``key``, just stored in host, should be spilled here now."""
        return self._sightings.admits(key)

    # ------------------------------------------------------------------ fills

    def fill_aliases(self, key: bytes) -> tuple[bytes, ...]:
        entry = self.get(key)
        assert entry is not None
        return entry.aliases

    def plan_fill(self, plan: StepPlan, job_id: int, key: bytes, host_slot: int,
                  req_id: str) -> None:
        entry = self.get(key)
        assert entry is not None
        self.pin(key)
        plan.promotes.append(PromoteJob(job_id, key, entry.slot, host_slot, req_id=req_id))

    def fill_done(self, key: bytes, ok: bool) -> None:
        self.unpin(key)
        if not ok:
            self.remove(key)  # nothing that failed is ever promised again

    # ------------------------------------------------------------------ capacity

    def gauges(self) -> dict[str, int]:
        """Capacity and occupancy (``<name>_slots_capacity``, ``<name>_slots_used``,
        ``<name>_entries``)."""
        name = self.name
        return {
            f"{name}_slots_capacity": self.num_slots,
            f"{name}_slots_used": self.used_slots,
            f"{name}_entries": len(self),
        }
