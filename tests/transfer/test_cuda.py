"""CUDA-only checks: pinned memory, stream ordering, every backend's bytes, d2h/h2d lanes independent.

Skipped without CUDA. Needs only torch (and cupy for the cupy backend), not vLLM nor the disk
tier's dependencies: ``python -m pytest tests/transfer/test_cuda.py -m cuda -q``.
"""

from __future__ import annotations

import random

import pytest
import torch
from cuda_ordering import IssueProbe, assert_still_queued, busy, rehearse
from transfer_helpers import layout_caches, make_key, results_by_id, slot_block

from tieredkv.protocol import Job, LoadChunk
from tieredkv.transfer.backends.base import select_backend
from tieredkv.transfer.backends.cupy_backend import CupyCopyBackend
from tieredkv.transfer.backends.torch_backend import TorchCopyBackend
from tieredkv.transfer.backends.vllm_backend import VllmCopyBackend
from tieredkv.transfer.engine import TransferEngine
from tieredkv.transfer.host_pool import HostPool
from tieredkv.transfer.kv_views import KVViews
from tieredkv.transfer.lanes import CopyLane

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

C = 4


def _cuda_views(kind: str, num_blocks: int = 64) -> KVViews:
    if kind == "per-layer":
        caches = {
            "a": torch.randint(0, 255, (num_blocks, 2, 16, 64), dtype=torch.uint8, device="cuda"),
            "b": torch.randn(num_blocks, 8, 32, device="cuda", dtype=torch.float16),
        }
        return KVViews.from_kv_caches(caches, num_blocks)
    return KVViews.from_kv_caches(
        layout_caches(kind, num_layers=4, num_blocks=num_blocks, heads=2, tokens=16, content=64,
                      device="cuda", seed=3), num_blocks)


class _TorchCopyBlocksOp:
    """vLLM's CUDA CopyBlocksOp semantics (``dst[ids] = src[ids].cpu()``); no vLLM here."""

    def __call__(self, src: dict, dst: dict, src_ids: list, dst_ids: list, direction: str) -> None:
        for name, tensor in src.items():
            target = dst[name]
            picked = tensor[torch.tensor(src_ids, device=tensor.device)]
            target[torch.tensor(dst_ids, device=target.device)] = picked.to(target.device)


def _backend(name: str):
    if name == "torch":
        return TorchCopyBackend()
    if name == "torch-dma":
        return TorchCopyBackend(mapped=False)
    if name == "vllm":
        return VllmCopyBackend(_TorchCopyBlocksOp())
    ok, why = CupyCopyBackend.available(torch.device("cuda"))
    if not ok:
        pytest.skip(why)
    return CupyCopyBackend(torch.device("cuda"))


def test_host_pool_is_pinned_and_mapped() -> None:
    pool = HostPool(3, 1 << 20)
    assert pool.pinned and pool.buffer.is_pinned()
    assert pool.buffer.data_ptr() % 4096 == 0
    ok, why = CupyCopyBackend.available(torch.device("cuda"), pool)
    try:
        import cupy  # noqa: F401
    except ImportError:
        return
    assert ok, why  # UVA: the pinned pool is addressable from the device at the same pointer


def test_torch_moves_slots_through_the_pools_device_mapping() -> None:
    # The default: one index kernel per piece through the mapped pool, not one DMA call per
    # slot. A pool the device cannot address falls back to DMA, and mapped=False forces it.
    kv = _cuda_views("LBHNC")
    pinned, plain = HostPool(4, kv.slot_payload_bytes(C)), HostPool(4, kv.slot_payload_bytes(C), pin=False)
    backend = TorchCopyBackend()
    assert backend.registered(kv, pinned).mapped is not None
    assert backend.registered(kv, plain).mapped is None
    assert TorchCopyBackend(mapped=False).registered(kv, pinned).mapped is None


@pytest.mark.parametrize("backend_name", ["torch", "torch-dma", "cupy", "vllm"])
@pytest.mark.parametrize("kind", ["LBHNC", "BLHNC", "per-layer"])
def test_every_backend_moves_the_right_bytes(backend_name: str, kind: str) -> None:
    rng = random.Random(11)
    kv = _cuda_views(kind)
    host = HostPool(16, kv.slot_payload_bytes(C))
    host.buffer.random_(0, 255)
    backend = _backend(backend_name)
    blocks = rng.sample(range(kv.num_blocks), kv.num_blocks)
    pairs = []
    for i, slot in enumerate(rng.sample(range(host.num_slots), 10)):
        n = C if i % 3 else rng.randint(1, C - 1)  # some partial chunks
        first = 0 if n == C else rng.randint(0, C - n)
        pairs.append((slot, first, tuple(blocks.pop() for _ in range(n))))
    before = host.buffer.clone()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        backend.d2h(kv, host, pairs)
    stream.synchronize()
    touched = set()
    for slot, first, ids in pairs:
        for layer in range(kv.num_layers):
            for j, block in enumerate(ids):
                touched.add((slot, layer, first + j))
                assert torch.equal(slot_block(kv, host, slot, layer, first + j),
                                   kv.rows[layer][block].cpu())
    chunk_blocks = kv.chunk_blocks_for(host.payload_bytes)
    for slot, _, _ in pairs:  # positions the pairs did not name are untouched
        for layer in range(kv.num_layers):
            for pos in range(chunk_blocks):
                if (slot, layer, pos) in touched:
                    continue
                off = slot * host.slot_bytes + kv.layer_offsets(chunk_blocks)[layer] + pos * kv.block_bytes[layer]
                assert torch.equal(slot_block(kv, host, slot, layer, pos),
                                   before[off : off + kv.block_bytes[layer]])
    back = [(slot, first, tuple(blocks.pop() for _ in ids)) for slot, first, ids in pairs[:5]]
    device_before = [rows.clone() for rows in kv.rows]
    with torch.cuda.stream(stream):
        backend.h2d(kv, host, back)
    stream.synchronize()
    written = set()
    for slot, first, ids in back:
        for layer in range(kv.num_layers):
            for j, block in enumerate(ids):
                written.add(block)
                assert torch.equal(kv.rows[layer][block].cpu(), slot_block(kv, host, slot, layer, first + j))
    for layer in range(kv.num_layers):
        others = [b for b in range(kv.num_blocks) if b not in written]
        assert torch.equal(kv.rows[layer][others], device_before[layer][others])


@pytest.mark.parametrize("backend_name", ["torch", "torch-dma"])
def test_a_slot_named_twice_in_one_store_holds_the_last_chunk(backend_name: str) -> None:
    # The backend API allows it (the engine's slot guard does not produce it): a slot written
    # twice in one batch ends as the later pair wrote it, never a mix. The mapped path sends
    # such a batch by DMA, in order.
    kv = _cuda_views("LBHNC")
    host = HostPool(4, kv.slot_payload_bytes(C))
    backend = _backend(backend_name)
    backend.d2h(kv, host, [(1, 0, (1, 2, 3, 4)), (2, 0, (9, 10, 11, 12)), (1, 0, (5, 6, 7, 8))])
    torch.cuda.synchronize()
    for layer, rows in enumerate(kv.rows):
        for slot, blocks in ((1, (5, 6, 7, 8)), (2, (9, 10, 11, 12))):
            for j, block in enumerate(blocks):
                assert torch.equal(slot_block(kv, host, slot, layer, j), rows[block].cpu())


@pytest.mark.parametrize("backend_name", ["torch", "torch-dma", "cupy"])
def test_store_is_ordered_after_the_compute_stream(backend_name: str, cuda_warm: float) -> None:
    kv = _cuda_views("LBHNC", num_blocks=16)
    host = HostPool(4, kv.slot_payload_bytes(C))
    probe = IssueProbe(_backend(backend_name), None)
    engine = TransferEngine(kv, host, None, backend=probe)
    device = torch.device("cuda")
    # On the device before anything is queued: indexing with a Python list uploads the ids from
    # pageable memory, which waits for the stream, so the forward would be over before the store.
    blocks = torch.tensor([1, 2, 3, 4]).to(device)

    def forward_then_store(job_id: int, value: int, delay_ms: float) -> torch.cuda.Event:
        for rows in kv.rows:
            rows.index_fill_(0, blocks, 0)
        torch.cuda.synchronize()
        busy(device, delay_ms)  # the forward's queued work on the compute (current) stream
        for rows in kv.rows:  # the forward's "write" happens after all of that
            rows.index_fill_(0, blocks, value)
        written = torch.cuda.Event()
        written.record()
        probe.forward = written
        engine.submit([Job.store(job_id, make_key(job_id), 2, (1, 2, 3, 4))])  # no sync before
        return written

    try:
        rehearse(device, lambda: (forward_then_store(1, 5, 1.0), results_by_id(engine, 1)))
        probe.pending_at_issue.clear()
        written = forward_then_store(2, 7, 150.0)
        assert_still_queued(written, "the store")
        assert results_by_id(engine, 1, timeout_s=60.0)[2].ok
        probe.assert_issued_while_pending("d2h")
        assert bool((host.slot(2) == 7).all()), "the store copied blocks before the forward wrote them"
    finally:
        engine.shutdown()


@pytest.mark.parametrize("backend_name", ["torch", "torch-dma", "cupy"])
def test_engine_store_then_load_on_cuda(backend_name: str) -> None:
    kv = _cuda_views("LBHNC")
    host = HostPool(8, kv.slot_payload_bytes(C))
    engine = TransferEngine(kv, host, None, backend=_backend(backend_name))
    try:
        want = [rows[[5, 9, 2, 40]].clone() for rows in kv.rows]
        engine.submit([Job.store(1, make_key(1), 3, (5, 9, 2, 40))])
        assert results_by_id(engine, 1)[1].ok
        engine.submit([Job.load(2, "r", (LoadChunk(make_key(1), 3, 1, (60, 61, 62)),))])
        assert results_by_id(engine, 1)[2].ok
        for rows, expected in zip(kv.rows, want, strict=True):
            assert torch.equal(rows[[60, 61, 62]], expected[1:])
    finally:
        engine.shutdown()


@pytest.mark.parametrize("backend_name", ["torch", "torch-dma", "cupy"])
def test_a_busy_d2h_lane_does_not_hold_back_h2d(cuda_warm: float, backend_name: str) -> None:
    # Order, not speed: the d2h lane's stream is held by a kernel that spins for seconds, and an
    # h2d copy on its own lane must finish while that work is still queued (one shared stream
    # or a device-wide sync would make it wait). How far the two directions overlap on the GPU
    # timeline is test_gpu_integration's check; their bandwidth is the transfer benchmark's.
    # The mapped path (torch's default) failed this once on an H100 (2026-11-26, at 953e5bf);
    # benchmarks/mapped_probe.py repeats it with fresh streams on each GPU a session gets.
    kv = _cuda_views("LBHNC", num_blocks=64)
    host = HostPool(4, kv.slot_payload_bytes(C))
    backend = _backend(backend_name)
    d2h, h2d = CopyLane("d2h", kv.device, None), CopyLane("h2d", kv.device, None)
    up_blocks = (40, 41, 42, 43)
    up_ids = torch.tensor(up_blocks).to(kv.device)  # no pageable upload while the lane is held
    host.slot(1).fill_(9)
    try:
        # Both copies once with nothing held, so no first launch (lazy kernel loading can
        # synchronise the context) makes the h2d wait for the held lane; with the measured
        # calls' batch shapes, so each lane's staging and pinned index buffers already have
        # their final size (allocating pinned memory is an implicit synchronisation too).
        d2h.call(d2h.run, lambda: backend.d2h(kv, host, [(2, 0, (5, 6, 7, 8))])).result(timeout=60)
        h2d.call(h2d.run, lambda: backend.h2d(kv, host, [(3, 0, (44, 45, 46, 47))])).result(timeout=60)
        torch.cuda.synchronize()

        def held_store() -> None:
            torch.cuda._sleep(5_000_000_000)  # seconds of spinning at any H100/H200 clock
            backend.d2h(kv, host, [(0, 0, (1, 2, 3, 4))])

        held = d2h.call(d2h.run, held_store)
        loaded = h2d.call(h2d.run, lambda: backend.h2d(kv, host, [(1, 0, up_blocks)]))
        loaded.result(timeout=60)
        assert not held.done(), "the h2d copy waited for the d2h lane's queued work"
        assert all(bool((rows[up_ids] == 9).all()) for rows in kv.rows)
        held.result(timeout=60)
        for layer, rows in enumerate(kv.rows):
            for j, block in enumerate((1, 2, 3, 4)):
                assert torch.equal(slot_block(kv, host, 0, layer, j), rows[block].cpu())
    finally:
        d2h.stop(1.0)
        h2d.stop(1.0)


def test_auto_picks_torch_on_cuda_and_cupy_only_by_name() -> None:
    # Only a backend verified on a GPU may be the default: torch's batched copies. CuPy's
    # single-launch kernel stays available as copy_backend: cupy.
    kv = _cuda_views("LBHNC", num_blocks=8)
    host = HostPool(2, kv.slot_payload_bytes(C))
    assert select_backend("auto", kv=kv, host=host).name == "torch"
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="copy_backend='cupy'"):
            select_backend("cupy", kv=kv, host=host)
    else:
        assert select_backend("cupy", kv=kv, host=host).name == "cupy"
