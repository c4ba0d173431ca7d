"""Sleep mode: tieredkv stops touching device memory before vLLM's Worker.sleep frees it.

The CPU build has no sleep mode, so the hook is driven here on a stand-in worker class whose
``sleep`` records what tieredkv was still doing at the moment the real one would free the
memory; the worker half, its engine and the copies are real.
"""

from __future__ import annotations

import threading

import torch
from test_worker_side import LAYERS, block, collect_until, make_worker, step

from tieredkv.protocol import Job, LoadChunk, Move, StepPlan
from tieredkv.vllm import worker_side


class _GatedStores:
    """Wraps the engine's backend: d2h copies wait for a gate (a store in flight)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.started = threading.Event()

    def d2h(self, *args) -> None:
        self.started.set()
        self.gate.wait(10)
        self.inner.d2h(*args)

    def h2d(self, *args) -> None:
        self.inner.h2d(*args)


def test_sleep_waits_for_running_stores_and_refuses_device_jobs_until_wake_up():
    w, caches = make_worker()
    engine = w.engine
    events: list[str] = []

    class FakeWorker:
        def sleep(self, level: int = 1) -> None:
            with engine._lock:
                busy = [j for j in engine._pending.values() if j.move in (Move.STORE, Move.LOAD)]
            events.append(f"sleep level={level} device_jobs={len(busy)}")

        def wake_up(self, tags=None) -> None:
            events.append("wake_up")

    worker_side.patch_worker_class(FakeWorker)
    worker_side.patch_worker_class(FakeWorker)  # idempotent: wrapped once
    try:
        gated = _GatedStores(engine.backend)
        engine.backend = gated
        step(w, StepPlan(jobs=[Job.store(1, b"a" * 32, 0, (4, 5), req_id="r")]))
        assert gated.started.wait(5)

        def release_store() -> None:
            events.append("store released")
            gated.gate.set()

        threading.Timer(0.2, release_store).start()
        FakeWorker().sleep(1)
        # It waited for the running store: the store was let go first, and when vLLM's own
        # sleep ran, no device job was left.
        assert events == ["store released", "sleep level=1 device_jobs=0"]
        _, _, metas = collect_until(w, lambda s, r, m: any(1 in x.results for x in m))
        assert (metas[-1].results[1].ok, metas[-1].results[1].failed) == (1, 0)  # the store completed before the sleep

        # asleep: a load is refused at once and its blocks are reported for recompute
        load = Job.load(2, "q", (LoadChunk(b"a" * 32, 0, 0, (30, 31)),))
        before = [block(caches, layer, 30) for layer in range(LAYERS)]
        _, recving = step(w, StepPlan(jobs=[load], compute_idle=True))
        assert recving == {"q"}
        assert w.take_load_errors() == {30, 31}
        assert all(torch.equal(block(caches, layer, 30), before[layer]) for layer in range(LAYERS))

        FakeWorker().wake_up()
        assert events[-1] == "wake_up"
        load = Job.load(3, "q2", (LoadChunk(b"a" * 32, 0, 0, (30, 31)),))
        _, recving = step(w, StepPlan(jobs=[load], compute_idle=True))
        assert recving == {"q2"} and w.take_load_errors() == set()
        assert torch.equal(block(caches, 0, 30), block(caches, 0, 4))
    finally:
        w.shutdown()


def test_the_hook_wraps_vllms_gpu_worker_when_a_worker_half_starts():
    import vllm.v1.worker.gpu_worker as gpu_worker

    w, _ = make_worker()
    try:
        assert getattr(gpu_worker.Worker.sleep, "_tieredkv_sleep_hook", False)
        assert getattr(gpu_worker.Worker.wake_up, "_tieredkv_sleep_hook", False)
        assert w in set(worker_side._halves)
    finally:
        w.shutdown()
