"""What tieredkv needs to know about the engine, read from vLLM's configs in one place.

Both halves call :func:`engine_geometry` with the configs vLLM hands them, so the scheduler
and every worker derive the same namespace fingerprint and the same slot sizes without
talking to each other.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tieredkv.config import TieredKVConfig
from tieredkv.keys import Namespace

logger = logging.getLogger(__name__)

_STABLE_HASHES = ("sha256", "sha256_cbor")
_PROCESS_NONCE = os.urandom(8).hex()


@dataclass(frozen=True)
class EngineGeometry:
    namespace: Namespace
    fingerprint: bytes
    block_size: int
    chunk_blocks: int
    chunk_payload_bytes: int  # one chunk on one rank, all layers
    num_layers: int
    world_size: int
    stable_hashes: bool


def _weights_version(model: str, revision: str | None) -> str:
    """Changes when the weights change: the revision, or the weight files' names/sizes/mtimes."""
    path = Path(model)
    if not path.is_dir():
        return revision or ""
    digest = hashlib.sha256((revision or "").encode())
    for item in sorted(path.iterdir()):
        if item.suffix in (".safetensors", ".bin", ".pt", ".json") and item.is_file():
            stat = item.stat()
            digest.update(f"{item.name}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    return digest.hexdigest()[:16]


def engine_geometry(vllm_config: Any, kv_cache_config: Any, config: TieredKVConfig) -> EngineGeometry:
    """Derive namespace and sizes; refuse configurations tieredkv cannot serve correctly."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(
            "tieredkv: this model has "
            f"{len(groups)} KV-cache groups (hybrid or sliding-window attention); tieredkv "
            "supports exactly one full-attention group for now, so it refuses to start rather "
            "than serve wrong KV. Remove --kv-transfer-config for this model."
        )
    spec = groups[0].kv_cache_spec
    config = config.resolved(int(spec.block_size))
    num_layers = len(groups[0].layer_names)
    parallel = vllm_config.parallel_config
    world_size = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    cache = vllm_config.cache_config
    model = vllm_config.model_config
    hash_algo = getattr(cache, "prefix_caching_hash_algo", "sha256")
    stable = hash_algo in _STABLE_HASHES or os.getenv("PYTHONHASHSEED") is not None
    layout = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(
        cache, "kv_cache_layout", None
    ) or "unknown"
    weights = _weights_version(str(model.model), getattr(model, "revision", None))
    if not stable:
        # Block hashes differ per process: stored chunks are useless after a restart.
        weights += f"+process-{_PROCESS_NONCE}"
    namespace = Namespace(
        model=str(model.model),
        dtype=f"{model.dtype}/{cache.cache_dtype}",
        kv_layout=str(layout),
        block_size=int(spec.block_size),
        chunk_blocks=config.chunk_blocks,
        num_layers=num_layers,
        num_kv_heads=int(getattr(spec, "num_kv_heads", 0)),
        head_size=int(getattr(spec, "head_size", 0)),
        tp_size=parallel.tensor_parallel_size,
        weights_version=weights,
        cache_shape=f"pp{parallel.pipeline_parallel_size}",
    )
    return EngineGeometry(
        namespace=namespace,
        fingerprint=namespace.fingerprint(),
        block_size=int(spec.block_size),
        chunk_blocks=config.chunk_blocks,
        chunk_payload_bytes=int(spec.page_size_bytes) * num_layers * config.chunk_blocks,
        num_layers=num_layers,
        world_size=world_size,
        stable_hashes=stable,
    )
