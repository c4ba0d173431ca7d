"""The disk tier on its own: its index journaled by a real catalog (what a restart finds),
admission by sightings, the fill hooks a promotion uses, and its gauges."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from test_planner import FP, keys_for

from tieredkv.disk import aliases_kept
from tieredkv.disk.catalog import DiskCatalog
from tieredkv.disk.format import MAX_HEADER_ALIASES
from tieredkv.disk.slab import SlabFile
from tieredkv.metrics.specs import Count
from tieredkv.protocol import Job, Move, StepPlan, Tier
from tieredkv.scheduler.lower_tier import DiskTier, LowerTier
from tieredkv.scheduler.tier_index import TierIndex

PAYLOAD, SLOTS = 8192, 4
KEYS = keys_for(list(range(2048)))  # 32 blocks, 8 chunks of 4
A, B, C = KEYS[0], KEYS[1], KEYS[2]


def tier(slots: int = SLOTS, admission: int = 1, catalog: DiskCatalog | None = None) -> DiskTier:
    return DiskTier(slots, policy="lru", admission=admission, seen_limit=64, catalog=catalog)


@contextmanager
def opened(path: Path) -> Iterator[tuple[DiskTier, DiskCatalog, SlabFile]]:
    """The disk tier of one engine run on ``path`` (what it recovered, its catalog, its slab)."""
    with DiskCatalog.open(path, FP, PAYLOAD, SLOTS, 1) as catalog:
        with SlabFile.open(catalog.slab_path(0), SLOTS, PAYLOAD, FP) as slab:
            yield tier(catalog=catalog), catalog, slab
        catalog.flush()


def spill(disk: DiskTier, slab: SlabFile, key: bytes, aliases: tuple[bytes, ...] = ()) -> int:
    """Be the planner and the worker for one spill: slot, bytes with header, READY, recorded."""
    allocation = disk.allocate(key, aliases)
    assert allocation is not None
    slot = allocation[0]
    slab.write_slot(slot, key, memoryview(bytes([slot + 1]) * PAYLOAD), aliases=disk.kept_aliases(aliases))
    assert disk.mark_ready(key)
    disk.record_written(key)
    return slot


def test_the_disk_tier_is_its_own_index_and_a_lower_tier():
    disk = tier()
    assert isinstance(disk, TierIndex) and isinstance(disk, LowerTier)
    assert (disk.name, disk.fill_move, disk.fill_counter) == (Tier.DISK, Move.PROMOTE,
                                                              Count.PROMOTED_CHUNKS)


def test_what_was_recorded_written_is_found_again_after_a_restart_by_any_of_its_blocks(tmp_path):
    aliases = KEYS.block_keys(4, 6)  # a tail of chunk 1: blocks 4..6, found by any of them
    tail = KEYS.block_key(7)
    with opened(tmp_path) as (disk, _, slab):
        slot_a = spill(disk, slab, A)
        slot_t = spill(disk, slab, tail, aliases)
        not_recorded = disk.allocate(C, ())  # still being written when the engine stopped
        assert not_recorded is not None
    with opened(tmp_path) as (disk, _, _):
        assert disk.is_ready(A) and disk.get(A).slot == slot_a  # type: ignore[union-attr]
        assert disk.get(tail).slot == slot_t and disk.get(tail).aliases == aliases  # type: ignore[union-attr]
        assert all(disk.holders(alias) == [tail] for alias in aliases)
        assert C not in disk and len(disk) == 2


def test_removals_evictions_and_a_reset_are_recorded_too(tmp_path):
    with opened(tmp_path) as (disk, _, slab):
        for key in (A, B, C, KEYS[3]):
            spill(disk, slab, key)
        disk.remove(B)
        assert disk.allocate(KEYS[4], ()) == (disk.get(KEYS[4]).slot, [])  # type: ignore[union-attr]
        disk.mark_ready(KEYS[4])  # never recorded written
        evicted = disk.allocate(KEYS[5], ())  # the disk is full: the least recent (A) goes
        assert evicted is not None and [k for k, _ in evicted[1]] == [A]
        disk.abort(KEYS[5])
    with opened(tmp_path) as (disk, _, _):
        assert set(disk) == {C, KEYS[3]}
        assert [key for key, _ in disk.clear()] and len(disk) == 0
    with opened(tmp_path) as (disk, catalog, _):
        assert not catalog.recovered and len(disk) == 0


def test_an_entry_never_recorded_leaves_no_record_when_removed(tmp_path):
    with opened(tmp_path) as (disk, _, slab):
        spill(disk, slab, A)
        allocation = disk.allocate(B, ())
        assert allocation is not None
        disk.mark_ready(B)
        disk.remove(B, recorded=False)  # superseded before it was recorded: nothing to undo
    with opened(tmp_path) as (disk, catalog, _):
        assert set(catalog.recovered) == {A} and set(disk) == {A}


def test_a_promotion_pins_its_entry_and_a_failed_one_drops_it_for_good(tmp_path):
    with opened(tmp_path) as (disk, _, slab):
        slot_a, slot_b = spill(disk, slab, A), spill(disk, slab, B)
        plan = StepPlan()
        disk.plan_fill(plan, 7, A, 3, "r")
        disk.plan_fill(plan, 8, B, 2, "r")
        assert plan.of(Move.PROMOTE) == [Job.promote(7, A, slot_a, 3, req_id="r"),
                                 Job.promote(8, B, slot_b, 2, req_id="r")]
        assert disk.get(A).pins == 1 and disk.fill_aliases(A) == ()  # type: ignore[union-attr]
        assert disk.allocate(C, ()) is not None and disk.allocate(KEYS[3], ()) is not None
        assert disk.allocate(KEYS[4], ()) is None  # pinned by their reads: nothing to evict
        disk.fill_done(A, ok=True)
        disk.fill_done(B, ok=False)  # bad bytes on disk: never promised again
        assert disk.is_ready(A) and disk.get(A).pins == 0  # type: ignore[union-attr]
        assert B not in disk
    with opened(tmp_path) as (disk, _, _):
        assert A in disk and B not in disk  # the failed entry's removal was recorded


def test_a_disk_entry_keeps_the_aliases_one_slot_header_lists():
    disk = tier()
    few = tuple(bytes([i]) * 32 for i in range(3))
    many = tuple(bytes([i]) * 32 for i in range(MAX_HEADER_ALIASES + 1))
    assert disk.kept_aliases(few) == aliases_kept(few) == few
    assert disk.kept_aliases(many) == ()  # past one header page only the key survives
    allocation = disk.allocate(A, few)
    assert allocation is not None and disk.fill_aliases(A) == few


def test_admission_counts_sightings_and_a_reset_forgets_them():
    disk = tier(admission=2)
    assert not disk.note_seen(A) and not disk.admits(A)
    assert disk.note_seen(A) and disk.admits(A)
    disk.clear()
    assert not disk.admits(A)


def test_gauges_say_capacity_and_use():
    disk = tier(slots=3)
    assert disk.gauges() == {"disk_slots_capacity": 3, "disk_slots_used": 0, "disk_entries": 0}
    disk.allocate(A, ())
    disk.allocate(B, ())
    disk.mark_ready(A)
    assert disk.gauges() == {"disk_slots_capacity": 3, "disk_slots_used": 2, "disk_entries": 2}


def test_a_hybrid_models_shorter_entry_beside_a_longer_one_survives_a_restart(tmp_path):
    """Hybrid models keep a prompt's shorter entry beside a longer one of its chunk (it holds
    the sliding window before its own end): recovery must not drop it as superseded."""
    longer, shorter = KEYS.block_key(6), KEYS.block_key(5)  # 3 and 2 blocks of chunk 1
    with opened(tmp_path) as (disk, _, slab):
        spill(disk, slab, longer, KEYS.block_keys(4, 6))
        spill(disk, slab, shorter, KEYS.block_keys(4, 5))
    for supersedes, kept in ((False, {longer, shorter}), (True, {longer})):
        with DiskCatalog.open(tmp_path, FP, PAYLOAD, SLOTS, 1) as catalog:
            disk = DiskTier(SLOTS, policy="lru", admission=1, seen_limit=64, catalog=catalog,
                            supersedes=supersedes)
            assert {key for key in (longer, shorter) if key in disk} == kept
            if not supersedes:
                assert disk.get(shorter).blocks == 2 and disk.get(longer).blocks == 3
