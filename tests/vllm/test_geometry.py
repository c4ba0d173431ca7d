"""The namespace's identity of weights, settings and LoRA adapters, without starting vLLM.

The real-vLLM side (a restart with another RoPE base, KV dtype, weight file or adapter misses)
is ``tests/e2e/test_e2e_namespace.py``; these tests pin the pieces it is built from.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from tieredkv.vllm import geometry as geo


def _model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 8}')
    (model / "model.safetensors").write_bytes(b"\x01" * 64)
    (model / "README.md").write_text("not a model file")
    return model


def test_files_signature_changes_when_a_weight_file_is_rewritten_in_place(tmp_path):
    model = _model_dir(tmp_path)
    before = geo.files_signature(model)
    assert before == geo.files_signature(model)  # stable while untouched
    weights = model / "model.safetensors"
    stat = weights.stat()
    weights.write_bytes(b"\x02" * 64)  # same size, same inode
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert weights.stat().st_ino == stat.st_ino
    assert geo.files_signature(model) != before


def test_files_signature_ignores_files_that_cannot_change_the_model(tmp_path):
    model = _model_dir(tmp_path)
    before = geo.files_signature(model)
    (model / "README.md").write_text("edited")
    (model / ".cache").mkdir()
    (model / ".cache" / "x.json").write_text("{}")
    assert geo.files_signature(model) == before


def test_a_replaced_gguf_file_changes_the_identity(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    config = SimpleNamespace(model=str(gguf), revision=None, model_weights="")
    first, how = geo.weights_identity(config)
    assert first and first.startswith("files:") and str(gguf) in how
    replacement = tmp_path / "new.gguf"
    replacement.write_bytes(b"GGUF" + b"\1" * 60)
    replacement.replace(gguf)  # a new inode under the same name
    assert geo.weights_identity(config)[0] != first


def test_a_hub_id_without_a_resolved_commit_has_no_identity(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    config = SimpleNamespace(model="acme/no-such-model", revision=None, model_weights="")
    identity, why = geo.weights_identity(config)
    assert identity is None and "no resolved hub commit" in why
    commit = "0123456789abcdef0123456789abcdef01234567"
    resolved = SimpleNamespace(model="acme/x", revision=SimpleNamespace(resolved=commit), model_weights="")
    assert geo.weights_identity(resolved)[0] == f"hub:{commit}"


def _vllm_config(model: str, model_hash: str, cache_dtype: str = "auto") -> SimpleNamespace:
    return SimpleNamespace(
        model_config=SimpleNamespace(model=model, revision=None, model_weights="",
                                     compute_hash=lambda: model_hash),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype, kv_cache_dtype_skip_layers=None,
                                     sliding_window=None),
        load_config=SimpleNamespace(load_format="auto", model_loader_extra_config={},
                                    download_dir=None),
        parallel_config=SimpleNamespace(prefill_context_parallel_size=1,
                                        decode_context_parallel_size=1,
                                        dcp_kv_cache_interleave_size=1,
                                        cp_kv_cache_interleave_size=1),
    )


def test_settings_that_change_kv_change_the_identity(tmp_path):
    model = str(_model_dir(tmp_path))
    base = geo._stable_identity(_vllm_config(model, "h1"), stable_hashes=True)
    assert base == geo._stable_identity(_vllm_config(model, "h1"), stable_hashes=True)
    assert "process-" not in base[0] + base[1]  # survives a restart
    assert geo._stable_identity(_vllm_config(model, "h2"), True)[1] != base[1]  # e.g. hf_overrides
    assert geo._stable_identity(_vllm_config(model, "h1", "fp8"), True)[1] != base[1]


def test_unstable_block_hashes_or_unknown_weights_make_the_namespace_process_local(tmp_path):
    model = str(_model_dir(tmp_path))
    weights, settings = geo._stable_identity(_vllm_config(model, "h1"), stable_hashes=False)
    assert weights.endswith(f"process-{geo._PROCESS_NONCE}")
    weights, _ = geo._stable_identity(_vllm_config("acme/unknown", "h1"), stable_hashes=True)
    assert f"process-{geo._PROCESS_NONCE}" in weights


def test_model_config_without_a_hash_goes_process_local(tmp_path):
    def refuse() -> str:
        raise TypeError("unhashable")

    config = _vllm_config(str(_model_dir(tmp_path)), "h1")
    config.model_config.compute_hash = refuse
    _, settings = geo._stable_identity(config, stable_hashes=True)
    assert settings == f"process-{geo._PROCESS_NONCE}"


@pytest.mark.parametrize("attr", ["lora_path", "path"])
def test_lora_digest_follows_the_adapter_files(tmp_path, attr):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(b"\1" * 32)
    request = SimpleNamespace(lora_name="tenant", lora_int_id=1, **{attr: str(adapter)})
    digests = geo.AdapterDigests()
    first = digests.digest(request)
    assert first == digests.digest(request) and len(first) == 32
    replacement = tmp_path / "new.safetensors"
    replacement.write_bytes(b"\2" * 32)
    replacement.replace(weights)
    assert digests.digest(request) != first
    assert digests.digest(None) == b""


def test_engine_geometry_resolves_the_config_once_for_everyone(tmp_path):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from tieredkv.config import TieredKVConfig

    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    kv_cache_config = SimpleNamespace(
        kv_cache_layout="LBHNC",
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=["l0", "l1"])],
    )
    vllm_config = _vllm_config(str(_model_dir(tmp_path)), "h1")
    vllm_config.model_config.dtype = "float32"
    vllm_config.parallel_config.tensor_parallel_size = 1
    vllm_config.parallel_config.pipeline_parallel_size = 1
    auto = TieredKVConfig.from_dict({})  # chunk_blocks 0: auto
    geometry = geo.engine_geometry(vllm_config, kv_cache_config, auto)
    assert geometry.config == auto.resolved(32) and geometry.config.chunk_blocks == 8
    assert geometry.chunk_blocks == geometry.config.chunk_blocks
    assert geometry.chunk_payload_bytes == spec.page_size_bytes * 2 * 8
    assert not geometry.slot_rows.hybrid and geometry.slot_rows.rows == 8
