"""The fill path on its own: chunks of a tier below host into host slots, one loop and one
completion for every tier (disk, and a tier without an index such as the remote one)."""

from __future__ import annotations

import pytest
from test_planner import BLOCK, CHUNK_BLOCKS, CHUNK_TOKENS, keys_for

from tieredkv.config import TieredKVConfig
from tieredkv.metrics.specs import Count, Counts
from tieredkv.protocol import Job, JobResult, Move, StepPlan, Tier
from tieredkv.scheduler.ledger import HitEpoch, JobLedger, PlannerParts, RequestTable
from tieredkv.scheduler.lower_tier import DiskTier, Fill, LowerTier
from tieredkv.scheduler.placement import Placer
from tieredkv.scheduler.tier_index import TierIndex

DISK_SLOT = 5


class SharedTier(LowerTier):
    """A tier with no index (as the remote one): what its hooks were called with."""

    name = Tier.REMOTE
    fill_move = Move.REMOTE_READ
    fill_counter = Count.REMOTE_READ_CHUNKS

    def __init__(self) -> None:
        self.done: list[tuple[bytes, bool]] = []

    def fill_aliases(self, key: bytes) -> None:
        return None

    def plan_fill(self, plan: StepPlan, job_id: int, key: bytes, host_slot: int,
                  req_id: str) -> None:
        plan.jobs.append(Job.remote_read(job_id, key, host_slot, req_id=req_id))

    def fill_done(self, key: bytes, ok: bool) -> None:
        self.done.append((key, ok))


class Rig:
    """A host index, a disk tier, a shared tier and a ledger whose fills complete through
    :meth:`Fill.complete`; chunk 0 of the prompt READY in host, chunk 1 READY on disk."""

    def __init__(self, host_slots: int = 8) -> None:
        self.keys = keys_for(list(range(4 * CHUNK_TOKENS)))
        self.chunk = [self.keys[i] for i in range(4)]
        self.host = TierIndex(Tier.HOST, host_slots)
        self.disk = DiskTier(8, policy="lru", admission=1, seen_limit=64)
        self.shared = SharedTier()
        self.requests = RequestTable()
        self.ledger = JobLedger(1, self.requests)
        self.counters = Counts()
        parts = PlannerParts(
            config=TieredKVConfig.from_dict({"chunk_blocks": CHUNK_BLOCKS}), block_size=BLOCK,
            host=self.host, lower=self.disk, requests=self.requests, ledger=self.ledger,
            epoch=HitEpoch(), counters=self.counters, remote=self.shared,  # type: ignore[arg-type]
        )
        self.fill = Fill(parts, Placer(parts))

        def not_a_fill(job, outcome):
            pytest.fail(f"a {job.move} job completed")

        self.ledger.set_handlers({**{kind: not_a_fill for kind in Move},
                                  Move.PROMOTE: self.fill.complete,
                                  Move.REMOTE_READ: self.fill.complete})
        self.host.allocate(self.chunk[0])
        self.host.mark_ready(self.chunk[0])
        self.disk_aliases = self.keys.block_keys(CHUNK_BLOCKS, 2 * CHUNK_BLOCKS - 1)
        self.disk.restore(self.chunk[1], DISK_SLOT, self.disk_aliases)

    def fill_run(self, req: str, run: list[bytes], lower: list[bytes], shared: list[bytes],
                 shared_pos: int) -> list[bytes]:
        return self.fill.fill_run(self.requests.ensure(req), run, lower, shared, shared_pos, 0,
                                  self.keys)


def test_disk_and_a_tier_without_index_fill_through_one_loop():
    r = Rig()
    c0, c1, c2 = r.chunk[:3]
    assert r.fill_run("a", [c0, c1, c2], [c1], [c2], 2) == [c0, c1, c2]
    plan = r.ledger.take_plan()
    (promote,) = plan.of(Move.PROMOTE)
    (read,) = plan.of(Move.REMOTE_READ)
    assert (promote.key, promote.src.slot, promote.host_slot) == (c1, DISK_SLOT,
                                                                   r.host.get(c1).slot)
    assert (read.key, read.host_slot) == (c2, r.host.get(c2).slot)
    # The disk entry is held for the read; each host entry knows its blocks: the disk entry's
    # aliases, and (a tier that keeps none) the request's own block keys of that chunk.
    assert r.disk.get(c1).pins == 1
    assert r.host.get(c1).aliases == r.disk_aliases
    assert r.host.get(c2).aliases == r.keys.block_keys(2 * CHUNK_BLOCKS, 3 * CHUNK_BLOCKS - 1)
    assert r.host.get(c0).pins == 0  # pinned only while the slots were taken
    state = r.requests.get("a")
    assert set(r.fill.in_flight) == {c1, c2} and state.promote_jobs == {promote.job_id,
                                                                         read.job_id}
    assert state.filled == {c1: Tier.DISK, c2: Tier.REMOTE}


def test_one_completion_serves_every_tier():
    r = Rig()
    c0, c1, c2 = r.chunk[:3]
    r.fill_run("a", [c0, c1, c2], [c1], [c2], 2)
    plan = r.ledger.take_plan()
    r.ledger.apply([JobResult.done(plan.of(Move.PROMOTE)[0].job_id),
                    JobResult.done(plan.of(Move.REMOTE_READ)[0].job_id)])
    assert r.host.is_ready(c1) and r.host.is_ready(c2)
    assert r.disk.get(c1).pins == 0 and r.disk.is_ready(c1)
    assert r.shared.done == [(c2, True)]
    assert r.counters[Count.PROMOTED_CHUNKS] == 1 and r.counters[Count.REMOTE_READ_CHUNKS] == 1
    assert not r.fill.in_flight and r.requests.get("a").promote_jobs == set()


def test_a_failed_fill_drops_the_host_entry_and_what_the_tier_held():
    r = Rig()
    c0, c1, c2 = r.chunk[:3]
    r.fill_run("a", [c0, c1, c2], [c1], [c2], 2)
    plan = r.ledger.take_plan()
    r.ledger.apply([JobResult.fail(plan.of(Move.PROMOTE)[0].job_id, "checksum"),
                    JobResult.fail(plan.of(Move.REMOTE_READ)[0].job_id, "missing")])
    assert c1 not in r.host and c2 not in r.host and not r.host.is_doomed(c1)
    assert c1 not in r.disk and not r.disk.is_doomed(c1)  # never promised again
    assert r.shared.done == [(c2, False)]
    assert r.counters[Count.DISK_READ_FAILED, "checksum"] == 1
    assert r.counters[Count.REMOTE_READ_FAILED, "missing"] == 1
    assert not r.fill.in_flight


def test_the_run_is_cut_where_a_chunk_gets_no_host_slot():
    r = Rig(host_slots=2)
    c0, c1, c2 = r.chunk[:3]
    r.disk.restore(c2, DISK_SLOT + 1)
    assert r.fill_run("a", [c0, c1, c2], [c1, c2], [], 3) == [c0, c1]
    assert [job.key for job in r.ledger.take_plan().of(Move.PROMOTE)] == [c1]
    assert r.host.is_ready(c0)  # the run's own resident chunk was not evicted for it
    assert r.counters[Count.PROMOTE_NO_HOST_SLOT] == 1
    assert r.requests.get("a").promote_rounds == 1


def test_a_chunk_another_request_is_filling_is_waited_for_not_filled_twice():
    r = Rig()
    c0, c1, c2 = r.chunk[:3]
    r.fill_run("a", [c0, c1], [c1], [], 2)
    r.ledger.take_plan()
    assert r.fill_run("b", [c0, c1, c2], [c1], [c2], 2) == [c0]
    plan = r.ledger.take_plan()
    assert not plan.of(Move.PROMOTE) and not plan.of(Move.REMOTE_READ)
    assert r.requests.get("b").promote_jobs == set()
    # The remote chunks come after a chunk that cannot be served now: none is read.
    assert c2 not in r.host
