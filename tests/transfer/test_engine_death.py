"""A dead engine thread fails every job at once; nothing waits on a result that cannot come.

The transfer engine's work runs on threads of its own: the event loop, one copy lane per
direction, the slab I/O pool. When one of them dies (at start-up or mid-serving), every job
still pending must get a failed result within a bounded time, later submits must fail at
once, and the cause must be logged once with its traceback. The worker half then reports
failed loads through ``get_block_ids_with_load_errors`` and failed stores as finished.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from transfer_helpers import (
    CHUNK_BLOCKS,
    SlowBackend,
    device_snapshot,
    drain,
    expected_slot,
    make_key,
    results_by_id,
)

from tests.helpers import HANG_S, finishes
from tieredkv.protocol import Job, LoadChunk, Move
from tieredkv.transfer import lanes
from tieredkv.transfer.engine import EngineDeadError, TransferEngine
from tieredkv.transfer.lanes import STOP

pytestmark = pytest.mark.timeout(120)  # on a regression these tests fail, they never hang

C = CHUNK_BLOCKS
# The engines here time loads out only after this long: a failed result that arrives at all
# (within HANG_S, which only turns a hang into a failure) came from the dead thread's clean-up,
# and its cause says so ("cancelled", not "timeout").
LOAD_TIMEOUT_S = 600.0
ENGINE_LOGGER = "tieredkv.transfer.engine"


class Boom(RuntimeError):
    pass


def _store_ok(engine, kv, slots: dict[int, tuple[int, ...]], first_id: int) -> None:
    jobs = [Job.store(first_id + i, make_key(slot), slot, ids) for i, (slot, ids) in enumerate(slots.items())]
    engine.submit(jobs)
    assert all(r.ok for r in results_by_id(engine, len(jobs)).values())


def _death_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name == ENGINE_LOGGER and r.levelno >= logging.ERROR and r.exc_info]


def _assert_failed(results: dict, jobs) -> None:
    """Every job failed; a failed load names all of its device blocks (vLLM recomputes them)."""
    for job in jobs:
        result = results[job.job_id]
        assert not result.ok, result
        assert result.failure == "cancelled", result
        if job.move is Move.LOAD:
            assert set(result.failed_block_ids) == set(job.block_ids), result
        else:
            assert result.failed_block_ids == ()


def _assert_later_submits_fail_at_once(engine, kv, cause: BaseException) -> None:
    before = device_snapshot(kv)
    jobs = [
        Job.store(900, make_key(900), 7, (32, 33, 34, 35)),
        Job.load(901, "later-host", (LoadChunk(make_key(0), 0, 0, (36, 37, 38, 39)),)),
        Job.promote(903, make_key(1), 4, 9),
        Job.spill(904, make_key(0), 0, 5),
    ]
    engine.submit(jobs, inline_max_bytes=1 << 30)
    results = {r.job_id: r for r in engine.poll()}  # no waiting: they are there already
    assert set(results) == {job.job_id for job in jobs}
    _assert_failed(results, jobs)
    after = device_snapshot(kv)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))  # nothing ran
    assert isinstance(engine.error, EngineDeadError)
    assert engine.error.__cause__ is cause
    assert drain(engine, 0.0)


# ---------------------------------------------------------------------------- start-up


@pytest.mark.parametrize("where", ["setup", "h2d_lane"])
def test_a_loop_that_cannot_start_fails_every_job_and_every_later_submit(
    kv, host, slab, make_engine, monkeypatch, caplog, where
) -> None:
    boom = Boom(f"injected start-up failure in {where}")
    if where == "setup":
        def broken_setup(self) -> None:
            raise boom

        monkeypatch.setattr(TransferEngine, "_setup", broken_setup)
    else:
        real_lane = lanes.CopyLane

        def lane(name, *args, **kwargs):
            if name == "h2d":
                raise boom
            return real_lane(name, *args, **kwargs)

        monkeypatch.setattr("tieredkv.transfer.device_jobs.CopyLane", lane)
    caplog.set_level(logging.ERROR, logger=ENGINE_LOGGER)
    engine = make_engine(load_timeout_s=LOAD_TIMEOUT_S)
    jobs = [
        Job.store(1, make_key(1), 1, (1, 2, 3, 4)),
        Job.spill(2, make_key(2), 2, 3),
        Job.promote(3, make_key(3), 3, 4),
        Job.load(4, "load-with-others", (LoadChunk(make_key(5), 5, 0, (8, 9, 10, 11)),)),
        Job.load(5, "load-alone", (LoadChunk(make_key(6), 6, 0, (12, 13, 14, 15)),)),
    ]
    engine.submit(jobs[:4])
    results = results_by_id(engine, 4, timeout_s=HANG_S)
    engine.submit(jobs[4:])  # a load alone, which skips the event loop
    results.update(results_by_id(engine, 1, timeout_s=HANG_S))
    _assert_failed(results, jobs)
    _assert_later_submits_fail_at_once(engine, kv, boom)
    (record,) = _death_records(caplog)  # logged once, with the traceback
    assert record.exc_info[1] is boom
    finishes(lambda: engine.shutdown(timeout_s=2.0))


# ---------------------------------------------------------------------------- mid-serving


def test_the_loop_thread_dying_mid_serving_fails_every_pending_job(
    kv, host, slab, fio, make_engine, monkeypatch, caplog
) -> None:
    caplog.set_level(logging.ERROR, logger=ENGINE_LOGGER)
    backend = SlowBackend()
    engine = make_engine(backend, load_timeout_s=LOAD_TIMEOUT_S)
    _store_ok(engine, kv, {0: (1, 2, 3, 4), 1: (5, 6, 7, 8)}, first_id=1)
    engine.submit([Job.spill(3, make_key(1), 1, 4)])
    assert results_by_id(engine, 1)[3].ok

    # Jobs in flight on the loop: a store stuck in its d2h copy, a promotion stuck on disk.
    gate = backend.gate("d2h")
    hung = fio.hang("read")
    backend.started["d2h"].clear()
    in_flight = [
        Job.store(10, make_key(2), 2, (9, 10, 11, 12)),
        Job.promote(11, make_key(1), 4, 5),
    ]
    engine.submit(in_flight)
    assert backend.started["d2h"].wait(5)
    deadline = time.monotonic() + 5
    while fio.faults["read:hang"] < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert fio.faults["read:hang"] >= 1

    # The loop thread dies while handing out the next jobs.
    death = SystemExit("injected: the transfer loop thread dies")

    def dying_start(start, entries) -> None:
        raise death

    monkeypatch.setattr(engine, "_start_on_loop", dying_start)
    lost = [Job.store(13, make_key(3), 3, (21, 22, 23, 24)), Job.spill(14, make_key(0), 0, 6)]
    engine.submit(lost)
    results = results_by_id(engine, len(in_flight) + len(lost), timeout_s=HANG_S)
    _assert_failed(results, in_flight + lost)

    gate.set()
    hung.set()
    _assert_later_submits_fail_at_once(engine, kv, death)
    (record,) = _death_records(caplog)
    assert record.exc_info[1] is death


def _crashing_serve_calls(thread_prefix: str, crash: threading.Event):
    """``serve_calls`` that dies (raises out of the thread) on the first call after ``crash``,
    in threads whose name starts with ``thread_prefix``: that call is lost, as in a real crash."""

    def serve(calls) -> None:
        mine = threading.current_thread().name.startswith(thread_prefix)
        while True:
            item = calls.get()
            if item is STOP:
                return
            if mine and crash.is_set():
                raise Boom(f"injected crash of {threading.current_thread().name}")
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001
                future.set_exception(exc)

    return serve


def test_a_copy_lane_thread_crash_fails_every_pending_job(kv, host, slab, make_engine, monkeypatch, caplog) -> None:
    caplog.set_level(logging.ERROR, logger=ENGINE_LOGGER)
    crash = threading.Event()
    monkeypatch.setattr(lanes, "serve_calls", _crashing_serve_calls("tieredkv-d2h", crash))
    engine = make_engine(load_timeout_s=LOAD_TIMEOUT_S)
    _store_ok(engine, kv, {0: (1, 2, 3, 4), 1: (5, 6, 7, 8)}, first_id=1)
    want = expected_slot(kv, C, (1, 2, 3, 4))
    engine.submit([Job.load(3, "ok", (LoadChunk(make_key(0), 0, 0, (30, 31, 32, 33)),))])
    assert results_by_id(engine, 1)[3].ok  # served normally up to here
    assert torch.equal(kv.rows[0][30], want[(0, 0)])

    crash.set()
    jobs = [Job.store(10, make_key(2), 2, (9, 10, 11, 12)), Job.store(11, make_key(3), 3, (13, 14, 15, 16))]
    engine.submit(jobs)
    results = results_by_id(engine, len(jobs), timeout_s=HANG_S)
    _assert_failed(results, jobs)
    (record,) = _death_records(caplog)
    cause = record.exc_info[1]
    assert isinstance(cause, Boom) and "tieredkv-d2h" in str(cause)
    _assert_later_submits_fail_at_once(engine, kv, cause)
    assert len(_death_records(caplog)) == 1


def test_a_slab_io_thread_crash_fails_every_pending_job(kv, host, slab, make_engine, monkeypatch, caplog) -> None:
    caplog.set_level(logging.ERROR, logger=ENGINE_LOGGER)
    crash = threading.Event()
    monkeypatch.setattr("tieredkv.transfer.disk_jobs.serve_calls", _crashing_serve_calls("tieredkv-io", crash))
    engine = make_engine(load_timeout_s=LOAD_TIMEOUT_S)  # a lost read must not wait for it
    _store_ok(engine, kv, {0: (1, 2, 3, 4), 1: (5, 6, 7, 8)}, first_id=1)
    engine.submit([Job.spill(3, make_key(1), 1, 4)])
    assert results_by_id(engine, 1)[3].ok

    crash.set()
    jobs = [Job.promote(10, make_key(1), 4, 5)]
    engine.submit(jobs)
    results = results_by_id(engine, len(jobs), timeout_s=HANG_S)
    _assert_failed(results, jobs)
    (record,) = _death_records(caplog)
    cause = record.exc_info[1]
    assert isinstance(cause, Boom) and "tieredkv-io" in str(cause)
    _assert_later_submits_fail_at_once(engine, kv, cause)


# ---------------------------------------------------------------------------- worker half


def _fake_configs():
    from tests.vllm.test_worker_side import BLOCK as block
    from tests.vllm.test_worker_side import BLOCKS as blocks
    from tests.vllm.test_worker_side import CONTENT as content
    from tests.vllm.test_worker_side import HEADS as heads
    from tests.vllm.test_worker_side import LAYERS as layers
    from tests.vllm.test_worker_side import fake_configs

    vllm_config, kv_cache_config = fake_configs()
    caches = {f"l{i}": torch.zeros(blocks, heads, block, content) for i in range(layers)}
    return vllm_config, kv_cache_config, caches


def test_worker_half_reports_every_request_when_the_engine_cannot_start(monkeypatch, caplog) -> None:
    from tieredkv.config import TieredKVConfig
    from tieredkv.protocol import StepPlan
    from tieredkv.vllm.metadata import TieredKVMetadata
    from tieredkv.vllm.worker_side import WorkerHalf

    def broken_setup(self) -> None:
        raise Boom("injected start-up failure")

    monkeypatch.setattr(TransferEngine, "_setup", broken_setup)
    vllm_config, kv_cache_config, caches = _fake_configs()
    config = TieredKVConfig.from_dict({"host_bytes": "8MiB", "chunk_blocks": 2})
    worker = WorkerHalf(vllm_config, kv_cache_config, config)
    worker.register_kv_caches(caches)
    try:
        plan = StepPlan(jobs=[
            Job.store(1, b"s" * 32, 0, (1, 2), req_id="stored"),
            Job.load(2, "loaded", (LoadChunk(b"x" * 32, 3, 0, (10, 11)),)),
        ])
        metadata = TieredKVMetadata(plan=plan)
        worker.handle_preemptions(metadata)
        worker.start_jobs(metadata)
        worker.submit_stores(metadata)
        sending, recving = worker.collect(set())
        assert recving == {"loaded"}  # no later step needed: the failure is known now
        assert worker.take_load_errors() == {10, 11}
        # the request whose blocks the store read is freed as soon as vLLM asks
        sending, _ = worker.collect(set())
        worker.start_jobs(TieredKVMetadata(plan=StepPlan(delayed_req_ids=["stored"])))
        sending, _ = worker.collect({"stored"})
        assert sending == {"stored"}
        meta = worker.build_worker_meta()
        assert meta is not None
        assert {job: (r.ok, r.failed, r.failure) for job, r in meta.results.items()} == {
            1: (0, 1, "cancelled"), 2: (0, 1, "cancelled"),
        }
    finally:
        finishes(worker.shutdown)


def test_a_death_racing_a_store_submit_leaves_no_ticket_behind(kv, host, slab, make_engine, caplog) -> None:
    """The engine dies right after submit recorded a store and before its handler ran: the
    store fails (cancelled) and its fence ticket goes with it, so no later fence waits on or
    cancels a store that will never run (review of #24's handlers)."""
    caplog.set_level(logging.CRITICAL, logger=ENGINE_LOGGER)
    engine = make_engine()
    device = engine._device
    submit_stores = device.submit_stores

    def die_first(entries) -> None:
        engine.die("a test, between submit and the store handler", RuntimeError("injected"))
        submit_stores(entries)

    engine._routes[Move.STORE] = die_first
    job = Job.store(1, b"k" * 32, 0, (1, 2, 3, 4))
    engine.submit([job])
    results = results_by_id(engine, 1, timeout_s=HANG_S)
    assert results[1].failure == "cancelled"
    assert device._tickets == {} and device._block_tickets == {}
