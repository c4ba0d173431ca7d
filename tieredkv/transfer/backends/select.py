"""Which copy backend a worker uses: ``copy_backend`` from the config, checked against what this
machine can run, with ``auto`` picking the verified default for the device."""

from __future__ import annotations

import logging

import torch

from tieredkv.protocol import BackendName
from tieredkv.transfer.backends.base import CopyBackend
from tieredkv.transfer.backends.cupy_backend import CupyCopyBackend
from tieredkv.transfer.backends.native_backend import NativeCopyBackend
from tieredkv.transfer.backends.torch_backend import TorchCopyBackend
from tieredkv.transfer.backends.vllm_backend import CopyBlocksOp, VllmCopyBackend
from tieredkv.transfer.host_pool import HostPool
from tieredkv.transfer.kv_views import KVViews

logger = logging.getLogger(__name__)


def select_backend(
    name: str = BackendName.AUTO,
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
    try:
        choice = BackendName(str(name).lower())
    except ValueError:
        raise ValueError(
            f"copy_backend={name!r}: expected one of {', '.join(BackendName)}"
        ) from None
    if device is None:
        device = kv.device if kv is not None else torch.device("cpu")
    if choice is BackendName.TORCH:
        return TorchCopyBackend()
    if choice is BackendName.NATIVE:
        ok, why = NativeCopyBackend.available(device)
        if not ok:
            raise ValueError(f"copy_backend='native' is not available here: {why}")
        return NativeCopyBackend()
    if choice is BackendName.VLLM:
        ok, why = VllmCopyBackend.available(vllm_copy_op, device)
        if not ok:
            raise ValueError(f"copy_backend='vllm' is not available here: {why}")
        return VllmCopyBackend(vllm_copy_op)  # type: ignore[arg-type]
    if choice is BackendName.CUPY:
        ok, why = CupyCopyBackend.available(device, host)
        if not ok:
            raise ValueError(f"copy_backend='cupy' is not available here: {why}")
        return CupyCopyBackend(device)
    # BackendName.AUTO
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
