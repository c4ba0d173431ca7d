"""The rig behind ``test_gpu_integration.py``: the real worker half and transfer engine on a KV
cache laid out as vLLM serves it (``vllm_cuda_layouts``), a stand-in forward pass written
through the kernels' own views, and a CPU replica of the cache that is the reference for every
byte. No vLLM needed: where it is not installed (the GPU machines), ``tieredkv.vllm.metadata``'s
two vLLM base classes are stood in for while it is imported.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import threading
import time
import types
from collections.abc import Callable, Sequence
from math import prod
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from cuda_ordering import busy, warm_gpu
from transfer_helpers import slot_block
from vllm_cuda_layouts import LayoutCase, build_kv_caches, kv_parts, layer_names

from tests.helpers import full_attention_spec
from tieredkv.config import TieredKVConfig
from tieredkv.protocol import Job, StepPlan
from tieredkv.transfer.backends.base import CopyBackend
from tieredkv.transfer.backends.cupy_backend import CupyCopyBackend
from tieredkv.transfer.kv_views import KVViews

_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"


def _import_worker_half() -> tuple[Any, Any]:
    """``tieredkv.vllm.worker_side`` and ``tieredkv.vllm.metadata``; where vLLM is not installed (the GPU
    machines), ``tieredkv.vllm.metadata``'s two vLLM base classes are stood in for while it is
    imported, then the stand-in modules are removed again (other tests still see no vLLM)."""
    try:
        importlib.import_module(_BASE)
    except ImportError:
        parts = _BASE.split(".")
        added = []
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            if name not in sys.modules:
                module = types.ModuleType(name)
                module.__path__ = []  # a package, so that submodules resolve
                sys.modules[name] = module
                added.append(name)
        base = sys.modules[_BASE]
        base.KVConnectorMetadata = type("KVConnectorMetadata", (), {})  # type: ignore[attr-defined]
        base.KVConnectorWorkerMetadata = type("KVConnectorWorkerMetadata", (), {})  # type: ignore[attr-defined]
        try:
            return importlib.import_module("tieredkv.vllm.worker_side"), importlib.import_module("tieredkv.vllm.metadata")
        finally:
            for name in added:
                sys.modules.pop(name, None)
    return importlib.import_module("tieredkv.vllm.worker_side"), importlib.import_module("tieredkv.vllm.metadata")


_worker_half, _metadata = _import_worker_half()
WorkerHalf = _worker_half.WorkerHalf
WorkerHalf = _worker_half.WorkerHalf
TieredKVMetadata = _metadata.TieredKVMetadata

LAYERS, BLOCKS, CHUNK = 4, 32, 4
FORWARD_DELAY_MS = 150.0  # how long the compute stream stays busy before the forward's writes

# ---------------------------------------------------------------------------- set-up


def _configs(case: LayoutCase, num_layers: int, num_blocks: int) -> tuple[Any, Any]:
    """The fields of vLLM's configs the worker half reads (as tests/vllm/test_worker_side.py)."""
    spec = full_attention_spec(case.block_size, case.num_kv_heads, case.head_size,
                               case.page_size_bytes)
    kv_cache_config = SimpleNamespace(
        num_blocks=num_blocks, kv_cache_layout=case.layout, hash_block_size=case.block_size,
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=layer_names(num_layers))],
    )
    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(
            prefix_caching_hash_algo="sha256", kv_cache_layout=case.layout,
            cache_dtype="fp8" if case.dtype == "uint8" else "auto",
        ),
        model_config=SimpleNamespace(model=f"gpu-integration-{case.id}", dtype=case.compute_dtype,
                                     revision=None),
    )
    return vllm_config, kv_cache_config


class Rig:
    """A registered worker half on ``device``, its caches, and a CPU replica of them."""

    def __init__(self, case: LayoutCase, device: str, backend: str, *, num_layers: int = LAYERS,
                 num_blocks: int = BLOCKS, host_slots: int = 12, seed: int = 0) -> None:
        if backend == "cupy":
            ok, why = CupyCopyBackend.available(torch.device(device))
            if not ok:
                pytest.skip(f"cupy backend: {why}")
        self.case = case
        self.device = torch.device(device)
        self.caches, self.raw = build_kv_caches(case, num_layers, num_blocks, device, seed)
        self.replica, self.replica_raw = build_kv_caches(case, num_layers, num_blocks, "cpu", seed)
        self.replica_kv = KVViews.from_kv_caches(self.replica, num_blocks, layout=case.layout)
        payload = self.replica_kv.slot_payload_bytes(CHUNK)
        vllm_config, kv_cache_config = _configs(case, num_layers, num_blocks)
        config = TieredKVConfig.from_dict({
            "host_bytes": host_slots * -(-payload // 4096) * 4096, "chunk_blocks": CHUNK,
            "copy_backend": backend,
        })
        self.worker = WorkerHalf(vllm_config, kv_cache_config, config)
        try:
            self.worker.register_kv_caches(self.caches)
            self.engine = self.worker.engine
            self.kv: KVViews = self.engine.kv
            self.host = self.worker.host
            assert self.host.num_slots == host_slots
            assert self.kv.stacked is not None  # one backing buffer, as vLLM allocates it
            if backend != "auto":
                assert self.engine.backend.name == backend
        except BaseException:
            self.worker.shutdown()
            raise
        self.compute = None
        if self.device.type == "cuda":
            warm_gpu(self.device.index or 0)  # clocks up and the delay calibrated, once
            self.compute = torch.cuda.Stream(self.device)
        self._ids = iter(range(1, 1_000_000))

    def job_id(self) -> int:
        return next(self._ids)

    def close(self) -> None:
        self.worker.shutdown()

    # -------------------------------------------------------------- the stand-in forward

    def _rows(self, blocks: Sequence[int]) -> list[int]:
        ratio = self.case.ratio
        return [b * ratio + r for b in blocks for r in range(ratio)]

    def forward_values(self, blocks: Sequence[int], step: int) -> list[list[torch.Tensor]]:
        """Per layer, per K/V part: the values the forward writes into ``blocks`` (CPU,
        registered dtype; small integers, exact in every KV dtype, made distinct per block,
        layer, part and step)."""
        case = self.case
        rows = torch.tensor(self._rows(blocks))
        mod = 17 if case.torch_compute_dtype.itemsize == 1 else 251
        out = []
        for layer, tensor in enumerate(self.replica.values()):
            parts = []
            for p, part in enumerate(kv_parts(case, tensor)):
                shape = (len(rows), *part.shape[1:])
                grid = torch.arange(prod(shape)).view(shape)
                v = (grid * 7 + rows.view(-1, 1, 1, 1) * 13 + layer * 131 + p * 29 + step * 3) % mod
                values = (v - mod // 2).to(torch.float32).to(case.torch_compute_dtype)
                parts.append(values.view(case.torch_dtype))
            out.append(parts)
        return out

    def forward(self, blocks: Sequence[int], step: int, *, delay_ms: float = 0.0) -> Any:
        """Write the step's K/V into ``blocks`` of every layer, on the device (CUDA: on the
        compute stream, after ``delay_ms`` of queued work; returns an event recorded after the
        writes) and into the replica."""
        values = self.forward_values(blocks, step)
        rows = torch.tensor(self._rows(blocks))
        for tensor, parts in zip(self.replica.values(), values, strict=True):
            for part, v in zip(kv_parts(self.case, tensor), parts, strict=True):
                part[rows] = v
        if self.compute is None:
            for tensor, parts in zip(self.caches.values(), values, strict=True):
                for part, v in zip(kv_parts(self.case, tensor), parts, strict=True):
                    part[rows] = v
            return None
        # Everything the kernels need is on the device before the compute stream is held up:
        # a synchronous upload after the delay would wait for it and hide the race under test.
        rows_dev = rows.to(self.device)
        values_dev = [[v.to(self.device) for v in parts] for parts in values]
        self.compute.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.compute):
            if delay_ms:
                busy(self.device, delay_ms)
            for tensor, parts in zip(self.caches.values(), values_dev, strict=True):
                for part, v in zip(kv_parts(self.case, tensor), parts, strict=True):
                    part[rows_dev] = v
            done = torch.cuda.Event()
            done.record(self.compute)
        for v in (rows_dev, *(t for parts in values_dev for t in parts)):
            v.record_stream(self.compute)
        return done

    def in_compute(self) -> Any:
        """Context: the compute stream is current (where vLLM's worker thread runs the step)."""
        if self.compute is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.compute)

    # -------------------------------------------------------------- vLLM's calls, one step

    def step(self, plan: StepPlan) -> tuple[set[str], set[str]]:
        """handle_preemptions, start_load_kv, (forward), wait_for_save, get_finished."""
        metadata = TieredKVMetadata(plan=plan)
        with self.in_compute():
            self.worker.handle_preemptions(metadata)
            self.worker.start_jobs(metadata)
            self.worker.submit_stores(metadata)
            return self.worker.collect(set())

    def results_until(self, job_ids: Sequence[int], timeout_s: float = 20.0,
                       after: tuple[set[str], set[str]] | None = None) -> dict:
        """Later steps' get_finished until every job in ``job_ids`` has an outcome."""
        got: dict[int, tuple] = {}
        recving: set[str] = set(after[1]) if after else set()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            _, r = self.worker.collect(set())
            recving |= r
            meta = self.worker.build_worker_meta()
            if meta is not None:
                got.update(meta.results)
            if all(j in got for j in job_ids):
                return {"outcomes": got, "recving": recving}
            time.sleep(0.002)
        raise AssertionError(f"no outcome for jobs {[j for j in job_ids if j not in got]}")

    def store(self, blocks: Sequence[int], slot: int, req: str = "r") -> int:
        job = Job.store(self.job_id(), b"k%d" % slot, slot, tuple(blocks), req_id=req)
        self.step(StepPlan(jobs=[job]))
        return job.job_id

    # -------------------------------------------------------------- checks

    def assert_slot_holds(self, slot: int, blocks: Sequence[int], first: int = 0) -> None:
        """Host slot positions hold the replica's bytes of ``blocks`` (every layer)."""
        for layer in range(self.kv.num_layers):
            for j, block in enumerate(blocks):
                got = slot_block(self.kv, self.host, slot, layer, first + j)
                want = self.replica_kv.rows[layer][block]
                assert torch.equal(got.cpu(), want), (
                    f"{self.case.id}: slot {slot} position {first + j} layer {layer} does not "
                    f"hold block {block} as the forward wrote it"
                )

    def assert_device_matches_replica(self) -> None:
        """Every byte of every layer's cache equals the replica (nothing else was touched)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        got = self.raw.cpu()
        if not torch.equal(got, self.replica_raw):
            bad = (got != self.replica_raw).nonzero().flatten()
            page = self.case.page_size_bytes
            where = sorted({int(i) // page for i in bad[:4096]})[:10]
            raise AssertionError(
                f"{self.case.id}: {bad.numel()} device bytes differ from the expected cache "
                f"(first pages, in units of one layer-block: {where})"
            )

    def replica_load(self, slot: int, first: int, blocks: Sequence[int]) -> None:
        """What a load does, applied to the replica from the slot's bytes."""
        for layer in range(self.kv.num_layers):
            for j, block in enumerate(blocks):
                self.replica_kv.rows[layer][block] = slot_block(
                    self.kv, self.host, slot, layer, first + j).cpu()


class GatedStores(CopyBackend):
    """Wraps the engine's backend: d2h copies wait for ``gate`` (a store in flight)."""

    name = "gated"

    def __init__(self, inner: CopyBackend) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.started = threading.Event()

    def d2h(self, *args: Any) -> None:
        self.started.set()
        self.gate.wait(20)
        self.inner.d2h(*args)

    def h2d(self, *args: Any) -> None:
        self.inner.h2d(*args)


class Timeline(CopyBackend):
    """Wraps the engine's backend; notes when each copy call ran. CUDA: timing events recorded
    on the lane's stream around the call (GPU time); CPU: the wall clock."""

    name = "timeline"

    def __init__(self, inner: CopyBackend) -> None:
        self.inner = inner
        self.spans: list[tuple[str, Any, Any]] = []

    def _mark(self) -> Any:
        if torch.cuda.is_available() and torch.cuda.current_stream().cuda_stream != 0:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _run(self, direction: str, copy: Callable[..., None], *args: Any) -> None:
        start = self._mark()
        copy(*args)
        self.spans.append((direction, start, self._mark()))

    def d2h(self, *args: Any) -> None:
        self._run("d2h", self.inner.d2h, *args)

    def h2d(self, *args: Any) -> None:
        self._run("h2d", self.inner.h2d, *args)


