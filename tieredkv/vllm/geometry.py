"""What tieredkv needs to know about the engine, read from vLLM's configs in one place.

Both halves call :func:`engine_geometry` with the configs vLLM hands them, so the scheduler
and every worker derive the same namespace fingerprint and the same slot sizes without
talking to each other.

The fingerprint must change whenever a single K or V byte would: a restart on the same
``disk_path`` with other weights or settings must miss, never serve the old KV. It is built
from vLLM's own config hash factors (so settings vLLM adds later are covered by default),
the KV-cache dtype, the load format, context parallelism and the weights' content identity
(the resolved hub commit, or the weight files' size, mtime and inode). When the weights have
no identity that survives a restart, the namespace is made process-local: a miss after
restart, never a wrong hit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tieredkv.config import ConfigError, TieredKVConfig, format_size
from tieredkv.keys import Namespace
from tieredkv.protocol import SlotRows
from tieredkv.vllm.groups import group_geometry

logger = logging.getLogger(__name__)

# vLLM's collision-resistant prefix-caching hashes (--prefix-caching-hash-algo, 0.32): their
# hashes are the same in every process (a fixed default seed) and cannot be forged. Any
# other algorithm (xxhash, xxhash_cbor, whatever comes later) is treated as forgeable.
_STABLE_HASHES = ("sha256", "sha256_cbor")
_PROCESS_NONCE = os.urandom(8).hex()
_COMMIT = re.compile(r"[0-9a-f]{40}")

# vLLM's own ModelConfig.compute_hash() leaves these out (vllm/config/model.py, 0.32). hf_overrides
# is among them because it is applied to hf_config, which is hashed (and may be a callable).
_VLLM_IGNORED_MODEL_FIELDS = frozenset({
    "convert", "tokenizer", "tokenizer_mode", "seed", "hf_config_path",
    "allowed_local_media_path", "allowed_media_domains", "tokenizer_revision",
    "spec_target_max_model_len", "enforce_eager", "return_sampling_mask", "logprobs_mode",
    "use_fp64_gumbel", "enable_trace_replay", "disable_cascade_attn", "skip_tokenizer_init",
    "served_model_name", "config_format", "hf_token", "hf_overrides", "logits_processors",
    "io_processor_plugin", "pooler_config", "multimodal_config", "limit_mm_per_prompt",
    "media_io_kwargs", "mm_processor_kwargs", "mm_processor_cache_gb",
    "mm_processor_cache_type", "mm_shm_cache_max_object_size_mb", "mm_encoder_tp_mode",
    "interleave_mm_strings", "skip_mm_profiling", "mm_ipc_gpu_memory_gb",
})
# Fields vLLM does hash that cannot change a K or V byte (sampling output, memory management,
# process plumbing). Leaving them out keeps the disk tier across such restarts. Anything not
# listed here is hashed: an unknown setting costs a miss, never a wrong hit.
_NON_KV_MODEL_FIELDS = frozenset({
    "max_logprobs", "generation_config", "override_generation_config", "enable_sleep_mode",
    "sleep_mode_backend", "sleep_mode_offload_cudagraph", "sleep_preserve_parameter_names",
    "enable_cumem_allocator", "enable_nccl_comm_suspend", "renderer_num_workers",
})
_CACHE_FIELDS = ("cache_dtype", "kv_cache_dtype_skip_layers", "sliding_window")
_LOAD_FIELDS = ("load_format", "model_loader_extra_config")
_PARALLEL_FIELDS = (
    "prefill_context_parallel_size", "decode_context_parallel_size",
    "dcp_kv_cache_interleave_size", "cp_kv_cache_interleave_size",
)
# Files whose change can change the model's output: weights, configs, remote modelling code.
_MODEL_FILE_SUFFIXES = frozenset({
    ".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".json", ".py", ".msgpack",
    ".h5", ".npz", ".tensors", ".onnx", ".onnx_data",
})


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
    # The tieredkv config resolved for this engine (chunk_blocks fixed): resolved here, once,
    # and taken from here by both halves and the planner.
    config: TieredKVConfig
    # The KV-cache groups and where their blocks sit in a slot (one full group: rows are blocks).
    slot_rows: SlotRows


# ---------------------------------------------------------------------------- files


def files_signature(path: Path, suffixes: frozenset[str] | None = _MODEL_FILE_SUFFIXES) -> str | None:
    """Digest of the names, sizes, mtimes and inodes of a file or of the files under a directory.

    Cheap (no file is read) and stable across restarts while the files are untouched; a
    replaced or rewritten file changes its mtime or inode. Hidden entries (``.cache``,
    ``.git``) and ``__pycache__`` are skipped. ``suffixes=None`` takes every file. ``None``
    when ``path`` cannot be read.
    """
    digest = hashlib.sha256()
    try:
        if path.is_file():
            _add_stat(digest, path.name, path.stat())
            return digest.hexdigest()[:32]
        for root, dirs, names in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "__pycache__")
            for name in sorted(names):
                if name.startswith(".") or (suffixes is not None and Path(name).suffix not in suffixes):
                    continue
                item = Path(root, name)
                _add_stat(digest, str(item.relative_to(path)), item.stat())
    except OSError as exc:
        logger.warning("tieredkv: cannot read %s to identify it (%s)", path, exc)
        return None
    return digest.hexdigest()[:32]


def _add_stat(digest: Any, name: str, stat: os.stat_result) -> None:
    digest.update(f"{name}:{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ino};".encode())


def hub_commit(repo_id: str, revision: Any, cache_dir: str | None = None) -> str | None:
    """The commit a hub id resolves to, from vLLM's resolved revision or the local cache only.

    vLLM resolves the revision before loading (``ModelConfig.revision`` is then a
    ``ResolvedRevision`` carrying ``.resolved``); a full commit hash names itself; otherwise
    the local hub cache's ``refs/`` is asked, never the network. ``None`` when unknown.
    """
    resolved = getattr(revision, "resolved", None)
    if isinstance(resolved, str) and _COMMIT.fullmatch(resolved):
        return resolved
    if isinstance(revision, str) and _COMMIT.fullmatch(revision):
        return revision
    if os.getenv("VLLM_USE_MODELSCOPE", "").lower() in ("1", "true"):
        return None
    try:
        from huggingface_hub import HfApi

        resolved = HfApi().resolve_revision(
            repo_id, revision=revision or None, cache_dir=cache_dir, local_files_only=True
        ).resolved
    except Exception:  # noqa: BLE001 - not in the cache, not a hub id, no huggingface_hub
        return None
    return resolved if isinstance(resolved, str) and _COMMIT.fullmatch(resolved) else None


def weights_identity(model_config: Any, load_config: Any = None) -> tuple[str | None, str]:
    """(identity of the weights that survives a restart or None, how it was found).

    A local directory or file (``.gguf`` included): :func:`files_signature`. A hub id: the
    resolved commit. Object storage (``model_weights`` set) and anything else: None.
    """
    model = str(getattr(model_config, "model", ""))
    revision = getattr(model_config, "revision", None)
    if getattr(model_config, "model_weights", ""):
        return None, f"weights streamed from {model_config.model_weights}"
    path = Path(model).expanduser()
    if path.exists():
        signature = files_signature(path)
        return (f"files:{signature}", f"files under {path}") if signature else (None, f"{path} unreadable")
    commit = hub_commit(model, revision, getattr(load_config, "download_dir", None))
    if commit:
        return f"hub:{commit}", f"hub commit {commit[:12]}"
    return None, f"no local files and no resolved hub commit for {model!r}"


# ---------------------------------------------------------------------------- settings


def model_config_factors(model_config: Any) -> str | None:
    """Digest of vLLM's ModelConfig hash factors, less those that cannot change K/V.

    Falls back to ``ModelConfig.compute_hash()`` (a superset) if vLLM's factor helper is
    missing or refuses a value; None if neither works (the caller then goes process-local).
    """
    try:
        from vllm.config.utils import get_hash_factors, hash_factors

        ignored = set(_VLLM_IGNORED_MODEL_FIELDS | _NON_KV_MODEL_FIELDS)
        return hash_factors(get_hash_factors(model_config, ignored))
    except Exception:  # noqa: BLE001 - not a vLLM dataclass, or a value vLLM cannot hash
        pass
    try:
        return str(model_config.compute_hash())
    except Exception:  # noqa: BLE001
        return None


def _picked(config: Any, names: tuple[str, ...]) -> dict[str, str]:
    return {name: repr(getattr(config, name, None)) for name in names}


def engine_settings(vllm_config: Any) -> tuple[str | None, str]:
    """(digest of every vLLM setting that changes K/V, or None; a reason when None).

    Covers the model config's hash factors (hf_config after ``hf_overrides``, RoPE,
    quantization, dtype, max_model_len, revision, ...), the KV-cache dtype and skipped layers,
    the load format and context parallelism, and vLLM's version (kernels may change bytes).
    """
    model_digest = model_config_factors(vllm_config.model_config)
    if model_digest is None:
        return None, "vLLM's model config cannot be hashed"
    try:
        from vllm import __version__ as vllm_version
    except Exception:  # noqa: BLE001 - unit tests without vLLM
        vllm_version = "unknown"
    parts = {
        "model": model_digest,
        "cache": _picked(vllm_config.cache_config, _CACHE_FIELDS),
        "load": _picked(getattr(vllm_config, "load_config", None), _LOAD_FIELDS),
        "parallel": _picked(vllm_config.parallel_config, _PARALLEL_FIELDS),
        "vllm": str(vllm_version),
    }
    canonical = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:32], ""


def _stable_identity(vllm_config: Any, stable_hashes: bool) -> tuple[str, str]:
    """(weights_version, engine_config) for the namespace; process-local when in doubt."""
    model = vllm_config.model_config
    weights, weights_how = weights_identity(model, getattr(vllm_config, "load_config", None))
    settings, settings_why = engine_settings(vllm_config)
    local = f"process-{_PROCESS_NONCE}"
    if not stable_hashes:
        # Block hashes differ per process: stored chunks are useless after a restart.
        return f"{weights or ''}+{local}", settings or local
    if weights is None or settings is None:
        logger.warning(
            "tieredkv: no identity of %s that survives a restart (%s); stored KV is kept "
            "for this process only, a restart starts the disk tier empty",
            model.model, settings_why or weights_how,
        )
        return f"{weights or ''}+{local}", settings or local
    logger.info("tieredkv: weights identified by %s", weights_how)
    return weights, settings


# ---------------------------------------------------------------------------- LoRA


class AdapterDigests:
    """Content digests of LoRA adapters, for the keys of LoRA requests.

    vLLM's block hashes cover an adapter's name and path, not its files: adapters replaced
    under the same name would otherwise hit each other's KV after a restart (or after vLLM
    reloads an evicted adapter). The digest is the adapter files' :func:`files_signature`
    (or the hub commit), re-checked for every new request; an adapter without an identity
    gets a process-local digest (a miss after restart).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._warned: set[str] = set()

    def digest(self, lora_request: Any) -> bytes:
        """The bytes mixed into this request's keys; empty without a LoRA adapter."""
        if lora_request is None:
            return b""
        path = str(getattr(lora_request, "lora_path", "") or getattr(lora_request, "path", "") or "")
        name = str(getattr(lora_request, "lora_name", ""))
        identity = self._identity(path) if path else None
        if identity is None:
            identity = f"process-{_PROCESS_NONCE}:{getattr(lora_request, 'lora_int_id', '')}"
            with self._lock:
                if path not in self._warned:
                    self._warned.add(path)
                    logger.warning(
                        "tieredkv: LoRA adapter %r (%s) has no identity that survives a "
                        "restart; its KV is kept for this process only", name, path or "no path",
                    )
        return hashlib.sha256(f"lora\0{name}\0{path}\0{identity}".encode()).digest()

    @staticmethod
    def _identity(path: str) -> str | None:
        local = Path(path).expanduser()
        if local.exists():
            signature = files_signature(local, suffixes=None)
            return f"files:{signature}" if signature else None
        commit = hub_commit(path, None)
        return f"hub:{commit}" if commit else None


# ---------------------------------------------------------------------------- safety checks


def forgeable_hash_warning(hash_algo: str, stable: bool, config: TieredKVConfig) -> str | None:
    """Why keys of a tier that outlives the process are forgeable under ``hash_algo``, or None.

    tieredkv keys chunks by vLLM's block hashes. A non-cryptographic algorithm is only safe
    while its seed is secret and random per process (vLLM's default without PYTHONHASHSEED;
    tieredkv then keeps the disk tier and Redis to this process). With PYTHONHASHSEED set the
    hashes are shared, and so is the seed: a prompt whose block hashes collide with another's
    can be computed offline, and the disk tier (across restarts) and Redis (for every replica)
    keep what it stores. Rehashing the chain with sha256 would not help: colliding block
    hashes stay colliding. Accepted, since the operator chose the algorithm, but said loudly.
    """
    if hash_algo in _STABLE_HASHES or not stable or not (config.has_disk or config.has_remote):
        return None
    tiers = " and ".join(name for name, on in (("disk", config.has_disk), ("remote (Redis)", config.has_remote)) if on)
    return (
        f"tieredkv: prefix_caching_hash_algo={hash_algo} is not collision resistant, and with "
        "PYTHONHASHSEED set its seed is fixed and predictable, so colliding prompts can be "
        "precomputed offline (vLLM keeps a random seed for this algorithm for that reason); "
        f"the {tiers} tier keeps these keys beyond this process (on disk across restarts, in "
        "Redis for every replica), so a prompt forged to collide with another can be served "
        "the other's KV, or make others be served its own. Use --prefix-caching-hash-algo "
        "sha256 (or sha256_cbor) where tenants do not trust each other"
    )


def check_remote_write_queue(config: TieredKVConfig, payload_bytes: int) -> None:
    """Refuse a ``remote_write_queue_bytes`` smaller than one chunk's value (every write dropped).

    The value of a chunk on one rank (its KV plus the codec's header) is known only once the
    model's geometry is: this is the first place the config meets it, in both halves.
    """
    if not (config.has_remote and config.remote_writes):
        return
    from tieredkv.remote.codec import HEADER_BYTES

    value_bytes = payload_bytes + HEADER_BYTES
    if config.remote_write_queue_bytes < value_bytes:
        raise ConfigError(
            "remote_write_queue_bytes",
            f"smaller than one chunk's value ({format_size(value_bytes)}, {value_bytes} bytes: "
            f"the chunk's KV on one rank and a {HEADER_BYTES}-byte header), so every write to "
            f"the remote tier would be dropped; set it to several values (e.g. "
            f"{format_size(8 * value_bytes)}), lower chunk_blocks, or set remote_writes: false",
            value=config.remote_write_queue_bytes,
        )


# ---------------------------------------------------------------------------- geometry


def engine_geometry(vllm_config: Any, kv_cache_config: Any, config: TieredKVConfig) -> EngineGeometry:
    """Derive namespace and sizes, and resolve ``config`` for them (the one place it is
    resolved: see ``EngineGeometry.config``); refuse configurations tieredkv cannot serve
    correctly."""
    groups = kv_cache_config.kv_cache_groups
    config = config.resolved(int(groups[0].kv_cache_spec.block_size)) if groups else config
    shape = group_geometry(kv_cache_config, config.chunk_blocks, vllm_config)
    spec, slot_rows = shape.spec, shape.slot_rows
    num_layers = shape.layers_per_group
    parallel = vllm_config.parallel_config
    world_size = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    cache = vllm_config.cache_config
    model = vllm_config.model_config
    hash_algo = getattr(cache, "prefix_caching_hash_algo", "sha256")
    stable = hash_algo in _STABLE_HASHES or os.getenv("PYTHONHASHSEED") is not None
    layout = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(
        cache, "kv_cache_layout", None
    ) or "unknown"
    weights, settings = _stable_identity(vllm_config, stable)
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
        # Hybrid models: the slot rows decide what a slot holds (single groups: unchanged).
        cache_shape=f"pp{parallel.pipeline_parallel_size}"
        + (f";groups={slot_rows.describe()}" if slot_rows.hybrid else ""),
        engine_config=settings,
    )
    fingerprint = namespace.fingerprint()
    logger.info("tieredkv: namespace fingerprint %s", fingerprint.hex()[:16])
    payload_bytes = shape.page_size_bytes * num_layers * slot_rows.rows
    check_remote_write_queue(config, payload_bytes)
    forgeable = forgeable_hash_warning(str(hash_algo), stable, config)
    if forgeable:
        logger.warning("%s", forgeable)
    return EngineGeometry(
        namespace=namespace,
        fingerprint=fingerprint,
        block_size=int(spec.block_size),
        chunk_blocks=config.chunk_blocks,
        chunk_payload_bytes=payload_bytes,
        num_layers=num_layers,
        world_size=world_size,
        stable_hashes=stable,
        config=config,
        slot_rows=slot_rows,
    )
