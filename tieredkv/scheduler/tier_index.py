"""The scheduler-side index of one tier (host or disk): which key holds which slot, in which state.

The index is the single owner of slot assignment for its tier. Workers only ever see the
concrete slots it hands out, so its one non-negotiable rule is that a slot is never handed
out again while a copy may still read or write it:

* an entry being written (``WRITING``) is pinned by its write until ``mark_ready``/``abort``;
* a reader pins a ``READY`` entry for the duration of its copy;
* only ``READY`` entries with no pins are evicted;
* an entry removed while pinned is *doomed*: it disappears from lookups at once, but its slot
  stays taken until the last pin is dropped.

While a doomed copy of a key still holds a slot, the key cannot be stored again (``allocate``
returns None, a plain miss), so ``unpin(key)`` always names one record and is never ambiguous.

An entry is keyed by the key of the last block it holds and may carry *aliases*: the keys of
its other blocks (an entry holds the first ``len(aliases) + 1`` blocks of one chunk). Block
keys are chained hashes, so an entry holding block ``b`` holds every block of its chunk
before ``b`` too; :meth:`ready_holder` finds a READY entry holding a given block, which is how
a hit ends at the last block held instead of at a chunk boundary. Aliases of live entries are
indexed; doomed entries' are not.
A full tier whose entries are all pinned answers ``allocate`` with None: never a wait, never
an assert. Not thread-safe: the scheduler half calls it from one thread.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from tieredkv.scheduler.policies import EvictionPolicy, make_policy


class SlotState(enum.Enum):
    WRITING = "writing"
    READY = "ready"


@dataclass(slots=True)
class Placement:
    """Where a key lives in the tier; ``pins`` counts in-flight copies (the write included)."""

    slot: int
    state: SlotState
    pins: int = 0
    aliases: tuple[bytes, ...] = ()  # keys of the entry's other blocks, first block first

    @property
    def blocks(self) -> int:
        """How many blocks of its chunk the entry holds (slot positions 0 .. blocks-1)."""
        return len(self.aliases) + 1


class TierListener(Protocol):
    """Told when an entry becomes READY or stops being served (KV events; None: no cost)."""

    def entry_ready(self, tier: str, key: bytes, aliases: tuple[bytes, ...]) -> None: ...

    def entry_gone(self, tier: str, key: bytes) -> None: ...

    def tier_cleared(self, tier: str) -> None: ...


class TierIndex:
    """``num_slots`` slots of one tier, a key -> :class:`Placement` map and an eviction policy."""

    def __init__(self, name: str, num_slots: int, policy: str = "lru") -> None:
        if num_slots < 0:
            raise ValueError(f"tieredkv: {name} tier: num_slots must be >= 0, got {num_slots}")
        self.name = name
        self.num_slots = num_slots
        self.policy: EvictionPolicy = make_policy(policy, num_slots)
        self._entries: dict[bytes, Placement] = {}
        self._doomed: dict[bytes, Placement] = {}
        # alias key -> the live entry (or entries, a list) whose aliases include it
        self._alias: dict[bytes, bytes | list[bytes]] = {}
        # An insertion-ordered dict used as a set: O(1) pop of the most recently freed slot and
        # O(1) removal of a given slot (restore). Lowest slots come out first on a fresh index.
        self._free: dict[int, None] = dict.fromkeys(range(num_slots - 1, -1, -1))
        self._ready = 0
        self._pinned = 0
        self.evictions = 0
        # Bumped whenever something a miss could turn on changes: an entry arrives or becomes
        # READY (allocate, mark_ready, restore), or a removed entry's slot is finally freed
        # or its write aborted (a copy in the tier below is no longer hidden behind it). A
        # lookup's cached miss stays true while this and the other tier's count stand.
        self.changes = 0
        self.listener: TierListener | None = None

    # ------------------------------------------------------------------ lookups

    def get(self, key: bytes) -> Placement | None:
        """A snapshot of ``key``'s placement, or None (also for doomed keys); no side effects."""
        entry = self._entries.get(key)
        return None if entry is None else Placement(entry.slot, entry.state, entry.pins, entry.aliases)

    def is_ready(self, key: bytes) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.state is SlotState.READY

    def is_doomed(self, key: bytes) -> bool:
        """Whether a removed-but-pinned copy of ``key`` still holds a slot."""
        return key in self._doomed

    def present(self, key: bytes) -> bool:
        """Live (any state) or doomed: a slot is held under ``key``."""
        return key in self._entries or key in self._doomed

    def holds(self, key: bytes) -> bool:
        """Whether a live entry (any state) holds the block ``key`` names (its own or an alias)."""
        return key in self._entries or key in self._alias

    def holders(self, key: bytes) -> list[bytes]:
        """Keys of the live entries (any state) holding the block ``key`` names."""
        out = [key] if key in self._entries else []
        held = self._alias.get(key)
        if held is not None:
            out.extend(held if isinstance(held, list) else (held,))
        return out

    def ready_holder(self, key: bytes) -> bytes | None:
        """The key of a READY entry holding the block ``key`` names, or None.

        The entry keyed by ``key`` itself first, else one holding it as an alias (a longer
        entry of the same prefix, or another prompt's chunk sharing these blocks).
        """
        entries = self._entries
        entry = entries.get(key)
        if entry is not None and entry.state is SlotState.READY:
            return key
        held = self._alias.get(key)
        if held is None:
            return None
        if not isinstance(held, list):
            return held if entries[held].state is SlotState.READY else None
        for holder in held:
            if entries[holder].state is SlotState.READY:
                return holder
        return None

    def covering(self, key: bytes) -> list[bytes]:
        """READY entries other than ``key``'s own that hold ``key``'s last block as an alias:
        they hold every block of ``key``'s entry too."""
        held = self._alias.get(key)
        if held is None:
            return []
        entries = self._entries
        return [k for k in (held if isinstance(held, list) else (held,))
                if k != key and entries[k].state is SlotState.READY]

    def touch(self, key: bytes) -> None:
        """Record a hit in the policy; unknown keys are ignored."""
        if key in self._entries:
            self.policy.touch(key)

    def keys(self) -> list[bytes]:
        """The live keys (a snapshot; doomed keys excluded)."""
        return list(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[bytes]:
        return iter(self.keys())

    # ------------------------------------------------------------------ accounting

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def used_slots(self) -> int:
        """Slots not free: live entries and doomed ones still held by a copy."""
        return self.num_slots - len(self._free)

    @property
    def ready_count(self) -> int:
        return self._ready

    @property
    def writing_count(self) -> int:
        return len(self._entries) - self._ready

    @property
    def pinned_count(self) -> int:
        """Slots held by at least one in-flight copy (writes and doomed entries included)."""
        return self._pinned

    @property
    def doomed_count(self) -> int:
        return len(self._doomed)

    # ------------------------------------------------------------------ writes

    def allocate(
        self, key: bytes, aliases: tuple[bytes, ...] = ()
    ) -> tuple[int, list[tuple[bytes, int]]] | None:
        """Reserve a slot for ``key`` (with ``aliases``) in state ``WRITING``, pinned by its write.

        Takes a free slot, else evicts the policy's victim among unpinned ``READY`` entries.
        Returns ``(slot, evicted)`` with the ``(key, slot)`` pairs evicted to make room, or
        None when nothing can be evicted or a doomed copy of ``key`` still holds a slot.
        Raises KeyError when ``key`` is already present (callers check with :meth:`get`).
        """
        if key in self._entries:
            raise KeyError(f"tieredkv: {self.name} tier: key {key.hex()} is already present")
        if key in self._doomed:
            return None
        evicted: list[tuple[bytes, int]] = []
        if not self._free:
            victim = self.policy.victim(self._evictable)
            if victim is None:
                return None
            entry = self._entries.pop(victim)
            self._unlink(victim, entry.aliases)
            self.policy.remove(victim, evicted=True)
            self._ready -= 1
            self._free[entry.slot] = None
            self.evictions += 1
            evicted.append((victim, entry.slot))
            if self.listener is not None:
                self.listener.entry_gone(self.name, victim)
        slot, _ = self._free.popitem()
        self._entries[key] = Placement(slot, SlotState.WRITING, pins=1, aliases=aliases)
        self._link(key, aliases)
        self._pinned += 1
        self.changes += 1
        self.policy.insert(key)
        return slot, evicted

    def mark_ready(self, key: bytes) -> bool:
        """A write finished: ``WRITING`` -> ``READY`` and the write pin is dropped.

        Returns False when the entry was removed while being written (doomed): its slot is
        freed now if no other copy holds it, and the written bytes must not be advertised.
        """
        entry = self._writing_entry(key, "mark_ready")
        if key in self._doomed:
            self._drop_pin(key, entry)
            return False
        entry.state = SlotState.READY
        entry.pins = 0
        self._pinned -= 1
        self._ready += 1
        self.changes += 1
        if self.listener is not None:
            self.listener.entry_ready(self.name, key, entry.aliases)
        return True

    def abort(self, key: bytes) -> None:
        """A write failed: the entry is removed and its slot freed."""
        entry = self._writing_entry(key, "abort")
        if key in self._doomed:
            self._drop_pin(key, entry)
            return
        del self._entries[key]
        self._unlink(key, entry.aliases)
        self.policy.remove(key, evicted=False)
        self._pinned -= 1
        self._free[entry.slot] = None
        self.changes += 1

    def restore(self, key: bytes, slot: int, aliases: tuple[bytes, ...] = ()) -> None:
        """Insert a ``READY`` entry at ``slot`` (journal recovery)."""
        if key in self._entries or key in self._doomed:
            raise KeyError(f"tieredkv: {self.name} tier: key {key.hex()} is already present")
        if not 0 <= slot < self.num_slots:
            raise ValueError(
                f"tieredkv: {self.name} tier: slot {slot} out of range 0..{self.num_slots - 1}"
            )
        if slot not in self._free:
            raise ValueError(f"tieredkv: {self.name} tier: slot {slot} is already taken")
        del self._free[slot]
        self._entries[key] = Placement(slot, SlotState.READY, aliases=aliases)
        self._link(key, aliases)
        self._ready += 1
        self.changes += 1
        self.policy.insert(key)

    # ------------------------------------------------------------------ reads

    def pin(self, key: bytes) -> None:
        """Hold a ``READY`` entry for an in-flight read: it cannot be evicted until unpinned."""
        entry = self._entries.get(key)
        if entry is None:
            raise KeyError(f"tieredkv: {self.name} tier: cannot pin absent key {key.hex()}")
        if entry.state is not SlotState.READY:
            raise ValueError(
                f"tieredkv: {self.name} tier: cannot pin {key.hex()} while it is being written"
            )
        if entry.pins == 0:
            self._pinned += 1
        entry.pins += 1

    def unpin(self, key: bytes) -> None:
        """Release a read pin; the last pin of a doomed entry frees its slot."""
        entry = self._entries.get(key) or self._doomed.get(key)
        if entry is None:
            raise KeyError(f"tieredkv: {self.name} tier: cannot unpin absent key {key.hex()}")
        if entry.state is SlotState.WRITING:
            raise ValueError(
                f"tieredkv: {self.name} tier: {key.hex()} is being written; "
                "its pin is dropped by mark_ready or abort"
            )
        if entry.pins == 0:
            raise ValueError(f"tieredkv: {self.name} tier: unpin of {key.hex()} below zero pins")
        self._drop_pin(key, entry)

    def ready_prefix(self, keys: Sequence[bytes], start: int, stop: int) -> int:
        """How many of ``keys[start:stop]``, from ``start`` on, are READY (one tight loop)."""
        entries = self._entries
        ready = SlotState.READY
        i = start
        while i < stop:
            entry = entries.get(keys[i])
            if entry is None or entry.state is not ready:
                break
            i += 1
        return i - start

    def pin_all(self, keys: list[bytes]) -> None:
        """:meth:`pin` for many READY keys at once (a hit of a long prefix)."""
        entries = self._entries
        for key in keys:
            entry = entries.get(key)
            if entry is None or entry.state is not SlotState.READY:
                raise KeyError(f"tieredkv: {self.name} tier: cannot pin {key!r}: not READY")
            if entry.pins == 0:
                self._pinned += 1
            entry.pins += 1

    # ------------------------------------------------------------------ removal

    def remove(self, key: bytes) -> int | None:
        """Drop ``key`` (e.g. after a failed read); returns the slot freed now, if any.

        A pinned entry is doomed instead: gone from lookups at once, its slot freed only when
        the last pin (or its write) goes. Unknown or already doomed keys return None.
        """
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self._unlink(key, entry.aliases)
        self.policy.remove(key, evicted=False)
        if entry.state is SlotState.READY:
            self._ready -= 1
            if self.listener is not None:
                self.listener.entry_gone(self.name, key)
        if entry.pins > 0:
            self._doomed[key] = entry
            return None
        self._free[entry.slot] = None
        return entry.slot

    def clear(self) -> list[tuple[bytes, int]]:
        """Drop every live entry (a cache reset); pinned ones become doomed.

        Returns the ``(key, slot)`` pairs whose slots were freed now. The listener hears one
        ``tier_cleared``, not one removal per entry.
        """
        dropped: list[tuple[bytes, int]] = []
        listener, self.listener = self.listener, None
        try:
            for key in list(self._entries):
                slot = self.remove(key)
                if slot is not None:
                    dropped.append((key, slot))
        finally:
            self.listener = listener
        self.policy.clear()
        if listener is not None:
            listener.tier_cleared(self.name)
        return dropped

    # ------------------------------------------------------------------ internals

    def _link(self, key: bytes, aliases: tuple[bytes, ...]) -> None:
        table = self._alias
        for alias in aliases:
            held = table.get(alias)
            if held is None:
                table[alias] = key
            elif isinstance(held, list):
                held.append(key)
            else:
                table[alias] = [held, key]

    def _unlink(self, key: bytes, aliases: tuple[bytes, ...]) -> None:
        table = self._alias
        for alias in aliases:
            held = table.get(alias)
            if isinstance(held, list):
                held.remove(key)
                if len(held) == 1:
                    table[alias] = held[0]
            elif held == key:
                del table[alias]

    def _evictable(self, key: bytes) -> bool:
        entry = self._entries[key]
        return entry.state is SlotState.READY and entry.pins == 0

    def _writing_entry(self, key: bytes, action: str) -> Placement:
        entry = self._entries.get(key) or self._doomed.get(key)
        if entry is None:
            raise KeyError(f"tieredkv: {self.name} tier: {action} of absent key {key.hex()}")
        if entry.state is not SlotState.WRITING:
            raise ValueError(
                f"tieredkv: {self.name} tier: {action} of {key.hex()}, which is not being written"
            )
        return entry

    def _drop_pin(self, key: bytes, entry: Placement) -> None:
        entry.pins -= 1
        if entry.pins > 0:
            return
        self._pinned -= 1
        if self._doomed.get(key) is entry:
            del self._doomed[key]
            self._free[entry.slot] = None
            self.changes += 1
