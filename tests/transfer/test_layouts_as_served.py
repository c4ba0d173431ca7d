"""The KV-cache layouts the CUDA tests use are the ones vLLM serves tieredkv.

tieredkv's connector asks vLLM for ``LBHNC`` (``get_required_kvcache_layout``), and vLLM takes
a connector's layout wherever every attention backend supports it: FlashAttention, Triton,
FlashInfer and FlashMLA serve ``LBHNC``, FlexAttention (``LBNHC`` only) keeps ``LBNHC``. The
installed vLLM's own resolution is run for every case of ``vllm_cuda_layouts.CASES`` (in a
subprocess: see ``vllm_layout_probe.py``), and the tensors it would register are compared with
what ``build_kv_caches`` builds for the GPU tests. Without vLLM (the GPU machines) only the
fixture's self-check runs.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_cuda_layouts import (
    CASES,
    CONNECTOR_LAYOUT,
    DECLARED_LAYOUTS,
    DEFAULT_LAYOUT,
    RECORD_BLOCKS,
    RECORD_LAYERS,
    RECORDED,
    VLLM_VERSION,
    LayoutCase,
    build_kv_caches,
    kv_parts,
    layer_names,
)

from tieredkv.transfer.kv_views import KVViews

ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).with_name("vllm_layout_probe.py")
HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="needs vLLM (not on the GPU machines)")
CASE_PARAMS = [pytest.param(case, id=case.id) for case in CASES]


@pytest.fixture(scope="module")
def served() -> dict[str, dict[str, Any]]:
    """What the installed vLLM serves for each case, with tieredkv as the connector."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("VLLM_KV_CACHE_LAYOUT", None)
    proc = subprocess.run([sys.executable, str(PROBE)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_vllm
def test_connector_layout_is_what_vllm_serves_for_every_case(served: dict[str, dict[str, Any]]) -> None:
    from tieredkv.vllm.connector import TieredKVConnector

    assert TieredKVConnector.get_required_kvcache_layout(None) == CONNECTOR_LAYOUT  # type: ignore[arg-type]
    assert set(served) == {case.id for case in CASES}
    for case in CASES:
        got = served[case.id]
        assert got["backend"] == case.backend, case.id
        assert got["served"] == case.layout, (
            f"{case.id}: vLLM serves tieredkv {got['served']}, the GPU tests build {case.layout}")
        key = f"{case.backend}@sm100" if case.capability[0] == 10 else case.backend
        declared = DECLARED_LAYOUTS[key]
        assert got["declared"] == (None if declared is None else list(declared)), case.id
    # The one backend that cannot take tieredkv's layout, and the user's override, are covered.
    assert {case.layout for case in CASES} >= {"LBHNC", "LBNHC", "BLHNC"}
    assert served["flex_attention-LBNHC-fp16"]["served"] != CONNECTOR_LAYOUT


@needs_vllm
def test_kernel_block_splits_are_what_the_backends_declare(served: dict[str, dict[str, Any]]) -> None:
    for case in CASES:
        sizes = [s for s in served[case.id]["kernel_block_sizes"] if isinstance(s, int)]
        if case.kernel_block_size is not None:  # the largest declared size dividing the block
            assert case.kernel_block_size == max(s for s in sizes if case.block_size % s == 0), case.id
            assert case.block_size not in sizes, case.id
        elif sizes:
            assert case.block_size in sizes, case.id


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_fixture_builds_the_recorded_vllm_layout_and_kvviews_finds_each_block(case: LayoutCase) -> None:
    caches, raw = build_kv_caches(case, RECORD_LAYERS, RECORD_BLOCKS)
    shape, stride, offsets = RECORDED[case.id]
    for tensor, offset in zip(caches.values(), offsets, strict=True):
        assert tuple(tensor.shape) == shape and tuple(tensor.stride()) == stride
        assert tensor.storage_offset() == offset and tensor.dtype == case.torch_dtype
        assert tensor.untyped_storage().data_ptr() == raw.untyped_storage().data_ptr()
    kv = KVViews.from_kv_caches(caches, RECORD_BLOCKS, layout=case.layout)
    assert kv.block_bytes == (case.page_size_bytes,) * RECORD_LAYERS
    assert kv.stacked is not None
    # Mark one block of one layer through the kernels' own views: exactly its row changes.
    before = [rows.clone() for rows in kv.rows]
    layer, block = RECORD_LAYERS - 1, 7
    for part in kv_parts(case, caches[layer_names(RECORD_LAYERS)[layer]]):
        part[block * case.ratio : (block + 1) * case.ratio].fill_(90)
    for other, (rows, old) in enumerate(zip(kv.rows, before, strict=True)):
        for b in range(RECORD_BLOCKS):
            changed = not torch.equal(rows[b], old[b])
            assert changed == (other == layer and b == block), (other, b)
    assert bool((kv.rows[layer][block] != before[layer][block]).float().mean() > 0.5)
    assert kv.rows[layer][block].numel() == case.page_size_bytes


def _vllm_registered(case: LayoutCase, kv_interface: Any, layout_cls: Any) -> list[torch.Tensor]:
    """What vLLM's own code builds for ``case`` (get_kv_cache_config + create_kv_cache_views)."""
    if case.mla:
        spec = kv_interface.MLAAttentionSpec(
            block_size=case.block_size, num_kv_heads=1, head_size=case.head_size,
            dtype=case.torch_dtype)
    else:
        spec = kv_interface.FullAttentionSpec(
            block_size=case.block_size, num_kv_heads=case.num_kv_heads, head_size=case.head_size,
            head_size_v=case.head_size_v, dtype=case.torch_dtype)
    assert spec.page_size_bytes == case.page_size_bytes
    layout = layout_cls[case.layout]
    per_block = spec.page_size_bytes * RECORD_LAYERS
    layer_stride, block_stride, *_ = kv_interface.compute_layout_strides(
        spec, RECORD_BLOCKS, RECORD_LAYERS, layout,
        fixed_strides=(None, per_block if layout.is_block_outermost else None, None, None, None))
    tensor = kv_interface.KVCacheTensor(
        size=per_block * RECORD_BLOCKS, layers=layer_names(RECORD_LAYERS),
        layer_stride=layer_stride, block_stride=block_stride)
    raw = torch.zeros(per_block * RECORD_BLOCKS, dtype=torch.int8)
    return kv_interface.create_kv_cache_views(raw, spec, RECORD_BLOCKS, layout, tensor,
                                              kernel_block_size=case.kernel_block_size)


@needs_vllm
def test_recorded_layouts_match_the_installed_vllm() -> None:
    """The data in vllm_cuda_layouts is still what vLLM registers (else re-record it)."""
    import vllm
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
    from vllm.v1 import kv_cache_interface
    from vllm.v1.attention.backends import utils as backend_utils
    from vllm.v1.kv_cache_layout import KVCacheLayout

    assert vllm.__version__ == VLLM_VERSION, (
        f"vLLM {vllm.__version__} installed, layouts recorded from {VLLM_VERSION}: re-read the "
        "backends listed in tests/transfer/vllm_cuda_layouts.py and re-record"
    )
    for case in CASES:
        views = _vllm_registered(case, kv_cache_interface, KVCacheLayout)
        got = (tuple(views[0].shape), tuple(views[0].stride()), tuple(v.storage_offset() for v in views))
        assert got == RECORDED[case.id], case.id
        assert views[0].dtype == case.torch_dtype, case.id
    assert backend_utils._DEFAULT_LAYOUT_PREFERENCE[0].name == DEFAULT_LAYOUT
    assert STR_DTYPE_TO_TORCH_DTYPE["fp8"] is torch.uint8
    flash_attn = importlib.import_module("vllm.v1.attention.backends.flash_attn")
    with open(flash_attn.__file__) as f:  # the kernels' K/V views, which kv_parts mirrors
        assert "kv_cache.transpose(1, 2).split(self.head_size, dim=-1)" in f.read()
