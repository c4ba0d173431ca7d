"""Hybrid KV-cache groups: what tieredkv serves, what it refuses, and where each block goes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tieredkv.protocol import FULL, NO_BLOCK, SLIDING, KVGroup, SlotRows
from tieredkv.vllm.geometry import group_geometry

H = NO_BLOCK


def _spec(kind: str, window: int = 64, block_size: int = 32):
    from vllm.v1 import kv_cache_interface as kvi

    common = {"block_size": block_size, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float32}
    if kind == "full":
        return kvi.FullAttentionSpec(**common)
    if kind == "sliding":
        return kvi.SlidingWindowSpec(**common, sliding_window=window)
    if kind == "chunked":
        return kvi.ChunkedLocalAttentionSpec(**common, attention_chunk_size=64)
    if kind == "mamba":
        return kvi.MambaSpec(block_size=block_size, shapes=((2, 4),), dtypes=(torch.float32,))
    raise AssertionError(kind)


def _config(*specs) -> SimpleNamespace:
    return SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=spec, layer_names=[f"model.layers.{i}.attn", f"model.layers.{i + 2}.attn"])
        for i, spec in enumerate(specs)
    ])


def test_one_full_attention_group_keeps_the_old_layout():
    shape = group_geometry(_config(_spec("full")), chunk_blocks=4)
    assert not shape.slot_rows.hybrid and shape.slot_rows.rows == 4
    assert shape.slot_rows.store_rows([[7, 8, 9, 10, 11, 12, 13, 14]], 1) == (11, 12, 13, 14)


def test_sliding_and_full_groups_are_served_with_their_windows():
    # Gemma-2 style: group 0 is the sliding one (vLLM orders groups by first layer).
    shape = group_geometry(_config(_spec("sliding", window=64), _spec("full")), chunk_blocks=4)
    assert shape.slot_rows.groups == (KVGroup(SLIDING, 2), KVGroup(FULL))  # cdiv(63, 32) = 2
    assert shape.slot_rows.hybrid and shape.slot_rows.rows == 8
    assert shape.layers_per_group == 2
    assert group_geometry(_config(_spec("sliding", window=200)), 4).slot_rows.groups == (KVGroup(SLIDING, 7),)


@pytest.mark.parametrize(("kind", "words"), [("mamba", "Mamba/SSM"), ("chunked", "does not store")])
def test_state_tieredkv_cannot_reproduce_is_refused_naming_the_layer(kind, words):
    with pytest.raises(ValueError, match=words) as err:
        group_geometry(_config(_spec("full"), _spec(kind)), chunk_blocks=4)
    assert "group 1" in str(err.value) and "model.layers.1.attn" in str(err.value)
    assert "--kv-transfer-config" in str(err.value)


def test_groups_of_different_block_sizes_are_refused():
    with pytest.raises(ValueError, match="block size"):
        group_geometry(_config(_spec("full"), _spec("sliding", block_size=64)), chunk_blocks=4)


def test_store_rows_keep_what_a_hit_at_a_chunk_boundary_needs():
    layout = SlotRows((KVGroup(SLIDING, 2), KVGroup(FULL)), chunk_blocks=4)
    sliding = [0, 0, 0, 0, 0, 21, 22, 23, 24, 25]  # freed blocks are vLLM's null block 0
    full = [30, 31, 32, 33, 34, 35, 36, 37, 38, 39]
    # chunk 1 = blocks 4..7: the window's last two blocks of the chunk, all four full blocks.
    assert layout.store_rows([sliding, full], 1) == (H, H, 22, 23, 34, 35, 36, 37)
    # A hole where vLLM already freed a block the window would need is never read.
    assert layout.store_rows([[0] * 8, full], 1) == (H, H, H, H, 34, 35, 36, 37)


def test_load_rows_fill_every_real_block_from_the_rows_stored():
    layout = SlotRows((KVGroup(SLIDING, 2), KVGroup(FULL)), chunk_blocks=4)
    # A hit of 2 chunks (blocks 0..7) after a 1-block local hit: vLLM gave the sliding group
    # real blocks only for the window's last two blocks.
    sliding = [0, 0, 0, 0, 0, 0, 51, 52]
    full = [60, 61, 62, 63, 64, 65, 66, 67]
    assert layout.load_rows([sliding, full], 0, 1, 4) == (H, H, H, H, H, 61, 62, 63)
    assert layout.load_rows([sliding, full], 1, 4, 8) == (H, H, 51, 52, 64, 65, 66, 67)
    assert layout.unserved([sliding, full], 1, 4, 8) == []
    # A real sliding block outside the rows stored would stay unwritten: it is reported.
    assert layout.unserved([[0, 0, 0, 0, 0, 50, 51, 52], full], 1, 4, 8) == [50]


# --- KV that is not a function of its block's prefix (#23) ----------------------------------


def _kvi():
    from vllm.v1 import kv_cache_interface as kvi

    return kvi


COMMON = {"block_size": 32, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float32}


def _real_config(*groups):
    """vLLM's own KVCacheConfig of (spec, group options) pairs, two layers per group."""
    kvi = _kvi()
    return kvi.KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[
        kvi.KVCacheGroupSpec([f"model.layers.{i}.attn", f"model.layers.{i + 2}.attn"], spec, **options)
        for i, (spec, options) in enumerate(groups)
    ])


def _refused_spec(kind: str):
    kvi = _kvi()
    return {
        "prefix_lm": lambda: kvi.FullAttentionSpec(**COMMON, non_causal=True),
        "prefix_lm_sink": lambda: kvi.SinkFullAttentionSpec(**COMMON, sink_len=4, non_causal=True),
        "mla_drafter": lambda: kvi.MLAAttentionSpec(**COMMON, non_causal_multi_token_decode=True),
        "compressed": lambda: kvi.MLAAttentionSpec(**COMMON, tokens_per_state=4),
        "ring": lambda: kvi.CircularBufferSpec(**COMMON),
        "bounded_replay": lambda: kvi.SlidingWindowMLASpec(**COMMON, sliding_window=64,
                                                           bounded_replay=True),
        "cross": lambda: kvi.CrossAttentionSpec(**COMMON),
        "encoder": lambda: kvi.EncoderOnlyAttentionSpec(**COMMON),
    }[kind]()


@pytest.mark.parametrize(("kind", "words"), [
    ("prefix_lm", "non-causally"),
    ("prefix_lm_sink", "non-causally"),
    ("mla_drafter", "EAGLE/MTP"),
    ("compressed", "tokens_per_state"),
    ("ring", "not prefix-cacheable"),
    ("bounded_replay", "not prefix-cacheable"),
    ("cross", "encoder"),
    ("encoder", "encoder"),
])
def test_kv_that_depends_on_more_than_its_prefix_is_refused_naming_the_layers(kind, words):
    kvi = _kvi()
    config = _real_config((kvi.FullAttentionSpec(**COMMON), {}), (_refused_spec(kind), {}))
    with pytest.raises(ValueError, match=words) as err:
        group_geometry(config, chunk_blocks=4)
    message = str(err.value)
    assert "group 1" in message and "model.layers.1.attn, model.layers.3.attn" in message
    assert type(_refused_spec(kind)).__name__ in message and "--kv-transfer-config" in message


@pytest.mark.parametrize(("options", "words"), [
    ({"is_eagle_group": True}, "EAGLE/MTP"),
    ({"enable_kv_transfer": False}, "not part of the KV state"),
])
def test_groups_vllm_flags_as_draft_or_untransferable_are_refused(options, words):
    kvi = _kvi()
    config = _real_config((kvi.FullAttentionSpec(**COMMON), options))
    with pytest.raises(ValueError, match=words) as err:
        group_geometry(config, chunk_blocks=4)
    assert "group 0" in str(err.value) and "model.layers.0.attn" in str(err.value)


def test_causal_variants_of_full_attention_are_still_served():
    # The hybrid manager off: sliding-window and chunked-local layers as FullAttentionSpec
    # (blocks for every token, still causal); MLA's latent KV; attention sinks.
    kvi = _kvi()
    for spec in (kvi.FullAttentionSpec(**COMMON, sliding_window=64),
                 kvi.FullAttentionSpec(**COMMON, attention_chunk_size=64),
                 kvi.MLAAttentionSpec(**COMMON),
                 kvi.SinkFullAttentionSpec(**COMMON, sink_len=4)):
        assert group_geometry(_real_config((spec, {})), 4).slot_rows.groups == (KVGroup(FULL),)


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory) -> str:
    from tieredkv.tools.tiny_model import make_tiny_llama

    return str(make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny"))


def test_a_pooling_model_that_needs_every_hidden_state_is_refused(tiny_llama_dir):
    # vLLM's own ModelConfig decides (is_prefix_caching_supported): a MEAN-pooling model
    # must compute every prompt token, so a tieredkv hit would change its embedding.
    from vllm.config import ModelConfig, PoolerConfig

    kvi = _kvi()
    config = _real_config((kvi.FullAttentionSpec(**COMMON), {}))
    generate = ModelConfig(model=tiny_llama_dir, runner="generate", skip_tokenizer_init=True)
    assert group_geometry(config, 4, SimpleNamespace(model_config=generate)).slot_rows.rows == 4
    pooling = ModelConfig(model=tiny_llama_dir, runner="pooling", skip_tokenizer_init=True,
                          pooler_config=PoolerConfig(seq_pooling_type="MEAN"))
    with pytest.raises(ValueError, match="does not reuse this pooling model's KV"):
        group_geometry(config, 4, SimpleNamespace(model_config=pooling))


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp", "dflash", "dspark"])
def test_drafters_that_write_next_token_kv_are_refused(method):
    from vllm.config import SpeculativeConfig

    # The methods vLLM itself treats as drafting from the target's hidden states.
    assert SpeculativeConfig.use_eagle(SimpleNamespace(method=method))
    engine = SimpleNamespace(speculative_config=SimpleNamespace(method=method))
    with pytest.raises(ValueError, match=f"method '{method}' writes draft KV from the next"):
        group_geometry(_config(_spec("full")), 4, engine)


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model"])
def test_drafters_without_next_token_kv_are_served(method):
    from vllm.config import SpeculativeConfig

    assert not SpeculativeConfig.use_eagle(SimpleNamespace(method=method))
    engine = SimpleNamespace(speculative_config=SimpleNamespace(method=method))
    assert group_geometry(_config(_spec("full")), 4, engine).slot_rows.rows == 4
