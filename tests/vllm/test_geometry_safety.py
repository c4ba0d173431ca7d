"""Start-up checks where tieredkv's config meets the engine's geometry (issue 23, point 6).

A remote write queue too small for one chunk's value, and block hashes that a tier keeps
beyond the process under an algorithm whose collisions can be precomputed.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import FullAttentionSpec

from tieredkv.config import ConfigError, MiB, TieredKVConfig
from tieredkv.remote.codec import HEADER_BYTES
from tieredkv.remote.write_queue import BoundedWriteQueue, WriteEntry
from tieredkv.vllm import geometry as geo

# 32 tokens x 2 heads x 64 x fp32 x (K, V) = 32 KiB a block and layer; 2 layers.
SPEC = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
LAYERS = 2
REDIS = "redis://127.0.0.1:1/0"  # never connected to: the check is at start-up


def _payload(chunk_blocks: int) -> int:
    return SPEC.page_size_bytes * LAYERS * chunk_blocks


def _geometry(tmp_path: Path, extra: dict, hash_algo: str = "sha256") -> geo.EngineGeometry:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(model=str(model), revision=None, model_weights="",
                                     dtype="float32", compute_hash=lambda: "h"),
        cache_config=SimpleNamespace(cache_dtype="auto", kv_cache_dtype_skip_layers=None,
                                     sliding_window=None, prefix_caching_hash_algo=hash_algo),
        load_config=SimpleNamespace(load_format="auto", model_loader_extra_config={},
                                    download_dir=None),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                        prefill_context_parallel_size=1,
                                        decode_context_parallel_size=1,
                                        dcp_kv_cache_interleave_size=1,
                                        cp_kv_cache_interleave_size=1),
    )
    kv_cache_config = SimpleNamespace(
        kv_cache_layout="LBHNC",
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=SPEC, layer_names=["l0", "l1"])],
    )
    return geo.engine_geometry(vllm_config, kv_cache_config, TieredKVConfig.from_dict(extra))


# ------------------------------------------------------------ remote_write_queue_bytes


def test_a_queue_smaller_than_one_value_drops_every_write():
    """The premise: a value larger than the queue's byte bound is never accepted."""
    value = _payload(64) + HEADER_BYTES
    queue = BoundedWriteQueue(4096, 4 * MiB)
    assert value > 4 * MiB
    assert queue.offer([WriteEntry(b"k", bytes(value))]) == (0, 1)
    assert queue.offer([WriteEntry(b"k", bytes(value))]) == (0, 1)  # every time, not once


@pytest.mark.parametrize("queue_bytes", [MiB, _payload(64), _payload(64) + HEADER_BYTES - 1])
def test_a_queue_smaller_than_one_value_is_a_start_up_error(tmp_path, queue_bytes):
    extra = {"remote_url": REDIS, "chunk_blocks": 64, "remote_write_queue_bytes": queue_bytes}
    with pytest.raises(ConfigError) as err:
        _geometry(tmp_path, extra)
    message = str(err.value)
    value = _payload(64) + HEADER_BYTES
    assert err.value.key == "remote_write_queue_bytes" and "remote_write_queue_bytes" in message
    assert f"{value} bytes" in message and "dropped" in message


def test_a_queue_that_holds_one_value_or_a_read_only_replica_starts(tmp_path):
    value = _payload(64) + HEADER_BYTES
    ok = _geometry(tmp_path, {"remote_url": REDIS, "chunk_blocks": 64, "remote_write_queue_bytes": value})
    assert ok.chunk_payload_bytes + HEADER_BYTES == value
    # A replica that never writes has no use for the queue.
    _geometry(tmp_path, {"remote_url": REDIS, "chunk_blocks": 64, "remote_writes": False,
                         "remote_write_queue_bytes": MiB})
    _geometry(tmp_path, {"chunk_blocks": 64})  # no remote tier at all


def test_the_auto_chunk_size_is_the_one_checked(tmp_path):
    """chunk_blocks 0 resolves to 256 tokens (8 blocks of 32: 512 KiB); 1 MiB holds it."""
    geometry = _geometry(tmp_path, {"remote_url": REDIS, "remote_write_queue_bytes": MiB})
    assert geometry.chunk_blocks == 8 and geometry.chunk_payload_bytes + HEADER_BYTES < MiB


# ------------------------------------------------------------ forgeable block hashes


def _forgery_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno == logging.WARNING and "not collision resistant" in r.getMessage()]


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
@pytest.mark.parametrize("tier", ["disk", "remote"])
def test_a_non_cryptographic_hash_with_a_lasting_tier_is_accepted_with_a_warning(
    tmp_path, caplog, monkeypatch, algo, tier
):
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # what makes such hashes shared, and predictable
    extra = {"disk_path": str(tmp_path / "kv"), "disk_bytes": "64MiB"} if tier == "disk" else {"remote_url": REDIS}
    caplog.set_level(logging.WARNING, logger="tieredkv")
    geometry = _geometry(tmp_path, extra, hash_algo=algo)
    [warning] = _forgery_warnings(caplog)
    assert f"prefix_caching_hash_algo={algo}" in warning
    assert "PYTHONHASHSEED" in warning and "precomputed" in warning  # the reason
    assert ("disk" if tier == "disk" else "Redis") in warning and "sha256" in warning  # the fix
    # The behaviour chosen: accepted, and the namespace survives the process (shared).
    assert geometry.stable_hashes
    assert "process-" not in geometry.namespace.weights_version + geometry.namespace.engine_config


@pytest.mark.parametrize(
    ("algo", "seed", "extra"),
    [
        ("sha256", "0", {"remote_url": REDIS}),  # collision resistant: nothing to say
        ("sha256_cbor", None, {"remote_url": REDIS}),
        ("xxhash", "0", {}),  # host tier only: nothing outlives the process
        ("xxhash", None, {"remote_url": REDIS}),  # random seed: the namespace is process-local
    ],
)
def test_no_forgery_warning_where_nothing_forgeable_outlives_the_process(
    tmp_path, caplog, monkeypatch, algo, seed, extra
):
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    caplog.set_level(logging.WARNING, logger="tieredkv")
    geometry = _geometry(tmp_path, extra, hash_algo=algo)
    assert _forgery_warnings(caplog) == []
    if algo == "xxhash" and seed is None:
        assert not geometry.stable_hashes
        assert f"process-{geo._PROCESS_NONCE}" in geometry.namespace.weights_version
