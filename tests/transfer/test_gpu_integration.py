"""The real worker half and transfer engine on KV caches laid out as vLLM's CUDA backends lay
them out, with a stand-in forward pass; no vLLM needed (none is installed on the GPU machines).

Every check runs on ``cpu`` and, where there is a GPU, on ``cuda`` (marked ``cuda``) with each
copy backend a user can pick there (``torch``, the ``auto`` default, and ``cupy``), over every
layout in ``vllm_cuda_layouts.CASES``. The forward writes known K/V through the kernels' own
views (``kv_cache.transpose(1, 2).split(head_size, dim=-1)``); a CPU replica of the same cache
receives the same writes and is the reference for every byte. On CUDA the forward runs on a
compute stream behind a long spinning kernel (the GPU warmed and the spin calibrated once per
session: ``cuda_ordering``), so a store or load submitted after it finds it still queued: only
stream/event ordering can make the bytes come out right. Each such test rehearses its own steps
with nothing queued first (no lazy kernel load may synchronise the device mid-test), then
asserts the forward was still pending both when the job was submitted and when its copy was
issued on the lane, so it cannot pass because the forward happened to be over. The layouts are
the ones vLLM serves tieredkv (``test_layouts_as_served.py``).

- a store copies exactly what the forward wrote, even when issued while the forward is queued;
- a load is complete when the worker reports it (the next forward, queued at once, reads the
  loaded bytes), lands after the blocks' previous tenant's queued writes, and touches no
  other block of any layer (a hit may start mid-chunk);
- ``handle_preemptions`` cancels a queued store and waits for a running one, so the next
  tenant's writes never reach a slot; the sleep-mode pause (the sleep hook in
  ``tieredkv/vllm/worker_side.py``) leaves no copy queued on any stream when the memory would
  go, refuses device jobs while asleep, and resumes after wake-up;
- d2h and h2d overlap each other and the next forward (CUDA: a timeline from CUDA events
  recorded by this test around every copy call on the lanes' streams; CPU: both complete
  and move the right bytes).

    python -m pytest tests/transfer/test_gpu_integration.py -q          # cpu (+ cuda if any)
    python -m pytest tests/transfer/test_gpu_integration.py -m cuda -q  # the GPU half only

The overlap test is a speed check (how far the copies overlap on the GPU timeline); every
other test here checks bytes and ordering. ``scripts/gpu_check.py`` judges them separately.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from cuda_ordering import IssueProbe, assert_still_queued, busy, rehearse
from gpu_rig import (
    CHUNK,
    FORWARD_DELAY_MS,
    GatedStores,
    Rig,
    Timeline,
)
from transfer_helpers import slot_block
from vllm_cuda_layouts import CASE_BY_ID, CASES, LayoutCase

from tests.helpers import finishes
from tieredkv.protocol import FailureCause, Job, LoadChunk, Move, StepPlan
from tieredkv.vllm import worker_side

HAS_CUDA = torch.cuda.is_available()
_CUDA = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]

# (device, copy_backend): on CUDA torch is what "auto" picks; cupy is there by name.
DEVICE_BACKENDS = [
    pytest.param("cpu", "auto", id="cpu-auto"),
    pytest.param("cuda", "torch", id="cuda-torch", marks=_CUDA),
    pytest.param("cuda", "cupy", id="cuda-cupy", marks=_CUDA),
]
CASE_PARAMS = [pytest.param(case, id=case.id) for case in CASES]


@pytest.fixture
def rig_factory(request: pytest.FixtureRequest) -> Any:
    rigs: list[Rig] = []

    def make(*args: Any, **kwargs: Any) -> Rig:
        if args[1] == "cuda":
            request.getfixturevalue("cuda_warm")  # clocks up, delay calibrated, before any rig
        rig = Rig(*args, **kwargs)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.close()


# ---------------------------------------------------------------------------- stores


@pytest.mark.parametrize("case", CASE_PARAMS)
@pytest.mark.parametrize(("device", "backend"), DEVICE_BACKENDS)
def test_store_copies_what_the_forward_wrote_even_while_it_is_queued(
    rig_factory: Callable[..., Rig], device: str, backend: str, case: LayoutCase
) -> None:
    rig = rig_factory(case, device, backend)
    full, partial = (5, 9, 2, 17), (20, 21)

    def stores() -> list[Job]:
        return [Job.store(rig.job_id(), b"a", 3, full, req_id="req"),
                Job.store(rig.job_id(), b"b", 6, partial, req_id="req")]

    def rehearsal() -> None:
        rig.forward([*full, *partial], step=0, delay_ms=1.0)
        jobs = stores()
        rig.step(StepPlan(jobs=jobs))
        rig.results_until([j.job_id for j in jobs])

    rehearse(rig.device, rehearsal)
    before = [rows.clone() for rows in rig.replica_kv.rows]
    done = rig.forward([*full, *partial], step=1, delay_ms=FORWARD_DELAY_MS)
    probe = IssueProbe(rig.engine.backend, done)
    rig.engine.backend = probe
    jobs = stores()
    rig.step(StepPlan(jobs=jobs))
    assert_still_queued(done, "the store")
    outcomes = rig.results_until([j.job_id for j in jobs])["outcomes"]
    assert all((outcomes[j.job_id].ok, outcomes[j.job_id].failed) == (1, 0) for j in jobs), outcomes
    probe.assert_issued_while_pending("d2h")
    for layer, old in enumerate(before):  # the forward did change those blocks
        assert not torch.equal(rig.replica_kv.rows[layer][list(full)], old[list(full)])
    rig.assert_slot_holds(3, full)
    rig.assert_slot_holds(6, partial)
    rig.assert_device_matches_replica()  # a store never writes the device


# ---------------------------------------------------------------------------- loads


@pytest.mark.parametrize("case", CASE_PARAMS)
@pytest.mark.parametrize(("device", "backend"), DEVICE_BACKENDS)
def test_load_is_complete_when_reported_and_touches_no_other_block(
    rig_factory: Callable[..., Rig], device: str, backend: str, case: LayoutCase
) -> None:
    rig = rig_factory(case, device, backend)
    source, targets = (3, 8, 11, 14), (25, 26, 27)
    targets_on_device = torch.tensor(targets).to(rig.device)  # no upload between load and read
    rig.forward(source, step=1)
    store = rig.store(source, slot=2)
    assert (lambda r: (r.ok, r.failed))(rig.results_until([store])["outcomes"][store]) == (1, 0)

    def load_behind_tenant(step: int, delay_ms: float) -> tuple[Any, Job, Any]:
        tenant = rig.forward(targets, step=step, delay_ms=delay_ms)
        load = Job.load(rig.job_id(), "hit", (LoadChunk(b"k2", 2, 1, targets),))  # from mid-chunk
        probe.forward = tenant
        return tenant, load, rig.step(StepPlan(jobs=[load]))

    def rehearsal() -> None:
        _, load, reported = load_behind_tenant(6, 1.0)
        rig.results_until([load.job_id], after=reported)
        rig.replica_load(2, 1, targets)

    probe = IssueProbe(rig.engine.backend, None)
    rig.engine.backend = probe
    rehearse(rig.device, rehearsal)
    probe.pending_at_issue.clear()
    # The targets' previous tenant is still writing them (queued on the compute stream) when
    # the load is submitted: the h2d must land after those writes.
    tenant, load, reported = load_behind_tenant(7, FORWARD_DELAY_MS)
    assert_still_queued(tenant, "the load")
    seen = rig.results_until([load.job_id], after=reported)
    assert (seen["outcomes"][load.job_id].ok, seen["outcomes"][load.job_id].failed) == (1, 0) and "hit" in seen["recving"]
    probe.assert_issued_while_pending("h2d")
    assert rig.worker.take_load_errors() == set()
    # vLLM schedules the request's forward right after get_finished reported the load: it
    # reads the blocks at once, on the compute stream, with no synchronisation in between.
    with rig.in_compute():
        read = [rows[targets_on_device].clone() for rows in rig.kv.rows]
    if rig.compute is not None:
        rig.compute.synchronize()  # before the copies to the CPU below, on another stream
    rig.replica_load(2, 1, targets)
    for layer, got in enumerate(read):
        want = rig.replica_kv.rows[layer][list(targets)]
        assert torch.equal(got.cpu(), want), f"layer {layer}: the forward read stale blocks"
    for layer in range(rig.kv.num_layers):  # and they are the stored blocks 8, 11, 14
        assert torch.equal(rig.replica_kv.rows[layer][list(targets)],
                           rig.replica_kv.rows[layer][list(source[1:])])
    rig.assert_device_matches_replica()


# ---------------------------------------------------------------------------- preemption


@pytest.mark.parametrize("case", CASE_PARAMS)
@pytest.mark.parametrize(("device", "backend"), DEVICE_BACKENDS)
def test_preemption_fence_cancels_queued_and_waits_for_running_stores(
    rig_factory: Callable[..., Rig], device: str, backend: str, case: LayoutCase,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rig = rig_factory(case, device, backend)
    # Fences wait for running stores up to a bound no run reaches: a fence returns either
    # because nothing it covers is running or because the store it waits for finished.
    monkeypatch.setattr(rig.engine, "fence_blocks",
                        partial(rig.engine.fence_blocks, timeout_s=600.0))
    running, queued = (1, 2, 3, 4), (6, 7, 8, 9)
    rig.forward([*running, *queued], step=1)
    gated = GatedStores(rig.engine.backend)
    rig.engine.backend = gated
    slot1_before = rig.host.slot(1).clone()
    store_a = rig.store(running, slot=0, req="a")
    assert gated.started.wait(10), "the first store never reached its lane"
    store_b = rig.store(queued, slot=1, req="b")  # queued behind the running one
    # vLLM preempted b: its blocks are free. The fence returns while a is still held at its
    # gate: a fence on a queued store does not wait.
    finishes(lambda: rig.step(StepPlan(fence_block_ids=list(queued))))
    assert not gated.gate.is_set()
    rig.forward(queued, step=9)  # the next tenant writes them at once
    order: list[str] = []

    def release_store() -> None:
        order.append("store released")
        gated.gate.set()

    threading.Timer(0.3, release_store).start()
    rig.step(StepPlan(fence_block_ids=list(running)))
    order.append("fence returned")
    assert order == ["store released", "fence returned"], "the fence returned while the store was still copying"
    first_tenant = [rows[list(running)].clone() for rows in rig.replica_kv.rows]
    tenant_a = rig.forward(running, step=9)  # after the fence: may overwrite at once
    outcomes = rig.results_until([store_a, store_b])["outcomes"]
    assert (outcomes[store_a].ok, outcomes[store_a].failed) == (1, 0)
    assert (outcomes[store_b].ok, outcomes[store_b].failed, outcomes[store_b].failure) == (0, 1, FailureCause.CANCELLED)
    if tenant_a is not None:
        tenant_a.synchronize()
    for layer, want in enumerate(first_tenant):  # the first tenant's bytes, not the next one's
        for j in range(len(running)):
            got = slot_block(rig.kv, rig.host, 0, layer, j).cpu()
            assert torch.equal(got, want[j]), f"layer {layer} block {running[j]}"
    assert torch.equal(rig.host.slot(1), slot1_before), "a cancelled store wrote its slot"
    rig.assert_device_matches_replica()


# ---------------------------------------------------------------------------- sleep mode


@pytest.mark.parametrize("case", CASE_PARAMS)
@pytest.mark.parametrize(("device", "backend"), DEVICE_BACKENDS)
def test_sleep_pause_leaves_no_copy_in_flight_and_resumes(
    rig_factory: Callable[..., Rig], device: str, backend: str, case: LayoutCase
) -> None:
    rig = rig_factory(case, device, backend)
    engine = rig.engine
    seen: list[str] = []

    class FakeGpuWorker:
        """vLLM's Worker.sleep/wake_up as worker_side's sleep hook wraps them; sleep notes what
        tieredkv still had in flight at the moment the real one would unmap the KV cache."""

        def sleep(self, level: int = 1) -> None:
            with engine._lock:
                busy_jobs = [j for j in engine._pending.values() if j.move in (Move.STORE, Move.LOAD)]
            streams = [lane.stream for lane in (engine._device.d2h, engine._device.h2d) if lane is not None]
            idle = all(s is None or s.query() for s in streams)
            seen.append(f"sleep device_jobs={len(busy_jobs)} streams_idle={idle}")

        def wake_up(self, tags: object = None) -> None:
            seen.append("wake_up")

    worker_side.patch_worker_class(FakeGpuWorker)
    blocks = (4, 5, 6, 7)
    rig.forward(blocks, step=1)
    gated = GatedStores(engine.backend)
    engine.backend = gated
    store = rig.store(blocks, slot=0)
    assert gated.started.wait(10)

    def release_store() -> None:
        seen.append("store released")
        gated.gate.set()

    threading.Timer(0.2, release_store).start()
    FakeGpuWorker().sleep(1)
    # It waited for the running store: the store was let go before the real sleep ran, and
    # then no device job or copy was left.
    assert seen == ["store released", "sleep device_jobs=0 streams_idle=True"]
    assert (lambda r: (r.ok, r.failed))(rig.results_until([store])["outcomes"][store]) == (1, 0)
    rig.assert_slot_holds(0, blocks)

    # Asleep: a load is refused at once, its blocks reported for recompute and left alone.
    load = Job.load(rig.job_id(), "q", (LoadChunk(b"k0", 0, 0, (30, 31)),))
    _, recving = rig.step(StepPlan(jobs=[load], compute_idle=True))
    assert recving == {"q"} and rig.worker.take_load_errors() == {30, 31}
    rig.assert_device_matches_replica()

    FakeGpuWorker().wake_up()
    assert seen[-1] == "wake_up"
    load = Job.load(rig.job_id(), "q2", (LoadChunk(b"k0", 0, 0, (30, 31)),))
    reported = rig.step(StepPlan(jobs=[load], compute_idle=True))
    seen_load = rig.results_until([load.job_id], after=reported)
    assert seen_load["outcomes"][load.job_id].ok == 1 and seen_load["outcomes"][load.job_id].failed == 0 and "q2" in seen_load["recving"]
    assert rig.worker.take_load_errors() == set()
    rig.replica_load(0, 0, (30, 31))
    rig.assert_device_matches_replica()


# ---------------------------------------------------------------------------- overlap


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def _keep_timeline(backend: str, timeline: dict[str, Any]) -> None:
    """scripts/gpu_check.sh sets GPU_CHECK_TIMELINE: the measured timeline goes in its results."""
    path = os.environ.get("GPU_CHECK_TIMELINE")
    if not path:
        return
    try:
        kept = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        kept = {}
    kept[backend] = timeline
    Path(path).write_text(json.dumps(kept, indent=1) + "\n")


@pytest.mark.parametrize(("device", "backend"), DEVICE_BACKENDS)
def test_d2h_and_h2d_overlap_each_other_and_the_next_forward(
    rig_factory: Callable[..., Rig], device: str, backend: str
) -> None:
    case = CASE_BY_ID["flash_attn-LBHNC"]  # the default on Ampere/Hopper, as tieredkv is served it
    cuda = device == "cuda"
    # CUDA: 64 MiB each way (64 chunks of 1 MiB); CPU: a few chunks, correctness only.
    chunks = 64 if cuda else 3
    rig = rig_factory(case, device, backend, num_blocks=2 * chunks * CHUNK + 8,
                      host_slots=2 * chunks + 1)
    timeline = Timeline(rig.engine.backend)
    rig.engine.backend = timeline
    down = [tuple(range(i * CHUNK, (i + 1) * CHUNK)) for i in range(chunks)]
    up = [tuple(range((chunks + i) * CHUNK, (chunks + i + 1) * CHUNK)) for i in range(chunks)]
    # Load sources: host slots chunks..2*chunks-1 hold known bytes (as if stored earlier).
    gen = torch.Generator().manual_seed(5)
    for i in range(chunks):
        src = torch.randint(0, 256, (rig.host.payload_bytes,), dtype=torch.uint8, generator=gen)
        rig.host.slot(chunks + i).copy_(src)
    # Warm-up with the measured step's batch sizes (all chunks each way): lanes, (cupy) the
    # kernel's compilation, and every staging and pinned index buffer at its final size, so
    # nothing is allocated inside the measured window (a pinned allocation synchronises across
    # streams; a 1-chunk warm-up left them to grow there). It stores `up` and loads into `down`
    # (same shapes), which the forward below overwrites: the measured copies still move new bytes.
    flat_down = [b for ids in down for b in ids]
    rig.forward(flat_down, step=0)
    warm_stores = [Job.store(rig.job_id(), b"w%d" % i, i, ids, req_id="warm") for i, ids in enumerate(up)]
    warm = Job.load(rig.job_id(), "warm",
                   tuple(LoadChunk(b"v%d" % i, chunks + i, 0, ids) for i, ids in enumerate(down)))
    warm_reported = rig.step(StepPlan(jobs=[*warm_stores, warm]))
    rig.results_until([*(s.job_id for s in warm_stores), warm.job_id], after=warm_reported)
    for i, ids in enumerate(down):
        rig.replica_load(chunks + i, 0, ids)
    timeline.spans.clear()
    # Forward N writes the blocks to store; its stores and the loads for step N+1 are submitted
    # while it is queued; forward N+1 follows. Both copies wait for N, then run beside N+1.
    rig.forward(flat_down, step=1, delay_ms=FORWARD_DELAY_MS if cuda else 0.0)
    ref = None
    if cuda:
        ref = torch.cuda.Event(enable_timing=True)
        ref.record(rig.compute)
    stores = [Job.store(rig.job_id(), b"s%d" % i, i, ids, req_id="prev") for i, ids in enumerate(down)]
    load = Job.load(rig.job_id(), "next",
                   tuple(LoadChunk(b"l%d" % i, chunks + i, 0, ids) for i, ids in enumerate(up)))
    reported = rig.step(StepPlan(jobs=[*stores, load]))
    compute_span = None
    if cuda:
        with rig.in_compute():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            a = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16)
            for _ in range(20):  # forward N+1: kernels that keep the SMs busy, ~100 ms
                busy(rig.device, 4.0)
                a = torch.tanh(a @ a)
            end.record()
        compute_span = (start, end)
    seen = rig.results_until([*(s.job_id for s in stores), load.job_id], after=reported)
    assert all((seen["outcomes"][s.job_id].ok, seen["outcomes"][s.job_id].failed) == (1, 0) for s in stores)
    assert (seen["outcomes"][load.job_id].ok, seen["outcomes"][load.job_id].failed) == (1, 0) and "next" in seen["recving"]
    for i, ids in enumerate(down):
        rig.assert_slot_holds(i, ids)
    for i, ids in enumerate(up):
        rig.replica_load(chunks + i, 0, ids)
    rig.assert_device_matches_replica()
    directions = {d for d, _, _ in timeline.spans}
    assert directions == {"d2h", "h2d"}, timeline.spans
    if not cuda:
        return
    torch.cuda.synchronize()

    def span(direction: str) -> tuple[float, float]:
        marks = [(ref.elapsed_time(s), ref.elapsed_time(e)) for d, s, e in timeline.spans if d == direction]
        return min(m[0] for m in marks), max(m[1] for m in marks)

    d2h, h2d = span("d2h"), span("h2d")
    forward = (ref.elapsed_time(compute_span[0]), ref.elapsed_time(compute_span[1]))
    report = (f"GPU timeline, ms after forward N ended: d2h {d2h[0]:.2f}-{d2h[1]:.2f}, "
              f"h2d {h2d[0]:.2f}-{h2d[1]:.2f}, forward N+1 {forward[0]:.2f}-{forward[1]:.2f}")
    print(report)
    _keep_timeline(backend, {"d2h_ms": d2h, "h2d_ms": h2d, "forward_ms": forward,
                             "bytes_each_way": chunks * rig.host.payload_bytes,
                             "gpu": torch.cuda.get_device_name(rig.device)})
    shorter = min(d2h[1] - d2h[0], h2d[1] - h2d[0])
    assert _overlap(d2h, h2d) >= 0.5 * shorter, f"d2h and h2d did not overlap; {report}"
    assert _overlap(d2h, forward) >= 0.5 * (d2h[1] - d2h[0]), f"d2h did not overlap compute; {report}"
    assert _overlap(h2d, forward) >= 0.5 * (h2d[1] - h2d[0]), f"h2d did not overlap compute; {report}"
