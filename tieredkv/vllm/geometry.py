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

The engine's KV-cache groups are read here too (:func:`group_geometry`): full-attention groups
(every block) and sliding-window groups (the blocks a hit ending at an entry's end needs)
become a :class:`~tieredkv.protocol.SlotRows`. tieredkv keys a block's KV by its prefix
(vLLM's chained block hashes, which also cover LoRA, multimodal inputs, prompt embeddings and
``cache_salt``), so it serves only KV that is a function of that prefix. Anything else is
refused at start-up, with the layers and what to do, rather than served wrong: non-causal
(Prefix-LM) attention, EAGLE/MTP draft KV (written with the next token), encoder,
cross-attention and other groups vLLM itself does not prefix-cache, Mamba/SSM state,
attention that evicts a middle gap (RSWA), chunked-local attention, and groups of different
block sizes or page sizes. Models vLLM says cannot reuse a prefix (encoder-decoder,
attention-free, pooling models that need every token's hidden state) are refused as a whole.
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

from tieredkv.config import TieredKVConfig
from tieredkv.keys import Namespace
from tieredkv.protocol import FULL, SLIDING, KVGroup, SlotRows
from tieredkv.remote.codec import HEADER_BYTES

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


# ---------------------------------------------------------------------------- KV-cache groups

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
    config.check_remote_value(payload_bytes, HEADER_BYTES)
    forgeable = config.forgeable_hash_warning(str(hash_algo), hash_algo in _STABLE_HASHES, stable)
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
