"""The placer on its own (stores, tails, spills, one copy per tier), on a real host index, disk
tier and job ledger: the jobs it plans and what each completion does to the tiers."""

from __future__ import annotations

from typing import NamedTuple

import pytest
from test_planner import BLOCK, CHUNK_BLOCKS, CHUNK_TOKENS, keys_for
from test_remote_tier import Store, remote_tier

from tieredkv.config import TieredKVConfig
from tieredkv.metrics.specs import Count, Counts
from tieredkv.protocol import FailureCause, JobResult, Move, StepPlan
from tieredkv.scheduler.ledger import HitEpoch, JobLedger, PlannerParts, RequestTable
from tieredkv.scheduler.lower_tier import DiskTier
from tieredkv.scheduler.placement import Placer
from tieredkv.scheduler.remote_tier import RemoteTier
from tieredkv.scheduler.tier_index import SlotState, TierIndex


class Rig(NamedTuple):
    placer: Placer
    host: TierIndex
    disk: DiskTier | None
    requests: RequestTable
    ledger: JobLedger
    counters: Counts


def rig(host_slots: int = 8, disk_slots: int = 0, admission: int = 1,
        remote: RemoteTier | None = None) -> Rig:
    requests = RequestTable()
    ledger = JobLedger(1, requests)
    host = TierIndex("host", host_slots)
    disk = (DiskTier(disk_slots, policy="lru", admission=admission, seen_limit=64)
            if disk_slots else None)
    counters = Counts()
    parts = PlannerParts(
        config=TieredKVConfig.from_dict({"chunk_blocks": CHUNK_BLOCKS}), block_size=BLOCK,
        host=host, lower=disk, requests=requests, ledger=ledger, epoch=HitEpoch(),
        counters=counters, remote=remote,
    )
    placer = Placer(parts)

    def not_planned_here(job, outcome):
        pytest.fail(f"the placer planned a {job.move} job")

    ledger.set_handlers({
        **{kind: not_planned_here for kind in Move},
        Move.STORE: placer.complete_store,
        Move.SPILL: placer.complete_spill,
        Move.REMOTE_WRITE: placer.complete_remote_write,
    })
    return Rig(placer, host, disk, requests, ledger, counters)


def prompt(n_tokens: int, start: int = 0) -> list[int]:
    return list(range(start, start + n_tokens))


def computed(r: Rig, req: str, tokens: list[int], tail: bool = False) -> StepPlan:
    """``req`` computed ``tokens`` on device blocks 100, 101, ...: this step's plan."""
    r.requests.ensure(req).block_ids = list(range(100, 100 + len(tokens) // BLOCK))
    r.placer.plan_stores(req, keys_for(tokens), len(tokens), tail=tail)
    return take(r)


def take(r: Rig) -> StepPlan:
    r.placer.plan_spills()
    r.placer.plan_remote_writes()
    return r.ledger.take_plan()


def report(r: Rig, plan: StepPlan, failure: str | None = None) -> None:
    jobs = [*plan.of(Move.STORE), *plan.of(Move.SPILL), *plan.of(Move.REMOTE_WRITE)]
    r.ledger.apply([JobResult.fail(j.job_id, failure) if failure else JobResult.done(j.job_id)
                    for j in jobs])


def test_whole_chunks_become_store_jobs_of_their_device_blocks_once():
    r = rig()
    tokens = prompt(2 * CHUNK_TOKENS + 5)
    keys = keys_for(tokens)
    plan = computed(r, "a", tokens)
    assert [job.block_ids for job in plan.of(Move.STORE)] == [(100, 101, 102, 103), (104, 105, 106, 107)]
    assert [job.key for job in plan.of(Move.STORE)] == [keys[0], keys[1]]
    assert [job.host_slot for job in plan.of(Move.STORE)] == [r.host.get(k).slot for k in (keys[0], keys[1])]  # type: ignore[union-attr]
    assert len({job.host_slot for job in plan.of(Move.STORE)}) == 2
    assert all(r.host.get(k).state is SlotState.WRITING for k in (keys[0], keys[1]))  # type: ignore[union-attr]
    r.placer.plan_stores("a", keys, len(tokens))  # the next step: nothing new to store
    assert take(r).of(Move.STORE) == []
    report(r, plan)
    assert r.host.is_ready(keys[0]) and r.host.is_ready(keys[1])
    assert r.counters["stored_chunks"] == 2 and r.host.pinned_count == 0


def test_only_chunks_both_computed_and_on_device_blocks_are_stored():
    r = rig()
    tokens = prompt(3 * CHUNK_TOKENS)
    r.requests.ensure("a").block_ids = list(range(100, 100 + 2 * CHUNK_BLOCKS))  # two chunks' blocks
    r.placer.plan_stores("a", keys_for(tokens), CHUNK_TOKENS + BLOCK)  # one chunk computed
    assert len(take(r).of(Move.STORE)) == 1
    r.placer.plan_stores("a", keys_for(tokens), len(tokens))  # all computed, two on device
    assert [job.block_ids[0] for job in take(r).of(Move.STORE)] == [100 + CHUNK_BLOCKS]


def test_a_chunk_held_already_is_touched_not_stored_again():
    r = rig(host_slots=2)
    a, b, d = prompt(CHUNK_TOKENS), prompt(CHUNK_TOKENS, 1000), prompt(CHUNK_TOKENS, 2000)
    report(r, computed(r, "a", a))
    report(r, computed(r, "b", b))
    assert computed(r, "c", a).of(Move.STORE) == []  # a's chunk again: hot, the least recent is now b's
    report(r, computed(r, "d", d))
    assert keys_for(a)[0] in r.host and keys_for(b)[0] not in r.host
    assert r.counters["evictions", "host"] == 1


def test_a_chunk_the_lower_tier_holds_is_not_stored_in_host():
    r = rig(disk_slots=4)
    assert r.disk is not None
    tokens = prompt(CHUNK_TOKENS)
    key = keys_for(tokens)[0]
    r.disk.allocate(key, ())
    r.disk.mark_ready(key)
    assert computed(r, "a", tokens).of(Move.STORE) == []
    assert key not in r.host


def test_a_prompts_tail_is_stored_as_an_entry_holding_its_full_blocks():
    r = rig()
    tokens = prompt(CHUNK_TOKENS + 2 * BLOCK + 3)
    keys = keys_for(tokens)
    assert len(computed(r, "a", tokens).of(Move.STORE)) == 1  # without tail: the whole chunk only
    r.placer.plan_stores("a", keys, len(tokens), tail=True)
    plan = take(r)
    (tail,) = plan.of(Move.STORE)
    assert tail.block_ids == (104, 105) and tail.key == keys.block_key(CHUNK_BLOCKS + 1)
    placement = r.host.get(tail.key)
    assert placement is not None and placement.blocks == 2
    assert placement.aliases == (keys.block_key(CHUNK_BLOCKS),)
    assert r.counters["stored_partial_chunks"] == 1


def test_a_longer_tail_supersedes_the_shorter_and_a_shorter_one_is_not_stored():
    r = rig()
    short, longer = prompt(CHUNK_TOKENS + 2 * BLOCK), prompt(CHUNK_TOKENS + 3 * BLOCK)
    report(r, computed(r, "a", short, tail=True))
    short_key = keys_for(short).block_key(CHUNK_BLOCKS + 1)
    assert r.host.is_ready(short_key)
    plan = computed(r, "b", longer, tail=True)
    (tail,) = plan.of(Move.STORE)  # the whole chunk is held already
    assert tail.block_ids == (104, 105, 106)
    report(r, plan)
    assert short_key not in r.host and r.host.holders(short_key) == [tail.key]
    assert r.counters["superseded", "host"] == 1
    assert computed(r, "c", short, tail=True).of(Move.STORE) == []  # held by the longer entry


def test_a_store_with_no_host_slot_free_is_skipped_and_counted():
    r = rig(host_slots=1)
    plan = computed(r, "a", prompt(2 * CHUNK_TOKENS))  # the first chunk's slot is still written
    assert len(plan.of(Move.STORE)) == 1 and r.counters["store_skipped_host_full"] == 1


def test_a_failed_store_drops_its_entry_and_never_spills():
    r = rig(disk_slots=4)
    tokens = prompt(CHUNK_TOKENS)
    report(r, computed(r, "a", tokens), failure="io_error")
    assert keys_for(tokens)[0] not in r.host and r.host.free_slots == 8
    assert r.counters["store_failed", "io_error"] == 1
    assert not r.placer.spills_queued and take(r).of(Move.SPILL) == []


def test_a_stored_chunk_is_spilled_with_its_host_copy_pinned_until_written():
    r = rig(disk_slots=4)
    assert r.disk is not None
    tokens = prompt(CHUNK_TOKENS + 2 * BLOCK)
    report(r, computed(r, "a", tokens, tail=True))
    assert r.placer.spills_queued
    plan = take(r)
    assert len(plan.of(Move.SPILL)) == 2
    for spill in plan.of(Move.SPILL):
        assert spill.host_slot == r.host.get(spill.key).slot  # type: ignore[union-attr]
        assert r.host.get(spill.key).pins == 1 and not r.disk.is_ready(spill.key)  # type: ignore[union-attr]
    tail_spill = next(s for s in plan.of(Move.SPILL) if s.key != keys_for(tokens)[0])
    assert tail_spill.dst.aliases == r.host.get(tail_spill.key).aliases != ()  # type: ignore[union-attr]
    report(r, plan)
    assert all(r.disk.is_ready(s.key) and r.host.get(s.key).pins == 0 for s in plan.of(Move.SPILL))  # type: ignore[union-attr]
    assert r.counters["spilled_chunks"] == 2 and take(r).of(Move.SPILL) == []


def test_disk_admission_waits_for_enough_sightings():
    r = rig(disk_slots=4, admission=2)
    tokens = prompt(CHUNK_TOKENS)
    report(r, computed(r, "a", tokens))
    assert r.counters["disk_admission_rejected"] == 1 and take(r).of(Move.SPILL) == []
    plan = computed(r, "b", tokens)  # another request finds it stored: its second sighting
    assert plan.of(Move.STORE) == [] and [s.key for s in plan.of(Move.SPILL)] == [keys_for(tokens)[0]]


def test_a_failed_spill_frees_the_disk_slot_and_unpins_the_host_copy():
    r = rig(disk_slots=4)
    assert r.disk is not None
    tokens = prompt(CHUNK_TOKENS)
    key = keys_for(tokens)[0]
    report(r, computed(r, "a", tokens))
    report(r, take(r), failure="no_space")
    assert key not in r.disk and r.disk.free_slots == 4
    assert r.host.is_ready(key) and r.host.get(key).pins == 0  # type: ignore[union-attr]
    assert r.counters["spill_failed", "no_space"] == 1


def test_a_spill_with_no_disk_slot_free_is_skipped_and_counted():
    r = rig(disk_slots=1)
    report(r, computed(r, "a", prompt(2 * CHUNK_TOKENS)))
    plan = take(r)  # the first spill's slot is still being written: nothing to evict
    assert len(plan.of(Move.SPILL)) == 1 and r.counters["spill_skipped_disk_full"] == 1


def test_finish_tail_stores_the_tail_unless_a_load_still_writes_the_blocks():
    r = rig()
    tokens = prompt(CHUNK_TOKENS + BLOCK)
    report(r, computed(r, "a", tokens))
    state = r.requests.get("a")
    assert state is not None
    state.load_job = 99
    r.placer.finish_tail("a", keys_for(tokens), len(tokens))
    assert take(r).of(Move.STORE) == []
    state.load_job = None
    r.placer.finish_tail("a", keys_for(tokens), len(tokens))
    (tail,) = take(r).of(Move.STORE)
    assert tail.block_ids == (104,)
    r.placer.finish_tail("gone", keys_for(tokens), len(tokens))  # unknown request: nothing
    assert take(r).of(Move.STORE) == []


def test_clearing_the_queue_drops_the_spills_not_yet_planned():
    r = rig(disk_slots=4)
    report(r, computed(r, "a", prompt(CHUNK_TOKENS)))
    assert r.placer.spills_queued
    r.placer.clear_spill_queue()
    assert not r.placer.spills_queued and take(r).of(Move.SPILL) == []


def test_a_chunk_and_a_tail_are_written_to_the_remote_tier_once_each_with_their_own_rows():
    tier = remote_tier(Store())
    r = rig(remote=tier)
    tokens = prompt(CHUNK_TOKENS + 2 * BLOCK)
    keys = keys_for(tokens)
    key, tail = keys[0], keys.block_key(CHUNK_BLOCKS + 1)
    report(r, computed(r, "a", tokens, tail=True))
    plan = take(r)
    writes = {w.key: w for w in plan.of(Move.REMOTE_WRITE)}
    assert set(writes) == {key, tail}
    for k, rows in ((key, CHUNK_BLOCKS), (tail, 2)):  # a tail names only its own rows
        w = writes[k]
        assert (w.host_slot, w.dst.rows, w.dst.holes) == (r.host.get(k).slot, rows, ())  # type: ignore[union-attr]
        assert r.host.get(k).pins == 1 and tier.holds_hint(k)  # type: ignore[union-attr]
    report(r, plan)
    assert r.host.get(key).pins == 0 and r.counters[Count.REMOTE_WRITTEN_CHUNKS] == 2  # type: ignore[union-attr]
    assert computed(r, "b", tokens).of(Move.REMOTE_WRITE) == []  # seen again: known there


def test_remote_writes_wait_for_admission():
    r = rig(remote=remote_tier(Store(), admission=2))
    tokens = prompt(CHUNK_TOKENS)
    report(r, computed(r, "a", tokens))
    assert r.counters[Count.REMOTE_ADMISSION_REJECTED] == 1 and take(r).of(Move.REMOTE_WRITE) == []
    assert [w.key for w in computed(r, "b", tokens).of(Move.REMOTE_WRITE)] == [keys_for(tokens)[0]]


@pytest.mark.parametrize(("cause", "count"), [(FailureCause.DROPPED, Count.REMOTE_WRITES_DROPPED),
                                              (FailureCause.IO_ERROR, Count.REMOTE_WRITE_FAILED)])
def test_a_failed_remote_write_unpins_the_host_copy_and_may_be_written_again(cause, count):
    tier = remote_tier(Store(), admission=1)
    r = rig(remote=tier)
    tokens = prompt(CHUNK_TOKENS)
    key = keys_for(tokens)[0]
    report(r, computed(r, "a", tokens))
    report(r, take(r), failure=cause)
    assert r.host.get(key).pins == 0 and not tier.holds_hint(key)  # type: ignore[union-attr]
    assert r.counters[count] == 1 and r.counters[Count.REMOTE_WRITTEN_CHUNKS] == 0
    assert [w.key for w in computed(r, "b", tokens).of(Move.REMOTE_WRITE)] == [key]
