"""The CuPy copier: ONE kernel launch per batch that moves every block of every layer straight
between device memory and UVA-mapped pinned host memory (no staging buffer, no per-slot DMA).

:func:`segment_table` is pure numpy, so the kernel's addresses can be checked on any machine;
``cupy`` itself is imported only when a :class:`CupyCopyBackend` is made.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tieredkv.protocol import BackendName
from tieredkv.transfer.backends.base import CopyBackend, IndexUploader, Pair, check_pairs
from tieredkv.transfer.host_pool import HostPool
from tieredkv.transfer.kv_views import KVViews

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

    Verified on an H100 (bytes, stream ordering, compute-sanitizer memcheck); not the default
    because it is no faster than ``torch`` there (``benchmarks/results/gpu/``).
    """

    name = BackendName.CUPY

    def __init__(self, device: torch.device | None = None) -> None:
        import cupy  # noqa: F401 - fail here, not mid-copy, if it is missing

        self._cupy = cupy
        self._device = device or torch.device("cuda", torch.cuda.current_device())
        self._kernel: Any = None
        self._sm_count = torch.cuda.get_device_properties(self._device).multi_processor_count
        # Pinned index-table buffers per direction: the d2h and h2d lanes run at once.
        self._uploads = {d2h: IndexUploader(pin=True) for d2h in (True, False)}

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
                runtime = cupy.cuda.runtime
                try:  # CuPy has no hostGetDevicePointer; cudaPointerGetAttributes says it all
                    attrs = runtime.pointerGetAttributes(ptr)
                except Exception as exc:  # noqa: BLE001 - any CUDA error means "cannot map"
                    return False, f"the host pool is not mapped for the device ({exc})"
                if attrs.type != runtime.memoryTypeHost:
                    return False, "the host pool is not page-locked memory registered with CUDA"
                if attrs.devicePointer != ptr:
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
        # A bad id here is memory corruption (raw pointers), not an index error: check it for
        # direct callers too, not only behind the transfer engine's own check.
        check_pairs(dev, host, dev.chunk_blocks_for(host.payload_bytes), pairs)
        table = segment_table(dev, host, pairs, d2h)
        nseg = table.shape[1]
        if nseg == 0:
            return
        # Uploaded through a reused pinned buffer (no page-lock per batch) into a device table
        # allocated on this stream, so the allocator reuses it only after this kernel ran.
        table_dev = torch.empty(table.size, dtype=torch.int64, device=self._device)
        self._uploads[d2h].upload(np.ascontiguousarray(table).ravel(), table_dev)
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
        return "cupy (single-launch UVA kernel)"
