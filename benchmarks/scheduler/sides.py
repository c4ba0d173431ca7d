"""scheduler_bench's two sides: one tiny model's real ``VllmConfig``, real requests and
scheduler steps (:class:`Engine`), and each connector's scheduler half behind one interface
(:class:`TieredSide`, :class:`VllmSide`), its CPU tier filled through its own store path."""

from __future__ import annotations

import copy
import itertools
import random
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.scheduler.workload import (
    BLOCK_SIZE,
    CHUNK_BLOCKS,
    CHUNK_TOKENS,
    KEYING_TOKENS,
    NUM_GPU_BLOCKS,
    TIER_BYTES,
)


class Engine:
    """The vLLM configs, the block hasher and request factories shared by both connectors."""

    def __init__(self, model_dir: Path | None = None, *, kv_events: bool = False) -> None:
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
        # --kv-events: a third side, tieredkv with vLLM's KV events on (the "null" publisher:
        # vLLM's scheduler would publish what take_events() yields; here it is dropped).
        self.kv_events = kv_events
        self.vllm_config_events = None
        if kv_events:
            from vllm.config import KVEventsConfig

            self.vllm_config_events = copy.copy(self.vllm_config)
            self.vllm_config_events.kv_events_config = KVEventsConfig(
                enable_kv_cache_events=True, publisher="null"
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

    def tieredkv_events(self) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from tieredkv.connector import TieredKVConnector

        connector = TieredKVConnector(
            self.vllm_config_events, KVConnectorRole.SCHEDULER, self.kv_cache_config
        )
        assert connector._scheduler.events is not None, "tieredkv: KV events not switched on"
        return connector

    def offloading(self) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
            OffloadingConnector,
        )

        return OffloadingConnector(
            self.vllm_config_offloading, KVConnectorRole.SCHEDULER, self.kv_cache_config
        )

    def pair(self) -> list[Side]:
        """tieredkv and vLLM's sides (and, with ``kv_events``, tieredkv with events on)."""
        sides: list[Side] = [TieredSide(self.tieredkv()), VllmSide(self.offloading())]
        if self.kv_events:
            sides.append(EventsSide(self.tieredkv_events()))
        return sides

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
        plan = meta.plan
        if not hasattr(plan, "of"):  # a commit before the one job type (before_after.py)
            return [job.job_id for job in plan.stores]
        from tieredkv.protocol import Move

        return [job.job_id for job in plan.of(Move.STORE)]

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


class EventsSide(TieredSide):
    """tieredkv with vLLM's KV events on: events are taken after each worker report, as
    vLLM's scheduler calls ``take_events()`` after ``update_connector_output``."""

    name = "tieredkv_events"
    label = "tieredkv, KV events on"

    def complete(self, job_ids: Sequence[int]) -> None:
        super().complete(job_ids)
        list(self.connector.take_events())


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
