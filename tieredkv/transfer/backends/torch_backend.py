"""Torch copies: batched index ops that work wherever torch does (the CUDA default).

CPU: numpy/torch gathers and scatters per chunk. CUDA: one gather kernel into a device staging
buffer laid out like the slots, then one async DMA per slot to or from pinned memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tieredkv.protocol import BackendName
from tieredkv.transfer.backends.base import CopyBackend, Pair, check_pairs
from tieredkv.transfer.host_pool import HostPool
from tieredkv.transfer.kv_views import KVViews, widest_item

_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _consecutive(ids: Sequence[int]) -> bool:
    first = ids[0]
    return ids[-1] - first == len(ids) - 1 and all(b == first + j for j, b in enumerate(ids))


class _CopyLayout:
    """Views of one (device caches, host pool) combination, computed once.

    Index ops run on the widest integer dtype that divides every size, stride and offset
    involved: the same bytes as fewer, larger elements (8x fewer on int64 than on uint8).
    """

    def __init__(self, dev: KVViews, host: HostPool) -> None:
        self.chunk_blocks = C = dev.chunk_blocks_for(host.payload_bytes)
        self.offsets = dev.layer_offsets(C)
        base_ptr = host.buffer.data_ptr() if host.buffer.numel() else 0
        self.width = widest_item(
            *dev.block_bytes, *(layer.block_stride for layer in dev.layers),
            *(layer.byte_offset for layer in dev.layers),
            *(layer.rows.data_ptr() for layer in dev.layers),
            *self.offsets, host.slot_bytes, base_ptr,
        )
        self.dtype = _DTYPES[self.width]
        w = self.width
        self.stacked = dev.stacked.view(self.dtype) if dev.stacked is not None else None
        self.rows = [rows.view(self.dtype) for rows in dev.rows]
        buffer = host.buffer
        slots = host.num_slots
        if self.stacked is not None:
            bb = dev.block_bytes[0]
            self.pool = buffer.as_strided(
                (slots, dev.num_layers, C, bb), (host.slot_bytes, C * bb, bb, 1), 0
            ).view(self.dtype)
        else:
            self.pool = None
        self.pools = [
            buffer.as_strided((slots, C, bb), (host.slot_bytes, bb, 1), off).view(self.dtype)
            for bb, off in zip(dev.block_bytes, self.offsets, strict=True)
        ]
        self.on_cpu = dev.device.type == "cpu"
        if self.on_cpu:
            # On CPU, numpy moves rows with one memmove each at ~1-2 us per call; torch's
            # index ops cost a TensorIterator per index (index_copy_ even goes element by
            # element). np.take needs a C-contiguous source (else it copies the whole cache
            # first), so strided layouts gather with torch.index_select instead.
            self.np_stacked = self.stacked.numpy() if self.stacked is not None else None
            self.np_pool = self.pool.numpy() if self.pool is not None else None
            self.np_rows = [r.numpy() for r in self.rows]
            self.np_pools = [p.numpy() for p in self.pools]
            self.take_stacked = bool(
                self.np_stacked is not None and self.np_stacked.flags.c_contiguous
            )
            self.take_rows = [bool(r.flags.c_contiguous) for r in self.np_rows]
        self.payload_elems = host.payload_bytes // w


class TorchCopyBackend(CopyBackend):
    """Batched torch index ops; works wherever torch does.

    CPU: one gather (``index_select`` into the slot) or scatter per chunk, over all layers
    at once when they share one storage; runs of consecutive block ids become slice copies.
    CUDA: gather every block of the batch into one device staging buffer laid out like the
    slots (one index kernel), then one async DMA per slot into pinned memory; h2d reverses it.
    """

    name = BackendName.TORCH

    def __init__(self) -> None:
        self._layouts: dict[tuple[int, int], _CopyLayout] = {}
        # One staging buffer per direction: the d2h and h2d lanes run concurrently.
        self._staging: dict[str, torch.Tensor] = {}

    def layout(self, dev: KVViews, host: HostPool) -> _CopyLayout:
        key = (id(dev), id(host))
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = _CopyLayout(dev, host)
        return layout

    # ------------------------------------------------------------------ CPU

    def d2h(self, dev: KVViews, host: HostPool, pairs: Sequence[Pair]) -> None:
        if not pairs:
            return
        layout = self.layout(dev, host)
        check_pairs(dev, host, layout.chunk_blocks, pairs)
        if not layout.on_cpu:
            return self._d2h_cuda(layout, dev, host, pairs)
        stacked, pool, take = layout.np_stacked, layout.np_pool, layout.take_stacked
        for slot, first, ids in pairs:
            n = len(ids)
            if n == 0:
                continue
            run = n == 1 or _consecutive(ids)
            if stacked is not None:
                out = pool[slot, :, first : first + n]
                if run:
                    out[...] = stacked[:, ids[0] : ids[0] + n]
                elif take:
                    # ids were range-checked above; "wrap" skips numpy's buffered bounds mode
                    np.take(stacked, ids, axis=1, out=out, mode="wrap")
                else:
                    torch.index_select(layout.stacked, 1, torch.tensor(ids),
                                       out=layout.pool[slot, :, first : first + n])
                continue
            index = None
            for layer, (rows, pool_l) in enumerate(zip(layout.np_rows, layout.np_pools, strict=True)):
                out = pool_l[slot, first : first + n]
                if run:
                    out[...] = rows[ids[0] : ids[0] + n]
                elif layout.take_rows[layer]:
                    np.take(rows, ids, axis=0, out=out, mode="wrap")
                else:
                    index = torch.tensor(ids) if index is None else index
                    torch.index_select(layout.rows[layer], 0, index,
                                       out=layout.pools[layer][slot, first : first + n])

    def h2d(self, dev: KVViews, host: HostPool, pairs: Sequence[Pair]) -> None:
        if not pairs:
            return
        layout = self.layout(dev, host)
        check_pairs(dev, host, layout.chunk_blocks, pairs)
        if not layout.on_cpu:
            return self._h2d_cuda(layout, dev, host, pairs)
        stacked, pool = layout.np_stacked, layout.np_pool
        for slot, first, ids in pairs:
            n = len(ids)
            if n == 0:
                continue
            if n == 1 or _consecutive(ids):
                target: Any = slice(ids[0], ids[0] + n)
            else:
                target = np.fromiter(ids, dtype=np.int64, count=n)
            if stacked is not None:
                stacked[:, target] = pool[slot, :, first : first + n]
                continue
            for rows, pool_l in zip(layout.np_rows, layout.np_pools, strict=True):
                rows[target] = pool_l[slot, first : first + n]

    # ------------------------------------------------------------------ CUDA

    def _staging_for(
        self, direction: str, layout: _CopyLayout, count: int, device: torch.device
    ) -> torch.Tensor:
        """(count, payload) staging in slot layout; reused across calls of one lane (the lane
        waits for each batch before issuing the next, so no copy still reads it)."""
        need = count * layout.payload_elems
        staging = self._staging.get(direction)
        if staging is None or staging.numel() < need or staging.dtype != layout.dtype:
            staging = self._staging[direction] = torch.empty(
                max(need, 1), dtype=layout.dtype, device=device
            )
        return staging[:need].view(count, layout.payload_elems)

    @staticmethod
    def _indices(pairs: Sequence[Pair], device: torch.device) -> tuple[torch.Tensor, ...]:
        """(pair index, slot position, device block) per moved block, uploaded in one copy."""
        kk, pos, blocks = [], [], []
        for k, (_, first, ids) in enumerate(pairs):
            kk.extend([k] * len(ids))
            pos.extend(range(first, first + len(ids)))
            blocks.extend(ids)
        table = torch.tensor([kk, pos, blocks], dtype=torch.int64).pin_memory()
        on_device = table.to(device, non_blocking=True)
        return on_device[0], on_device[1], on_device[2]

    def _layer_views(self, layout: _CopyLayout, dev: KVViews, staging: torch.Tensor) -> list[torch.Tensor]:
        """Staging viewed per layer as (count, C, block_elems)."""
        w = layout.width
        views = []
        for bb, off in zip(dev.block_bytes, layout.offsets, strict=True):
            start, size = off // w, layout.chunk_blocks * bb // w
            views.append(staging[:, start : start + size].view(staging.shape[0], layout.chunk_blocks, bb // w))
        return views

    def _d2h_cuda(self, layout: _CopyLayout, dev: KVViews, host: HostPool, pairs: Sequence[Pair]) -> None:
        device = dev.device
        count = len(pairs)
        staging = self._staging_for("d2h", layout, count, device)
        kk, pos, blocks = self._indices(pairs, device)
        if layout.stacked is not None:
            L = dev.num_layers
            layers = torch.arange(L, device=device).view(1, L)
            gathered = layout.stacked[layers, blocks.view(-1, 1)]  # (M, L, block_elems)
            st = staging.view(count, L, layout.chunk_blocks, -1).permute(0, 2, 1, 3)
            st.index_put_((kk, pos), gathered)
        else:
            for rows, st in zip(layout.rows, self._layer_views(layout, dev, staging), strict=True):
                st.index_put_((kk, pos), rows.index_select(0, blocks))
        w = layout.width
        for k, (slot, first, ids) in enumerate(pairs):
            n = len(ids)
            if first == 0 and n == layout.chunk_blocks:
                plan_host = host.slot(slot).view(layout.dtype)
                plan_host.copy_(staging[k], non_blocking=True)
                continue
            # A partial chunk: only its positions, per layer, so the rest of the slot stays.
            for bb, off in zip(dev.block_bytes, layout.offsets, strict=True):
                lo, hi = (off + first * bb) // w, (off + (first + n) * bb) // w
                host.slot(slot).view(layout.dtype)[lo:hi].copy_(staging[k, lo:hi], non_blocking=True)

    def _h2d_cuda(self, layout: _CopyLayout, dev: KVViews, host: HostPool, pairs: Sequence[Pair]) -> None:
        device = dev.device
        count = len(pairs)
        staging = self._staging_for("h2d", layout, count, device)
        for k, (slot, _, _) in enumerate(pairs):
            staging[k].copy_(host.slot(slot).view(layout.dtype), non_blocking=True)
        kk, pos, blocks = self._indices(pairs, device)
        if layout.stacked is not None:
            L = dev.num_layers
            layers = torch.arange(L, device=device).view(1, L)
            st = staging.view(count, L, layout.chunk_blocks, -1).permute(0, 2, 1, 3)
            layout.stacked.index_put_((layers, blocks.view(-1, 1)), st[kk, pos])
        else:
            for rows, st in zip(layout.rows, self._layer_views(layout, dev, staging), strict=True):
                rows.index_copy_(0, blocks, st[kk, pos])
