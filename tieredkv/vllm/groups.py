"""vLLM's KV-cache groups -> a :class:`~tieredkv.protocol.SlotRows`, or a refusal that says why.

tieredkv serves full-attention groups (every block) and sliding-window groups (the blocks a
hit ending at an entry's end needs: a chunk boundary, or where a stored prompt ended). It stores a block's KV under a key of the block's
prefix (vLLM's chained block hashes, which also cover LoRA, multimodal inputs, prompt
embeddings and ``cache_salt``), so it serves only KV that is a function of that prefix.
Anything else is refused at start-up, with the layers and what to do, rather than served
wrong: non-causal (Prefix-LM) attention, EAGLE/MTP draft KV (written with the next token),
encoder, cross-attention and other groups vLLM itself does not prefix-cache, Mamba/SSM
state, attention that evicts a middle gap (RSWA), chunked-local attention, and groups of
different block sizes or page sizes. Models vLLM says cannot reuse a prefix (encoder-decoder,
attention-free, pooling models that need every token's hidden state) are refused as a whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tieredkv.protocol import FULL, SLIDING, KVGroup, SlotRows

_WHAT_TO_DO = "remove --kv-transfer-config for this model (or serve it without tieredkv)"
# Speculative methods whose drafter writes KV from the target's hidden state and the *next*
# token (vLLM's ``SpeculativeConfig.use_eagle()``): a block's draft KV at its last position
# depends on a token after the block, which vLLM handles by dropping the last block of a hit.
_NEXT_TOKEN_DRAFTERS = ("eagle", "eagle3", "mtp", "dflash", "dspark")


@dataclass(frozen=True)
class GroupGeometry:
    slot_rows: SlotRows
    block_size: int
    page_size_bytes: int  # one block of one layer
    layers_per_group: int  # physical layer slots (groups alias the same per-index tensors)
    spec: Any  # the first group's spec (head counts for the namespace)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _layer_specs(spec: Any) -> list[Any]:
    """The per-layer specs of a group (vLLM's ``UniformTypeKVCacheSpecs`` wraps several)."""
    inner = getattr(spec, "kv_cache_specs", None)
    return [spec, *inner.values()] if isinstance(inner, dict) else [spec]


def _not_a_prefix_function(group: Any, spec: Any) -> str | None:
    """Why this group's block KV is not a function of the block's prefix alone (or of what
    vLLM's block hash covers), or None. Spec fields as vLLM 0.32 defines them."""
    specs = _layer_specs(spec)
    if any(getattr(s, "non_causal", False) for s in specs):
        return ("attends non-causally (Prefix-LM: the prompt attends both ways), so a "
                "block's KV depends on the prompt tokens after it and no other prompt "
                "sharing the prefix may reuse it (vLLM turns its own prefix cache off for it)")
    if any(getattr(s, "non_causal_multi_token_decode", False) for s in specs) or getattr(
        group, "is_eagle_group", False
    ):
        return ("holds EAGLE/MTP draft layers, whose KV at a block's last position is "
                "written with the next token (vLLM drops the last block of every hit for them)")
    if any(getattr(s, "tokens_per_state", 1) != 1 for s in specs):
        return ("stores states that compress or split tokens (tokens_per_state != 1), "
                "which tieredkv does not store as prefix blocks")
    if any(getattr(s, "prefix_cacheable", True) is False for s in specs):
        return "is not prefix-cacheable (vLLM never reuses it across requests either)"
    if getattr(group, "enable_kv_transfer", True) is False or getattr(group, "host_resident", False):
        return "is not part of the KV state vLLM lets a connector transfer"
    role = getattr(group, "role", None)
    if role is not None and str(getattr(role, "value", role)) != "default":
        return f"has the role {getattr(role, 'value', role)!s} (HiSparse), not plain KV"
    return None


def _kind(group: Any, index: int) -> KVGroup:
    # By class name along the MRO (vLLM's kv_cache_interface classes), so that the worker half
    # also runs where vLLM is not installed (the GPU check runs it on recorded groups).
    spec, layers = group.kv_cache_spec, list(group.layer_names)
    names = {cls.__name__ for cls in type(spec).__mro__}
    name = type(spec).__name__
    where = f"KV-cache group {index} ({name}, layers {', '.join(layers[:3])}{'...' if len(layers) > 3 else ''})"
    if "MambaSpec" in names:
        raise ValueError(
            f"tieredkv: {where} holds Mamba/SSM recurrent state, which tieredkv cannot store "
            f"and restore from KV blocks; it refuses to start rather than serve wrong state: "
            f"{_WHAT_TO_DO}"
        )
    if "RSWASpec" in names:
        raise ValueError(
            f"tieredkv: {where} evicts a middle span of the context, which tieredkv does not "
            f"reproduce; {_WHAT_TO_DO}"
        )
    why = _not_a_prefix_function(group, spec)
    if why is not None:
        raise ValueError(f"tieredkv: {where} {why}; tieredkv refuses to start rather than "
                         f"serve such KV to another prompt: {_WHAT_TO_DO}")
    if "CrossAttentionSpec" in names or "EncoderOnlyAttentionSpec" in names:
        raise ValueError(
            f"tieredkv: {where} holds an encoder's KV (encoder-only or cross-attention), a "
            f"function of the encoder input, not of the prompt's prefix; {_WHAT_TO_DO}"
        )
    if "SlidingWindowSpec" in names:
        window = int(spec.sliding_window) - 1 + int(getattr(spec, "extra_retained_tokens", 0) or 0)
        return KVGroup(SLIDING, max(1, _cdiv(window, int(spec.block_size))))
    if "FullAttentionSpec" in names:
        return KVGroup(FULL)
    raise ValueError(
        f"tieredkv: {where} is a kind of attention tieredkv does not store (it serves full and "
        f"sliding-window attention only); {_WHAT_TO_DO}"
    )


def refuse_unreusable_model(vllm_config: Any) -> None:
    """ValueError for an engine whose KV vLLM itself says cannot be reused across prompts
    (``ModelConfig.is_prefix_caching_supported``: encoder-decoder, attention-free, pooling
    models that need every token's hidden state), or whose drafter writes next-token KV."""
    model = getattr(vllm_config, "model_config", None)
    supported = getattr(model, "is_prefix_caching_supported", True)
    if supported is False:
        kind = getattr(model, "attn_type", "unknown")
        pooling = " pooling" if getattr(model, "pooler_config", None) is not None else ""
        raise ValueError(
            f"tieredkv: vLLM does not reuse this{pooling} model's KV across prompts "
            f"(attention type {kind!r}: encoder-decoder, attention-free, or a pooler that "
            f"needs every token's hidden state); a tieredkv hit would skip what it must "
            f"compute: {_WHAT_TO_DO}"
        )
    speculative = getattr(vllm_config, "speculative_config", None)
    method = getattr(speculative, "method", None)
    uses_eagle = getattr(speculative, "use_eagle", None)
    if method in _NEXT_TOKEN_DRAFTERS or (callable(uses_eagle) and uses_eagle()):
        raise ValueError(
            f"tieredkv: speculative decoding method {method!r} writes draft KV from the next "
            f"token, so a stored block's KV depends on a token after it; tieredkv does not "
            f"serve it (ngram, suffix and draft_model speculation are fine): {_WHAT_TO_DO}"
        )


def group_geometry(kv_cache_config: Any, chunk_blocks: int, vllm_config: Any = None) -> GroupGeometry:
    """The engine's groups as tieredkv stores them; ValueError for what it cannot serve
    (``vllm_config``, when given: the model-wide checks of :func:`refuse_unreusable_model`)."""
    groups = list(kv_cache_config.kv_cache_groups)
    if not groups:
        raise ValueError("tieredkv: the engine has no KV-cache group to offload")
    kinds = [_kind(g, i) for i, g in enumerate(groups)]  # first: they name the layers
    if vllm_config is not None:
        refuse_unreusable_model(vllm_config)
    block_sizes = {int(g.kv_cache_spec.block_size) for g in groups}
    page_sizes = {int(g.kv_cache_spec.page_size_bytes) for g in groups}
    if len(block_sizes) != 1 or len(page_sizes) != 1:
        raise ValueError(
            f"tieredkv: the KV-cache groups differ in block size {sorted(block_sizes)} or page "
            f"size {sorted(page_sizes)}; tieredkv needs one of each; {_WHAT_TO_DO}"
        )
    return GroupGeometry(
        slot_rows=SlotRows(tuple(kinds), chunk_blocks),
        block_size=block_sizes.pop(),
        page_size_bytes=page_sizes.pop(),
        layers_per_group=max(len(g.layer_names) for g in groups),
        spec=groups[0].kv_cache_spec,
    )
