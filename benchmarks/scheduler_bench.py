"""Scheduler-half microbenchmark: TieredKVConnector against vLLM's own OffloadingConnector.

Both connectors are built as vLLM builds them in the engine-core process (role SCHEDULER)
from one real ``VllmConfig`` (a tiny Llama written to disk, block size 32) and one
``KVCacheConfig`` with a single FullAttentionSpec group. Both use 512-token offload chunks
(tieredkv ``chunk_blocks=16``; vLLM ``blocks_per_chunk=16``) and a CPU tier large enough
never to evict. Requests are real ``vllm.v1.request.Request`` objects whose ``block_hashes``
come from vLLM's own block hasher (sha256); scheduler steps are real ``SchedulerOutput``s.

Measured, tieredkv and vLLM alternating call by call (the first of the pair alternates too):

* ``get_num_new_matched_tokens`` for prompts of 1k..128k tokens, ``hit`` (every chunk is in
  the connector's CPU tier, stored through the connector's own store path and completed by
  a worker report) and ``miss`` (empty tier). One size (2,348 tokens) is no multiple of the
  chunk: tieredkv's hit ends inside its last chunk (the prompt's tail), vLLM's at the last
  chunk boundary. ``cold`` is the first call for a fresh request
  (chunk keys derived from the block hashes inside the call); ``repeat`` is the same request
  asked again, as vLLM's scheduler does while a request waits (keys cached).
* ``build_connector_meta`` with 1..256 running requests: ``decode`` (every request scheduled
  one token, prefixes already stored, nothing to plan) and ``prefill`` (every request
  scheduled its second 512-token prefill chunk, so one store per request is planned).
* Keying alone for a 128k prompt: ``tieredkv.keys.chunk_keys`` and the host-index lookups of
  the resulting keys, next to vLLM's key packing and ``CPUOffloadingManager.lookup``.

Medians and p90 of ``time.perf_counter_ns`` samples; the garbage collector is paused inside
timed calls (collected between iterations) for both sides alike.

    python -m benchmarks.scheduler_bench            # quick profile (< 3 minutes)
    python -m benchmarks.scheduler_bench --full     # more iterations
"""

from __future__ import annotations

import argparse
import copy
import gc
import itertools
import logging
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import common

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

NAME = "scheduler_bench"
BLOCK_SIZE = 32
CHUNK_BLOCKS = 16
CHUNK_TOKENS = BLOCK_SIZE * CHUNK_BLOCKS
# 2,348 = 4 chunks + 300 tokens: its hit ends inside a chunk (the prompt's 9-block tail).
PROMPT_SIZES = (1024, 2348, 4096, 16384, 32768, 65536, 131072)
RUNNING = (1, 4, 16, 64, 256)
DECODE_PROMPT_TOKENS = 2048
PREFILL_PROMPT_TOKENS = 2 * CHUNK_TOKENS
# Scheduler side only: nothing is allocated. Above the ~1.5 GiB of chunks the run stores (no
# eviction), below host_bytes' bound (the machine's physical memory).
TIER_BYTES = 8 << 30
NUM_GPU_BLOCKS = 1 << 17
LOOKUP_TARGET_US = 2000.0
NOISE_BAND = 1.10
KEYING_TOKENS = 131072


@dataclass(frozen=True)
class Profile:
    name: str
    sizes: tuple[int, ...]
    running: tuple[int, ...]
    lookup_iters: int  # fresh requests per (size, hit/miss) and connector
    lookup_repeats: int  # repeated calls per fresh request
    decode_iters: int
    prefill_iters: int  # fresh connector pairs per running-request count
    keying_iters: int


PROFILES = {
    "smoke": Profile("smoke", (1024, 2348, 4096), (1, 4), 4, 2, 10, 3, 10),
    "quick": Profile("quick", PROMPT_SIZES, RUNNING, 300, 3, 800, 60, 1000),
    "full": Profile("full", PROMPT_SIZES, RUNNING, 1500, 5, 4000, 250, 5000),
}


def _fmt_size(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


# ---------------------------------------------------------------------------- vLLM objects


class Engine:
    """The vLLM configs, the block hasher and request factories shared by both connectors."""

    def __init__(self, model_dir: Path | None = None) -> None:
        from vllm.config import KVTransferConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
        )

        from tieredkv.tools.tiny_model import make_tiny_llama

        model_dir = model_dir or Path(tempfile.gettempdir()) / "tieredkv_scheduler_bench_model"
        model = make_tiny_llama(model_dir, max_positions=262144)
        tieredkv_transfer = KVTransferConfig(
            kv_connector="TieredKVConnector",
            kv_connector_module_path="tieredkv.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={"host_bytes": TIER_BYTES, "chunk_blocks": CHUNK_BLOCKS},
        )
        args = EngineArgs(
            model=str(model),
            block_size=BLOCK_SIZE,
            max_model_len=KEYING_TOKENS + 8192,
            enable_prefix_caching=True,
            prefix_caching_hash_algo="sha256",
            kv_transfer_config=tieredkv_transfer,
        )
        self.vllm_config = args.create_engine_config()
        # The same engine with vLLM's own CPU offloading connector instead.
        self.vllm_config_offloading = copy.copy(self.vllm_config)
        self.vllm_config_offloading.kv_transfer_config = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config={
                "cpu_bytes_to_use": TIER_BYTES,
                "blocks_per_chunk": CHUNK_BLOCKS,
            },
        )
        model_config = self.vllm_config.model_config
        parallel = self.vllm_config.parallel_config
        num_layers = model_config.get_num_layers(parallel)
        spec = FullAttentionSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=model_config.get_num_kv_heads(parallel),
            head_size=model_config.get_head_size(),
            dtype=model_config.dtype,
        )
        layers = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
        page = spec.page_size_bytes
        self.kv_cache_config = KVCacheConfig(
            num_blocks=NUM_GPU_BLOCKS,
            kv_cache_tensors=[
                KVCacheTensor(
                    size=page * NUM_GPU_BLOCKS * num_layers,
                    layers=layers,
                    layer_stride=page * NUM_GPU_BLOCKS,
                    block_stride=page,
                )
            ],
            kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
        )
        hash_fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
        self.sampling_params = SamplingParams(max_tokens=64)
        self._block_ids = itertools.count(1)  # 0 is vLLM's null block
        self.geometry = {
            "model": "tiny Llama (random weights)",
            "num_layers": num_layers,
            "num_kv_heads": spec.num_kv_heads,
            "head_size": spec.head_size,
            "dtype": str(model_config.dtype),
            "block_size": BLOCK_SIZE,
            "chunk_tokens": CHUNK_TOKENS,
            "page_size_bytes": page,
            "hash": self.vllm_config.cache_config.prefix_caching_hash_algo,
        }

    def tieredkv(self) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from tieredkv.connector import TieredKVConnector

        return TieredKVConnector(self.vllm_config, KVConnectorRole.SCHEDULER, self.kv_cache_config)

    def offloading(self) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
            OffloadingConnector,
        )

        return OffloadingConnector(
            self.vllm_config_offloading, KVConnectorRole.SCHEDULER, self.kv_cache_config
        )

    def pair(self) -> list[Side]:
        return [TieredSide(self.tieredkv()), VllmSide(self.offloading())]

    def request(self, req_id: str, tokens: list[int]) -> Any:
        """A request whose block hashes vLLM's own hasher computes."""
        from vllm.v1.request import Request

        return Request(req_id, tokens, self.sampling_params, None, block_hasher=self.block_hasher)

    def clone(self, req_id: str, template: Any) -> Any:
        """A fresh request with ``template``'s prompt and (already computed) block hashes."""
        from vllm.v1.request import Request

        request = Request(req_id, template.prompt_token_ids, self.sampling_params, None)
        request.block_hashes = template.block_hashes  # read-only for the connectors
        return request

    def new_blocks(self, count: int) -> list[int]:
        return list(itertools.islice(self._block_ids, count))


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(length)]


# ---------------------------------------------------------------------------- steps


def step(
    new: Sequence[tuple[Any, list[int], int]] = (),
    cached: Sequence[tuple[Any, list[int] | None, int]] = (),
    finished: Sequence[str] = (),
) -> Any:
    """A ``SchedulerOutput``: ``new`` (request, block ids, tokens), ``cached`` likewise."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    scheduled = {req.request_id: n for req, _, n in new}
    scheduled.update({req.request_id: n for req, _, n in cached})
    return SchedulerOutput(
        scheduled_new_reqs=[NewRequestData.from_request(req, (ids,)) for req, ids, _ in new],
        scheduled_cached_reqs=CachedRequestData(
            req_ids=[req.request_id for req, _, _ in cached],
            resumed_req_ids=set(),
            new_token_ids=[[] for _ in cached],
            all_token_ids={},
            new_block_ids=[None if ids is None else (ids,) for _, ids, _ in cached],
            num_computed_tokens=[req.num_computed_tokens for req, _, _ in cached],
            num_output_tokens=[req.num_output_tokens for req, _, _ in cached],
        ),
        num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={},
        finished_req_ids=set(finished),
        free_encoder_mm_hashes=[],
    )


def no_blocks() -> Any:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

    return KVCacheBlocks(([],))


class Side:
    """One connector's scheduler half plus what the benchmark needs to drive it."""

    name = ""
    label = ""

    def __init__(self, connector: Any) -> None:
        self.connector = connector

    def store_job_ids(self, meta: Any) -> list[int]:
        raise NotImplementedError

    def worker_report(self, job_ids: Sequence[int]) -> Any:
        raise NotImplementedError

    def complete(self, job_ids: Sequence[int]) -> None:
        from vllm.v1.outputs import KVConnectorOutput

        if job_ids:
            self.connector.update_connector_output(
                KVConnectorOutput(kv_connector_worker_meta=self.worker_report(job_ids))
            )

    def admit(self, requests: Sequence[Any]) -> None:
        """What vLLM does when requests arrive and find no hit: on_new_request, lookup, alloc."""
        for request in requests:
            self.connector.on_new_request(request)
            hit, _ = self.connector.get_num_new_matched_tokens(request, 0)
            assert hit == 0, f"{self.name}: unexpected hit of {hit} tokens while admitting"
            self.connector.update_state_after_alloc(request, no_blocks(), 0)

    def finish(self, requests: Sequence[Any], status: Any = None) -> None:
        """Finish requests the way vLLM does: request_finished, then a step naming them."""
        from vllm.v1.request import RequestStatus

        for request in requests:
            request.status = status or RequestStatus.FINISHED_STOPPED
            delayed, _ = self.connector.request_finished(request, [])
            assert not delayed, f"{self.name}: finished request still has stores in flight"
        meta = self.connector.build_connector_meta(
            step(finished=[r.request_id for r in requests])
        )
        assert not self.store_job_ids(meta)

    def check_idle(self) -> None:
        """Nothing pinned or tracked beyond the stored chunks (lookups left no state)."""


class TieredSide(Side):
    name = "tieredkv"
    label = "tieredkv (TieredKVConnector)"

    @property
    def half(self) -> Any:
        return self.connector._scheduler

    def store_job_ids(self, meta: Any) -> list[int]:
        return [job.job_id for job in meta.plan.stores]

    def worker_report(self, job_ids: Sequence[int]) -> Any:
        from tieredkv.protocol import JobResult
        from tieredkv.vllm.metadata import TieredKVWorkerMetadata

        return TieredKVWorkerMetadata(results={job: JobResult.done(job) for job in job_ids})

    def pinned(self) -> int:
        return self.half.planner.host.pinned_count

    def check_idle(self) -> None:
        planner = self.half.planner
        assert planner.host.pinned_count == 0, "tieredkv: host chunks still pinned"
        assert not planner.pending_jobs, "tieredkv: jobs still pending"
        assert not self.half._keys, "tieredkv: per-request keys not released"


class VllmSide(Side):
    name = "vllm"
    label = "vLLM OffloadingConnector (CPU)"

    @property
    def scheduler(self) -> Any:
        return self.connector.connector_scheduler

    def store_job_ids(self, meta: Any) -> list[int]:
        return list(meta.store_jobs)

    def worker_report(self, job_ids: Sequence[int]) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata,
        )

        return OffloadingWorkerMetadata(completed_jobs=dict.fromkeys(job_ids, 1))

    def check_idle(self) -> None:
        assert not self.scheduler._jobs, "vllm: jobs still pending"
        assert not self.scheduler._req_status, "vllm: request state not released"


def store_prompts(side: Side, engine: Engine, requests: Sequence[Any]) -> None:
    """Store whole prompts through the connector's own path: one prefill step, then the
    workers report every store job done; the requests then finish."""
    side.admit(requests)
    work = [(r, engine.new_blocks(-(-r.num_tokens // BLOCK_SIZE)), r.num_tokens) for r in requests]
    meta = side.connector.build_connector_meta(step(new=work))
    jobs = side.store_job_ids(meta)
    assert jobs, f"{side.name}: no stores planned for {len(requests)} prompt(s)"
    side.complete(jobs)
    for request in requests:
        request.num_computed_tokens = request.num_tokens
    side.finish(requests)
    side.check_idle()


# ---------------------------------------------------------------------------- timing


class Samples:
    def __init__(self) -> None:
        self.by_key: dict[tuple[str, ...], list[float]] = {}

    def add(self, key: tuple[str, ...], micros: float) -> None:
        self.by_key.setdefault(key, []).append(micros)

    def get(self, key: tuple[str, ...]) -> list[float]:
        return self.by_key.get(key, [])


def timed(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """Call once with the collector paused; returns (result, microseconds)."""
    gc.disable()
    try:
        start = time.perf_counter_ns()
        out = fn(*args)
        end = time.perf_counter_ns()
    finally:
        gc.enable()
    return out, (end - start) / 1000.0


def ordered(sides: Sequence[Side], iteration: int) -> list[Side]:
    """Alternate which connector goes first, so drift and cache effects hit both alike."""
    return list(sides) if iteration % 2 == 0 else list(reversed(sides))


# ---------------------------------------------------------------------------- phases


def bench_lookups(
    engine: Engine, profile: Profile, samples: Samples, progress: common.Progress
) -> dict[str, Any]:
    """get_num_new_matched_tokens: hit and miss, cold keys and repeated, per prompt size."""
    from vllm.v1.request import RequestStatus

    filled = engine.pair()
    empty = engine.pair()
    templates = {n: engine.request(f"template-{n}", prompt(n, n)) for n in profile.sizes}
    for n, template in templates.items():
        for side in filled:
            store_prompts(side, engine, [engine.clone(f"fill-{side.name}-{n}", template)])
    hits: dict[str, dict[int, int]] = {"tieredkv": {}, "vllm": {}}
    serial = itertools.count()
    for n in profile.sizes:
        template = templates[n]
        for state, sides in (("hit", filled), ("miss", empty)):
            progress.set_label(f"lookup {_fmt_size(n)} {state}")
            for i in range(profile.lookup_iters):
                for side in ordered(sides, i):
                    request = engine.clone(f"{side.name}-{state}-{n}-{next(serial)}", template)
                    side.connector.on_new_request(request)
                    call = side.connector.get_num_new_matched_tokens
                    (tokens, is_async), micros = timed(call, request, 0)
                    samples.add((side.name, "lookup", state, "cold", str(n)), micros)
                    pinned = side.pinned() if isinstance(side, TieredSide) else None
                    for _ in range(profile.lookup_repeats):
                        (again, _), micros = timed(call, request, 0)
                        samples.add((side.name, "lookup", state, "repeat", str(n)), micros)
                        assert again == tokens, f"{side.name}: repeated lookup changed the hit"
                        if pinned is not None:
                            assert side.pinned() == pinned, "tieredkv: repeated lookup re-pinned"
                    _check_hit(side.name, state, n, tokens, is_async)
                    if state == "hit":
                        hits[side.name][n] = tokens
                    # vLLM's path for a request that is then not admitted: no allocation.
                    side.connector.update_state_after_alloc(request, no_blocks(), 0)
                    side.finish([request], RequestStatus.FINISHED_ABORTED)
                    side.check_idle()
                if i % 20 == 19:
                    gc.collect()
                progress.advance()
    return {"hit_tokens": hits}


def _check_hit(name: str, state: str, n: int, tokens: int | None, is_async: bool) -> None:
    if state == "miss":
        assert tokens == 0 and not is_async, f"{name}: miss row returned {tokens}"
        return
    assert tokens is not None and is_async, f"{name}: hit row returned {tokens}"
    if name == "tieredkv":
        # Everything but the block holding the last prompt token (vLLM recomputes it).
        expected = (n - 1) // BLOCK_SIZE * BLOCK_SIZE
        assert tokens == expected, f"tieredkv: hit {tokens} tokens of {n}, expected {expected}"
    else:
        assert n - CHUNK_TOKENS <= tokens <= n, f"vllm: hit {tokens} tokens of {n}"


def _running_requests(engine: Engine, count: int, length: int, tag: str, seed: int) -> list[Any]:
    return [engine.request(f"{tag}-{i}", prompt(seed + i, length)) for i in range(count)]


def bench_decode(
    engine: Engine, profile: Profile, samples: Samples, progress: common.Progress
) -> None:
    """build_connector_meta with N running requests, each scheduled one decode token."""
    from vllm.v1.request import RequestStatus

    for count in profile.running:
        progress.set_label(f"build_connector_meta decode x{count}")
        sides = engine.pair()
        requests = _running_requests(engine, count, DECODE_PROMPT_TOKENS, f"dec{count}", 10_000)
        for side in sides:
            side.admit(requests)
        # Prefill in one step; the workers report every store done.
        prefill = [(r, engine.new_blocks(DECODE_PROMPT_TOKENS // BLOCK_SIZE), r.num_tokens)
                   for r in requests]
        metas = {side.name: side.connector.build_connector_meta(step(new=prefill)) for side in sides}
        for side in sides:
            side.complete(side.store_job_ids(metas[side.name]))
        for request in requests:
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = request.num_tokens
            request.append_output_token_ids(7)
        # First decode step: one new block per request (a new block starts at token 2048).
        first = [(r, engine.new_blocks(1), 1) for r in requests]
        for side in sides:
            assert not side.store_job_ids(side.connector.build_connector_meta(step(cached=first)))
        for request in requests:
            request.num_computed_tokens += 1
            request.append_output_token_ids(7)
        # Steady decode steps: one token each, no new block, nothing to store.
        for i in range(profile.decode_iters):
            for side in ordered(sides, i):
                output = step(cached=[(r, None, 1) for r in requests])
                meta, micros = timed(side.connector.build_connector_meta, output)
                assert not side.store_job_ids(meta), f"{side.name}: decode step planned stores"
                samples.add((side.name, "meta", "decode", "", str(count)), micros)
            if i % 50 == 49:
                gc.collect()
            progress.advance()
        for side in sides:
            side.finish(requests)
            side.check_idle()


def bench_prefill(
    engine: Engine, profile: Profile, samples: Samples, progress: common.Progress
) -> None:
    """build_connector_meta with N requests in their second 512-token prefill chunk."""
    for count in profile.running:
        progress.set_label(f"build_connector_meta prefill x{count}")
        templates = _running_requests(engine, count, PREFILL_PROMPT_TOKENS, "tpl", 20_000)
        for i in range(profile.prefill_iters):
            sides = engine.pair()  # fresh tiers: the chunks are new to both every time
            requests = [engine.clone(f"pre{count}-{i}-{j}", t) for j, t in enumerate(templates)]
            for side in sides:
                side.admit(requests)
            first = [(r, engine.new_blocks(CHUNK_BLOCKS), CHUNK_TOKENS) for r in requests]
            for side in sides:
                # Chunk 0 is planned now and stays in flight, as it would on a busy engine.
                meta = side.connector.build_connector_meta(step(new=first))
                assert len(side.store_job_ids(meta)) == count, f"{side.name}: chunk 0 stores"
            for request in requests:
                request.num_computed_tokens = CHUNK_TOKENS
            second = [(r, engine.new_blocks(CHUNK_BLOCKS), CHUNK_TOKENS) for r in requests]
            for side in ordered(sides, i):
                meta, micros = timed(side.connector.build_connector_meta, step(cached=second))
                planned = len(side.store_job_ids(meta))
                assert planned == count, f"{side.name}: planned {planned} stores for {count}"
                samples.add((side.name, "meta", "prefill", "", str(count)), micros)
            for side in sides:
                side.connector.shutdown()
            del sides
            gc.collect()
            progress.advance()


def bench_keying(
    engine: Engine, profile: Profile, samples: Samples, progress: common.Progress
) -> dict[str, Any]:
    """Keying and index lookups of a 128k-token prompt, without the connector around them."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

    from tieredkv.keys import chunk_keys

    progress.set_label("keying 128k")
    template = engine.request("keying", prompt(KEYING_TOKENS, KEYING_TOKENS))
    tiered, offloading = engine.pair()
    for side in (tiered, offloading):
        store_prompts(side, engine, [engine.clone(f"keying-fill-{side.name}", template)])
    fingerprint = tiered.half.geometry.fingerprint
    host = tiered.half.planner.host
    manager = offloading.scheduler.manager
    context = ReqContext(req_id="keying")
    hashes = template.block_hashes
    last = CHUNK_BLOCKS - 1

    def tiered_keys() -> list[bytes]:
        return chunk_keys(fingerprint, hashes, CHUNK_BLOCKS)

    def vllm_keys() -> list[bytes]:
        return [make_offload_key(h, 0) for h in itertools.islice(hashes, last, None, CHUNK_BLOCKS)]

    tk, vk = tiered_keys(), vllm_keys()

    def tiered_lookup() -> int:
        return sum(1 for key in tk if host.is_ready(key))

    def vllm_lookup() -> int:
        return sum(1 for key in vk if manager.lookup(key, context) is LookupResult.HIT)

    def plain_dict() -> int:
        return sum(1 for key in tk if key in entries)

    entries = dict.fromkeys(tk)
    assert tiered_lookup() == vllm_lookup() == len(tk) == KEYING_TOKENS // CHUNK_TOKENS
    pairs = [
        ("keying", tiered_keys, vllm_keys),
        ("index", tiered_lookup, vllm_lookup),
    ]
    for i in range(profile.keying_iters):
        for what, tfn, vfn in pairs:
            order = [("tieredkv", tfn), ("vllm", vfn)]
            for name, fn in order if i % 2 == 0 else reversed(order):
                _, micros = timed(fn)
                samples.add((name, what, "", "", str(KEYING_TOKENS)), micros)
        _, micros = timed(plain_dict)
        samples.add(("dict", "index", "", "", str(KEYING_TOKENS)), micros)
        if i % 100 == 99:
            gc.collect()
        progress.advance()
    return {"keys": len(tk), "block_hashes": len(hashes)}


# ---------------------------------------------------------------------------- report


def verdict(ratio: float) -> str:
    if ratio != ratio:  # NaN
        return "n/a"
    if ratio <= 1.0:
        return "PASS"
    if ratio <= NOISE_BAND:
        return "PASS (within noise)"
    return "FAIL"


def _row(
    samples: Samples, operation: str, key: tuple[str, ...], size: int, unit: str, **extra: Any
) -> dict[str, Any]:
    t = common.summarize(samples.get(("tieredkv", *key)))
    v = common.summarize(samples.get(("vllm", *key)))
    ratio = t["median"] / v["median"] if v["median"] else float("nan")
    return {
        "operation": operation,
        "size": size,
        "size_label": _fmt_size(size) + (" tokens" if unit == "tokens" else f" {unit}"),
        "unit": unit,
        "tieredkv_median_us": t["median"],
        "tieredkv_p90_us": t["p90"],
        "vllm_median_us": v["median"],
        "vllm_p90_us": v["p90"],
        "ratio": ratio,
        "target": "<= vLLM",
        "verdict": verdict(ratio),
        "samples": min(t["n"], v["n"]),
        **extra,
    }


def build_rows(samples: Samples, profile: Profile) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for state in ("hit", "miss"):
        for phase in ("cold", "repeat"):
            what = "first call, cold keys" if phase == "cold" else "repeated call"
            for n in profile.sizes:
                rows.append(_row(
                    samples, f"get_num_new_matched_tokens {state} ({what})",
                    ("lookup", state, phase, str(n)), n, "tokens",
                    group="lookup", state=state, phase=phase,
                ))
    for variant, what in (("decode", "decode, 1 token each"),
                          ("prefill", "prefill, 512-token chunk each, 1 store each")):
        for count in profile.running:
            rows.append(_row(
                samples, f"build_connector_meta ({what})", ("meta", variant, "", str(count)),
                count, "requests", group="meta", variant=variant,
            ))
    n = KEYING_TOKENS
    rows.append(_row(samples, "keying alone: chunk keys from block hashes (256 keys)",
                     ("keying", "", "", str(n)), n, "tokens", group="keying"))
    rows.append(_row(samples, "index lookups alone: 256 keys, all present",
                     ("index", "", "", str(n)), n, "tokens", group="keying"))
    big = max(profile.sizes)
    for row in rows:
        if row.get("group") == "lookup" and row["size"] == big and row["state"] == "hit" \
                and row["phase"] == "cold" and big == KEYING_TOKENS:
            passed = row["tieredkv_median_us"] < LOOKUP_TARGET_US
            rows.append({
                **row,
                "operation": "128k-token lookup (hit, cold keys) in under 2 ms",
                "group": "target",
                "ratio": row["ratio"],
                "target": "< 2000 us",
                "verdict": ("PASS" if passed else "FAIL")
                + f" (p90 {row['tieredkv_p90_us']:,.0f} us)",
            })
    for row in rows:
        row["tieredkv_us"] = _us(row["tieredkv_median_us"], row["tieredkv_p90_us"])
        row["vllm_us"] = _us(row["vllm_median_us"], row["vllm_p90_us"])
        row["ratio_text"] = f"{row['ratio']:.2f}" if row["ratio"] == row["ratio"] else "n/a"
        row["target_text"] = f"{row['target']}: {row['verdict']}"
    return rows


def _load_average() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:
        return None


def _us(median: float, p90: float) -> str:
    if median != median:
        return "n/a"
    return f"{_num(median)} (p90 {_num(p90)})"


def _num(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


COLUMNS = [
    ("operation", "operation"),
    ("size_label", "size"),
    ("tieredkv_us", "tieredkv µs median (p90)"),
    ("vllm_us", "vLLM µs median (p90)"),
    ("ratio_text", "ratio tieredkv/vLLM"),
    ("target_text", "target"),
]


def keying_summary(samples: Samples) -> str:
    n = str(KEYING_TOKENS)
    keying = common.summarize(samples.get(("tieredkv", "keying", "", "", n)))
    index = common.summarize(samples.get(("tieredkv", "index", "", "", n)))
    plain = common.summarize(samples.get(("dict", "index", "", "", n)))
    keys = KEYING_TOKENS // CHUNK_TOKENS
    return (
        f"Keying a 128k-token prompt ({KEYING_TOKENS // BLOCK_SIZE} vLLM block hashes -> "
        f"{keys} chunk keys): {keying['median']:.1f} us median "
        f"({keying['median'] * 1000 / keys:.0f} ns/key, p90 {keying['p90']:.1f} us); "
        f"looking the {keys} keys up in the host index: {index['median']:.1f} us "
        f"(p90 {index['p90']:.1f} us; a bare dict membership test: {plain['median']:.1f} us); "
        f"together {keying['median'] + index['median']:.1f} us."
    )


def plot(rows: list[dict[str, Any]], path: Path, machine: str, profile: Profile) -> Path:
    colors = {"tieredkv": "tab:blue", "vllm": "tab:orange"}
    names = {"tieredkv": "tieredkv", "vllm": "vLLM Offloading"}

    def series(select: Callable[[dict[str, Any]], bool], variants: dict[str, tuple[str, str]]):
        out = []
        for variant, (label, style) in variants.items():
            chosen = [r for r in rows if select(r) and _variant_of(r) == variant]
            if not chosen:
                continue
            chosen.sort(key=lambda r: r["size"])
            for side in ("tieredkv", "vllm"):
                out.append({
                    "label": f"{names[side]} {label}",
                    "x": [r["size"] for r in chosen],
                    "y": [r[f"{side}_median_us"] for r in chosen],
                    "yerr_hi": [r[f"{side}_p90_us"] for r in chosen],
                    "color": colors[side],
                    "linestyle": style,
                    "marker": "o" if side == "tieredkv" else "s",
                })
        return out

    sizes = list(profile.sizes)
    running = list(profile.running)
    lookup_variants = {"cold": ("cold keys", "-"), "repeat": ("repeated", "--")}
    panels = [
        {
            "title": "get_num_new_matched_tokens, hit (all chunks in CPU tier)",
            "xlabel": "prompt tokens", "ylabel": "µs per call (median; bar to p90)",
            "xticks": (sizes, [_fmt_size(s) for s in sizes]),
            "series": series(lambda r: r.get("group") == "lookup" and r["state"] == "hit",
                             lookup_variants),
            "hlines": [(LOOKUP_TARGET_US, "2 ms target (128k)")],
        },
        {
            "title": "get_num_new_matched_tokens, miss (empty tier)",
            "xlabel": "prompt tokens", "ylabel": "µs per call (median; bar to p90)",
            "xticks": (sizes, [_fmt_size(s) for s in sizes]),
            "series": series(lambda r: r.get("group") == "lookup" and r["state"] == "miss",
                             lookup_variants),
        },
        {
            "title": "build_connector_meta per scheduler step",
            "xlabel": "running requests", "ylabel": "µs per call (median; bar to p90)",
            "xticks": (running, [str(c) for c in running]),
            "series": series(lambda r: r.get("group") == "meta",
                             {"decode": ("decode (1 token each)", "-"),
                              "prefill": ("prefill (512-token chunk each)", "--")}),
        },
    ]
    return common.plot_panels(
        path, panels,
        title="Scheduler-half cost: tieredkv vs vLLM OffloadingConnector (lower is better)",
        footnote=f"{machine} | profile {profile.name} | 512-token chunks, block size 32",
    )


def _variant_of(row: dict[str, Any]) -> str:
    return row.get("phase") or row.get("variant") or ""


# ---------------------------------------------------------------------------- profiling


def cprofile_hot_paths(engine: Engine, tokens: int = KEYING_TOKENS, iters: int = 100,
                       top: int = 12) -> str:
    """cProfile of both connectors' lookup (hit; cold + 3 repeats) and of a 256-request
    prefill step, sorted by own time: where the time goes."""
    import cProfile
    import io
    import pstats

    from vllm.v1.request import RequestStatus

    template = engine.request("profile", prompt(tokens, tokens))
    sides = engine.pair()
    for side in sides:
        store_prompts(side, engine, [engine.clone(f"profile-fill-{side.name}", template)])
    report = []

    def lookups(side: Side) -> None:
        for i in range(iters):
            request = engine.clone(f"profile-{side.name}-{i}", template)
            side.connector.on_new_request(request)
            for _ in range(4):
                side.connector.get_num_new_matched_tokens(request, 0)
            side.connector.update_state_after_alloc(request, no_blocks(), 0)
            side.finish([request], RequestStatus.FINISHED_ABORTED)

    def prefill_step(side_index: int) -> Callable[[], None]:
        def run_steps() -> None:
            for i in range(max(1, iters // 20)):
                side = engine.pair()[side_index]
                requests = [engine.clone(f"pp-{i}-{j}", t) for j, t in enumerate(templates)]
                side.admit(requests)
                side.connector.build_connector_meta(step(new=[
                    (r, engine.new_blocks(CHUNK_BLOCKS), CHUNK_TOKENS) for r in requests]))
                for request in requests:
                    request.num_computed_tokens = CHUNK_TOKENS
                profiler.enable()
                side.connector.build_connector_meta(step(cached=[
                    (r, engine.new_blocks(CHUNK_BLOCKS), CHUNK_TOKENS) for r in requests]))
                profiler.disable()
        return run_steps

    templates = _running_requests(engine, 256, PREFILL_PROMPT_TOKENS, "ptpl", 30_000)
    for index, side in enumerate(sides):
        for what, body in (
            (f"get_num_new_matched_tokens {_fmt_size(tokens)} hit, cold + 3 repeats", None),
            ("build_connector_meta prefill x256", prefill_step(index)),
        ):
            profiler = cProfile.Profile()
            if body is None:
                profiler.enable()
                lookups(side)
                profiler.disable()
            else:
                body()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
            report.append(f"### {side.label}: {what}\n{text.getvalue().strip()}")
    return "\n\n".join(report)


# ---------------------------------------------------------------------------- main


@dataclass
class Result:
    rows: list[dict[str, Any]]
    payload: dict[str, Any]
    markdown: str
    paths: dict[str, str] = field(default_factory=dict)


def run(
    profile_name: str = "quick",
    *,
    out_dir: Path | str | None = None,
    write: bool = True,
    make_plot: bool = True,
    show_progress: bool = True,
    model_dir: Path | None = None,
) -> Result:
    """Run one profile in-process; returns the rows and (optionally) writes the results."""
    profile = PROFILES[profile_name]
    started = time.time()
    load_before = _load_average()
    engine = Engine(model_dir)
    gc.collect()
    gc.freeze()  # as vLLM's engine does after start-up: long-lived objects leave the GC's scans
    samples = Samples()
    total = (
        len(profile.sizes) * 2 * profile.lookup_iters
        + len(profile.running) * (profile.decode_iters + profile.prefill_iters)
        + profile.keying_iters
    )
    progress = common.Progress(total, "starting", enabled=show_progress)
    try:
        lookup_info = bench_lookups(engine, profile, samples, progress)
        bench_decode(engine, profile, samples, progress)
        bench_prefill(engine, profile, samples, progress)
        keying_info = bench_keying(engine, profile, samples, progress)
    finally:
        progress.close()
        gc.unfreeze()
    rows = build_rows(samples, profile)
    machine = common.machine_name()
    judged = [r for r in rows if r["group"] != "target"]
    fails = [r for r in judged if r["verdict"] == "FAIL"]
    target_rows = [r for r in rows if r["group"] == "target"]
    import vllm

    payload = {
        "benchmark": NAME,
        "profile": profile.name,
        "machine": {**common.machine_info(), "load_average_at_start": load_before},
        "vllm_version": getattr(vllm, "__version__", "unknown"),
        "tieredkv_revision": common.git_revision(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "wall_seconds": round(time.time() - started, 1),
        "settings": {
            **engine.geometry,
            "tier_bytes": TIER_BYTES,
            "lookup_iters": profile.lookup_iters,
            "lookup_repeats": profile.lookup_repeats,
            "decode_iters": profile.decode_iters,
            "prefill_iters": profile.prefill_iters,
            "keying_iters": profile.keying_iters,
            "decode_prompt_tokens": DECODE_PROMPT_TOKENS,
            "prefill_prompt_tokens": PREFILL_PROMPT_TOKENS,
            "noise_band": NOISE_BAND,
        },
        "targets": {
            "no_slower_than_vllm": "FAIL" if fails else "PASS",
            "failing_rows": [f"{r['operation']} @ {r['size_label']}" for r in fails],
            "lookup_128k_under_2ms": target_rows[0]["verdict"] if target_rows else "not measured",
        },
        "hit_tokens": lookup_info["hit_tokens"],
        "keying": {**keying_info, "summary": keying_summary(samples)},
        "rows": [{k: v for k, v in r.items() if not k.endswith("_text") and k not in
                  ("tieredkv_us", "vllm_us")} for r in rows],
    }
    load = payload["machine"].get("load_average")
    notes = (
        f"Machine: {machine}"
        + (f" (1-min load average {load_before[0]:.1f} at start, {load[0]:.1f} at end)"
           if load and load_before else "")
        + f". vLLM {payload['vllm_version']}, tieredkv {payload['tieredkv_revision']}, "
        f"profile `{profile.name}`, {payload['date']}, {payload['wall_seconds']} s.\n\n"
        "Scheduler halves only (role SCHEDULER), built from one real VllmConfig (tiny Llama, "
        "block size 32, sha256 block hashes from vLLM's own hasher), 512-token offload chunks on "
        "both sides, CPU tier large enough never to evict. tieredkv and vLLM calls alternate; "
        "µs are medians (p90) of `perf_counter_ns` samples on a shared, noisy machine. Ratio = "
        f"tieredkv median / vLLM median: PASS <= 1.00, PASS (within noise) <= {NOISE_BAND:.2f}, "
        "FAIL beyond. *cold keys*: first call for a fresh request (chunk keys derived inside "
        "the call); *repeated*: the same request asked again (keys cached). Decode: prompts of "
        f"{DECODE_PROMPT_TOKENS} tokens already stored, 1 token scheduled each, nothing to plan. "
        "Prefill: each request's second 512-token chunk is scheduled, one store planned each."
    )
    table = common.markdown_table(rows, COLUMNS)
    summary = (
        f"**Target 'no slower than vLLM on any row': {payload['targets']['no_slower_than_vllm']}**"
        + (f" (FAIL rows: {', '.join(payload['targets']['failing_rows'])})" if fails else "")
        + f"  \n**Target '128k-token lookup under 2 ms': {payload['targets']['lookup_128k_under_2ms']}**"
    )
    markdown = "\n\n".join([notes, summary, table, keying_summary(samples)])
    result = Result(rows, payload, markdown)
    if write:
        out = common.results_dir(out_dir)
        result.paths["json"] = str(common.write_json(out / f"{NAME}.json", payload))
        result.paths["md"] = str(common.write_markdown(
            out / f"{NAME}.md", "Scheduler-half benchmark: tieredkv vs vLLM OffloadingConnector",
            [markdown]))
        if make_plot:
            result.paths["png"] = str(plot(rows, out / f"{NAME}.png", machine, profile))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--full", action="store_true", help="more iterations (several minutes)")
    group.add_argument("--profile", choices=sorted(PROFILES), help="quick (default), full, smoke")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help=f"results directory (default {common.RESULTS_DIR})")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="where the tiny model is written (default: a temp directory)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--cprofile", action="store_true",
                        help="only print cProfile reports of the hot paths, no timing run")
    args = parser.parse_args(argv)
    logging.getLogger("tieredkv").setLevel(logging.ERROR)  # the CLI's output is the table
    if args.cprofile:
        print(cprofile_hot_paths(Engine(args.model_dir)))
        return 0
    profile = "full" if args.full else (args.profile or "quick")
    result = run(
        profile,
        out_dir=args.out_dir,
        write=not args.no_write,
        make_plot=not args.no_plot,
        show_progress=not args.quiet,
        model_dir=args.model_dir,
    )
    print(result.markdown)
    for kind, path in result.paths.items():
        print(f"wrote {kind}: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
