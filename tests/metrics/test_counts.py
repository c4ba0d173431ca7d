"""Scheduler counters are declared once (``specs.Count``) and every one a real run counts is
exported: a counter cannot be counted and never reach Prometheus (#24 point 3).

The runs are the planner's own (host, disk, a hybrid model's unserved load) and the remote
tier's probe over a store stub that answers at once; the counts they leave are turned into
Prometheus samples by the standalone exporter, and each must show up with its value.
"""

from __future__ import annotations

from concurrent.futures import Future

import pytest
from prometheus_client import CollectorRegistry

from tieredkv.config import TieredKVConfig
from tieredkv.keys import LazyChunkKeys
from tieredkv.metrics.exporter import build_exporter_metrics
from tieredkv.metrics.specs import COUNT_ROUTES, COUNTER, METRIC_SPECS, Count, Counts, route_counter
from tieredkv.protocol import FULL, SLIDING, FailureCause, JobResult, KVGroup, Move, SlotRows, Tier
from tieredkv.remote.results import BatchResult
from tieredkv.scheduler.planner import Planner
from tieredkv.scheduler.remote_tier import RemoteProbe, RemoteTier
from tieredkv.testing.hashing import sha256_block_hashes

BLOCK, C = 16, 4
CHUNK_TOKENS = BLOCK * C
FP = b"c" * 32


def keys_of(tokens: list[int], per_block: int = 1) -> LazyChunkKeys:
    return LazyChunkKeys(FP, sha256_block_hashes(tokens, BLOCK), C, hashes_per_block=per_block)


def planner(host: int, disk: int = 0, slot_rows: SlotRows | None = None, **extra) -> Planner:
    config = TieredKVConfig.from_dict({"chunk_blocks": C, **extra})
    return Planner(config, block_size=BLOCK, num_host_slots=host, num_disk_slots=disk,
                   slot_rows=slot_rows)


def finish(p: Planner, plan, failure: str | None = None) -> None:
    jobs = [*plan.of(Move.STORE), *plan.of(Move.SPILL), *plan.of(Move.PROMOTE), *plan.of(Move.LOAD)]
    p.apply([JobResult.fail(j.job_id, failure) if failure else JobResult.done(j.job_id)
             for j in jobs])


def store(p: Planner, req: str, tokens: list[int], failure: str | None = None) -> None:
    p.set_block_ids(req, list(range(100, 100 + len(tokens) // BLOCK)), replace=True)
    p.plan_stores(req, keys_of(tokens), len(tokens), tail=True)
    finish(p, p.take_plan(), failure)


def host_and_disk_run() -> Counts:
    """Stores (whole and tail), spills, evictions, a promotion, hits from both tiers, failed
    store/spill/promotion/load, a skipped store, a preemption and a reset."""
    p = planner(host=2, disk=8)
    a = list(range(CHUNK_TOKENS + 2 * BLOCK + 1))  # a chunk and a tail
    store(p, "a", a)
    finish(p, p.take_plan())  # spills
    hit = p.lookup("h", keys_of(a), 0, len(a))  # host, ends inside the tail's chunk
    p.on_alloc("h", list(range(8)), hit)
    finish(p, p.take_plan())
    store(p, "b", [t + 10_000 for t in range(2 * CHUNK_TOKENS + 1)])  # evicts a from host
    finish(p, p.take_plan(), FailureCause.NO_SPACE)  # its spills fail
    assert p.lookup("d", keys_of(a), 0, len(a)) is None  # a is on disk only: promoted
    finish(p, p.take_plan())
    hit = p.lookup("d", keys_of(a), 0, len(a))
    p.on_alloc("d", list(range(8)), hit)
    (load,) = p.take_plan().of(Move.LOAD)
    p.apply([JobResult.fail(load.job_id, FailureCause.COPY_ERROR, load.block_ids)])
    c = [t + 20_000 for t in range(CHUNK_TOKENS + BLOCK + 1)]
    store(p, "c", c)
    finish(p, p.take_plan())
    store(p, "c2", c + list(range(BLOCK)))  # c's tail grows: the shorter copy is superseded
    finish(p, p.take_plan())
    store(p, "e", [t + 30_000 for t in range(CHUNK_TOKENS + 1)], FailureCause.IO_ERROR)
    store(p, "e2", [t + 50_000 for t in range(2 * CHUNK_TOKENS + 1)])  # c leaves host
    finish(p, p.take_plan())
    assert p.lookup("g", keys_of(c), 0, len(c)) is None  # c on disk only: promoted
    for promote in p.take_plan().of(Move.PROMOTE):
        p.apply([JobResult.fail(promote.job_id, FailureCause.CHECKSUM)])
    p.set_block_ids("f", list(range(8)), replace=True)
    p.plan_stores("f", keys_of([t + 40_000 for t in range(3 * CHUNK_TOKENS + 1)]),
                  3 * CHUNK_TOKENS + 1)  # more chunks than host slots, none finishes
    p.preempted("f")
    p.take_plan()
    assert p.lookup("i", keys_of(a), 0, len(a)) == 0  # a on disk, no host slot to fill
    p.reset()
    p.take_counter_deltas()
    return p.counters


def unserved_load_run() -> Counts:
    """A hybrid model's load that would leave a block unwritten (see
    tests/scheduler/test_hybrid_unserved_load.py)."""
    layout = SlotRows((KVGroup(SLIDING, 2), KVGroup(FULL)), chunk_blocks=C)
    tokens = list(range(2 * CHUNK_TOKENS + 10))
    keys = keys_of(tokens, per_block=0)
    p = planner(host=8, slot_rows=layout)
    n = len(tokens) // BLOCK
    p.set_block_ids("a", [list(range(100, 100 + n)), list(range(200, 200 + n))], replace=True)
    p.plan_stores("a", keys, len(tokens), computed_tokens=0)
    finish(p, p.take_plan())
    hit = p.lookup("b", keys, 0, len(tokens))
    p.on_alloc("b", [[0, 0, 0, 0, 41, 0, 42, 43], list(range(300, 308))], hit)
    finish(p, p.take_plan(), FailureCause.MISSING)
    return p.counters


class AnsweringStore:
    """``batch_exists`` answered at once: chunks in ``held`` exist, a down store fails."""

    def __init__(self, held: set[bytes]) -> None:
        self.held = held
        self.down = False

    def batch_exists(self, names: list[str], timeout_s: float) -> Future:
        future: Future = Future()
        if self.down:
            future.set_result(BatchResult([], FailureCause.UNAVAILABLE))
        else:
            future.set_result(BatchResult([True] * len(names), latency_s=0.001))
        return future


def remote_probe_run() -> Counts:
    """Probes that ask, one answered from the known-present hints, one the store refuses."""
    store = AnsweringStore(set())
    probe = RemoteProbe(store, FP, world_size=2, deadline_s=1.0)
    tier = RemoteTier(probe, is_up=lambda: True, writes=False, admission=1, seen_limit=8)
    keys = list(keys_of(list(range(3 * CHUNK_TOKENS + 1))))[:3]
    assert probe.poll("a", keys) is None and probe.poll("a", keys) == 3
    assert probe.poll("b", keys) == 3  # known present: not asked again
    store.down = True
    assert probe.poll("c", [b"x" * 32]) is None and probe.poll("c", [b"x" * 32]) == 0
    counts = Counts()
    tier.take_stats(counts)
    return counts


RUNS = {"host_and_disk": host_and_disk_run, "unserved_load": unserved_load_run,
        "remote_probe": remote_probe_run}


@pytest.mark.parametrize("run", RUNS)
def test_every_counter_a_run_counts_is_exported_with_its_value(run: str) -> None:
    counts = RUNS[run]()
    assert counts, "the run counted nothing"
    registry = CollectorRegistry()
    build_exporter_metrics(registry, {"scheduler": {"counters": counts.snapshot()}}, "m")
    expected: dict[tuple[str, str | None], int] = {}
    for key, n in counts.items():
        count, label = key if isinstance(key, tuple) else (key, None)
        route = route_counter(count, label)
        assert route is not None, key
        expected[route] = expected.get(route, 0) + n
    for (spec_id, value), n in expected.items():
        spec = METRIC_SPECS[spec_id]
        labels = {"model_name": "m", **({spec.label: value} if spec.label else {})}
        if spec.label2:  # two labels: the route's value is the pair
            labels.update({spec.label: value[0], spec.label2: value[1]})
        assert registry.get_sample_value(spec.name + "_total", labels) == n, (spec_id, value)


def test_the_runs_count_what_was_once_counted_and_never_exported() -> None:
    counted = {k if not isinstance(k, tuple) else k[0]
               for run in RUNS.values() for k, n in run().items() if n}
    once_dark = {Count.PARTIAL_HITS, Count.STORED_PARTIAL_CHUNKS,
                 Count.CHUNKS_DROPPED_BY_FAILED_LOADS, Count.LOAD_ROWS_UNSERVED,
                 Count.REMOTE_PROBE_KEYS, Count.REMOTE_PROBE_KNOWN_HITS}
    assert once_dark <= counted, once_dark - counted
    assert {Count.HIT_TOKENS, Count.EVICTIONS, Count.SUPERSEDED, Count.LOAD_FAILED,
            Count.DISK_READ_FAILED, Count.STORE_FAILED, Count.SPILL_FAILED,
            Count.REMOTE_PROBE_FAILED, Count.PROMOTED_CHUNKS, Count.SPILLED_CHUNKS} <= counted


def test_a_counter_that_is_not_declared_cannot_be_counted() -> None:
    counts = Counts()
    for bad in ("lookups", "load_failed_checksum", (Count.LOOKUPS, "x"), Count.HIT_TOKENS,
                ("hit_tokens", "host"), (Count.HIT_TOKENS,)):
        with pytest.raises(KeyError, match="not a declared counter"):
            counts[bad] += 1
    with pytest.raises(KeyError, match="not a declared counter"):
        counts.update({"remote_probes": 1})
    with pytest.raises(KeyError, match="not a declared counter"):
        Counts({"partial_hits": 1})
    assert not counts
    counts[Count.LOOKUPS] += 2
    counts[Count.HIT_TOKENS, Tier.DISK] += 64
    assert counts["lookups"] == 2 and counts["hit_tokens", "disk"] == 64  # read by plain strs
    assert counts.snapshot() == {"lookups": 2, "hit_tokens": {"disk": 64}}


def test_reading_a_counter_that_is_not_declared_raises() -> None:
    """A misspelled counter read 0 (Counter's default), so an assertion on it could never
    fail: reading any key that no :class:`Count` declares, in its shape, names it and raises."""
    counts = Counts()
    for bad in ("hits_declined_slower", ("hits_declined_slower", "disk"), Count.HIT_TOKENS,
                (Count.LOOKUPS, "disk"), (Count.HIT_TOKENS,), ("hit_tokens", 3)):
        with pytest.raises(KeyError, match="not a declared counter") as raised:
            counts[bad]  # noqa: B018 (the read is the test)
        assert repr(bad) in str(raised.value)
    assert counts[Count.LOOKUPS] == 0 and counts["lookups"] == 0  # declared, never counted
    assert counts[Count.HITS_DECLINED_SLOWER, Tier.DISK] == 0
    assert counts["hits_declined_slower_than_recompute", "disk"] == 0
    assert not counts  # reading counts nothing


def test_every_declared_counter_feeds_a_counter_metric() -> None:
    assert set(COUNT_ROUTES) == set(Count)
    for count, route in COUNT_ROUTES.items():
        assert METRIC_SPECS[route.spec].kind == COUNTER, count
        label = "some_label" if route.by else None
        value = route.value or label
        if route.value2 is not None:  # a metric with two labels: the pair
            assert route.value2 in METRIC_SPECS[route.spec].values2, count
            value = (value, route.value2)
        assert route_counter(count, label) == (route.spec, value), count
        # The other shape is not this counter: a newer peer's payload is skipped, not misfiled.
        assert route_counter(count, None if route.by else "x") is None, count
    assert route_counter("a_counter_from_the_future") is None
