"""Ask the installed vLLM which KV-cache layout each case of ``vllm_cuda_layouts.CASES`` is
served with when tieredkv is the connector; prints one JSON object.

Run in a subprocess by ``test_layouts_as_served.py``: FlashInfer's backend module needs the
``flashinfer`` package to import, so it is imported here against stand-in ``flashinfer``
modules (its layout declaration calls none of them), and the GPU's compute capability is set
per case. Neither may leak into the test process.

For each case: vLLM's own ``get_supported_kv_cache_layouts`` over the backend class, then its
``resolve_kv_cache_layout`` with ``kv_transfer_config`` naming ``TieredKVConnector`` (vLLM
calls ``get_required_kvcache_layout`` on it) and ``VLLM_KV_CACHE_LAYOUT`` as the case sets it.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import json
import os
import sys
import types
from pathlib import Path

BACKEND_CLASSES = {
    "FLASH_ATTN": ("vllm.v1.attention.backends.flash_attn", "FlashAttentionBackend"),
    "TRITON_ATTN": ("vllm.v1.attention.backends.triton_attn", "TritonAttentionBackend"),
    "FLEX_ATTENTION": ("vllm.v1.attention.backends.flex_attention", "FlexAttentionBackend"),
    "FLASHINFER": ("vllm.v1.attention.backends.flashinfer", "FlashInferBackend"),
    "FLASHMLA": ("vllm.v1.attention.backends.mla.flashmla", "FlashMLABackend"),
}


class _Anything:
    """Whatever FlashInfer's backend module imports from ``flashinfer`` at import time."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def __call__(self, *args: object, **kwargs: object) -> _Anything:
        return _Anything()

    def __getattr__(self, name: str) -> _Anything:
        return _Anything()


def _stand_in_flashinfer() -> None:
    def attribute(name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything

    for name in ("flashinfer", "flashinfer.decode", "flashinfer.prefill", "flashinfer.utils"):
        module = types.ModuleType(name)
        module.__path__ = []  # type: ignore[attr-defined]
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__getattr__ = attribute  # type: ignore[method-assign]
        sys.modules[name] = module


def main() -> int:
    sys.path[:0] = [str(Path(__file__).resolve().parent)]
    import torch  # noqa: F401 - before the stand-ins: torch inspects modules while it loads
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends import utils as backend_utils
    from vllm_cuda_layouts import CASES

    from tieredkv.vllm.plugin import register

    register()
    _stand_in_flashinfer()
    config = VllmConfig(
        kv_transfer_config=KVTransferConfig(kv_connector="TieredKVConnector", kv_role="kv_both"))
    os.environ.pop("VLLM_KV_CACHE_LAYOUT", None)
    out: dict[str, dict[str, object]] = {}
    for case in CASES:
        module, cls = BACKEND_CLASSES[case.backend]
        backend = getattr(importlib.import_module(module), cls)
        capability = DeviceCapability(*case.capability)
        current_platform.get_device_capability = lambda device_id=0, c=capability: c  # type: ignore[method-assign]
        declared = backend.supported_kv_cache_layouts()
        supported = [layout.name for layout in backend_utils.get_supported_kv_cache_layouts([backend])]
        if case.env_layout:
            os.environ["VLLM_KV_CACHE_LAYOUT"] = case.env_layout
        config.cache_config.kv_cache_layout = None
        try:
            served = backend_utils.resolve_kv_cache_layout(config, [supported], []).name
        finally:
            os.environ.pop("VLLM_KV_CACHE_LAYOUT", None)
        sizes = backend.get_supported_kernel_block_sizes()
        out[case.id] = {
            "backend": backend.get_name(),
            "declared": None if declared is None else [layout.name for layout in declared],
            "served": served,
            "kernel_block_sizes": [s if isinstance(s, int) else f"MultipleOf({s.base})" for s in sizes],
        }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
