"""The job ledger on its own: jobs issued, every rank's report folded in, one completion per
job, the step plan handed out once, and the request a job served forgotten when done."""

from __future__ import annotations

import pytest

from tieredkv.protocol import Job, JobResult, Move
from tieredkv.scheduler.ledger import JobLedger, JobRecord, RequestTable


def ledger_with_log(world: int = 1) -> tuple[JobLedger, RequestTable, list[tuple[JobRecord, JobResult]]]:
    """A ledger whose every completion handler appends (job, merged outcome) to the log."""
    requests = RequestTable()
    ledger = JobLedger(world, requests)
    done: list[tuple[JobRecord, JobResult]] = []
    ledger.set_handlers({kind: lambda job, outcome: done.append((job, outcome)) for kind in Move})
    return ledger, requests, done


def test_ledger_needs_a_handler_for_every_job_kind():
    ledger = JobLedger(1, RequestTable())
    with pytest.raises(ValueError, match="load"):
        ledger.set_handlers({kind: lambda job, outcome: None for kind in Move if kind != Move.LOAD})


def test_ledger_completes_a_job_once_every_rank_reported_then_forgets_the_request():
    ledger, requests, done = ledger_with_log(world=2)
    state = requests.ensure("r")
    job_id = ledger.issue(Move.STORE, (b"k",), "r", chunk_blocks=((1, 2),))
    state.store_jobs.add(job_id)
    state.finished = True
    ledger.apply([JobResult(job_id, ok=1), JobResult(job_id + 100, ok=1)])  # unknown: ignored
    assert not done and len(ledger) == 1
    ledger.apply([JobResult.fail(job_id, "io_error")])
    assert [(job.job_id, outcome) for job, outcome in done] == [
        (job_id, JobResult(job_id, ok=1, failed=1, failure="io_error"))
    ]
    assert len(ledger) == 0 and requests.get("r") is None


def test_each_job_gets_its_own_id_and_its_own_handler_by_kind():
    requests = RequestTable()
    ledger = JobLedger(1, requests)
    seen: list[tuple[Move, int, tuple[bytes, ...]]] = []
    ledger.set_handlers({
        kind: (lambda job, outcome, kind=kind: seen.append((kind, job.job_id, job.keys)))
        for kind in Move
    })
    ids = [ledger.issue(kind, (kind.value.encode(),), None) for kind in Move]
    assert len(set(ids)) == len(ids) == len(ledger)
    ledger.apply([JobResult.done(job_id) for job_id in reversed(ids)])
    # Reports complete jobs in the order they arrive, each by the handler of its own kind.
    assert seen == [(kind, job_id, (kind.value.encode(),))
                    for kind, job_id in reversed(list(zip(Move, ids, strict=True)))]
    assert len(ledger) == 0


def test_a_second_report_for_a_completed_job_is_ignored():
    ledger, _, done = ledger_with_log()
    job_id = ledger.issue(Move.SPILL, (b"k",), None)
    ledger.apply([JobResult.done(job_id)])
    ledger.apply([JobResult.fail(job_id, "io_error")])  # late or duplicated: no second completion
    assert len(done) == 1 and done[0][1] == JobResult.done(job_id)


def test_a_request_still_running_is_kept_once_its_jobs_are_done():
    ledger, requests, _ = ledger_with_log()
    state = requests.ensure("r")
    load = ledger.issue(Move.LOAD, (b"a",), "r")
    promote = ledger.issue(Move.PROMOTE, (b"b",), "r")
    state.load_job, state.promote_jobs = load, {promote}
    assert state.waiting_on_load
    ledger.apply([JobResult.done(load), JobResult.done(promote)])
    assert state.load_job is None and not state.promote_jobs and not state.waiting_on_load
    assert requests.get("r") is state  # not finished: still tracked
    state.finished = True
    job = ledger.issue(Move.STORE, (b"c",), "r")
    state.store_jobs.add(job)
    ledger.apply([JobResult.done(job)])
    assert requests.get("r") is None


def test_take_plan_hands_out_this_steps_jobs_once():
    ledger, _, _ = ledger_with_log()
    job_id = ledger.issue(Move.STORE, (b"k",), "r", chunk_blocks=((3, 4),))
    ledger.plan.jobs.append(Job.store(job_id, b"k", 0, (3, 4), req_id="r"))
    plan = ledger.take_plan()
    assert [job.job_id for job in plan.of(Move.STORE)] == [job_id]
    assert ledger.take_plan().of(Move.STORE) == []  # the next step starts empty
    assert len(ledger) == 1  # handing the plan out does not complete the job


def test_fence_stores_fences_the_blocks_of_the_requests_stores_in_flight():
    ledger, requests, _ = ledger_with_log()
    state = requests.ensure("r")
    first = ledger.issue(Move.STORE, (b"a",), "r", chunk_blocks=((1, 2), (3, -1)))
    second = ledger.issue(Move.STORE, (b"b",), "r", chunk_blocks=((7,),))
    ledger.issue(Move.STORE, (b"c",), "other", chunk_blocks=((9,),))  # another request's
    state.store_jobs.update({first, second})
    ledger.fence_stores(state)
    assert sorted(ledger.plan.fence_block_ids) == [1, 2, 3, 7]  # no padding (-1), no block 9
    ledger.apply([JobResult.done(first)])
    state.store_jobs.discard(first)
    ledger.take_plan()
    ledger.fence_stores(state)
    assert ledger.plan.fence_block_ids == [7]  # only what is still in flight


def test_sliding_sources_count_the_stores_reading_each_block_until_they_complete():
    ledger, _, _ = ledger_with_log()
    first = ledger.issue(Move.STORE, (b"a",), "r", sliding=(5, 6))
    second = ledger.issue(Move.STORE, (b"b",), "r", sliding=(6, 7))
    assert dict(ledger.sliding_sources) == {5: 1, 6: 2, 7: 1}
    ledger.apply([JobResult.done(first)])
    assert dict(ledger.sliding_sources) == {6: 1, 7: 1}  # the other store still reads 6
    ledger.apply([JobResult.fail(second, "cancelled")])
    assert not ledger.sliding_sources


@pytest.mark.parametrize("move", [Move.LOAD, Move.PROMOTE, Move.REMOTE_READ])
def test_bytes_a_request_waits_for_are_in_flight_until_their_job_completes(move):
    ledger, _, _ = ledger_with_log()
    for quiet in (Move.STORE, Move.SPILL, Move.REMOTE_WRITE):
        ledger.issue(quiet, (b"q",), None)
    assert not ledger.bringing_up()  # stores, spills and writes: nobody waits on them
    job_id = ledger.issue(move, (b"k",), "r")
    assert ledger.bringing_up()
    ledger.apply([JobResult(job_id, ok=1)])
    assert not ledger.bringing_up()
