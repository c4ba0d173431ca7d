"""TransferEngine on CPU with real tensors and real slab files: bytes, order, faults, shutdown."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from transfer_helpers import (
    CHUNK_BLOCKS,
    SlowBackend,
    assert_slot_holds,
    device_snapshot,
    drain,
    expected_slot,
    make_key,
    results_by_id,
)

from tests.helpers import HANG_S, finishes
from tieredkv.protocol import (
    FailureCause,
    Job,
    JobResult,
    LoadChunk,
)

C = CHUNK_BLOCKS


def _store_all(engine, kv, chunks: dict[int, tuple[int, ...]], first_id: int = 1) -> dict:
    """Store {host_slot: block ids}; returns the expected slot contents."""
    want = {slot: expected_slot(kv, C, ids) for slot, ids in chunks.items()}
    jobs = [Job.store(first_id + i, make_key(slot), slot, ids) for i, (slot, ids) in enumerate(chunks.items())]
    engine.submit(jobs)
    results = results_by_id(engine, len(jobs))
    assert all(r.ok for r in results.values()), results
    return want


def _device_blocks(kv, ids) -> list[list[torch.Tensor]]:
    return [[kv.rows[layer][b].clone() for b in ids] for layer in range(kv.num_layers)]


# ---------------------------------------------------------------------------- bytes


def test_every_job_type_moves_the_right_bytes(kv, host, make_engine) -> None:
    rng = random.Random(1)
    engine = make_engine()
    blocks = rng.sample(range(kv.num_blocks), 3 * C)
    chunks = {slot: tuple(blocks[i * C : (i + 1) * C]) for i, slot in enumerate((0, 5, 9))}
    want = _store_all(engine, kv, chunks)
    for slot, ids in chunks.items():
        assert_slot_holds(kv, host, slot, ids, snapshot=want[slot])

    # spill two chunks, wreck their host copies, promote them back into other slots
    engine.submit([Job.spill(10, make_key(0), 0, 3), Job.spill(11, make_key(5), 5, 7)])
    assert all(r.ok for r in results_by_id(engine, 2).values())
    host.slot(0).fill_(0xAA)
    host.slot(5).fill_(0x55)
    engine.submit([Job.promote(12, make_key(0), 3, 1), Job.promote(13, make_key(5), 7, 2)])
    assert all(r.ok for r in results_by_id(engine, 2).values())
    assert_slot_holds(kv, host, 1, chunks[0], snapshot=want[0])
    assert_slot_holds(kv, host, 2, chunks[5], snapshot=want[5])

    # load: chunk 9 from its host slot, chunk 0 from the slot it was promoted into
    free = [b for b in range(kv.num_blocks) if b not in blocks]
    rng.shuffle(free)
    target_a, target_b = tuple(free[:C]), tuple(free[C : 2 * C])
    untouched = [b for b in range(kv.num_blocks) if b not in target_a + target_b]
    before = _device_blocks(kv, untouched)
    engine.submit([Job.load(14, "req", (
        LoadChunk(make_key(9), 9, 0, target_a),
        LoadChunk(make_key(0), 1, 0, target_b),
    ))])
    assert results_by_id(engine, 1)[14] == JobResult.done(14)
    for layer in range(kv.num_layers):
        for j in range(C):
            assert torch.equal(kv.rows[layer][target_a[j]], want[9][(layer, j)])
            assert torch.equal(kv.rows[layer][target_b[j]], want[0][(layer, j)])
    after = _device_blocks(kv, untouched)
    assert all(torch.equal(a, b) for la, lb in zip(after, before, strict=True)
               for a, b in zip(la, lb, strict=True))
    stats = engine.take_stats()
    assert stats["ops"] == {"d2h": 3, "h2d": 2, "spill": 2, "restore": 2, "remote_read": 0,
                            "remote_write": 0}
    assert stats["bytes"]["d2h"] == 3 * host.payload_bytes
    assert stats["failures"] == {} and len(stats["latency_s"]["store"]) == 3
    again = engine.take_stats()
    assert again["ops"] == dict.fromkeys(again["ops"], 0) and again["latency_s"]["store"] == []


def test_without_a_remote_tier_remote_jobs_fail_unavailable_and_leave_their_slots_free(
        kv, host, make_engine) -> None:
    # No remote_url on this worker: the scheduler may still ship remote jobs (another rank
    # has the tier); each fails ``unavailable`` at once, and no slot stays taken by it.
    engine = make_engine()
    engine.submit([Job.remote_read(1, make_key(1), 2), Job.remote_write(2, make_key(3), 3)])
    assert results_by_id(engine, 2) == {1: JobResult.fail(1, FailureCause.UNAVAILABLE),
                                        2: JobResult.fail(2, FailureCause.UNAVAILABLE)}
    want = _store_all(engine, kv, {2: (0, 1, 2, 3), 3: (4, 5, 6, 7)}, first_id=3)
    assert_slot_holds(kv, host, 2, (0, 1, 2, 3), snapshot=want[2])
    stats = engine.take_stats()
    assert stats["remote_writes_failed"] == 0
    assert "remote_write_queue" not in stats["queue_depths"]
    assert stats["ops"]["remote_read"] == stats["ops"]["remote_write"] == 0


def test_mid_chunk_load_copies_only_the_tail(kv, host, make_engine) -> None:
    engine = make_engine()
    ids = (3, 17, 8, 30)
    want = _store_all(engine, kv, {4: ids})
    engine.submit([Job.spill(2, make_key(4), 4, 0)])
    assert results_by_id(engine, 1)[2].ok
    engine.submit([Job.promote(5, make_key(4), 0, 6)])
    assert results_by_id(engine, 1)[5].ok
    targets_host, targets_promoted = (20, 21, 22), (33, 11)
    other = [b for b in range(kv.num_blocks) if b not in targets_host + targets_promoted]
    before = device_snapshot(kv)
    engine.submit([
        Job.load(3, "a", (LoadChunk(make_key(4), 4, 1, targets_host),)),
        Job.load(4, "b", (LoadChunk(make_key(4), 6, 2, targets_promoted),)),
    ])
    results = results_by_id(engine, 2)
    assert results[3].ok and results[4].ok
    for layer in range(kv.num_layers):
        for j, block in enumerate(targets_host):
            assert torch.equal(kv.rows[layer][block], want[4][(layer, 1 + j)])
        for j, block in enumerate(targets_promoted):
            assert torch.equal(kv.rows[layer][block], want[4][(layer, 2 + j)])
        for block in other:
            assert torch.equal(kv.rows[layer][block], before[layer][block])


def test_many_random_jobs_in_one_submit(kv, host, make_engine) -> None:
    rng = random.Random(7)
    engine = make_engine()
    jobs, want = [], {}
    blocks = rng.sample(range(kv.num_blocks), kv.num_blocks)
    for i, slot in enumerate(rng.sample(range(host.num_slots), 8)):
        ids = tuple(blocks[i * C : (i + 1) * C])
        want[slot] = (ids, expected_slot(kv, C, ids))
        jobs.append(Job.store(100 + i, make_key(slot), slot, ids))
    engine.submit(jobs)
    assert all(r.ok for r in results_by_id(engine, len(jobs)).values())
    for slot, (ids, snapshot) in want.items():
        assert_slot_holds(kv, host, slot, ids, snapshot=snapshot)


# ---------------------------------------------------------------------------- pipelining


def test_independent_jobs_run_concurrently(kv, host, make_engine, fio) -> None:
    backend = SlowBackend()
    gate = backend.gate("h2d")
    engine = make_engine(backend)
    _store_all(engine, kv, {0: (1, 2, 3, 4)})
    engine.submit([Job.load(2, "r", (LoadChunk(make_key(0), 0, 0, (10, 11, 12, 13)),))])
    assert backend.started["h2d"].wait(5)
    # a store is not stuck behind a blocked load (separate lane, separate stream): it finishes
    # while the load is still held at its gate
    engine.submit([Job.store(3, make_key(1), 1, (5, 6, 7, 8))])
    got = results_by_id(engine, 1, timeout_s=HANG_S)
    assert set(got) == {3} and got[3].ok
    gate.set()
    assert results_by_id(engine, 1)[2].ok


# ---------------------------------------------------------------------------- fences


def test_fence_waits_for_running_store_and_cancels_queued(kv, host, make_engine) -> None:
    backend = SlowBackend()
    gate = backend.gate("d2h")
    engine = make_engine(backend)
    running = expected_slot(kv, C, (1, 2, 3, 4))
    engine.submit([Job.store(1, make_key(1), 1, (1, 2, 3, 4))])
    assert backend.started["d2h"].wait(5)
    engine.submit([Job.store(2, make_key(2), 2, (5, 6, 7, 8)), Job.store(3, make_key(3), 3, (9, 10, 11, 12))])

    # Nothing reads these: it returns at once, while the running store is still held (with a
    # timeout no run reaches, a fence that waited for that store would not return).
    finishes(lambda: engine.fence_blocks([30, 31, 32], timeout_s=600.0))

    fenced = threading.Thread(target=engine.fence_blocks, args=([2, 6],))
    fenced.start()
    fenced.join(0.3)
    assert fenced.is_alive(), "the fence returned while a store still read block 2"
    gate.set()
    fenced.join(5)
    assert not fenced.is_alive()
    results = results_by_id(engine, 3)
    assert results[1].ok
    assert results[2] == JobResult.fail(2, "cancelled")
    assert results[3].ok
    assert_slot_holds(kv, host, 1, (1, 2, 3, 4), snapshot=running)


def test_fence_timeout_fails_the_store_it_gave_up_on(kv, host, make_engine) -> None:
    backend = SlowBackend()
    gate = backend.gate("d2h")
    engine = make_engine(backend)
    engine.submit([Job.store(1, make_key(1), 1, (1, 2, 3, 4))])
    assert backend.started["d2h"].wait(5)
    # The store stays held at its gate until the fence has returned: only the fence's own
    # timeout can end it, and the store it gave up on is failed.
    finishes(lambda: engine.fence_blocks([3], timeout_s=0.1))
    gate.set()
    assert results_by_id(engine, 1)[1] == JobResult.fail(1, "cancelled")


# ---------------------------------------------------------------------------- shutdown


def test_shutdown_with_jobs_in_flight_is_bounded_and_reports_everything(kv, host, slab, fio, make_engine) -> None:
    backend = SlowBackend()
    engine = make_engine(backend)
    _store_all(engine, kv, {0: (1, 2, 3, 4)})
    engine.submit([Job.spill(2, make_key(0), 0, 0)])
    assert results_by_id(engine, 1)[2].ok
    release = fio.hang("read")
    gate = backend.gate("d2h")
    h2d_gate = backend.gate("h2d")
    jobs = [
        Job.store(3, make_key(3), 3, (5, 6, 7, 8)),  # blocked in the copy
        Job.store(4, make_key(4), 4, (9, 10, 11, 12)),  # queued behind it
        Job.load(5, "r", (LoadChunk(make_key(0), 0, 0, (20, 21, 22, 23)),)),  # blocked in the copy
        Job.promote(6, make_key(0), 0, 7),  # hung read
        *[Job.spill(10 + i, make_key(0), 0, 1 + i) for i in range(5)],  # behind the hung read
    ]
    engine.submit(jobs)
    assert backend.started["d2h"].wait(5) and backend.started["h2d"].wait(5)
    # Every job stays held (gates, hung read) until after shutdown: only its own bound ends it.
    finishes(lambda: engine.shutdown(timeout_s=0.3))
    results = results_by_id(engine, len(jobs))
    assert {r.failure for r in results.values()} <= {"cancelled", None}
    assert results[5] == JobResult.fail(5, "cancelled", (20, 21, 22, 23))
    assert results[4].failure == "cancelled"
    engine.shutdown()  # idempotent
    engine.submit([Job.store(99, make_key(9), 9, (1, 2, 3, 4))])
    assert results_by_id(engine, 1)[99] == JobResult.fail(99, "cancelled")
    gate.set()
    h2d_gate.set()
    release.set()
    fio.release_all()


def test_drain_and_poll_are_non_blocking(kv, host, make_engine) -> None:
    engine = make_engine()
    assert engine.poll() == [] and drain(engine, 0.1)
    engine.submit([Job.store(1, make_key(1), 1, (1, 2, 3, 4))])
    assert drain(engine, 5)
    assert [r.job_id for r in engine.poll()] == [1]


# ---------------------------------------------------------------------------- backpressure


def test_slow_disk_drops_spills_and_never_delays_stores(kv, host, fio, make_engine) -> None:
    engine = make_engine(spill_queue_depth=2, io_threads=2)
    _store_all(engine, kv, {0: (1, 2, 3, 4)})
    engine.take_stats()
    writes = fio.calls["write"]
    fio.hang("write")  # a disk that does not answer until the test says so
    engine.submit([Job.spill(10 + i, make_key(0), 0, i) for i in range(8)])
    while fio.calls["write"] == writes:  # a spill is stuck on the disk
        time.sleep(0.002)
    engine.submit([Job.store(30 + i, make_key(30 + i), 1 + i, (5 + i, 10 + i, 20 + i, 30 + i)) for i in range(4)])
    stores = {}
    deadline = time.monotonic() + HANG_S  # only so stores that wait for the disk fail, not hang
    while len(stores) < 4:
        assert time.monotonic() < deadline, "stores waited for the slow disk"
        for r in engine.poll():
            if r.job_id >= 30:
                stores[r.job_id] = r
            else:
                assert r.failure == "dropped", r
        time.sleep(0.002)
    assert all(r.ok for r in stores.values()) and len(stores) == 4  # all done, disk still hung
    fio.release_all()
    assert drain(engine, HANG_S)
    stats = engine.take_stats()
    # the burst arrives at once: two fit the queue, the other six are dropped
    assert stats["spills_dropped"] == 6 and stats["ops"]["spill"] == 2


# ---------------------------------------------------------------------------- failures


def test_disk_jobs_without_a_slab_fail_missing(kv, host, make_engine) -> None:
    engine = make_engine(with_slab=False)
    _store_all(engine, kv, {0: (1, 2, 3, 4)})
    engine.submit([Job.spill(2, make_key(0), 0, 4), Job.promote(3, make_key(0), 4, 5)])
    results = results_by_id(engine, 2)
    assert results[2] == JobResult.fail(2, "missing")
    assert results[3] == JobResult.fail(3, "missing")
    assert engine.take_stats()["failures"] == {"missing": 2}


def test_promote_timeout_keeps_the_slot_reserved_until_the_read_returns(kv, host, fio, make_engine) -> None:
    engine = make_engine(load_timeout_s=0.2)
    _store_all(engine, kv, {0: (1, 2, 3, 4)})
    engine.submit([Job.spill(2, make_key(0), 0, 0)])
    assert results_by_id(engine, 1)[2].ok
    release = fio.hang("read", times=1)
    engine.submit([Job.promote(3, make_key(0), 0, 5)])
    assert results_by_id(engine, 1, timeout_s=3)[3] == JobResult.fail(3, "timeout")
    # the hung read still owns slot 5: a store into it is refused, not corrupted
    engine.submit([Job.store(4, make_key(4), 5, (5, 6, 7, 8))])
    assert results_by_id(engine, 1)[4] == JobResult.fail(4, "copy_error")
    release.set()
    deadline = time.monotonic() + 3
    while engine.take_stats()["queue_depths"]["host_slots_in_flight"] and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.submit([Job.store(6, make_key(4), 5, (5, 6, 7, 8))])
    assert results_by_id(engine, 1)[6].ok


def test_bad_job_fails_alone(kv, host, make_engine) -> None:
    engine = make_engine()
    engine.submit([
        Job.store(1, make_key(1), 1, (1, 2, 3, 999)),
        Job.store(2, make_key(2), 2, (5, 6, 7, 8)),
        Job.load(3, "r", (LoadChunk(make_key(1), 1, 0, (10, 11)), LoadChunk(make_key(1), 99, 0, (12,)))),
    ])
    results = results_by_id(engine, 3)
    assert results[1].failure == "copy_error" and results[2].ok
    assert results[3] == JobResult.fail(3, "copy_error", (12,))
    with pytest.raises(TypeError):
        engine.submit(["not a job"])  # type: ignore[list-item]


# ---------------------------------------------------------------------------- slot reuse


def test_slot_in_flight_is_never_reused(kv, host, make_engine) -> None:
    backend = SlowBackend()
    gate = backend.gate("d2h")
    engine = make_engine(backend)
    want = expected_slot(kv, C, (1, 2, 3, 4))
    engine.submit([Job.store(1, make_key(1), 3, (1, 2, 3, 4))])
    assert backend.started["d2h"].wait(5)
    # while the store still writes slot 3: no second writer, no reader
    engine.submit([
        Job.store(2, make_key(2), 3, (5, 6, 7, 8)),
        Job.spill(3, make_key(1), 3, 0),
        Job.load(4, "r", (LoadChunk(make_key(1), 3, 0, (20, 21, 22, 23)),)),
        Job.promote(5, make_key(1), 0, 3),
    ])
    early = results_by_id(engine, 4)
    assert {i: r.failure for i, r in early.items()} == dict.fromkeys((2, 3, 4, 5), "copy_error")
    assert early[4].failed_block_ids == (20, 21, 22, 23)
    gate.set()
    assert results_by_id(engine, 1)[1].ok
    assert_slot_holds(kv, host, 3, (1, 2, 3, 4), snapshot=want)


def test_promote_into_a_slot_being_loaded_is_refused(kv, host, fio, make_engine) -> None:
    engine = make_engine()
    _store_all(engine, kv, {0: (1, 2, 3, 4)})
    engine.submit([Job.spill(2, make_key(0), 0, 0)])
    assert results_by_id(engine, 1)[2].ok
    fio.delay("read", 0.3, times=1)
    before = device_snapshot(kv)
    engine.submit([Job.promote(3, make_key(0), 0, 6)])  # slow read writing slot 6
    time.sleep(0.05)
    engine.submit([Job.load(4, "r", (LoadChunk(make_key(0), 6, 0, (30, 31, 32, 33)),))])
    results = results_by_id(engine, 2)
    assert results[3].ok
    assert results[4] == JobResult.fail(4, "copy_error", (30, 31, 32, 33))
    for layer in range(kv.num_layers):
        for block in (30, 31, 32, 33):
            assert torch.equal(kv.rows[layer][block], before[layer][block])


# ---------------------------------------------------------------------------- host-tier loads


class _ThreadRecorder(SlowBackend):
    """Records which thread ran each h2d copy."""

    def __init__(self) -> None:
        super().__init__()
        self.h2d_threads: list[str] = []

    def h2d(self, dev, host, pairs) -> None:  # type: ignore[override]
        self.h2d_threads.append(threading.current_thread().name)
        super().h2d(dev, host, pairs)


def test_inline_host_load_is_done_when_submit_returns(kv, host, make_engine) -> None:
    """An idle step's host-tier load runs in the caller's thread: no hand-off to wait for."""
    backend = _ThreadRecorder()
    engine = make_engine(backend)
    want = _store_all(engine, kv, {2: (1, 2, 3, 4)})
    engine.submit([Job.load(7, "r", (LoadChunk(make_key(2), 2, 0, (30, 31, 32, 33)),))],
                  inline_max_bytes=1 << 40)
    assert engine.poll() == [JobResult.done(7)]  # no wait: it already happened
    assert backend.h2d_threads == [threading.current_thread().name]
    assert_slot_holds(kv, host, 2, (30, 31, 32, 33), snapshot=want[2])


def test_host_load_outside_an_idle_step_runs_on_the_h2d_lane(kv, host, make_engine) -> None:
    backend = _ThreadRecorder()
    engine = make_engine(backend)
    _store_all(engine, kv, {2: (1, 2, 3, 4)})
    engine.submit([Job.load(8, "r", (LoadChunk(make_key(2), 2, 0, (30, 31, 32, 33)),))])
    assert results_by_id(engine, 1)[8].ok
    assert backend.h2d_threads == ["tieredkv-h2d"]


def test_inline_load_from_a_slot_being_written_is_refused_untouched(kv, host, make_engine) -> None:
    backend = SlowBackend()
    gate = backend.gate("d2h")
    engine = make_engine(backend)
    engine.submit([Job.store(1, make_key(1), 3, (1, 2, 3, 4))])
    assert backend.started["d2h"].wait(5)
    before = device_snapshot(kv)
    engine.submit([Job.load(2, "r", (LoadChunk(make_key(1), 3, 0, (20, 21, 22, 23)),))],
                  inline_max_bytes=1 << 40)
    assert engine.poll() == [JobResult.fail(2, "copy_error", (20, 21, 22, 23))]
    for layer in range(kv.num_layers):
        for block in (20, 21, 22, 23):
            assert torch.equal(kv.rows[layer][block], before[layer][block])
    gate.set()
    assert results_by_id(engine, 1)[1].ok


def test_wait_for_results_sleeps_until_a_result_or_the_timeout(kv, host, make_engine) -> None:
    backend = SlowBackend()
    gate = backend.gate("h2d")
    engine = make_engine(backend)
    _store_all(engine, kv, {2: (1, 2, 3, 4)})
    assert engine.wait_for_results(0.0)  # nothing in flight: returns at once
    engine.submit([Job.load(5, "r", (LoadChunk(make_key(2), 2, 0, (30, 31, 32, 33)),))])
    assert backend.started["h2d"].wait(5)
    start = time.monotonic()
    assert not engine.wait_for_results(0.1)
    assert time.monotonic() - start >= 0.09
    threading.Timer(0.05, gate.set).start()
    assert engine.wait_for_results(5.0)
    assert engine.poll() == [JobResult.done(5)]


def test_a_load_bigger_than_the_inline_budget_goes_to_the_lane(kv, host, make_engine) -> None:
    """A long context's load must not hold the caller (vLLM's engine thread) in a busy step."""
    backend = _ThreadRecorder()
    engine = make_engine(backend)
    _store_all(engine, kv, {2: (1, 2, 3, 4)})
    one_chunk = C * kv.total_block_bytes
    engine.submit([Job.load(7, "r", (LoadChunk(make_key(2), 2, 0, (30, 31, 32, 33)),))],
                  inline_max_bytes=one_chunk - 1)
    assert results_by_id(engine, 1)[7].ok
    engine.submit([Job.load(8, "r", (LoadChunk(make_key(2), 2, 0, (34, 35, 36, 37)),))],
                  inline_max_bytes=one_chunk)
    assert engine.poll() == [JobResult.done(8)]
    assert backend.h2d_threads == ["tieredkv-h2d", threading.current_thread().name]
