"""The C copier keeps its own promise: a bad id never becomes a wild write.

These call ``_rowcopy.copy_blocks`` directly, with no :func:`check_pairs` in front, on plain
numpy buffers with a guard region on both sides of the device cache and of the host pool. A
refused table must raise a clear error and leave every byte of both buffers (guards and
neighbouring slots included) as it was; a valid one must still move exactly the right bytes.

Why the particular ids: ``(2**52 + 2) * 4096`` wraps in int64 to 8192 and ``2**62 * 4096`` to
0, addresses well inside the region the bounds describe, so a copier that multiplies before
it checks copies them. ``2**63 - 1`` and the negatives are the other edges.
"""

from __future__ import annotations

from array import array

import numpy as np
import pytest
import torch
from transfer_helpers import layout_caches

from tieredkv.transfer.backends import _rowcopy, native_backend
from tieredkv.transfer.backends.native_backend import NativeCopyBackend
from tieredkv.transfer.host_pool import HostPool
from tieredkv.transfer.kv_views import KVViews

LAYERS = 2
BLOCKS = 4  # device blocks per layer
BB = 4096  # bytes per block: a power of two, so huge ids wrap to in-region addresses
CHUNK = 2  # positions per host slot
SLOTS = 3
SLOT_BYTES = LAYERS * CHUNK * BB  # layer-major slot: [layer 0: CHUNK blocks][layer 1: ...]
GUARD = 2 * BB
COUNTS = (BLOCKS, SLOTS, CHUNK)

HUGE = [2**52 + 2, 2**62, 2**63 - 1]
NEGATIVE = [-1, -(2**52 + 2), -(2**63)]
GOOD = (1, 0, 2)  # (slot, position, block): valid, and listed first in every bad table


def _addr(buf: np.ndarray) -> int:
    return buf.__array_interface__["data"][0]


class Rig:
    """A device cache and a host pool, each between two guard regions, all random bytes."""

    def __init__(self, layout: str = "layer-major", seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.dev = rng.integers(0, 256, GUARD + LAYERS * BLOCKS * BB + GUARD, dtype=np.uint8)
        self.host = rng.integers(0, 256, GUARD + SLOTS * SLOT_BYTES + GUARD, dtype=np.uint8)
        self.dev_lo = _addr(self.dev) + GUARD
        self.host_lo = _addr(self.host) + GUARD
        if layout == "layer-major":  # [L][B][bytes]
            self.layer_start = [layer * BLOCKS * BB for layer in range(LAYERS)]
            self.stride = BB
        else:  # block-major, [B][L][bytes]: the layers interleave per block
            self.layer_start = [layer * BB for layer in range(LAYERS)]
            self.stride = LAYERS * BB
        self.layers = np.array(
            [(self.dev_lo + start, self.stride, BB, layer * CHUNK * BB)
             for layer, start in enumerate(self.layer_start)],
            dtype=np.int64,
        )
        self.bounds = (self.dev_lo, self.dev_lo + LAYERS * BLOCKS * BB,
                       self.host_lo, self.host_lo + SLOTS * SLOT_BYTES)

    def copy(self, items, to_host: bool, counts=COUNTS, nontemporal: bool = True,
             layers=None, host_base=None, slot_bytes=SLOT_BYTES) -> None:
        args = [self.layers if layers is None else layers,
                self.host_lo if host_base is None else host_base, slot_bytes,
                array("q", [v for item in items for v in item]), to_host, nontemporal,
                self.bounds]
        if counts is not None:
            args.append(counts)
        _rowcopy.copy_blocks(*args)

    def dev_offset(self, layer: int, block: int) -> int:
        return GUARD + self.layer_start[layer] + block * self.stride

    def host_offset(self, layer: int, slot: int, pos: int) -> int:
        return GUARD + slot * SLOT_BYTES + layer * CHUNK * BB + pos * BB

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        return self.dev.copy(), self.host.copy()

    def assert_unchanged(self, snap: tuple[np.ndarray, np.ndarray]) -> None:
        assert np.array_equal(self.dev, snap[0]), "a device byte (or its guard) changed"
        assert np.array_equal(self.host, snap[1]), "a host byte (a slot or a guard) changed"


def _bad_items() -> list[tuple[str, tuple[int, int, int]]]:
    cases = []
    for v in HUGE + NEGATIVE:
        cases += [(f"block={v}", (0, 0, v)), (f"slot={v}", (v, 0, 0)), (f"position={v}", (0, v, 0))]
    return cases


BAD = _bad_items()


def _message(item: tuple[int, int, int], counts) -> str:
    """The error a refused item must raise: which id, and that nothing was copied."""
    slot, pos, block = item
    if counts is None:
        return "outside its region; nothing was copied"
    if not 0 <= block < counts[0]:
        return rf"item 1: device block id {block} out of range 0\.\.{counts[0] - 1}; nothing was"
    if not 0 <= slot < counts[1]:
        return rf"item 1: host slot {slot} out of range 0\.\.{counts[1] - 1}; nothing was"
    return rf"item 1: position {pos} out of range 0\.\.{counts[2] - 1} of a chunk; nothing was"


@pytest.mark.parametrize("to_host", [True, False], ids=["d2h", "h2d"])
@pytest.mark.parametrize("with_counts", [True, False], ids=["counts", "no-counts"])
@pytest.mark.parametrize("name,bad", BAD, ids=[name for name, _ in BAD])
def test_huge_and_negative_ids_are_refused_and_nothing_is_copied(
    name: str, bad: tuple[int, int, int], with_counts: bool, to_host: bool
) -> None:
    """Even without the counts, checked arithmetic refuses what int64 would wrap."""
    rig = Rig()
    snap = rig.snapshot()
    counts = COUNTS if with_counts else None
    with pytest.raises(ValueError, match=_message(bad, counts)):
        rig.copy([GOOD, bad], to_host, counts=counts)
    rig.assert_unchanged(snap)


@pytest.mark.parametrize("to_host", [True, False], ids=["d2h", "h2d"])
@pytest.mark.parametrize("with_counts", [True, False], ids=["counts", "no-counts"])
@pytest.mark.parametrize("pos", [CHUNK, CHUNK + 1, 10])
def test_position_past_the_chunk_is_refused(pos: int, with_counts: bool, to_host: bool) -> None:
    """Position CHUNK of the last layer is position 0 of the next slot's first layer: the
    pool's bounds alone let that through. Refused by the counts, and without them by the
    rule that a run stays inside its own slot."""
    rig = Rig()
    snap = rig.snapshot()
    counts = COUNTS if with_counts else None
    with pytest.raises(ValueError, match=_message((0, pos, 0), counts)):
        rig.copy([GOOD, (0, pos, 0)], to_host, counts=counts)
    rig.assert_unchanged(snap)


@pytest.mark.parametrize("to_host", [True, False], ids=["d2h", "h2d"])
def test_position_past_the_chunk_inside_the_slot_is_refused(to_host: bool) -> None:
    """For a layer that is not the slot's last, position CHUNK is the next layer's position 0,
    inside the slot and the pool: only the counts can refuse it."""
    rig = Rig()
    snap = rig.snapshot()
    with pytest.raises(ValueError, match=r"item 1: position 2 out of range 0\.\.1 of a chunk"):
        rig.copy([GOOD, (0, CHUNK, 0)], to_host, layers=rig.layers[:1])
    rig.assert_unchanged(snap)


@pytest.mark.parametrize("to_host", [True, False], ids=["d2h", "h2d"])
def test_slot_and_block_out_of_range_are_refused(to_host: bool) -> None:
    rig = Rig()
    snap = rig.snapshot()
    for bad, counts in [
        ((SLOTS, 0, 0), COUNTS),  # one past the pool
        ((SLOTS + 5, 0, 0), COUNTS),
        ((0, 0, BLOCKS), COUNTS),  # one past the cache
        ((SLOTS, 0, 0), None),
        ((0, 0, BLOCKS * LAYERS), None),
        # Inside the buffers, but past what the caller says it owns: only the counts know.
        ((SLOTS - 1, 0, 0), (BLOCKS, SLOTS - 1, CHUNK)),
        ((0, 0, BLOCKS - 1), (BLOCKS - 1, SLOTS, CHUNK)),
        ((0, CHUNK - 1, 0), (BLOCKS, SLOTS, CHUNK - 1)),
    ]:
        with pytest.raises(ValueError, match=_message(bad, counts)):
            rig.copy([GOOD, bad], to_host, counts=counts)
        rig.assert_unchanged(snap)


def test_the_whole_table_is_refused_whatever_the_position_of_the_bad_item() -> None:
    rig = Rig()
    snap = rig.snapshot()
    good = [(s, p, b) for s in range(SLOTS) for p in range(CHUNK) for b in (p, p + 2)]
    for at in (0, len(good) // 2, len(good)):
        items = good[:at] + [(0, 0, 2**52 + 2)] + good[at:]
        with pytest.raises(ValueError, match=f"item {at}: device block id"):
            rig.copy(items, True)
        rig.assert_unchanged(snap)


@pytest.mark.parametrize("layout", ["layer-major", "block-major"])
@pytest.mark.parametrize("to_host", [True, False], ids=["d2h", "h2d"])
@pytest.mark.parametrize("nontemporal", [True, False], ids=["stream", "memcpy"])
@pytest.mark.parametrize("with_counts", [True, False], ids=["counts", "no-counts"])
def test_valid_tables_copy_exactly_the_right_bytes(
    layout: str, to_host: bool, nontemporal: bool, with_counts: bool
) -> None:
    rig = Rig(layout, seed=3)
    # Adjacent on both sides (merged into one run), scattered, and the last of everything.
    items = [(0, 0, 0), (0, 1, 1), (2, 1, 3), (1, 0, 2), (2, 0, 0)]
    expected_dev, expected_host = rig.snapshot()
    for slot, pos, block in items:
        for layer in range(LAYERS):
            d, h = rig.dev_offset(layer, block), rig.host_offset(layer, slot, pos)
            if to_host:
                expected_host[h:h + BB] = rig.dev[d:d + BB]
            else:
                expected_dev[d:d + BB] = rig.host[h:h + BB]
    rig.copy(items, to_host, counts=COUNTS if with_counts else None, nontemporal=nontemporal)
    rig.assert_unchanged((expected_dev, expected_host))


def test_an_empty_table_copies_nothing() -> None:
    rig = Rig()
    snap = rig.snapshot()
    rig.copy([], True)
    rig.copy([], False, counts=(0, 0, 0))
    rig.assert_unchanged(snap)


def test_bad_layer_tables_and_arguments_are_refused() -> None:
    rig = Rig()
    snap = rig.snapshot()
    for column, value in [(2, 0), (2, -BB), (2, SLOT_BYTES + 1), (1, -BB), (3, -1), (0, -1)]:
        layers = rig.layers.copy()
        layers[1, column] = value
        with pytest.raises(ValueError, match="layer 1: .*nothing was copied"):
            rig.copy([GOOD], True, layers=layers)
    with pytest.raises(ValueError, match="counts must be nonnegative"):
        rig.copy([GOOD], True, counts=(BLOCKS, -1, CHUNK))
    with pytest.raises(TypeError, match=r"counts must be \(num_blocks, num_slots, chunk_blocks\)"):
        rig.copy([GOOD], True, counts=(BLOCKS, SLOTS))
    with pytest.raises(ValueError, match="host_base must be >= 0 and slot_bytes > 0"):
        rig.copy([GOOD], True, host_base=-rig.host_lo)
    with pytest.raises(ValueError, match="host_base must be >= 0 and slot_bytes > 0"):
        rig.copy([GOOD], True, slot_bytes=0)
    rig.assert_unchanged(snap)


def test_native_backend_passes_the_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """With check_pairs out of the way, the extension alone refuses a position past the chunk
    (which stays inside the pool): NativeCopyBackend hands it the counts."""
    assert getattr(_rowcopy, "API_VERSION", 1) >= 2
    kv = KVViews.from_kv_caches(layout_caches(num_layers=2, num_blocks=8), 8)
    chunk = 2
    host = HostPool(3, kv.slot_payload_bytes(chunk), pin=False)
    host.buffer.fill_(7)
    monkeypatch.setattr(native_backend, "check_pairs", lambda *args: None)
    backend = NativeCopyBackend()
    assert backend._pointers(kv, host)[1] == chunk
    with pytest.raises(ValueError, match=r"position 2 out of range 0\.\.1 of a chunk"):
        backend.d2h(kv, host, [(0, 1, [0, 1])])
    with pytest.raises(ValueError, match=r"device block id 8 out of range 0\.\.7"):
        backend.d2h(kv, host, [(0, 0, [8])])
    assert bool((host.buffer == 7).all())
    backend.d2h(kv, host, [(1, 0, [3, 5])])
    for layer in range(kv.num_layers):
        assert torch.equal(kv.rows[layer][3], _slot_row(kv, host, chunk, 1, layer, 0))
        assert torch.equal(kv.rows[layer][5], _slot_row(kv, host, chunk, 1, layer, 1))


def _slot_row(kv: KVViews, host: HostPool, chunk: int, slot: int, layer: int, pos: int):
    bb = kv.block_bytes[layer]
    start = slot * host.slot_bytes + kv.layer_offsets(chunk)[layer] + pos * bb
    return host.buffer[start:start + bb]
