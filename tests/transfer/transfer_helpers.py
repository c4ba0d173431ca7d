"""Helpers for transfer tests: vLLM-shaped KV caches with random bytes, recorders, pollers.

(A uniquely named module, not conftest: tests/disk has a conftest too.)
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from tests.helpers import make_key  # noqa: F401 - re-exported to the transfer tests
from tieredkv.protocol import Move
from tieredkv.transfer.backends.base import CopyBackend, Pair
from tieredkv.transfer.backends.torch_backend import TorchCopyBackend
from tieredkv.transfer.engine import TransferEngine
from tieredkv.transfer.host_pool import HostPool
from tieredkv.transfer.kv_views import KVViews

FINGERPRINT = hashlib.sha256(b"tieredkv tests/transfer namespace").digest()
_DIMS = "LBHNC"


def layout_caches(
    layout: str = "LBHNC",
    num_layers: int = 3,
    num_blocks: int = 40,
    heads: int = 2,
    tokens: int = 4,
    content: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Per-layer logical [B, H, N, C] views of one random int8 buffer, strided like vLLM's
    ``KVCacheLayout`` (a permutation of the logical [L, B, H, N, C] axes in memory)."""
    itemsize = torch.tensor([], dtype=dtype).element_size()
    shape = {"L": num_layers, "B": num_blocks, "H": heads, "N": tokens, "C": content * itemsize}
    strides: dict[str, int] = {}
    step = 1
    for dim in reversed(layout):
        strides[dim] = step
        step *= shape[dim]
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(-128, 128, (step,), dtype=torch.int8, generator=gen).to(device)
    views = torch.as_strided(raw, [shape[d] for d in _DIMS], [strides[d] for d in _DIMS])
    return {f"model.layers.{i}.self_attn.attn": views[i].view(dtype) for i in range(num_layers)}


def expected_slot(kv: KVViews, chunk_blocks: int, ids: Sequence[int], first: int = 0) -> dict:
    """{(layer, position): bytes} a slot must hold after a d2h of ``ids`` at ``first``."""
    return {
        (layer, first + j): kv.rows[layer][block].clone()
        for layer in range(kv.num_layers)
        for j, block in enumerate(ids)
    }


def slot_block(kv: KVViews, host: HostPool, slot: int, layer: int, position: int) -> torch.Tensor:
    chunk_blocks = kv.chunk_blocks_for(host.payload_bytes)
    offset = kv.layer_offsets(chunk_blocks)[layer] + position * kv.block_bytes[layer]
    return host.slot(slot)[offset : offset + kv.block_bytes[layer]]


def assert_slot_holds(kv: KVViews, host: HostPool, slot: int, ids: Sequence[int], first: int = 0,
                      snapshot: dict | None = None) -> None:
    chunk_blocks = kv.chunk_blocks_for(host.payload_bytes)
    want = snapshot if snapshot is not None else expected_slot(kv, chunk_blocks, ids, first)
    for (layer, position), data in want.items():
        got = slot_block(kv, host, slot, layer, position)
        assert torch.equal(got, data.to(got.device)), f"slot {slot} layer {layer} pos {position}"


def device_snapshot(kv: KVViews) -> list[torch.Tensor]:
    return [rows.clone() for rows in kv.rows]


class SlowBackend(CopyBackend):
    """Wraps a backend; logs (direction, start, end, pairs), optional delay and gate."""

    name = "slow"

    def __init__(self, inner: CopyBackend | None = None, delay_s: float = 0.0) -> None:
        self.inner = inner or TorchCopyBackend()
        self.delay = {"d2h": delay_s, "h2d": delay_s}
        self.gates: dict[str, threading.Event] = {}
        self.started: dict[str, threading.Event] = {"d2h": threading.Event(), "h2d": threading.Event()}
        self.log: list[tuple[str, float, float, list[Pair]]] = []

    def gate(self, direction: str) -> threading.Event:
        """Copies in ``direction`` block until the returned event is set."""
        self.gates[direction] = threading.Event()
        return self.gates[direction]

    def _run(self, direction: str, copy, dev: KVViews, host: HostPool, pairs: Sequence[Pair]) -> None:
        start = time.monotonic()
        self.started[direction].set()
        gate = self.gates.get(direction)
        if gate is not None:
            gate.wait(10)
        if self.delay[direction]:
            time.sleep(self.delay[direction])
        copy(dev, host, pairs)
        self.log.append((direction, start, time.monotonic(), list(pairs)))

    def d2h(self, dev: KVViews, host: HostPool, pairs: Sequence[Pair]) -> None:
        self._run("d2h", self.inner.d2h, dev, host, pairs)

    def h2d(self, dev: KVViews, host: HostPool, pairs: Sequence[Pair]) -> None:
        self._run("h2d", self.inner.h2d, dev, host, pairs)


def recording_io():
    """A FaultyFileIO that also notes when each read starts and ends: (offset, start, end).

    Built on demand so that GPU-only runs (no disk-tier dependencies) can import this module.
    """
    from tieredkv.testing.faulty_fileio import FaultyFileIO

    class RecordingIO(FaultyFileIO):
        def __init__(self) -> None:
            super().__init__()
            self.reads: list[tuple[int, float, float]] = []

        def pread_into(self, fd: int, bufs: list[memoryview], offset: int) -> int:
            start = time.monotonic()
            try:
                return super().pread_into(fd, bufs, offset)
            finally:
                self.reads.append((offset, start, time.monotonic()))

    return RecordingIO()


CHUNK_BLOCKS = 4


def drain(engine: TransferEngine, timeout_s: float | None = None) -> bool:
    """Wait until every job submitted to ``engine`` has its result (left there to poll);
    False on timeout. For tests only: the worker never waits for an empty engine, it polls.
    Every result is recorded under the engine's lock with ``_result_ready`` notified, so the
    wait wakes when the last job ends."""
    with engine._result_ready:
        return engine._result_ready.wait_for(lambda: not engine._pending, timeout_s)


def run_step(planner: Any, engine: TransferEngine, timeout_s: float = 10.0) -> None:
    """One scheduler step on a real engine: the plan's jobs run, every result goes back."""
    plan = planner.take_plan()
    jobs = [*plan.of(Move.REMOTE_READ), *plan.of(Move.PROMOTE), *plan.of(Move.LOAD), *plan.of(Move.SPILL), *plan.of(Move.STORE),
            *plan.of(Move.REMOTE_WRITE)]
    if jobs:
        engine.submit(jobs)
    assert drain(engine, timeout_s), "a job never reported"
    planner.apply(engine.poll())


def results_by_id(engine: TransferEngine, count: int, timeout_s: float = 10.0) -> dict:
    """Poll until ``count`` results arrived; {job_id: JobResult}."""
    got: dict = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        for result in engine.poll():
            assert result.job_id not in got, f"two results for job {result.job_id}"
            got[result.job_id] = result
        if len(got) < count:
            time.sleep(0.002)
    assert len(got) == count, f"got {len(got)} of {count} results: {got}"
    return got
