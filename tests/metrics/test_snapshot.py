"""Stats snapshots without vLLM: merging steps and ranks, emptiness, the log summary.

``tieredkv.vllm.stats.TieredKVStats`` only delegates to these functions; its own tests (with
vLLM) are in test_prom_metrics.py and tests/vllm.
"""

from __future__ import annotations

import copy

from tieredkv.metrics import snapshot

SCHED = {
    "counters": {"lookups": 1, "hit_tokens": {"host": 128}},
    "gauges": {"host_slots_used": 3},
    "chunk_bytes": 4096, "chunk_tokens": 64, "world_size": 2,
}
WORKER = {
    "bytes": {"d2h": 1 << 20, "spill": 1 << 19}, "ops": {"d2h": 2}, "spills_dropped": 1,
    "failures": {"checksum": 1}, "latency_s": {"store": [0.01]},
    "reads_retried": {"timeout": 1}, "reads_recovered": 1, "queue_depths": {"spill_queue": 4},
}


def test_merge_adds_counters_and_keeps_the_latest_gauges() -> None:
    first = {"scheduler": SCHED, "workers": {"0": WORKER}}
    later_sched = {**SCHED, "counters": {"lookups": 2, "hit_tokens": {"host": 64, "disk": 32}}, "gauges": {"host_slots_used": 5}}
    later_worker = {"bytes": {"d2h": 1 << 20}, "latency_s": {"store": [0.02]},
                    "queue_depths": {"spill_queue": 0}}
    before = copy.deepcopy(first)
    merged = snapshot.merge(first, {"scheduler": later_sched, "workers": {"0": later_worker, "1": WORKER}})
    assert first == before, "merge must not modify its inputs"
    sched = merged["scheduler"]
    assert sched["counters"] == {"lookups": 3, "hit_tokens": {"host": 192, "disk": 32}}
    assert sched["gauges"] == {"host_slots_used": 5}
    rank0 = merged["workers"]["0"]
    assert rank0["bytes"] == {"d2h": 2 << 20, "spill": 1 << 19}
    assert rank0["latency_s"] == {"store": [0.01, 0.02]}
    assert rank0["queue_depths"] == {"spill_queue": 0}  # a gauge: the latest, not a sum
    assert merged["workers"]["1"] == WORKER


def test_merge_with_nothing_is_a_copy() -> None:
    data = {"scheduler": SCHED}
    assert snapshot.merge(data, None) == data
    assert snapshot.merge(data, {}) is not data
    assert snapshot.merge({}, {"workers": {"0": WORKER}}) == {"workers": {"0": WORKER}}


def test_is_empty() -> None:
    assert snapshot.is_empty({})
    assert snapshot.is_empty({"scheduler": {"counters": {}, "gauges": {}}, "workers": {"0": {}}})
    quiet = {"bytes": {"d2h": 0}, "ops": {}, "queue_depths": {"spill_queue": 0}, "latency_s": {}}
    assert snapshot.is_empty({"workers": {"0": quiet}})
    assert not snapshot.is_empty({"scheduler": SCHED})
    assert not snapshot.is_empty({"workers": {"0": {**quiet, "queue_depths": {"spill_queue": 1}}}})
    assert not snapshot.is_empty({"workers": {"0": {**quiet, "reads_recovered": 1}}})
    assert not snapshot.is_empty({"workers": {"0": {**quiet, "latency_s": {"load": [0.1]}}}})


def test_summary() -> None:
    data = {"scheduler": SCHED, "workers": {"0": WORKER, "1": WORKER}}
    assert snapshot.summary(data) == {
        "hit_tokens_host": 128, "hit_tokens_disk": 0, "hit_tokens_remote": 0, "d2h_MiB": 2.0, "spill_MiB": 1.0,
        "failures": 2, "reads_retried": 2,
    }
    assert snapshot.summary({}) == {
        "hit_tokens_host": 0, "hit_tokens_disk": 0, "hit_tokens_remote": 0, "failures": 0, "reads_retried": 0,
    }
