"""The native CPU copier: the small C extension ``_rowcopy`` (``_rowcopy.c`` next to this file).

Why: one C call per batch, streaming stores, no GIL held while it copies. The extension is
optional at install time; :func:`_import_rowcopy` says why it is missing, and ``auto`` then
falls back to the torch/numpy path (see :func:`tieredkv.transfer.backends.base.select_backend`).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tieredkv.protocol import BackendName
from tieredkv.transfer.backends.base import CopyBackend, Pair, RegistrationCache, check_pairs
from tieredkv.transfer.host_pool import HostPool
from tieredkv.transfer.kv_views import KVViews

_ROWCOPY_API = 2  # copy_blocks takes counts=(num_blocks, num_slots, chunk_blocks)


def _import_rowcopy() -> tuple[Any, str]:
    try:
        from tieredkv.transfer.backends import _rowcopy
    except ImportError as exc:
        return None, (
            f"the C extension tieredkv.transfer.backends._rowcopy is not built ({exc}); "
            "reinstall tieredkv where a C compiler is available"
        )
    if getattr(_rowcopy, "API_VERSION", 1) < _ROWCOPY_API:
        # A build left over from older source takes other arguments: say so here rather than
        # fail on the first copy.
        return None, (
            "the C extension tieredkv.transfer.backends._rowcopy was built from older source; "
            "rebuild it (python setup.py build_ext --inplace, or reinstall tieredkv)"
        )
    return _rowcopy, ""


# (per-layer [rows ptr, block stride, block bytes, slot offset], chunk blocks, address bounds)
_NativePointers = tuple[np.ndarray, int, tuple[int, int, int, int]]


def _native_pointers(dev: KVViews, host: HostPool) -> _NativePointers:
    """Raw addresses of one (caches, pool) pair: valid only while both are alive, which the
    :class:`RegistrationCache` holding it guarantees (an entry goes when either does)."""
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
    return layers, chunk_blocks, bounds


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

    name = BackendName.NATIVE

    def __init__(self, nontemporal: bool = True) -> None:
        module, why = _import_rowcopy()
        if module is None:
            raise ValueError(f"copy_backend='native' is not available here: {why}")
        self._copy = module.copy_blocks
        self.nontemporal = nontemporal
        self._registered: RegistrationCache[_NativePointers] = RegistrationCache(_native_pointers)

    @staticmethod
    def available(device: torch.device) -> tuple[bool, str]:
        if device.type != "cpu":
            return False, "the KV caches are not CPU tensors"
        module, why = _import_rowcopy()
        return module is not None, why

    def _pointers(self, dev: KVViews, host: HostPool) -> _NativePointers:
        return self._registered.get(dev, host)

    def _run(self, dev: KVViews, host: HostPool, pairs: Sequence[Pair], to_host: bool) -> None:
        if not pairs:
            return
        layers, chunk_blocks, bounds = self._pointers(dev, host)
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
