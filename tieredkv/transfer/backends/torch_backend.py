"""Torch copies: batched index ops that work wherever torch does (the CUDA default).

CPU: numpy/torch gathers and scatters per chunk. CUDA: a gather kernel into a bounded device
staging buffer laid out like the slots, then whole slots move by one index kernel through the
pinned pool's device mapping (``mapped``, the default), piece by piece when the batch is larger
than the buffer. Partial chunks, and pools the device cannot address, go by one async DMA per
slot instead (``mapped=False`` forces that path everywhere).

Why mapped: a DMA call per slot costs host time per slot. In ``benchmarks/mapped_probe.py``'s
kept runs (``benchmarks/results/gpu/``, worse direction) 64 KiB x 512 chunks moved at 0.32 of
a contiguous copy mapped against 0.07 by DMA on an H100, and 0.41 against 0.12 on an H200; at
4 MiB chunks the two paths are within 0.02 of each other. A load through the mapped path never
waited for a busy store lane there (16 of 16 on the H100, 8 of 8 on the H200); the one time it
did (H100, 2026-11-26, at 953e5bf) was not reproduced and is not explained.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from tieredkv.protocol import BackendName
from tieredkv.transfer.backends.base import (
    CopyBackend,
    IndexUploader,
    Pair,
    RegistrationCache,
    StagingBuffer,
    check_pairs,
)
from tieredkv.transfer.host_pool import HostPool
from tieredkv.transfer.kv_views import KVViews, widest_item

_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
# Device staging per direction: enough for several slots of most models at once, and a bound
# on what a large load holds (a slot larger than this is staged one at a time).
DEFAULT_STAGING_BYTES = 64 * 1024 * 1024


def _consecutive(ids: Sequence[int]) -> bool:
    first = ids[0]
    return ids[-1] - first == len(ids) - 1 and all(b == first + j for j, b in enumerate(ids))


class _CudaArray:
    """Just enough of ``__cuda_array_interface__`` for torch to alias device-visible memory."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            "strides": None,
        }


def mapped_rows(host: HostPool, device: torch.device, dtype: torch.dtype, width: int,
                payload_elems: int) -> torch.Tensor | None:
    """The pool as a CUDA tensor of (slots, payload) through its device mapping, or None.

    The pool is registered ``cudaHostRegisterMapped``; with unified addressing its device
    address is its host address. That is checked, not assumed: the first bytes read through
    the mapping must equal the host's. The view aliases the pool and must not outlive it (its
    :class:`RegistrationCache` entry goes with the pool).
    """
    buffer = host.buffer
    if not host.pinned or not buffer.numel() or device.type != "cuda":
        return None
    try:
        flat = torch.as_tensor(_CudaArray(buffer.data_ptr(), buffer.numel()), device=device)
        probe = min(4096, buffer.numel())
        if not torch.equal(flat[:probe].cpu(), buffer[:probe]):
            return None
    except (RuntimeError, TypeError, ValueError):  # no mapping: the DMA path serves
        return None
    rows = flat.as_strided((host.num_slots, payload_elems * width), (host.slot_bytes, 1))
    return rows.view(dtype)


class _RegisteredViews:
    """Views of one (device caches, host pool) combination, computed once.

    Holds views of the caches' and the pool's memory, never the KVViews or HostPool objects
    (the :class:`RegistrationCache` entry holding it goes when they do).

    Index ops run on the widest integer dtype that divides every size, stride and offset
    involved: the same bytes as fewer, larger elements (8x fewer on int64 than on uint8).
    """

    def __init__(self, dev: KVViews, host: HostPool, mapped: bool) -> None:
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
        # (slots, payload elems) on the device, aliasing the pinned pool; None: DMA per slot
        self.mapped = (None if self.on_cpu or not mapped else
                       mapped_rows(host, dev.device, self.dtype, w, self.payload_elems))


class TorchCopyBackend(CopyBackend):
    """Batched torch index ops; works wherever torch does.

    CPU: one gather (``index_select`` into the slot) or scatter per chunk, over all layers
    at once when they share one storage; runs of consecutive block ids become slice copies.
    CUDA: gather the blocks of as many slots as fit ``staging_bytes`` into a device staging
    buffer laid out like the slots (one index kernel), then one index kernel writes the whole
    slots through the pool's device mapping (``mapped=False``, a partial chunk or an unmapped
    pool: one async DMA per slot); h2d reverses it. Larger batches go through the same buffer piece by piece, in the
    order of the lane's stream, so a piece never overwrites staging a copy still reads.
    """

    name = BackendName.TORCH

    def __init__(self, staging_bytes: int = DEFAULT_STAGING_BYTES, *, mapped: bool = True) -> None:
        # mapped=False: one DMA per slot even where the pool is mapped (see the module docstring)
        self._registered: RegistrationCache[_RegisteredViews] = RegistrationCache(
            lambda dev, host: _RegisteredViews(dev, host, mapped))
        # One staging buffer and index uploader per direction: d2h and h2d lanes run at once.
        self._staging = {d: StagingBuffer(staging_bytes) for d in ("d2h", "h2d")}
        self._uploads: dict[str, IndexUploader] = {}

    def registered(self, dev: KVViews, host: HostPool) -> _RegisteredViews:
        return self._registered.get(dev, host)

    def d2h(self, dev: KVViews, host: HostPool, pairs: Sequence[Pair]) -> None:
        self._copy(dev, host, pairs, self._d2h_cpu, self._d2h_staged)

    def h2d(self, dev: KVViews, host: HostPool, pairs: Sequence[Pair]) -> None:
        self._copy(dev, host, pairs, self._h2d_cpu, self._h2d_staged)

    def _copy(self, dev: KVViews, host: HostPool, pairs: Sequence[Pair],
              cpu: Callable[[_RegisteredViews, Sequence[Pair]], None],
              staged: Callable[[_RegisteredViews, KVViews, HostPool, Sequence[Pair]], None]) -> None:
        """Check every pair before any byte moves, then copy in one direction: here for
        caches in CPU memory, else through the device staging buffer."""
        if not pairs:
            return
        reg = self.registered(dev, host)
        check_pairs(dev, host, reg.chunk_blocks, pairs)
        if reg.on_cpu:
            cpu(reg, pairs)
        else:
            staged(reg, dev, host, pairs)

    # ------------------------------------------------------------------ CPU

    def _d2h_cpu(self, reg: _RegisteredViews, pairs: Sequence[Pair]) -> None:
        stacked, pool, take = reg.np_stacked, reg.np_pool, reg.take_stacked
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
                    torch.index_select(reg.stacked, 1, torch.tensor(ids),
                                       out=reg.pool[slot, :, first : first + n])
                continue
            index = None
            for layer, (rows, pool_l) in enumerate(zip(reg.np_rows, reg.np_pools, strict=True)):
                out = pool_l[slot, first : first + n]
                if run:
                    out[...] = rows[ids[0] : ids[0] + n]
                elif reg.take_rows[layer]:
                    np.take(rows, ids, axis=0, out=out, mode="wrap")
                else:
                    index = torch.tensor(ids) if index is None else index
                    torch.index_select(reg.rows[layer], 0, index,
                                       out=reg.pools[layer][slot, first : first + n])

    def _h2d_cpu(self, reg: _RegisteredViews, pairs: Sequence[Pair]) -> None:
        stacked, pool = reg.np_stacked, reg.np_pool
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
            for rows, pool_l in zip(reg.np_rows, reg.np_pools, strict=True):
                rows[target] = pool_l[slot, first : first + n]

    # ------------------------------------------------------------------ CUDA (any device)

    def _index_table(
        self, direction: str, pairs: Sequence[Pair], per_piece: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """On ``device``: (3, M), per moved block its pair's place in its piece, its slot
        position and its device block; and (P,), each pair's slot. With each pair's first
        column. One upload per call."""
        counts = np.fromiter((len(ids) for _, _, ids in pairs), dtype=np.int64, count=len(pairs))
        starts = np.zeros(len(pairs) + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        total = int(starts[-1])
        firsts = np.fromiter((f for _, f, _ in pairs), dtype=np.int64, count=len(pairs))
        flat = np.empty(3 * total + len(pairs), dtype=np.int64)
        table = flat[: 3 * total].reshape(3, total)
        table[0] = np.repeat(np.arange(len(pairs), dtype=np.int64) % per_piece, counts)
        table[1] = np.arange(total, dtype=np.int64) + np.repeat(firsts - starts[:-1], counts)
        table[2] = np.fromiter((b for _, _, ids in pairs for b in ids), dtype=np.int64, count=total)
        flat[3 * total :] = np.fromiter((slot for slot, _, _ in pairs), dtype=np.int64,
                                        count=len(pairs))
        uploader = self._uploads.get(direction)
        if uploader is None:
            uploader = self._uploads[direction] = IndexUploader(pin=device.type == "cuda")
        out = uploader.upload(flat, torch.empty(flat.size, dtype=torch.int64, device=device))
        return out[: 3 * total].view(3, total), out[3 * total :], starts

    def _pieces(
        self, direction: str, reg: _RegisteredViews, pairs: Sequence[Pair], device: torch.device
    ) -> Iterator[tuple[Sequence[Pair], torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(pairs, staging (count, payload), indices (3, m), slots (count,)) per piece that
        fits the bound."""
        staging_buffer = self._staging[direction]
        slot_bytes = reg.payload_elems * reg.width
        per_piece = staging_buffer.pieces(slot_bytes)
        table, slots, starts = self._index_table(direction, pairs, per_piece, device)
        try:
            for a in range(0, len(pairs), per_piece):
                piece = pairs[a : a + per_piece]
                count = len(piece)
                staging = staging_buffer.take(count * slot_bytes, device)
                staging = staging.view(reg.dtype).view(count, reg.payload_elems)
                yield (piece, staging, table[:, int(starts[a]) : int(starts[a + count])],
                       slots[a : a + count])
        finally:
            staging_buffer.release(device)

    def _layer_views(self, reg: _RegisteredViews, dev: KVViews, staging: torch.Tensor) -> list[torch.Tensor]:
        """Staging viewed per layer as (count, C, block_elems)."""
        w = reg.width
        views = []
        for bb, off in zip(dev.block_bytes, reg.offsets, strict=True):
            start, size = off // w, reg.chunk_blocks * bb // w
            views.append(staging[:, start : start + size].view(staging.shape[0], reg.chunk_blocks, bb // w))
        return views

    def _d2h_staged(self, reg: _RegisteredViews, dev: KVViews, host: HostPool, pairs: Sequence[Pair]) -> None:
        device = dev.device
        w = reg.width
        C = reg.chunk_blocks
        # A slot named twice in one batch goes by DMA, in order (the last write wins); one index
        # kernel writing a row twice would leave either, or a mix of both.
        mapped = reg.mapped if len({p[0] for p in pairs}) == len(pairs) else None
        if mapped is not None:
            # Whole chunks first, so that in every piece they are a prefix one index kernel
            # writes; a partial chunk keeps the rest of its slot, so it goes by its ranges.
            whole = [p for p in pairs if p[1] == 0 and len(p[2]) == C]
            if len(whole) != len(pairs):
                pairs = [*whole, *(p for p in pairs if not (p[1] == 0 and len(p[2]) == C))]
        for piece, staging, (kk, pos, blocks), slots in self._pieces("d2h", reg, pairs, device):
            count = len(piece)
            if reg.stacked is not None:
                L = dev.num_layers
                layers = torch.arange(L, device=device).view(1, L)
                gathered = reg.stacked[layers, blocks.view(-1, 1)]  # (M, L, block_elems)
                st = staging.view(count, L, C, -1).permute(0, 2, 1, 3)
                st.index_put_((kk, pos), gathered)
            else:
                for rows, st in zip(reg.rows, self._layer_views(reg, dev, staging), strict=True):
                    st.index_put_((kk, pos), rows.index_select(0, blocks))
            done = 0
            if mapped is not None:
                while done < count and piece[done][1] == 0 and len(piece[done][2]) == C:
                    done += 1
                if done:
                    # index_put_, not index_copy_: on the H100 index_copy_ held the GIL until
                    # the lane's queued work ran (a busy d2h lane then stalled the h2d lane).
                    mapped.index_put_((slots[:done],), staging[:done])
            for k in range(done, count):
                slot, first, ids = piece[k]
                n = len(ids)
                if n == 0:
                    continue
                plan_host = host.slot(slot).view(reg.dtype)
                if first == 0 and n == C:
                    plan_host.copy_(staging[k], non_blocking=True)
                    continue
                # A partial chunk: only its positions, per layer, so the rest of the slot stays.
                for bb, off in zip(dev.block_bytes, reg.offsets, strict=True):
                    lo, hi = (off + first * bb) // w, (off + (first + n) * bb) // w
                    plan_host[lo:hi].copy_(staging[k, lo:hi], non_blocking=True)

    def _h2d_staged(self, reg: _RegisteredViews, dev: KVViews, host: HostPool, pairs: Sequence[Pair]) -> None:
        device = dev.device
        for piece, staging, (kk, pos, blocks), slots in self._pieces("h2d", reg, pairs, device):
            count = len(piece)
            if reg.mapped is not None:
                torch.index_select(reg.mapped, 0, slots, out=staging)
            else:
                for k, (slot, _, _) in enumerate(piece):
                    staging[k].copy_(host.slot(slot).view(reg.dtype), non_blocking=True)
            if reg.stacked is not None:
                L = dev.num_layers
                layers = torch.arange(L, device=device).view(1, L)
                st = staging.view(count, L, reg.chunk_blocks, -1).permute(0, 2, 1, 3)
                reg.stacked.index_put_((layers, blocks.view(-1, 1)), st[kk, pos])
            else:
                for rows, st in zip(reg.rows, self._layer_views(reg, dev, staging), strict=True):
                    rows.index_copy_(0, blocks, st[kk, pos])
