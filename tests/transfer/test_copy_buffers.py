"""The copy backends' own buffers: bounded staging, reused pinned index buffers that are never
overwritten while a copy reads them, and registration caches that neither outlive the KV caches nor
hand a new registration a dead one's views."""

from __future__ import annotations

import gc
import random
import weakref

import numpy as np
import pytest
import torch
from test_copy_backends import C, _pairs, _views
from transfer_helpers import layout_caches

from tieredkv.transfer.backends.base import IndexUploader, StagingBuffer
from tieredkv.transfer.backends.native_backend import NativeCopyBackend
from tieredkv.transfer.backends.torch_backend import TorchCopyBackend
from tieredkv.transfer.host_pool import HostPool
from tieredkv.transfer.kv_views import KVViews, layer_view

# ---------------------------------------------------------------------- bounded staging


def _free_blocks_for(kv: KVViews, pairs: list) -> list:
    """The same shapes as ``pairs``, onto device blocks none of them uses."""
    used = {b for _, _, ids in pairs for b in ids}
    free = [b for b in range(kv.num_blocks) if b not in used]
    back = []
    for slot, first, ids in pairs:
        if len(free) < len(ids):
            break
        back.append((slot, first, tuple(free.pop() for _ in ids)))
    return back


@pytest.mark.parametrize("kind", ["LBHNC", "BLHNC", "per-layer", "odd-bytes"])
@pytest.mark.parametrize("partial", [False, True])
def test_staged_copies_go_piece_by_piece_through_a_bounded_buffer(kind: str, partial: bool) -> None:
    """The CUDA path (run here on CPU tensors) stages at most two slots at a time, reuses the
    one buffer across pieces and calls, and moves the bytes the reference path moves."""
    kv = _views(kind)
    ref_host = HostPool(8, kv.slot_payload_bytes(C), pin=False)
    ref_host.buffer.random_(0, 255)
    host = HostPool(8, kv.slot_payload_bytes(C), pin=False)
    host.buffer.copy_(ref_host.buffer)
    pairs = _pairs(random.Random(3), host, kv.num_blocks, 7, partial)  # 7 slots: 4 pieces
    bound = 2 * host.payload_bytes
    reference, staged = TorchCopyBackend(), TorchCopyBackend(staging_bytes=bound)

    reference.d2h(kv, ref_host, pairs)  # on CPU: the numpy path
    staged._d2h_staged(staged.registered(kv, host), kv, host, pairs)
    assert torch.equal(host.buffer, ref_host.buffer)

    for rows in kv.rows:  # the load must change them back
        rows.random_(0, 255)
    before = [rows.clone() for rows in kv.rows]
    reference.h2d(kv, ref_host, pairs)
    expected = [rows.clone() for rows in kv.rows]
    for _ in range(2):  # a second load reuses the same staging memory
        for rows, old in zip(kv.rows, before, strict=True):
            rows.copy_(old)
        staged._h2d_staged(staged.registered(kv, host), kv, host, pairs)
        assert all(torch.equal(r, e) for r, e in zip(kv.rows, expected, strict=True))
    for direction in ("d2h", "h2d"):
        staging = staged._staging[direction]
        assert 0 < staging.capacity_bytes <= bound
        assert staging.allocations == 1
    assert staged._uploads["h2d"].allocations == 2  # two index buffers, reused by the 2nd load


def test_a_slot_larger_than_the_bound_is_staged_alone() -> None:
    buffer = StagingBuffer(limit_bytes=1000)
    assert buffer.pieces(300) == 3 and buffer.pieces(5000) == 1
    piece = buffer.take(5000, torch.device("cpu"))
    assert piece.numel() == 5000 and buffer.capacity_bytes == 5000
    buffer.release(torch.device("cpu"))
    assert buffer.take(700, torch.device("cpu")).data_ptr() == piece.data_ptr()
    assert buffer.allocations == 1


# ---------------------------------------------------------------------- reuse while in flight


class _Event:
    """A copy that stays in flight until the test sets ``done`` or someone waits for it."""

    def __init__(self, log: list, name: str, on_wait=None) -> None:
        self.log, self.name, self.done, self.on_wait = log, name, False, on_wait

    def record(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        if self.on_wait is not None:
            self.on_wait(self)
        self.log.append(f"wait {self.name}")
        self.done = True


def test_staging_is_replaced_only_after_its_last_copy_finished() -> None:
    """Growing past the old buffer drops it: first wait until nothing reads it."""
    log: list[str] = []
    buffer = StagingBuffer(limit_bytes=1 << 20, new_event=lambda device: _Event(log, "use"))
    buffer.take(100, torch.device("cpu"))
    buffer.release(torch.device("cpu"))  # a copy from it is (pretend) still in flight
    assert not log
    buffer.take(4000, torch.device("cpu"))
    assert log == ["wait use"] and buffer.allocations == 2


def test_index_buffers_are_reused_and_grow_geometrically() -> None:
    uploader = IndexUploader(pin=False, count=2, min_elems=16)
    for n in (10, 12, 16, 3, 16, 10):
        values = np.arange(n, dtype=np.int64) * 7
        out = torch.empty(n, dtype=torch.int64)
        uploader.upload(values, out)
        assert out.tolist() == values.tolist()
    assert uploader.allocations == 2 and uploader.capacities() == [16, 16]
    uploader.upload(np.arange(20, dtype=np.int64), torch.empty(20, dtype=torch.int64))
    assert uploader.capacities() == [32, 32]  # max(need, twice the old), every buffer at once
    uploader.upload(np.arange(70, dtype=np.int64), torch.empty(70, dtype=torch.int64))
    assert uploader.capacities() == [70, 70]
    assert uploader.allocations == 6


@pytest.mark.parametrize("count", [2, 3])
def test_after_one_warm_up_call_no_call_of_that_size_allocates(count: int) -> None:
    """Allocating pinned memory synchronises across streams, so a measured run must not: the
    first call (or one that grows) sizes every buffer, not just the one whose turn it is."""
    uploader = IndexUploader(pin=False, count=count, min_elems=16)
    uploader.upload(np.arange(40, dtype=np.int64), torch.empty(40, dtype=torch.int64))
    assert uploader.allocations == count
    for n in (40, 7, 40, 40, 1):
        uploader.upload(np.arange(n, dtype=np.int64), torch.empty(n, dtype=torch.int64))
    assert uploader.allocations == count
    uploader.upload(np.arange(41, dtype=np.int64), torch.empty(41, dtype=torch.int64))
    assert uploader.allocations == 2 * count
    for _ in range(count + 1):
        uploader.upload(np.arange(80, dtype=np.int64), torch.empty(80, dtype=torch.int64))
    assert uploader.allocations == 2 * count


def test_growing_waits_for_a_copy_still_reading_a_buffer_before_dropping_it() -> None:
    log: list[str] = []
    names = iter("ab")
    uploader = IndexUploader(
        pin=False, count=2, min_elems=4, new_event=lambda device: _Event(log, next(names))
    )
    uploader.upload(np.arange(4, dtype=np.int64), torch.empty(4, dtype=torch.int64))  # 0: "a"
    assert not log
    uploader.upload(np.arange(9, dtype=np.int64), torch.empty(9, dtype=torch.int64))
    assert log == ["wait a"]  # buffer 0 was replaced only after its copy finished


def test_an_index_buffer_is_not_overwritten_while_its_copy_is_in_flight() -> None:
    log: list[str] = []
    events: list[_Event] = []
    seen_at_wait: dict[str, list[int]] = {}

    def snapshot(event: _Event) -> None:
        index = events.index(event)
        seen_at_wait[event.name] = uploader._buffers[index % 2][:4].tolist()

    def new_event(device: torch.device) -> _Event:
        event = _Event(log, "abcd"[len(events)], on_wait=snapshot)
        events.append(event)
        return event

    uploader = IndexUploader(pin=False, count=2, min_elems=4, new_event=new_event)
    a, b, c = (np.full(4, v, dtype=np.int64) for v in (1, 2, 3))
    uploader.upload(a, torch.empty(4, dtype=torch.int64))  # buffer 0, in flight
    uploader.upload(b, torch.empty(4, dtype=torch.int64))  # buffer 1: 0 is still read
    assert [buf[:4].tolist() for buf in uploader._buffers] == [[1] * 4, [2] * 4] and not log
    uploader.upload(c, torch.empty(4, dtype=torch.int64))  # both in flight: wait for the oldest
    assert log == ["wait a"] and seen_at_wait["a"] == [1] * 4  # waited before writing
    assert uploader._buffers[1][:4].tolist() == [2] * 4  # b's copy may still read it
    events[1].done = True
    uploader.upload(a, torch.empty(4, dtype=torch.int64))  # c's still pending: b's is free
    assert log == ["wait a"] and uploader._buffers[0][:4].tolist() == [3] * 4
    assert uploader._buffers[1][:4].tolist() == [1] * 4


# ---------------------------------------------------------------------- registration caches


def _backend(name: str):
    return TorchCopyBackend() if name == "torch" else NativeCopyBackend()


@pytest.mark.parametrize("backend_name", ["torch", "native"])
def test_registration_caches_hold_nothing_of_dead_kv_caches(backend_name: str) -> None:
    backend = _backend(backend_name)
    memory = np.random.default_rng(0).integers(0, 255, (3, 30, 64), dtype=np.uint8)
    alive = weakref.ref(memory)
    kv = KVViews.from_kv_caches({f"l{i}": torch.from_numpy(memory)[i] for i in range(3)}, 30)
    host = HostPool(4, kv.slot_payload_bytes(C), pin=False)
    backend.d2h(kv, host, [(0, 0, (1, 2, 3, 4))])
    backend.h2d(kv, host, [(0, 0, (5, 6, 7, 8))])
    assert len(backend._registered) == 1
    del kv, memory
    gc.collect()
    assert alive() is None, "the backend still holds the dead KV caches' memory"
    assert len(backend._registered) == 0


@pytest.mark.parametrize("backend_name", ["torch", "native"])
def test_a_new_registration_never_gets_a_dead_ones_views(backend_name: str) -> None:
    """Each registration's KVViews is built right after the last one died, the way CPython
    hands the dead object's id() to the new one: its copies must read its own caches."""
    backend = _backend(backend_name)
    host = HostPool(4, 3 * 64 * C, pin=False)
    kv = None
    for i in range(12):
        caches = [torch.full((30, 64), i, dtype=torch.uint8) for _ in range(3)]
        layers = [layer_view(f"l{j}", t, 30) for j, t in enumerate(caches)]
        del kv
        kv = KVViews(layers, 30)
        backend.d2h(kv, host, [(0, 0, (1, 2, 3, 4))])
        assert bool((host.slot(0) == i).all()), f"registration {i} copied another's bytes"
        del caches, layers
    host.close()


# ---------------------------------------------------------------------- on a GPU

def _cuda_views(kind: str) -> KVViews:
    if kind == "per-layer":
        caches = {
            "a": torch.randint(0, 255, (30, 2, 4, 8), dtype=torch.uint8, device="cuda"),
            "b": torch.randn(30, 2, 12, device="cuda"),
        }
        return KVViews.from_kv_caches(caches, 30)
    return KVViews.from_kv_caches(
        layout_caches(kind, num_layers=3, num_blocks=30, seed=7, device="cuda"), 30
    )


@pytest.mark.parametrize("partial", [False, True], ids=["whole", "partial"])
@pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "dma"])
@pytest.mark.parametrize("kind", ["LBHNC", "per-layer"])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_staged_copies_are_bounded_and_pin_nothing_per_batch(
    kind: str, mapped: bool, partial: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Seven slots through a two-slot buffer: four pieces; with partial chunks, the mapped path
    # reorders whole chunks first and moves the partial ones by DMA.
    kv = _cuda_views(kind)
    host = HostPool(8, kv.slot_payload_bytes(C), pin=True)
    assert host.buffer.is_pinned()
    backend = TorchCopyBackend(staging_bytes=2 * host.payload_bytes, mapped=mapped)
    pairs = _pairs(random.Random(5), host, kv.num_blocks, 7, partial)
    backend.d2h(kv, host, pairs)  # first batch: allocates the index buffers
    torch.cuda.synchronize()

    def no_pinning(*args: object, **kwargs: object) -> None:
        raise AssertionError("pin_memory() on the copy path")

    monkeypatch.setattr(torch.Tensor, "pin_memory", no_pinning)
    allocations = backend._uploads["d2h"].allocations
    for _ in range(3):
        backend.d2h(kv, host, pairs)
    torch.cuda.synchronize()
    assert backend._uploads["d2h"].allocations == allocations
    assert all(b is None or b.is_pinned() for b in backend._uploads["d2h"]._buffers)
    for slot, first, ids in pairs:
        for layer in range(kv.num_layers):
            for j, block in enumerate(ids):
                bb = kv.block_bytes[layer]
                off = slot * host.slot_bytes + kv.layer_offsets(C)[layer] + (first + j) * bb
                assert torch.equal(host.buffer[off : off + bb], kv.rows[layer][block].cpu())
    back = _free_blocks_for(kv, pairs)
    backend.h2d(kv, host, back)
    torch.cuda.synchronize()
    for slot, first, ids in back:
        for layer in range(kv.num_layers):
            for j, block in enumerate(ids):
                bb = kv.block_bytes[layer]
                off = slot * host.slot_bytes + kv.layer_offsets(C)[layer] + (first + j) * bb
                assert torch.equal(kv.rows[layer][block].cpu(), host.buffer[off : off + bb])
    assert backend._staging["h2d"].capacity_bytes <= 2 * host.payload_bytes
