"""Eviction policies: LRU order, ARC's scan resistance and adaptation, pinned keys skipped."""

from __future__ import annotations

import pytest

from tests.helpers import short_key as k
from tests.scheduler.index_checks import arc_lists, lru_order
from tieredkv.scheduler.policies import ARCPolicy, EvictionPolicy, LRUPolicy, make_policy


def always(_key: bytes) -> bool:
    return True


def run_cache(policy: EvictionPolicy, capacity: int, accesses: list[bytes]) -> int:
    """Drive ``policy`` as a cache of ``capacity`` keys would; returns the number of hits."""
    hits = 0
    for key in accesses:
        if key in policy:
            policy.touch(key)
            hits += 1
            continue
        if len(policy) >= capacity:
            victim = policy.victim(always)
            assert victim is not None
            policy.remove(victim)
        policy.insert(key)
        assert len(policy) <= capacity
    return hits


# ---------------------------------------------------------------------------- LRU


def test_lru_evicts_least_recently_used_first() -> None:
    lru = LRUPolicy()
    for i in range(4):
        lru.insert(k(i))
    lru.touch(k(0))  # 0 becomes the hottest
    assert lru_order(lru) == [k(1), k(2), k(3), k(0)]
    assert lru.victim(always) == k(1)
    assert lru.victim(always) == k(1), "victim must not remove the key"
    lru.remove(k(1))
    assert lru.victim(always) == k(2)
    lru.insert(k(2))  # re-insert of a resident key is a hit
    assert lru.victim(always) == k(3)
    assert len(lru) == 3 and k(1) not in lru and k(0) in lru


def test_lru_touch_and_remove_of_absent_keys_are_noops() -> None:
    lru = LRUPolicy()
    lru.insert(k(1))
    lru.touch(k(9))
    lru.remove(k(9))
    assert lru_order(lru) == [k(1)]
    assert k(9) not in lru


def test_lru_victim_skips_pinned_keys_and_returns_none_when_all_pinned() -> None:
    lru = LRUPolicy()
    for i in range(5):
        lru.insert(k(i))
    pinned = {k(0), k(1), k(2)}
    asked: list[bytes] = []

    def can_evict(key: bytes) -> bool:
        asked.append(key)
        return key not in pinned

    assert lru.victim(can_evict) == k(3)
    assert asked == [k(0), k(1), k(2), k(3)], "must walk from the cold end and stop early"
    assert lru.victim(lambda key: False) is None
    assert LRUPolicy().victim(always) is None


def test_lru_clear() -> None:
    lru = LRUPolicy()
    lru.insert(k(1))
    lru.clear()
    assert len(lru) == 0 and lru.victim(always) is None


# ---------------------------------------------------------------------------- ARC


def test_arc_new_keys_go_to_t1_and_hits_promote_to_t2() -> None:
    arc = ARCPolicy(4)
    arc.insert(k(1))
    arc.insert(k(2))
    assert arc.where(k(1)) == "t1"
    arc.touch(k(1))
    assert arc.where(k(1)) == "t2"
    arc.insert(k(2))  # re-insert of a resident key is a hit too
    assert arc.where(k(2)) == "t2"
    assert arc_lists(arc)["t2"] == [k(1), k(2)]
    arc.touch(k(1))
    assert arc_lists(arc)["t2"] == [k(2), k(1)]
    assert len(arc) == 2 and k(1) in arc and k(3) not in arc


def test_arc_survives_a_scan_that_flushes_lru() -> None:
    capacity = 4
    hot = k(1000)
    # The hot key is used twice, then a one-time scan of many keys goes by, then the hot key
    # is used again (interleaved with more scan keys).
    accesses = [hot, hot] + [k(i) for i in range(50)] + [hot]
    accesses += [k(i) for i in range(50, 100)] + [hot]

    lru = LRUPolicy()
    arc = ARCPolicy(capacity)
    lru_hits = run_cache(lru, capacity, accesses)
    arc_hits = run_cache(arc, capacity, accesses)

    assert lru_hits == 1, "under LRU the scan evicts the hot key"
    assert arc_hits == 3, "under ARC the hot key (in T2) survives the scan"
    assert arc.where(hot) == "t2"


def test_arc_victim_prefers_t1_when_it_exceeds_target() -> None:
    arc = ARCPolicy(4)
    arc.insert(k(1))
    arc.touch(k(1))  # t2 = [1]
    arc.insert(k(2))
    arc.insert(k(3))  # t1 = [2, 3], p = 0
    assert arc.victim(always) == k(2)


def test_arc_victim_takes_t2_when_t1_is_within_target() -> None:
    arc = ARCPolicy(2)
    arc.insert(k(1))
    arc.insert(k(2))
    arc.remove(k(1))  # evicted from T1: remembered in B1
    arc.insert(k(1))  # B1 ghost hit: p grows to 1, key 1 goes to T2
    assert arc.p == 1
    assert arc_lists(arc)["t1"] == [k(2)] and arc_lists(arc)["t2"] == [k(1)]
    # |T1| == 1 is not > p == 1, so REPLACE takes T2's coldest key.
    assert arc.victim(always) == k(1)


def test_arc_b1_ghost_hit_goes_to_t2_and_grows_p() -> None:
    arc = ARCPolicy(2)
    arc.insert(k(1))
    arc.insert(k(2))
    victim = arc.victim(always)
    assert victim == k(1)
    arc.remove(victim)
    assert arc.where(k(1)) == "b1"
    assert k(1) not in arc and len(arc) == 1
    assert arc.p == 0
    arc.insert(k(1))
    assert arc.where(k(1)) == "t2"
    assert arc.p == 1
    assert arc_lists(arc)["b1"] == []


def test_arc_b2_ghost_hit_goes_to_t2_and_shrinks_p() -> None:
    arc = ARCPolicy(2)
    # Grow p to 1 with a B1 ghost hit first, so that shrinking is visible.
    arc.insert(k(1))
    arc.insert(k(2))
    arc.remove(k(1))
    arc.insert(k(1))
    assert arc.p == 1 and arc.where(k(1)) == "t2"
    # Evict key 1 from T2: it is remembered in B2.
    arc.remove(k(1))
    assert arc.where(k(1)) == "b2"
    arc.insert(k(1))
    assert arc.where(k(1)) == "t2"
    assert arc.p == 0


def test_arc_removal_that_is_not_an_eviction_leaves_no_ghost() -> None:
    arc = ARCPolicy(2)
    arc.insert(k(1))
    arc.remove(k(1), evicted=False)
    assert arc.where(k(1)) is None
    arc.insert(k(1))
    assert arc.where(k(1)) == "t1" and arc.p == 0


def test_arc_ghost_lists_stay_bounded_by_capacity() -> None:
    capacity = 3
    arc = ARCPolicy(capacity)
    # Churn through many keys, evicting as a cache would, with some re-use to fill B2 too.
    accesses = []
    for i in range(200):
        accesses.append(k(i))
        accesses.append(k(i // 3))
    run_cache(arc, capacity, accesses)
    lists = arc_lists(arc)
    assert len(lists["t1"]) + len(lists["b1"]) <= capacity
    assert sum(len(v) for v in lists.values()) <= 2 * capacity
    assert len(lists["b1"]) + len(lists["b2"]) > 0
    assert 0 <= arc.p <= capacity
    # Lists are disjoint.
    seen = [key for v in lists.values() for key in v]
    assert len(seen) == len(set(seen))


def test_arc_zero_capacity_keeps_no_ghosts() -> None:
    arc = ARCPolicy(0)
    arc.insert(k(1))
    arc.remove(k(1))
    assert arc.where(k(1)) is None


def test_arc_victim_falls_back_to_other_list_when_preferred_is_pinned() -> None:
    arc = ARCPolicy(4)
    arc.insert(k(1))
    arc.touch(k(1))  # t2 = [1]
    arc.insert(k(2))
    arc.insert(k(3))  # t1 = [2, 3]; T1 preferred since |T1| > p = 0
    assert arc.victim(lambda key: key == k(1)) == k(1)
    assert arc.victim(lambda key: key != k(2)) == k(3)
    assert arc.victim(lambda key: False) is None


def test_arc_clear_forgets_ghosts_and_target() -> None:
    arc = ARCPolicy(2)
    arc.insert(k(1))
    arc.insert(k(2))
    arc.remove(k(1))
    arc.insert(k(1))
    assert arc.p == 1
    arc.clear()
    assert arc.p == 0 and len(arc) == 0
    assert all(v == [] for v in arc_lists(arc).values())


def test_arc_negative_capacity_is_rejected() -> None:
    with pytest.raises(ValueError):
        ARCPolicy(-1)


# ---------------------------------------------------------------------------- make_policy


@pytest.mark.parametrize(
    ("name", "cls"), [("lru", LRUPolicy), ("arc", ARCPolicy), ("ARC", ARCPolicy)]
)
def test_make_policy_builds_by_name(name: str, cls: type) -> None:
    policy = make_policy(name, 8)
    assert isinstance(policy, cls)
    assert policy.capacity == 8  # type: ignore[attr-defined]


def test_make_policy_rejects_unknown_names_naming_them() -> None:
    with pytest.raises(ValueError, match="'fifo'"):
        make_policy("fifo", 8)
    with pytest.raises(ValueError, match="lru"):
        make_policy("", 8)
