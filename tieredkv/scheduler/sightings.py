"""Admission by sightings: a chunk is written to a tier once it has been seen N times.

Shared by the disk tier (``disk_admission``) and the remote tier (``remote_admission``). A
sighting is a store, another request finding the chunk stored, or a load; the counts of the
most recent keys are remembered, a bounded number of them.
"""

from __future__ import annotations

from collections import OrderedDict


class Sightings:
    """Bounded LRU of per-key sighting counts; ``admission`` sightings admit a key."""

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
