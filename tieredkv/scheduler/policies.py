"""Eviction policies: which resident key a full tier gives up next.

A policy only orders opaque keys; it never allocates, frees or touches bytes. The tier index
tells it what became resident, what was hit and what left, and asks it for a victim among
the keys it may evict (pinned keys are skipped, not removed). Every operation is O(1) except
``victim``, which walks from the cold end and stops at the first evictable key, so it costs
O(1 + number of pinned keys it has to step over).

Policies are not thread-safe: the scheduler half owns them and runs on one thread.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable

from tieredkv.protocol import PolicyName


def _first_evictable(
    keys: Iterable[bytes], can_evict: Callable[[bytes], bool]
) -> bytes | None:
    for key in keys:
        if can_evict(key):
            return key
    return None


class EvictionPolicy(ABC):
    """Orders resident keys for eviction.

    ``can_evict`` passed to :meth:`victim` must not change the policy (it is called while the
    policy iterates its own lists).
    """

    @abstractmethod
    def insert(self, key: bytes) -> None:
        """``key`` became resident (inserting a resident key counts as a hit)."""

    @abstractmethod
    def touch(self, key: bytes) -> None:
        """``key`` was hit; a key that is not resident is ignored."""

    @abstractmethod
    def remove(self, key: bytes, *, evicted: bool = True) -> None:
        """``key`` is no longer resident; a no-op when it is absent.

        ``evicted`` says the key left because it was chosen as a victim: policies that learn
        from their own mistakes (ARC) remember it. Pass False for departures that say nothing
        about the policy's choices (an aborted write, a failed read, a cache reset).
        """

    @abstractmethod
    def victim(self, can_evict: Callable[[bytes], bool]) -> bytes | None:
        """The best resident key to evict among those ``can_evict`` accepts; not removed."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every key, resident or remembered (a reset makes all history stale)."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident keys."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is resident."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first: one ordered dict, coldest key at the front."""

    def __init__(self, capacity: int = 0) -> None:
        # The capacity is not needed by LRU; accepted so every policy is built the same way.
        self.capacity = capacity
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: bytes, *, evicted: bool = True) -> None:
        self._order.pop(key, None)

    def victim(self, can_evict: Callable[[bytes], bool]) -> bytes | None:
        return _first_evictable(self._order, can_evict)

    def clear(self) -> None:
        self._order.clear()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha, FAST 2003).

    Resident keys live in T1 (seen once recently) or T2 (seen at least twice). Keys evicted
    from them are remembered, without data, in the ghost lists B1 and B2. A key that comes
    back while remembered in B1 says T1 was too small, so the target size ``p`` of T1 grows;
    one back from B2 makes it shrink. Either way the key returns to T2. A one-time scan only
    ever churns T1, so keys hit more than once survive it, which plain LRU cannot promise.

    The tier index, not the policy, decides when to evict: :meth:`victim` applies ARC's
    REPLACE rule (T1's coldest key when ``|T1| > p``, else T2's) and falls back to the other
    list when every key of the preferred one is pinned. The ghost lists keep ARC's bounds:
    ``|T1| + |B1| <= capacity`` and ``|T1| + |T2| + |B1| + |B2| <= 2 * capacity``.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"ARC capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._p = 0
        self._t1: OrderedDict[bytes, None] = OrderedDict()
        self._t2: OrderedDict[bytes, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()

    @property
    def p(self) -> int:
        """Adaptive target size of T1, in ``0..capacity``."""
        return self._p

    def insert(self, key: bytes) -> None:
        if key in self._t1 or key in self._t2:
            self.touch(key)
            return
        if key in self._b1:
            # A recency ghost came back: T1 was evicted too eagerly.
            self._p = min(self.capacity, self._p + max(1, len(self._b2) // len(self._b1)))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            # A frequency ghost came back: T2 deserved more room.
            self._p = max(0, self._p - max(1, len(self._b1) // len(self._b2)))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._trim_ghosts()

    def touch(self, key: bytes) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def remove(self, key: bytes, *, evicted: bool = True) -> None:
        if key in self._t1:
            del self._t1[key]
            if evicted:
                self._b1[key] = None
        elif key in self._t2:
            del self._t2[key]
            if evicted:
                self._b2[key] = None
        else:
            return
        self._trim_ghosts()

    def victim(self, can_evict: Callable[[bytes], bool]) -> bytes | None:
        if len(self._t1) > self._p:
            first, second = self._t1, self._t2
        else:
            first, second = self._t2, self._t1
        found = _first_evictable(first, can_evict)
        return found if found is not None else _first_evictable(second, can_evict)

    def clear(self) -> None:
        for lst in (self._t1, self._t2, self._b1, self._b2):
            lst.clear()
        self._p = 0

    def where(self, key: bytes) -> str | None:
        """Which list holds ``key``: ``"t1"``, ``"t2"``, ``"b1"``, ``"b2"`` or None."""
        for name, lst in (("t1", self._t1), ("t2", self._t2), ("b1", self._b1), ("b2", self._b2)):
            if key in lst:
                return name
        return None

    def _trim_ghosts(self) -> None:
        # Only ghosts are dropped here; resident keys leave when the tier index evicts them.
        c = self.capacity
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        total = len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2)
        while total > 2 * c and (self._b1 or self._b2):
            (self._b2 if self._b2 else self._b1).popitem(last=False)
            total -= 1

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """Build the policy called ``name`` (``"lru"`` or ``"arc"``) for ``capacity`` slots."""
    normalized = name.strip().lower() if isinstance(name, str) else name
    if normalized == PolicyName.LRU:
        return LRUPolicy(capacity)
    if normalized == PolicyName.ARC:
        return ARCPolicy(capacity)
    raise ValueError(
        f"tieredkv: unknown eviction policy {name!r}; expected one of {', '.join(PolicyName)}"
    )
