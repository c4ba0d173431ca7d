"""The real worker half and transfer engine on KV caches laid out as vLLM's CUDA backends lay
them out, with a stand-in forward pass; no vLLM needed (none is installed on the GPU machines).

Every check runs on ``cpu`` and, where there is a GPU, on ``cuda`` (marked ``cuda``) with each
copy backend a user can pick there (``torch``, the ``auto`` default, and ``cupy``), over every
layout in ``vllm_cuda_layouts.CASES``. The forward writes known K/V through the kernels' own
views (``kv_cache.transpose(1, 2).split(head_size, dim=-1)``); a CPU replica of the same cache
receives the same writes and is the reference for every byte. On CUDA the forward runs on a
compute stream behind a long kernel, so a store or load submitted after it finds it still
queued: only stream/event ordering can make the bytes come out right.

- a store copies exactly what the forward wrote, even when issued while the forward is queued;
- a load is complete when the worker reports it (the next forward, queued at once, reads the
  loaded bytes), lands after the blocks' previous tenant's queued writes, and touches no
  other block of any layer (a hit may start mid-chunk);
- ``handle_preemptions`` cancels a queued store and waits for a running one, so the next
  tenant's writes never reach a slot; the sleep-mode pause (``tieredkv/vllm/sleep_hook.py``)
  leaves no copy queued on any stream when the memory would go, refuses device jobs while
  asleep, and resumes after wake-up;
- d2h and h2d overlap each other and the next forward (CUDA: a timeline from CUDA events
  recorded by this test around every copy call on the lanes' streams; CPU: both complete
  and move the right bytes).

    python -m pytest tests/transfer/test_gpu_integration.py -q          # cpu (+ cuda if any)
    python -m pytest tests/transfer/test_gpu_integration.py -m cuda -q  # the GPU half only
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import sys
import threading
import time
import types
from collections.abc import Callable, Sequence
from functools import cache, partial
from math import prod
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transfer_helpers import slot_block
from vllm_cuda_layouts import (
    CASE_BY_ID,
    CASES,
    DECLARED_LAYOUTS,
    DEFAULT_LAYOUT,
    RECORD_BLOCKS,
    RECORD_LAYERS,
    RECORDED,
    VLLM_VERSION,
    LayoutCase,
    build_kv_caches,
    kv_parts,
    layer_names,
)

from tests.helpers import finishes, full_attention_spec
from tieredkv.config import TieredKVConfig
from tieredkv.protocol import FailureCause, LoadChunk, LoadJob, StepPlan, StoreJob
from tieredkv.transfer.backends.base import CopyBackend
from tieredkv.transfer.backends.cupy_backend import CupyCopyBackend
from tieredkv.transfer.kv_views import KVViews
from tieredkv.vllm import sleep_hook

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
TieredKVMetadata = _metadata.TieredKVMetadata

HAS_CUDA = torch.cuda.is_available()
_CUDA = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]

# (device, copy_backend): on CUDA torch is what "auto" picks; cupy is there by name.
DEVICE_BACKENDS = [
    pytest.param("cpu", "auto", id="cpu-auto"),
    pytest.param("cuda", "torch", id="cuda-torch", marks=_CUDA),
    pytest.param("cuda", "cupy", id="cuda-cupy", marks=_CUDA),
]
CASE_PARAMS = [pytest.param(case, id=case.id) for case in CASES]

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
            _sleep_cycles_per_ms(self.device.index or 0)  # calibrate before any race is set up
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
                v = (grid * 7 + rows.view(-1, 1, 1, 1) * 13 + layer * 131 + p * 29 + step * 17) % mod
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
        job = StoreJob(self.job_id(), b"k%d" % slot, slot, tuple(blocks), req_id=req)
        self.step(StepPlan(stores=[job]))
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


@cache
def _sleep_cycles_per_ms(index: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(20_000_000)
    end.record()
    end.synchronize()
    return 20_000_000 / max(start.elapsed_time(end), 1e-3)


def busy(device: torch.device, ms: float) -> None:
    """Queue ~``ms`` of work on the current stream (a spinning kernel; a matmul loop if torch
    lacks ``_sleep``)."""
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(int(ms * _sleep_cycles_per_ms(device.index or 0)))
        return
    a = torch.randn(2048, 2048, device=device)
    for _ in range(max(1, int(ms / 2))):
        a = torch.tanh(a @ a)


def assert_still_queued(rig: Rig, event: Any, what: str) -> None:
    """CUDA: the forward had not run yet when the jobs were submitted (else the test proves
    nothing about ordering)."""
    if event is not None:
        assert not event.query(), (
            f"the forward finished before {what} was submitted; raise FORWARD_DELAY_MS"
        )


@pytest.fixture
def rig_factory() -> Any:
    rigs: list[Rig] = []

    def make(*args: Any, **kwargs: Any) -> Rig:
        rig = Rig(*args, **kwargs)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.close()


# ---------------------------------------------------------------------------- the layouts


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_fixture_builds_the_recorded_vllm_layout_and_kvviews_finds_each_block(case: LayoutCase) -> None:
    caches, raw = build_kv_caches(case, RECORD_LAYERS, RECORD_BLOCKS)
    shape, stride, offsets = RECORDED[case.id]
    for tensor, offset in zip(caches.values(), offsets, strict=True):
        assert tuple(tensor.shape) == shape and tuple(tensor.stride()) == stride
        assert tensor.storage_offset() == offset and tensor.dtype == case.torch_dtype
        assert tensor.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
    kv = KVViews.from_kv_caches(caches, RECORD_BLOCKS, layout=case.layout)
    assert kv.block_bytes == (case.page_size_bytes,) * RECORD_LAYERS
    assert kv.stacked is not None
    # Mark one block of one layer through the kernels' own views: exactly its row changes.
    before = [rows.clone() for rows in kv.rows]
    layer, block = RECORD_LAYERS - 1, 7
    for part in kv_parts(case, caches[layer_names(RECORD_LAYERS)[layer]]):
        part[block * case.ratio : (block + 1) * case.ratio].fill_(90)
    for other, (rows, old) in enumerate(zip(kv.rows, before, strict=True)):
        for b in range(RECORD_BLOCKS):
            changed = not torch.equal(rows[b], old[b])
            assert changed == (other == layer and b == block), (other, b)
    assert not torch.equal(kv.rows[layer][block], before[layer][block])
    assert bool((kv.rows[layer][block] != before[layer][block]).float().mean() > 0.5)
    assert kv.rows[layer][block].numel() == case.page_size_bytes


def _vllm_registered(case: LayoutCase, kv_interface: Any, layout_cls: Any) -> list[torch.Tensor]:
    """What vLLM's own code builds for ``case`` (get_kv_cache_config + create_kv_cache_views)."""
    if case.mla:
        spec = kv_interface.MLAAttentionSpec(
            block_size=case.block_size, num_kv_heads=1, head_size=case.head_size,
            dtype=case.torch_dtype)
    else:
        spec = kv_interface.FullAttentionSpec(
            block_size=case.block_size, num_kv_heads=case.num_kv_heads, head_size=case.head_size,
            head_size_v=case.head_size_v, dtype=case.torch_dtype)
    assert spec.page_size_bytes == case.page_size_bytes
    layout = layout_cls[case.layout]
    per_block = spec.page_size_bytes * RECORD_LAYERS
    layer_stride, block_stride, *_ = kv_interface.compute_layout_strides(
        spec, RECORD_BLOCKS, RECORD_LAYERS, layout,
        fixed_strides=(None, per_block if layout.is_block_outermost else None, None, None, None))
    tensor = kv_interface.KVCacheTensor(
        size=per_block * RECORD_BLOCKS, layers=layer_names(RECORD_LAYERS),
        layer_stride=layer_stride, block_stride=block_stride)
    raw = torch.zeros(per_block * RECORD_BLOCKS, dtype=torch.int8)
    return kv_interface.create_kv_cache_views(raw, spec, RECORD_BLOCKS, layout, tensor,
                                              kernel_block_size=case.kernel_block_size)


def test_recorded_layouts_match_the_installed_vllm() -> None:
    """Where vLLM is installed: the data above is still what it registers (else re-record)."""
    kv_interface = pytest.importorskip("vllm.v1.kv_cache_interface")
    import vllm
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1.attention.backends import utils as backend_utils
    from vllm.v1.kv_cache_layout import KVCacheLayout

    assert vllm.__version__ == VLLM_VERSION, (
        f"vLLM {vllm.__version__} installed, layouts recorded from {VLLM_VERSION}: re-read the "
        "backends listed in tests/transfer/vllm_cuda_layouts.py and re-record"
    )
    for case in CASES:
        views = _vllm_registered(case, kv_interface, KVCacheLayout)
        got = (tuple(views[0].shape), tuple(views[0].stride()), tuple(v.storage_offset() for v in views))
        assert got == RECORDED[case.id], case.id
        assert views[0].dtype == case.torch_dtype, case.id
    assert backend_utils._DEFAULT_LAYOUT_PREFERENCE[0].name == DEFAULT_LAYOUT
    assert STR_DTYPE_TO_TORCH_DTYPE["fp8"] is torch.uint8
    backends_dir = inspect.getfile(backend_utils).rsplit("/", 1)[0]
    importable = {
        "FLASH_ATTN": ("flash_attn", "FlashAttentionBackend"),
        "TRITON_ATTN": ("triton_attn", "TritonAttentionBackend"),
        "FLEX_ATTENTION": ("flex_attention", "FlexAttentionBackend"),
    }
    for name, (module, cls) in importable.items():
        backend = getattr(importlib.import_module(f"vllm.v1.attention.backends.{module}"), cls)
        declared = backend.supported_kv_cache_layouts()
        assert (None if declared is None else tuple(d.name for d in declared)) == DECLARED_LAYOUTS[name]
    with open(f"{backends_dir}/flashinfer.py") as f:  # needs flashinfer to import: read it
        flashinfer = f.read()
    assert "return (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC)" in flashinfer
    assert "return [16, 32, 64]" in flashinfer
    with open(f"{backends_dir}/mla/flashmla.py") as f:
        flashmla = f.read()
    assert "supported_kv_cache_layouts" not in flashmla and "return [64]" in flashmla
    with open(f"{backends_dir}/flash_attn.py") as f:
        assert "kv_cache.transpose(1, 2).split(self.head_size, dim=-1)" in f.read()


# ---------------------------------------------------------------------------- stores


@pytest.mark.parametrize("case", CASE_PARAMS)
@pytest.mark.parametrize(("device", "backend"), DEVICE_BACKENDS)
def test_store_copies_what_the_forward_wrote_even_while_it_is_queued(
    rig_factory: Callable[..., Rig], device: str, backend: str, case: LayoutCase
) -> None:
    rig = rig_factory(case, device, backend)
    full, partial = (5, 9, 2, 17), (20, 21)
    before = [rows.clone() for rows in rig.replica_kv.rows]
    done = rig.forward([*full, *partial], step=1, delay_ms=FORWARD_DELAY_MS)
    jobs = [StoreJob(rig.job_id(), b"a", 3, full, req_id="req"), StoreJob(rig.job_id(), b"b", 6, partial, req_id="req")]
    rig.step(StepPlan(stores=jobs))
    assert_still_queued(rig, done, "the store")
    outcomes = rig.results_until([j.job_id for j in jobs])["outcomes"]
    assert all((outcomes[j.job_id].ok, outcomes[j.job_id].failed) == (1, 0) for j in jobs), outcomes
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
    rig.forward(source, step=1)
    store = rig.store(source, slot=2)
    assert (lambda r: (r.ok, r.failed))(rig.results_until([store])["outcomes"][store]) == (1, 0)
    # The targets' previous tenant is still writing them (queued on the compute stream) when
    # the load is submitted: the h2d must land after those writes.
    tenant = rig.forward(targets, step=7, delay_ms=FORWARD_DELAY_MS)
    load = LoadJob(rig.job_id(), "hit", (LoadChunk(b"k2", 2, 1, targets),))  # from mid-chunk
    reported = rig.step(StepPlan(loads=[load]))
    assert_still_queued(rig, tenant, "the load")
    seen = rig.results_until([load.job_id], after=reported)
    assert (seen["outcomes"][load.job_id].ok, seen["outcomes"][load.job_id].failed) == (1, 0) and "hit" in seen["recving"]
    assert rig.worker.take_load_errors() == set()
    # vLLM schedules the request's forward right after get_finished reported the load: it
    # reads the blocks at once, on the compute stream, with no synchronisation in between.
    with rig.in_compute():
        read = [rows[list(targets)].clone() for rows in rig.kv.rows]
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
        """vLLM's Worker.sleep/wake_up as sleep_hook wraps them; sleep notes what tieredkv
        still had in flight at the moment the real one would unmap the KV cache."""

        def sleep(self, level: int = 1) -> None:
            with engine._lock:
                busy_jobs = [j for j in engine._pending.values() if isinstance(j, StoreJob | LoadJob)]
            streams = [lane.stream for lane in (engine._d2h, engine._h2d) if lane is not None]
            idle = all(s is None or s.query() for s in streams)
            seen.append(f"sleep device_jobs={len(busy_jobs)} streams_idle={idle}")

        def wake_up(self, tags: object = None) -> None:
            seen.append("wake_up")

    sleep_hook.patch_worker_class(FakeGpuWorker)
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
    load = LoadJob(rig.job_id(), "q", (LoadChunk(b"k0", 0, 0, (30, 31)),))
    _, recving = rig.step(StepPlan(loads=[load], compute_idle=True))
    assert recving == {"q"} and rig.worker.take_load_errors() == {30, 31}
    rig.assert_device_matches_replica()

    FakeGpuWorker().wake_up()
    assert seen[-1] == "wake_up"
    load = LoadJob(rig.job_id(), "q2", (LoadChunk(b"k0", 0, 0, (30, 31)),))
    reported = rig.step(StepPlan(loads=[load], compute_idle=True))
    seen_load = rig.results_until([load.job_id], after=reported)
    assert seen_load["outcomes"][load.job_id].ok == 1 and seen_load["outcomes"][load.job_id].failed == 0 and "q2" in seen_load["recving"]
    assert rig.worker.take_load_errors() == set()
    rig.replica_load(0, 0, (30, 31))
    rig.assert_device_matches_replica()


# ---------------------------------------------------------------------------- overlap


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
    case = CASE_BY_ID["flash_attn-LBNHC"]  # the default on Ampere/Hopper
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
    # Warm-up: lanes, staging buffers and (cupy) the kernel's compilation, outside the timing.
    rig.forward(down[0], step=0)
    warm_store = rig.store(down[0], slot=0)
    warm = LoadJob(rig.job_id(), "warm", (LoadChunk(b"w", 0, 0, up[0]),))
    warm_reported = rig.step(StepPlan(loads=[warm]))
    rig.results_until([warm_store, warm.job_id], after=warm_reported)
    rig.replica_load(0, 0, up[0])
    timeline.spans.clear()
    # Forward N writes the blocks to store; its stores and the loads for step N+1 are submitted
    # while it is queued; forward N+1 follows. Both copies wait for N, then run beside N+1.
    flat_down = [b for ids in down for b in ids]
    rig.forward(flat_down, step=1, delay_ms=FORWARD_DELAY_MS if cuda else 0.0)
    ref = None
    if cuda:
        ref = torch.cuda.Event(enable_timing=True)
        ref.record(rig.compute)
    stores = [StoreJob(rig.job_id(), b"s%d" % i, i, ids, req_id="prev") for i, ids in enumerate(down)]
    load = LoadJob(rig.job_id(), "next",
                   tuple(LoadChunk(b"l%d" % i, chunks + i, 0, ids) for i, ids in enumerate(up)))
    reported = rig.step(StepPlan(stores=stores, loads=[load]))
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
