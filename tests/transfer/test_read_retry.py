"""A transient disk read failure is retried once; a wrong byte or a second failure is not.

Faults come from the slab's FaultyFileIO (real files, real reads). The scheduler's planner is
driven with the engine's real results, so a failure that survives the retry is seen to drop
the disk entry, and a recovered one to promise the chunk.
"""

from __future__ import annotations

import threading

import pytest
import torch
from transfer_helpers import CHUNK_BLOCKS, make_key, results_by_id

from tieredkv.config import TieredKVConfig
from tieredkv.disk.format import HEADER_BYTES
from tieredkv.keys import chunk_keys
from tieredkv.protocol import Job, Move
from tieredkv.scheduler.planner import Planner
from tieredkv.testing.hashing import sha256_block_hashes

pytestmark = pytest.mark.timeout(60)

BLOCK = 16
CHUNK_TOKENS = BLOCK * CHUNK_BLOCKS
FP = b"r" * 32
PROMPT = list(range(CHUNK_TOKENS + 1))  # one chunk


def keys_for(tokens: list[int]) -> list[bytes]:
    return chunk_keys(FP, sha256_block_hashes(tokens, BLOCK, None), CHUNK_BLOCKS)


def run(engine, planner: Planner, plan) -> dict:
    """Execute a step's jobs on the engine and give the planner their real outcomes."""
    jobs = [*plan.of(Move.STORE), *plan.of(Move.SPILL), *plan.of(Move.PROMOTE), *plan.of(Move.LOAD)]
    engine.submit(jobs)
    results = results_by_id(engine, len(jobs))
    planner.apply(results.values())
    return results


def spilled_prompt(engine, host) -> tuple[Planner, torch.Tensor]:
    """A planner whose only copy of PROMPT's chunk is on disk; the chunk's stored bytes."""
    planner = Planner(TieredKVConfig.from_dict({"chunk_blocks": CHUNK_BLOCKS}),
                      block_size=BLOCK, num_host_slots=2, num_disk_slots=8)
    planner.set_block_ids("a", list(range(0, 5)), replace=True)
    planner.plan_stores("a", keys_for(PROMPT), len(PROMPT))
    plan = planner.take_plan()
    (store,) = plan.of(Move.STORE)
    run(engine, planner, plan)
    stored = host.slot(store.host_slot).clone()
    spills = planner.take_plan()
    assert len(spills.of(Move.SPILL)) == 1
    run(engine, planner, spills)
    other = [t + 10_000 for t in range(2 * CHUNK_TOKENS + 1)]  # takes over both host slots
    planner.set_block_ids("b", list(range(10, 19)), replace=True)
    planner.plan_stores("b", keys_for(other), len(other))
    run(engine, planner, planner.take_plan())
    assert not planner.host.is_ready(keys_for(PROMPT)[0])
    assert keys_for(PROMPT)[0] in planner.disk
    return planner, stored


def promote(engine, planner: Planner):
    assert planner.lookup("c", keys_for(PROMPT), 0, len(PROMPT)) is None  # promoting first
    plan = planner.take_plan()
    (job,) = plan.of(Move.PROMOTE)
    return job, plan


def reads_at(fio, offset: int) -> int:
    return sum(1 for start, _, _ in fio.reads if start == offset)


# ---------------------------------------------------------------------------- promotions


@pytest.mark.parametrize("fault", ["io_error", "short_read"])
def test_one_transient_failure_is_read_again_and_the_promotion_succeeds(
    host, slab, fio, make_engine, fault
) -> None:
    engine = make_engine()
    planner, stored = spilled_prompt(engine, host)
    job, plan = promote(engine, planner)
    at = slab.slot_offset(job.src.slot)
    if fault == "io_error":
        fio.fail_reads(at=at, times=1)  # EIO
    else:
        fio.short_reads(4096, at=at, times=1)
    engine.take_stats()
    before = reads_at(fio, at)

    assert run(engine, planner, plan)[job.job_id].ok
    assert torch.equal(host.slot(job.host_slot), stored)  # verified, exact bytes
    assert reads_at(fio, at) - before == 2
    stats = engine.take_stats()
    assert stats["reads_retried"] == {fault: 1}
    assert stats["reads_recovered"] == 1
    assert stats["failures"] == {}
    # the scheduler kept the entry and promises it now
    assert planner.lookup("c", keys_for(PROMPT), 0, len(PROMPT)) == CHUNK_TOKENS
    assert planner.counters["promoted_chunks"] == 1


def test_two_failures_in_a_row_fail_the_promotion_and_drop_the_entry(host, slab, fio, make_engine) -> None:
    engine = make_engine()
    planner, _ = spilled_prompt(engine, host)
    job, plan = promote(engine, planner)
    at = slab.slot_offset(job.src.slot)
    fio.fail_reads(at=at, times=2)
    engine.take_stats()
    before = reads_at(fio, at)

    result = run(engine, planner, plan)[job.job_id]
    assert (result.ok, result.failure) == (False, "io_error")
    assert reads_at(fio, at) - before == 2  # retried once, not more
    stats = engine.take_stats()
    assert stats["reads_retried"] == {"io_error": 1}
    assert stats["reads_recovered"] == 0
    assert stats["failures"] == {"io_error": 1}
    # a plain miss, and the disk entry is gone
    assert planner.lookup("c", keys_for(PROMPT), 0, len(PROMPT)) == 0
    assert keys_for(PROMPT)[0] not in planner.disk
    assert planner.counters["disk_read_failed", "io_error"] == 1


@pytest.mark.parametrize("fault", ["checksum", "wrong_key"])
def test_a_wrong_byte_is_never_read_again(host, slab, fio, make_engine, fault) -> None:
    engine = make_engine()
    planner, _ = spilled_prompt(engine, host)
    job, plan = promote(engine, planner)
    at = slab.slot_offset(job.src.slot)
    if fault == "checksum":
        fio.flip_read_bit(HEADER_BYTES + 100, at=at, times=1)  # a payload byte: a second read would pass
    else:
        wrong = Job.promote(job.job_id, make_key(99), job.src.slot, job.host_slot)
        plan.jobs[plan.jobs.index(job)] = job = wrong
    engine.take_stats()
    before = reads_at(fio, at)

    result = run(engine, planner, plan)[job.job_id]
    assert (result.ok, result.failure) == (False, fault)
    assert reads_at(fio, at) - before == 1
    stats = engine.take_stats()
    assert stats["reads_retried"] == {}
    assert stats["failures"] == {fault: 1}
    if fault == "checksum":
        assert keys_for(PROMPT)[0] not in planner.disk
        assert planner.counters["disk_read_failed", "checksum"] == 1


def test_a_timed_out_read_is_read_again_once_its_stuck_call_returned(host, slab, fio, make_engine) -> None:
    engine = make_engine(load_timeout_s=0.5)
    planner, stored = spilled_prompt(engine, host)
    job, plan = promote(engine, planner)
    at = slab.slot_offset(job.src.slot)
    stuck = fio.hang("read", at=at, times=1)
    # the device comes back after the read timed out: the slot is free to read into again
    threading.Timer(0.75, stuck.set).start()
    engine.take_stats()

    assert run(engine, planner, plan)[job.job_id].ok
    assert torch.equal(host.slot(job.host_slot), stored)
    stats = engine.take_stats()
    assert stats["reads_retried"] == {"timeout": 1}
    assert stats["reads_recovered"] == 1 and stats["failures"] == {}


def test_retries_reach_the_reported_stats(host, slab, fio, make_engine) -> None:
    from tieredkv.vllm.stats import TieredKVStats  # imports vLLM

    engine = make_engine()
    planner, _ = spilled_prompt(engine, host)
    job, plan = promote(engine, planner)
    fio.fail_reads(at=slab.slot_offset(job.src.slot), times=2)
    engine.take_stats()
    run(engine, planner, plan)
    stats = TieredKVStats(data={"workers": {"0": engine.take_stats()}})
    assert not stats.is_empty()
    merged = TieredKVStats().aggregate(stats).aggregate(stats)
    assert merged.data["workers"]["0"]["reads_retried"] == {"io_error": 2}
    assert merged.reduce()["reads_retried"] == 2 and merged.reduce()["failures"] == 2
