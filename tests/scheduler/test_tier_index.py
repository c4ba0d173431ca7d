"""TierIndex: slot assignment, pins, doomed entries; unit tests plus a stateful model check."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tests.helpers import short_key as k
from tests.scheduler.index_checks import check_invariants, lru_order
from tieredkv.scheduler.policies import ARCPolicy, LRUPolicy
from tieredkv.scheduler.tier_index import Placement, SlotState, TierIndex


def filled(num_slots: int, policy: str = "lru") -> TierIndex:
    """An index whose slots all hold READY, unpinned keys k(0)..k(num_slots - 1)."""
    index = TierIndex("host", num_slots, policy)
    for i in range(num_slots):
        index.allocate(k(i))
        index.mark_ready(k(i))
    check_invariants(index)
    return index


# ---------------------------------------------------------------------------- construction


def test_new_index_is_empty() -> None:
    index = TierIndex("disk", 3, "arc")
    assert isinstance(index.policy, ARCPolicy)
    assert isinstance(TierIndex("host", 3).policy, LRUPolicy)
    assert (index.num_slots, index.free_slots, index.used_slots) == (3, 3, 0)
    assert (len(index), index.ready_count, index.pinned_count, index.evictions) == (0, 0, 0, 0)
    assert index.keys() == []
    check_invariants(index)


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="num_slots"):
        TierIndex("host", -1)
    with pytest.raises(ValueError, match="'mru'"):
        TierIndex("host", 4, "mru")


# ---------------------------------------------------------------------------- allocate


def test_allocate_uses_free_slots_then_evicts_lru() -> None:
    index = TierIndex("host", 2)
    assert index.allocate(k(0)) == (0, [])
    assert index.allocate(k(1)) == (1, [])
    assert index.get(k(0)) == Placement(0, SlotState.WRITING, pins=1)
    index.mark_ready(k(0))
    index.mark_ready(k(1))
    index.touch(k(0))  # k(1) is now the least recently used
    assert index.allocate(k(2)) == (1, [(k(1), 1)])
    assert index.evictions == 1
    assert index.get(k(1)) is None
    assert index.get(k(2)) == Placement(1, SlotState.WRITING, pins=1)
    assert sorted(index.keys()) == [k(0), k(2)]
    check_invariants(index)


def test_allocate_of_present_key_raises() -> None:
    index = TierIndex("host", 2)
    index.allocate(k(0))
    with pytest.raises(KeyError):
        index.allocate(k(0))
    index.mark_ready(k(0))
    with pytest.raises(KeyError):
        index.allocate(k(0))
    check_invariants(index)


def test_allocate_never_evicts_pinned_or_writing_entries() -> None:
    index = filled(3)
    index.pin(k(0))
    index.remove(k(1))
    index.allocate(k(1))  # WRITING, takes the freed slot
    # Only k(2) is evictable; k(0) is older but pinned, k(1) is being written.
    slot, evicted = index.allocate(k(9))  # type: ignore[misc]
    assert evicted == [(k(2), 2)] and slot == 2
    assert index.get(k(0)) == Placement(0, SlotState.READY, pins=1)
    check_invariants(index)


def test_allocate_when_full_and_all_pinned_returns_none() -> None:
    index = filled(3)
    index.pin(k(0))
    index.pin(k(1))
    index.remove(k(2))
    index.allocate(k(2))  # WRITING pins it
    before = (index.keys(), index.free_slots, index.evictions)
    assert index.allocate(k(9)) is None
    assert (index.keys(), index.free_slots, index.evictions) == before
    assert index.get(k(9)) is None and k(9) not in index.policy
    check_invariants(index)


def test_allocate_on_zero_slots_is_a_clean_miss() -> None:
    index = TierIndex("disk", 0)
    assert index.allocate(k(0)) is None
    check_invariants(index)


def test_allocate_with_arc_evicts_one_time_keys_before_hot_ones() -> None:
    index = filled(3, "arc")
    index.touch(k(0))  # k(0) is hot (T2); k(1), k(2) seen once (T1)
    _, evicted = index.allocate(k(5))  # type: ignore[misc]
    assert evicted == [(k(1), 1)]
    index.mark_ready(k(5))
    _, evicted = index.allocate(k(6))  # type: ignore[misc]
    assert evicted == [(k(2), 2)]
    assert index.is_ready(k(0))
    check_invariants(index)


# ---------------------------------------------------------------------------- write lifecycle


def test_mark_ready_drops_the_write_pin() -> None:
    index = TierIndex("host", 2)
    index.allocate(k(0))
    assert not index.is_ready(k(0))
    assert index.pinned_count == 1 and index.ready_count == 0
    assert index.mark_ready(k(0)) is True
    assert index.is_ready(k(0))
    assert index.get(k(0)) == Placement(0, SlotState.READY, pins=0)
    assert index.pinned_count == 0 and index.ready_count == 1
    with pytest.raises(ValueError):
        index.mark_ready(k(0))
    with pytest.raises(KeyError):
        index.mark_ready(k(1))
    check_invariants(index)


def test_abort_frees_the_slot() -> None:
    index = TierIndex("host", 1)
    index.allocate(k(0))
    index.abort(k(0))
    assert index.get(k(0)) is None and index.free_slots == 1 and len(index) == 0
    assert k(0) not in index.policy
    assert index.allocate(k(1)) == (0, [])
    index.mark_ready(k(1))
    with pytest.raises(ValueError):
        index.abort(k(1))  # not being written: use remove
    with pytest.raises(KeyError):
        index.abort(k(7))
    check_invariants(index)


def test_get_returns_a_snapshot() -> None:
    index = filled(1)
    placement = index.get(k(0))
    assert placement is not None
    placement.pins = 5
    assert index.get(k(0)) == Placement(0, SlotState.READY, pins=0)


# ---------------------------------------------------------------------------- pins


def test_pin_and_unpin_count_in_flight_reads() -> None:
    index = filled(1)
    index.pin(k(0))
    index.pin(k(0))
    assert index.get(k(0)).pins == 2  # type: ignore[union-attr]
    assert index.pinned_count == 1
    index.unpin(k(0))
    index.unpin(k(0))
    assert index.pinned_count == 0
    with pytest.raises(ValueError, match="below zero"):
        index.unpin(k(0))
    assert index.get(k(0)).pins == 0  # type: ignore[union-attr]
    check_invariants(index)


def test_pin_errors() -> None:
    index = TierIndex("host", 2)
    with pytest.raises(KeyError):
        index.pin(k(0))
    with pytest.raises(KeyError):
        index.unpin(k(0))
    index.allocate(k(0))
    with pytest.raises(ValueError):
        index.pin(k(0))  # nothing may read bytes still being written
    with pytest.raises(ValueError):
        index.unpin(k(0))  # the write pin goes with mark_ready / abort
    check_invariants(index)


# ---------------------------------------------------------------------------- remove / doomed


def test_remove_unpinned_frees_slot_at_once() -> None:
    index = filled(2)
    assert index.remove(k(1)) == 1
    assert index.get(k(1)) is None and index.free_slots == 1
    assert index.remove(k(1)) is None
    assert index.remove(k(9)) is None
    check_invariants(index)


def test_removed_pinned_entry_holds_its_slot_until_last_unpin() -> None:
    index = filled(2)
    index.pin(k(0))
    index.pin(k(0))
    assert index.remove(k(0)) is None
    assert index.get(k(0)) is None and not index.is_ready(k(0)) and index.is_doomed(k(0))
    assert k(0) not in index and len(index) == 1
    assert index.used_slots == 2 and index.free_slots == 0 and index.doomed_count == 1
    check_invariants(index)
    # The doomed slot 0 is not free; the only way to room is evicting k(1) from slot 1.
    assert index.allocate(k(5)) == (1, [(k(1), 1)])
    index.mark_ready(k(5))
    index.pin(k(5))
    assert index.allocate(k(6)) is None
    index.unpin(k(0))
    assert index.free_slots == 0 and index.is_doomed(k(0))
    index.unpin(k(0))
    assert index.free_slots == 1 and not index.is_doomed(k(0))
    with pytest.raises(KeyError):
        index.unpin(k(0))
    assert index.allocate(k(6)) == (0, [])
    check_invariants(index)


def test_key_cannot_be_stored_again_while_its_doomed_copy_is_read() -> None:
    index = filled(3)
    index.pin(k(0))
    index.remove(k(0))
    assert index.allocate(k(0)) is None, "a doomed copy still holds a slot: a plain miss"
    with pytest.raises(KeyError):
        index.restore(k(0), 2)
    index.unpin(k(0))
    assert index.allocate(k(0)) == (0, [])
    check_invariants(index)


def test_remove_while_writing_frees_slot_when_write_ends() -> None:
    index = TierIndex("host", 2)
    index.allocate(k(0))
    index.allocate(k(1))
    assert index.remove(k(0)) is None
    assert index.remove(k(1)) is None
    assert index.free_slots == 0 and index.doomed_count == 2
    assert index.mark_ready(k(0)) is False  # the bytes landed, but must not be advertised
    assert index.get(k(0)) is None and index.free_slots == 1
    index.abort(k(1))
    assert index.free_slots == 2 and index.doomed_count == 0 and index.pinned_count == 0
    check_invariants(index)


# ---------------------------------------------------------------------------- restore


def test_restore_places_ready_entries() -> None:
    index = TierIndex("disk", 4)
    index.restore(k(0), 3)
    index.restore(k(1), 1)
    assert index.get(k(0)) == Placement(3, SlotState.READY, pins=0)
    assert index.ready_count == 2 and index.free_slots == 2
    with pytest.raises(ValueError, match="taken"):
        index.restore(k(2), 3)
    with pytest.raises(ValueError, match="range"):
        index.restore(k(2), 4)
    with pytest.raises(ValueError, match="range"):
        index.restore(k(2), -1)
    with pytest.raises(KeyError):
        index.restore(k(0), 2)
    slots = {index.allocate(k(i))[0] for i in (5, 6)}  # type: ignore[index]
    assert slots == {0, 2}
    check_invariants(index)


# ---------------------------------------------------------------------------- touch / clear


def test_touch_of_unknown_key_is_a_noop() -> None:
    index = filled(2)
    index.touch(k(9))
    assert k(9) not in index.policy
    check_invariants(index)


def test_clear_drops_unpinned_and_dooms_pinned() -> None:
    index = filled(4, "arc")
    index.pin(k(1))
    index.remove(k(3))
    index.allocate(k(3))  # WRITING
    dropped = index.clear()
    assert sorted(dropped) == [(k(0), 0), (k(2), 2)]
    assert len(index) == 0 and index.keys() == [] and len(index.policy) == 0
    assert index.used_slots == 2 and index.doomed_count == 2
    check_invariants(index)
    index.unpin(k(1))
    assert index.mark_ready(k(3)) is False
    assert index.free_slots == 4
    check_invariants(index)


def test_entries_are_found_by_any_block_they_hold() -> None:
    index = TierIndex("host", 4)
    index.allocate(k(1), (k(10), k(11)))  # holds blocks 10, 11 and 1 (its last)
    assert index.holds(k(10)) and index.holders(k(11)) == [k(1)]
    assert index.ready_holder(k(10)) is None  # being written: not servable yet
    index.mark_ready(k(1))
    assert index.ready_holder(k(10)) == index.ready_holder(k(1)) == k(1)
    assert index.get(k(1)).blocks == 3
    # A shorter entry of the same prefix (blocks 10 and 11): covered by the longer one.
    index.allocate(k(11), (k(10),))
    index.mark_ready(k(11))
    assert index.covering(k(11)) == [k(1)] and index.covering(k(1)) == []
    assert sorted(index.holders(k(10))) == [k(1), k(11)]
    # Removing one holder keeps the other's aliases; a doomed entry's are gone at once.
    index.pin(k(1))
    index.remove(k(1))
    assert index.holders(k(10)) == [k(11)] and index.ready_holder(k(11)) == k(11)
    assert not index.holds(k(1)) and index.covering(k(11)) == []
    index.unpin(k(1))
    check_invariants(index)
    index.clear()
    assert not index.holds(k(10))
    check_invariants(index)


def test_evicted_entries_leave_the_alias_index() -> None:
    index = TierIndex("host", 1)
    index.allocate(k(1), (k(10),))
    index.mark_ready(k(1))
    index.allocate(k(2), (k(20),))  # evicts k(1)
    assert not index.holds(k(10)) and index.holds(k(20))
    index.abort(k(2))
    assert not index.holds(k(20))
    index.restore(k(3), 0, (k(30),))
    assert index.ready_holder(k(30)) == k(3)
    check_invariants(index)


def test_check_invariants_catches_corruption() -> None:
    index = filled(2)
    index._entries[k(1)].slot = 0  # two keys on one slot
    with pytest.raises(AssertionError):
        check_invariants(index)


# ---------------------------------------------------------------------------- stateful model


KEYS = [k(i) for i in range(6)]
# Each key's aliases (the keys of its entry's other blocks): overlapping, as the blocks of
# prompts sharing a prefix overlap, so one alias often has several holders.
ALIAS_KEYS = [b"alias-" + bytes([i]) for i in range(4)]
ALIASES = {key: tuple(ALIAS_KEYS[: i % 4]) for i, key in enumerate(KEYS)}


@dataclass
class ModelEntry:
    slot: int
    state: SlotState
    pins: int = 0


@dataclass
class Model:
    num_slots: int
    live: dict[bytes, ModelEntry] = field(default_factory=dict)
    doomed: dict[bytes, ModelEntry] = field(default_factory=dict)
    recency: list[bytes] = field(default_factory=list)  # LRU order, coldest first

    def held(self) -> set[int]:
        return {e.slot for e in self.live.values()} | {e.slot for e in self.doomed.values()}

    def free(self) -> set[int]:
        return set(range(self.num_slots)) - self.held()

    def evictable(self) -> list[bytes]:
        return [
            key for key in self.recency
            if self.live[key].state is SlotState.READY and self.live[key].pins == 0
        ]

    def hit(self, key: bytes) -> None:
        self.recency.remove(key)
        self.recency.append(key)

    def drop(self, key: bytes) -> None:
        entry = self.live.pop(key)
        self.recency.remove(key)
        if entry.pins > 0:
            self.doomed[key] = entry

    def release(self, key: bytes, entry: ModelEntry) -> None:
        entry.pins -= 1
        if entry.pins == 0 and self.doomed.get(key) is entry:
            del self.doomed[key]


def _pick(data: st.DataObject, keys: list[bytes]) -> bytes:
    return data.draw(st.sampled_from(sorted(keys)))


class TierIndexMachine(RuleBasedStateMachine):
    """Every operation against a plain model; the index must agree after every step.

    Each operation has a rule over any key (error paths included) and, where a random key
    would rarely fit, a targeted rule that picks a key in the right state, so that pins,
    doomed entries and evictions under pressure are reached often.
    """

    policy_name = "lru"

    # Zero slots is covered by a unit test; here every example should have room to churn.
    @initialize(num_slots=st.integers(min_value=1, max_value=4))
    def setup(self, num_slots: int) -> None:
        self.index = TierIndex("host", num_slots, self.policy_name)
        self.model = Model(num_slots)

    # -- key sets of the model, for targeted rules

    def _entry(self, key: bytes) -> ModelEntry | None:
        return self.model.live.get(key) or self.model.doomed.get(key)

    def _writing(self) -> list[bytes]:
        m = self.model
        return [
            key for key, e in (*m.live.items(), *m.doomed.items()) if e.state is SlotState.WRITING
        ]

    def _ready(self) -> list[bytes]:
        return [key for key, e in self.model.live.items() if e.state is SlotState.READY]

    def _read_pinned(self) -> list[bytes]:
        m = self.model
        return [
            key for key, e in (*m.live.items(), *m.doomed.items())
            if e.state is SlotState.READY and e.pins > 0
        ]

    # -- operations, each checked against the model

    @rule(key=st.sampled_from(KEYS))
    def allocate(self, key: bytes) -> None:
        m = self.model
        if key in m.live:
            with pytest.raises(KeyError):
                self.index.allocate(key)
            return
        free_before, held_before = m.free(), m.held()
        evictable = m.evictable()
        result = self.index.allocate(key, ALIASES[key])
        if key in m.doomed:
            assert result is None
            return
        if not free_before and not evictable:
            # Full and every entry pinned (by a read, a write or a doomed copy): a clean miss.
            assert result is None
            return
        assert result is not None
        slot, evicted = result
        # No slot is handed out while any entry, live or doomed, still holds it.
        assert slot not in {e.slot for e in m.doomed.values()}
        if free_before:
            assert evicted == []
            assert slot in free_before
        else:
            assert len(evicted) == 1
            victim, victim_slot = evicted[0]
            # A pinned (or still-writing) entry is never evicted.
            assert victim in evictable
            assert m.live[victim].pins == 0 and m.live[victim].state is SlotState.READY
            if self.policy_name == "lru":
                assert victim == evictable[0], "LRU must evict the coldest evictable key"
            assert victim_slot == m.live[victim].slot == slot
            del m.live[victim]
            m.recency.remove(victim)
            assert slot in held_before
        m.live[key] = ModelEntry(slot, SlotState.WRITING, pins=1)
        m.recency.append(key)

    @precondition(lambda self: len(self.model.live) + len(self.model.doomed) < len(KEYS))
    @rule(data=st.data())
    def allocate_absent(self, data: st.DataObject) -> None:
        m = self.model
        present = m.live.keys() | m.doomed.keys()
        self.allocate(_pick(data, [key for key in KEYS if key not in present]))

    @rule(key=st.sampled_from(KEYS))
    def mark_ready(self, key: bytes) -> None:
        m = self.model
        entry = self._entry(key)
        if entry is None:
            with pytest.raises(KeyError):
                self.index.mark_ready(key)
        elif entry.state is not SlotState.WRITING:
            with pytest.raises(ValueError):
                self.index.mark_ready(key)
        elif key in m.doomed:
            assert self.index.mark_ready(key) is False
            m.release(key, entry)
        else:
            assert self.index.mark_ready(key) is True
            entry.state, entry.pins = SlotState.READY, 0

    @precondition(lambda self: self._writing())
    @rule(data=st.data())
    def mark_ready_writing(self, data: st.DataObject) -> None:
        self.mark_ready(_pick(data, self._writing()))

    @rule(key=st.sampled_from(KEYS))
    def abort(self, key: bytes) -> None:
        m = self.model
        entry = self._entry(key)
        if entry is None:
            with pytest.raises(KeyError):
                self.index.abort(key)
        elif entry.state is not SlotState.WRITING:
            with pytest.raises(ValueError):
                self.index.abort(key)
        elif key in m.doomed:
            self.index.abort(key)
            m.release(key, entry)
        else:
            self.index.abort(key)
            del m.live[key]
            m.recency.remove(key)

    @precondition(lambda self: self._writing())
    @rule(data=st.data())
    def abort_writing(self, data: st.DataObject) -> None:
        self.abort(_pick(data, self._writing()))

    @rule(key=st.sampled_from(KEYS))
    def pin(self, key: bytes) -> None:
        entry = self.model.live.get(key)
        if entry is None:
            with pytest.raises(KeyError):
                self.index.pin(key)
        elif entry.state is SlotState.WRITING:
            with pytest.raises(ValueError):
                self.index.pin(key)
        else:
            self.index.pin(key)
            entry.pins += 1

    @precondition(lambda self: self._ready())
    @rule(data=st.data())
    def pin_ready(self, data: st.DataObject) -> None:
        self.pin(_pick(data, self._ready()))

    @rule(key=st.sampled_from(KEYS))
    def unpin(self, key: bytes) -> None:
        m = self.model
        entry = self._entry(key)
        if entry is None:
            with pytest.raises(KeyError):
                self.index.unpin(key)
        elif entry.state is SlotState.WRITING or entry.pins == 0:
            with pytest.raises(ValueError):
                self.index.unpin(key)
        else:
            self.index.unpin(key)
            m.release(key, entry)

    @precondition(lambda self: self._read_pinned())
    @rule(data=st.data())
    def unpin_pinned(self, data: st.DataObject) -> None:
        self.unpin(_pick(data, self._read_pinned()))

    @rule(key=st.sampled_from(KEYS))
    def remove(self, key: bytes) -> None:
        m = self.model
        entry = m.live.get(key)
        freed = self.index.remove(key)
        if entry is None:
            assert freed is None
            return
        assert freed == (entry.slot if entry.pins == 0 else None)
        m.drop(key)

    @precondition(lambda self: self.model.live)
    @rule(data=st.data())
    def remove_live(self, data: st.DataObject) -> None:
        self.remove(_pick(data, list(self.model.live)))

    @rule(key=st.sampled_from(KEYS))
    def touch(self, key: bytes) -> None:
        self.index.touch(key)
        if key in self.model.live:
            self.model.hit(key)

    # Hypothesis favours rules without arguments; clearing only a full tier keeps resets from
    # wiping the state so often that pins, doomed entries and evictions are rarely reached.
    @precondition(lambda self: len(self.model.live) >= self.model.num_slots)
    @rule()
    def clear(self) -> None:
        m = self.model
        expected = sorted((key, e.slot) for key, e in m.live.items() if e.pins == 0)
        assert sorted(self.index.clear()) == expected
        for key in list(m.live):
            m.drop(key)

    @rule(key=st.sampled_from(KEYS), slot=st.integers(min_value=-1, max_value=4))
    def restore(self, key: bytes, slot: int) -> None:
        m = self.model
        if key in m.live or key in m.doomed:
            with pytest.raises(KeyError):
                self.index.restore(key, slot)
        elif slot not in m.free():
            with pytest.raises(ValueError):
                self.index.restore(key, slot)
        else:
            self.index.restore(key, slot, ALIASES[key])
            m.live[key] = ModelEntry(slot, SlotState.READY)
            m.recency.append(key)

    @precondition(
        lambda self: self.model.free() and len(self.model.live) + len(self.model.doomed) < len(KEYS)
    )
    @rule(data=st.data())
    def restore_free(self, data: st.DataObject) -> None:
        m = self.model
        absent = [key for key in KEYS if key not in m.live and key not in m.doomed]
        slot = data.draw(st.sampled_from(sorted(m.free())))
        self.restore(_pick(data, absent), slot)

    @invariant()
    def agrees_with_model(self) -> None:
        if not hasattr(self, "index"):
            return
        index, m = self.index, self.model
        check_invariants(index)
        for key in KEYS:
            entry = m.live.get(key)
            expected = None if entry is None else Placement(
                entry.slot, entry.state, entry.pins, ALIASES[key])
            assert index.get(key) == expected
            assert index.is_ready(key) == (entry is not None and entry.state is SlotState.READY)
            assert index.is_doomed(key) == (key in m.doomed)
        assert sorted(index.keys()) == sorted(m.live)
        # Blocks are found through live entries only, any state; ready_holder only READY ones.
        for alias in ALIAS_KEYS:
            holders = sorted(key for key in m.live if alias in ALIASES[key])
            assert sorted(index.holders(alias)) == holders
            assert index.holds(alias) == bool(holders)
            ready = [key for key in holders if m.live[key].state is SlotState.READY]
            assert (index.ready_holder(alias) in ready) if ready else index.ready_holder(alias) is None
        for key in KEYS:
            covering = [other for other in m.live if other != key and key in ALIASES[other]
                        and m.live[other].state is SlotState.READY]
            assert sorted(index.covering(key)) == sorted(covering)
        assert len(index) == len(m.live)
        assert index.free_slots == len(m.free())
        assert index.used_slots == len(m.held())
        assert index.ready_count == len(self._ready())
        assert index.doomed_count == len(m.doomed)
        assert index.pinned_count == sum(
            e.pins > 0 for e in (*m.live.values(), *m.doomed.values())
        )
        if self.policy_name == "lru":
            assert lru_order(index.policy) == m.recency


class ARCTierIndexMachine(TierIndexMachine):
    policy_name = "arc"


_settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestTierIndexLRU = TierIndexMachine.TestCase
TestTierIndexLRU.settings = _settings
TestTierIndexARC = ARCTierIndexMachine.TestCase
TestTierIndexARC.settings = _settings
