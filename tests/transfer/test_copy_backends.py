"""Copy backends move exactly the right bytes, for every layout kind, on CPU."""

from __future__ import annotations

import ctypes
import random

import pytest
import torch
from transfer_helpers import assert_slot_holds, expected_slot, layout_caches, slot_block

from tieredkv.transfer.backends import base as backend_select
from tieredkv.transfer.backends import native_backend
from tieredkv.transfer.backends.base import check_pairs, select_backend
from tieredkv.transfer.backends.cupy_backend import CupyCopyBackend, segment_table
from tieredkv.transfer.backends.native_backend import NativeCopyBackend
from tieredkv.transfer.backends.torch_backend import TorchCopyBackend
from tieredkv.transfer.backends.vllm_backend import VllmCopyBackend
from tieredkv.transfer.host_pool import HostPool
from tieredkv.transfer.kv_views import KVViews

C = 4


def _views(kind: str) -> KVViews:
    if kind == "per-layer":
        caches = {
            "a": torch.randint(0, 255, (30, 2, 4, 8), dtype=torch.uint8),
            "b": torch.randn(30, 2, 12),  # another size and dtype: per-layer path
            "c": torch.randint(0, 255, (30, 40, 2), dtype=torch.uint8)[:, 5:37],  # row stride > bytes
        }
        return KVViews.from_kv_caches(caches, 30)
    if kind == "odd-bytes":  # nothing wider than uint8 divides 3 * 5 bytes
        return KVViews.from_kv_caches({"x": torch.randint(0, 255, (30, 3, 5), dtype=torch.uint8)}, 30)
    return KVViews.from_kv_caches(layout_caches(kind, num_layers=3, num_blocks=30, seed=7), 30)


def _pairs(rng: random.Random, host: HostPool, num_blocks: int, count: int, partial: bool) -> list:
    """Random (slot, first, ids) with distinct device blocks; some ids are consecutive runs."""
    free = set(range(num_blocks))
    pairs = []
    for slot in rng.sample(range(host.num_slots), count):
        n = rng.randint(1, C) if partial else C
        first = rng.randint(0, C - n) if partial else 0
        runs = [s for s in range(num_blocks - n + 1) if free.issuperset(range(s, s + n))]
        if runs and rng.random() < 0.3:  # consecutive ids take the slice path
            start = rng.choice(runs)
            ids = tuple(range(start, start + n))
        else:
            ids = tuple(rng.sample(sorted(free), n))
        free.difference_update(ids)
        pairs.append((slot, first, ids))
    return pairs


BACKENDS = ["torch", "native", "vllm-semantics", "segment-table"]


class _PyCopyBlocksOp:
    """What vLLM's CopyBlocksOp does, in plain torch (the real one lacks a CPU implementation)."""

    def __call__(self, src: dict, dst: dict, src_ids: list, dst_ids: list, direction: str) -> None:
        assert direction in ("h2d", "d2h")
        for name, tensor in src.items():
            dst[name][torch.tensor(dst_ids)] = tensor[torch.tensor(src_ids)].cpu()


class _SegmentBackend(TorchCopyBackend):
    """Executes the CuPy kernel's segment table with memmove, so its addresses are checked."""

    def _run(self, dev: KVViews, host: HostPool, pairs: list, d2h: bool) -> None:
        table = segment_table(dev, host, pairs, d2h)
        for src, dst, nbytes in table.T.tolist():
            ctypes.memmove(dst, src, nbytes)

    def d2h(self, dev: KVViews, host: HostPool, pairs: list) -> None:
        self._run(dev, host, pairs, True)

    def h2d(self, dev: KVViews, host: HostPool, pairs: list) -> None:
        self._run(dev, host, pairs, False)


def _backend(name: str):
    if name == "torch":
        return TorchCopyBackend()
    if name == "native":  # must be built wherever the suite runs (CI builds it from source)
        return NativeCopyBackend()
    if name == "vllm-semantics":
        return VllmCopyBackend(_PyCopyBlocksOp())
    return _SegmentBackend()


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("kind", ["LBHNC", "BLHNC", "LBNHC", "per-layer", "odd-bytes"])
@pytest.mark.parametrize("partial", [False, True])
def test_d2h_then_h2d_moves_exact_bytes(backend_name: str, kind: str, partial: bool) -> None:
    rng = random.Random(hash((backend_name, kind, partial)) & 0xFFFF)
    kv = _views(kind)
    host = HostPool(8, kv.slot_payload_bytes(C), pin=False)
    host.buffer.random_(0, 255)
    backend = _backend(backend_name)
    pairs = _pairs(rng, host, kv.num_blocks, 6, partial)
    check_pairs(kv, host, C, pairs)
    before = host.buffer.clone()
    snapshots = {slot: expected_slot(kv, C, ids, first) for slot, first, ids in pairs}
    backend.d2h(kv, host, pairs)
    for slot, first, ids in pairs:
        assert_slot_holds(kv, host, slot, ids, first, snapshot=snapshots[slot])
        # positions outside [first, first + n) of the slot are untouched
        for layer in range(kv.num_layers):
            for pos in set(range(C)) - set(range(first, first + len(ids))):
                off = kv.layer_offsets(C)[layer] + pos * kv.block_bytes[layer] + slot * host.slot_bytes
                assert torch.equal(slot_block(kv, host, slot, layer, pos),
                                   before[off : off + kv.block_bytes[layer]])

    # h2d into other device blocks; everything else on the device stays as it was
    free = [b for b in range(kv.num_blocks) if all(b not in ids for _, _, ids in pairs)]
    rng.shuffle(free)
    back = []
    for slot, first, ids in pairs:
        if len(free) < len(ids):
            break
        back.append((slot, first, tuple(free.pop() for _ in ids)))
    device_before = [rows.clone() for rows in kv.rows]
    backend.h2d(kv, host, back)
    written = {b for _, _, ids in back for b in ids}
    for slot, first, ids in back:
        for layer in range(kv.num_layers):
            for j, block in enumerate(ids):
                assert torch.equal(kv.rows[layer][block], slot_block(kv, host, slot, layer, first + j))
    for layer in range(kv.num_layers):
        for block in set(range(kv.num_blocks)) - written:
            assert torch.equal(kv.rows[layer][block], device_before[layer][block])


def test_segment_table_merges_consecutive_and_splits_long_runs() -> None:
    kv = KVViews.from_kv_caches(layout_caches("LBHNC", num_layers=2, num_blocks=64, tokens=64,
                                              content=128), 64)
    host = HostPool(2, kv.slot_payload_bytes(C), pin=False)
    page = kv.block_bytes[0]  # 2 * 64 * 128 * 2 = 32 KiB
    table = segment_table(kv, host, [(1, 0, (8, 9, 10, 11))], d2h=True)
    # per layer one 128 KiB run, split into 64 KiB pieces
    assert table.shape[1] == 2 * 2
    assert set(table[2].tolist()) == {64 * 1024} and table[2].sum() == 2 * 4 * page
    scattered = segment_table(kv, host, [(1, 0, (8, 3, 20, 5))], d2h=True)
    assert scattered.shape[1] == 2 * 4


def test_check_pairs_refuses_out_of_range() -> None:
    kv = _views("LBHNC")
    host = HostPool(2, kv.slot_payload_bytes(C), pin=False)
    with pytest.raises(ValueError, match="host slot 2"):
        check_pairs(kv, host, C, [(2, 0, (1,))])
    with pytest.raises(ValueError, match="do not fit"):
        check_pairs(kv, host, C, [(0, 3, (1, 2))])
    with pytest.raises(ValueError, match="out of range"):
        check_pairs(kv, host, C, [(0, 0, (30,))])


@pytest.mark.parametrize("nontemporal", [True, False])
@pytest.mark.parametrize("block_bytes", [4096, 8192 + 24, 64 * 1024 + 8])
def test_native_large_rows_match_torch(nontemporal: bool, block_bytes: int) -> None:
    """Rows long enough for streaming stores, including ones that start off 16-byte alignment
    on one side or both (odd row sizes), with random and consecutive block ids."""
    num_blocks, layers = 40, 3
    raw = torch.randint(0, 255, (layers, num_blocks, block_bytes), dtype=torch.uint8)
    kv = KVViews.from_kv_caches({f"l{i}": raw[i] for i in range(layers)}, num_blocks)
    assert kv.stacked is not None
    pairs = [(3, 0, (5, 6, 7, 8)), (0, 1, (30, 2, 17)), (5, 2, (11,))]
    out_native = HostPool(6, kv.slot_payload_bytes(C), pin=False)
    out_torch = HostPool(6, kv.slot_payload_bytes(C), pin=False)
    for pool in (out_native, out_torch):
        pool.buffer.fill_(7)
    NativeCopyBackend(nontemporal=nontemporal).d2h(kv, out_native, pairs)
    TorchCopyBackend().d2h(kv, out_torch, pairs)
    assert torch.equal(out_native.buffer, out_torch.buffer)

    out_native.buffer.random_(0, 255)
    before = raw.clone()
    back = [(3, 0, (20, 21, 22, 23)), (0, 1, (1, 39, 12))]
    NativeCopyBackend(nontemporal=nontemporal).h2d(kv, out_native, back)
    expected = before.clone()
    for slot, first, ids in back:
        for layer in range(layers):
            for j, block in enumerate(ids):
                expected[layer, block] = slot_block(kv, out_native, slot, layer, first + j)
    assert torch.equal(raw, expected)


def test_native_refuses_a_run_outside_its_regions_before_copying() -> None:
    """The C copier checks every address itself: a bad table never becomes a wild write."""
    kv = _views("LBHNC")
    host = HostPool(2, kv.slot_payload_bytes(C), pin=False)
    host.buffer.fill_(9)
    backend = NativeCopyBackend()
    layers, _, bounds = backend._pointers(kv, host)
    from array import array

    good, bad = (0, 0, 1), (2, 0, 2)  # slot 2 of 2 lies past the end of the pool
    items = array("q", [*good, *bad])
    with pytest.raises(ValueError, match="outside its region; nothing was copied"):
        backend._copy(layers, host.buffer.data_ptr(), host.slot_bytes, items, True, True, bounds)
    assert bool((host.buffer == 9).all())  # the good item was not copied either
    with pytest.raises(ValueError, match="outside its region"):
        backend._copy(layers, host.buffer.data_ptr(), host.slot_bytes, array("q", [0, 0, -1]),
                      True, True, bounds)
    with pytest.raises(ValueError, match="multiple of 3"):
        backend._copy(layers, host.buffer.data_ptr(), host.slot_bytes, array("q", [0, 0]),
                      True, True, bounds)


def test_auto_falls_back_to_numpy_with_a_warning_when_native_is_not_built(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    kv = _views("LBHNC")
    host = HostPool(2, kv.slot_payload_bytes(C), pin=False)
    monkeypatch.setattr(native_backend, "_import_rowcopy", lambda: (None, "not built (test)"))
    # Listen on the module's logger itself: vLLM's logging set-up, run by other tests in this
    # process, may have changed how records reach the root logger.
    logger = backend_select.logger
    monkeypatch.setattr(logger, "disabled", False)
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level("WARNING", logger=logger.name):
            assert isinstance(select_backend("auto", kv=kv, host=host), TorchCopyBackend)
    finally:
        logger.removeHandler(caplog.handler)
    assert "slower numpy path: not built (test)" in caplog.text
    with pytest.raises(ValueError, match="copy_backend='native' is not available here"):
        select_backend("native", kv=kv, host=host)


def test_select_backend() -> None:
    kv = _views("LBHNC")
    host = HostPool(2, kv.slot_payload_bytes(C), pin=False)
    assert isinstance(select_backend("auto", kv=kv, host=host), NativeCopyBackend)
    assert select_backend("TORCH", kv=kv, host=host).describe() == "torch"
    assert select_backend("native", kv=kv, host=host).describe().startswith("native")
    with pytest.raises(ValueError, match="copy_backend='cupy'"):
        select_backend("cupy", kv=kv, host=host)
    with pytest.raises(ValueError, match="copy_backend='vllm'.*did not hand over"):
        select_backend("vllm", kv=kv, host=host)
    with pytest.raises(ValueError, match="copy_backend='magic'"):
        select_backend("magic", kv=kv, host=host)
    assert CupyCopyBackend.available(torch.device("cpu"))[0] is False


def test_vllm_backend_trial_detects_a_broken_op() -> None:
    def broken(*args: object) -> None:
        raise TypeError("'NoneType' object is not callable")

    ok, why = VllmCopyBackend.available(broken, torch.device("cpu"))
    assert not ok and "trial copy" in why
    assert VllmCopyBackend.available(_PyCopyBlocksOp(), torch.device("cpu")) == (True, "")

    def wrong(src: dict, dst: dict, *args: object) -> None:
        pass  # "succeeds" without copying

    assert not VllmCopyBackend.available(wrong, torch.device("cpu"))[0]
