"""A load the planner marks unserved (#23.2) copies nothing and fails every block it names."""

from __future__ import annotations

from transfer_helpers import device_snapshot, make_key, results_by_id

from tieredkv.protocol import FailureCause, Job, LoadChunk


def test_an_unserved_load_writes_no_block_and_reports_every_block_failed(kv, host, make_engine):
    engine = make_engine()
    engine.submit([Job.store(1, make_key(0), 0, (1, 2, 3, 4))])
    assert results_by_id(engine, 1)[1].ok
    targets = (20, 21, 22, 23)
    before = device_snapshot(kv)
    engine.submit([Job.load(2, "req", (LoadChunk(make_key(0), 0, 0, targets),), unserved=True)])
    result = results_by_id(engine, 1)[2]
    # Failed, naming every block: vLLM recomputes them (a hybrid request: all of it).
    assert result.failed and result.failure == FailureCause.MISSING
    assert set(result.failed_block_ids) == set(targets)
    after = device_snapshot(kv)
    assert all(a.equal(b) for a, b in zip(after, before, strict=True))
