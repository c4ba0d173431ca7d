"""vLLM's KV-cache groups -> a :class:`~tieredkv.kv_groups.GroupLayout`, or a refusal that says why.

tieredkv serves full-attention groups (every block) and sliding-window groups (the blocks a
hit ending at a chunk boundary needs). Anything whose state it cannot reproduce from stored
blocks is refused at start-up, with the layer kind and what to do, rather than served wrong:
Mamba/SSM state, attention that evicts a middle gap (RSWA), chunked-local attention, and
groups of different block sizes or page sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tieredkv.kv_groups import FULL, SLIDING, GroupLayout, KVGroup

_WHAT_TO_DO = "remove --kv-transfer-config for this model (or serve it without tieredkv)"


@dataclass(frozen=True)
class GroupGeometry:
    layout: GroupLayout
    block_size: int
    page_size_bytes: int  # one block of one layer
    layers_per_group: int  # physical layer slots (groups alias the same per-index tensors)
    spec: Any  # the first group's spec (head counts for the namespace)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _kind(spec: Any, index: int, layers: list[str]) -> KVGroup:
    # By class name along the MRO (vLLM's kv_cache_interface classes), so that the worker half
    # also runs where vLLM is not installed (the GPU check runs it on recorded layouts).
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
    if "SlidingWindowSpec" in names:
        window = int(spec.sliding_window) - 1 + int(getattr(spec, "extra_retained_tokens", 0) or 0)
        return KVGroup(SLIDING, max(1, _cdiv(window, int(spec.block_size))))
    if "FullAttentionSpec" in names:
        return KVGroup(FULL)
    raise ValueError(
        f"tieredkv: {where} is a kind of attention tieredkv does not store (it serves full and "
        f"sliding-window attention only); {_WHAT_TO_DO}"
    )


def group_geometry(kv_cache_config: Any, chunk_blocks: int) -> GroupGeometry:
    """The engine's groups as tieredkv stores them; ValueError for what it cannot serve."""
    groups = list(kv_cache_config.kv_cache_groups)
    if not groups:
        raise ValueError("tieredkv: the engine has no KV-cache group to offload")
    kinds = [_kind(g.kv_cache_spec, i, list(g.layer_names)) for i, g in enumerate(groups)]
    block_sizes = {int(g.kv_cache_spec.block_size) for g in groups}
    page_sizes = {int(g.kv_cache_spec.page_size_bytes) for g in groups}
    if len(block_sizes) != 1 or len(page_sizes) != 1:
        raise ValueError(
            f"tieredkv: the KV-cache groups differ in block size {sorted(block_sizes)} or page "
            f"size {sorted(page_sizes)}; tieredkv needs one of each; {_WHAT_TO_DO}"
        )
    return GroupGeometry(
        layout=GroupLayout(tuple(kinds), chunk_blocks),
        block_size=block_sizes.pop(),
        page_size_bytes=page_sizes.pop(),
        layers_per_group=max(len(g.layer_names) for g in groups),
        spec=groups[0].kv_cache_spec,
    )
