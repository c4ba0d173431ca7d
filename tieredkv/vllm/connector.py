"""``TieredKVConnector``: the thin vLLM-facing shell over the scheduler and worker halves.

vLLM builds it twice: in the engine-core process (scheduler role) and in every worker process
(worker role). Each role gets exactly one half; every method forwards to it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    CopyBlocksOp,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tieredkv.config import TieredKVConfig
from tieredkv.protocol import Tier
from tieredkv.vllm.metadata import TieredKVMetadata

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("tieredkv")

# The shared remote tier has no source of its own in vLLM: it is reported as external.
_SOURCES = {
    Tier.HOST: CacheHitSource.HOST,
    Tier.DISK: CacheHitSource.DISK,
    Tier.REMOTE: CacheHitSource.EXTERNAL_UNSPECIFIED,
}


class TieredKVConnector(KVConnectorBase_V1, SupportsHMA):
    """Offloads KV chunks to pinned host memory and NVMe; loads them back asynchronously.

    ``SupportsHMA``: vLLM keeps its hybrid KV-cache manager on (sliding-window layers keep
    only their window on the device); tieredkv stores every group a hit needs."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.config = TieredKVConfig.from_dict(extra)
        self._scheduler = None
        self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            from tieredkv.vllm.scheduler_side import SchedulerHalf

            self._scheduler = SchedulerHalf(vllm_config, kv_cache_config, self.config)
        else:
            from tieredkv.vllm.worker_side import WorkerHalf

            self._worker = WorkerHalf(vllm_config, kv_cache_config, self.config)

    @property
    def requires_kv_delivery(self) -> bool:
        # A dropped store is a future miss, not an error.
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # Per-layer, block-major pages: each block of a layer is one contiguous run, which
        # the copy backends move as whole rows. The CPU backend supports only this layout.
        return "LBHNC"

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def set_host_xfer_buffer_ops(self, copy_operation: CopyBlocksOp) -> None:
        assert self._worker is not None
        self._worker.set_host_xfer_buffer_ops(copy_operation)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert self._worker is not None
        if isinstance(kv_connector_metadata, TieredKVMetadata):
            self._worker.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, TieredKVMetadata)
        self._worker.start_jobs(metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous (between steps); nothing is loaded layer by layer.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        # Stores are issued once per step in wait_for_save, after the forward pass.
        return

    def wait_for_save(self) -> None:
        assert self._worker is not None
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, TieredKVMetadata)
        self._worker.submit_stores(metadata)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        sending, recving = self._worker.collect(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving,
            failed_recving=self._worker.take_failed_recving(),
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    def build_connector_worker_meta(self):
        if self._worker is None:
            return None
        return self._worker.build_worker_meta()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # ------------------------------------------------------------------ scheduler side

    def on_new_request(self, request: Any) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        try:
            return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception:  # noqa: BLE001 - a lookup bug must cost a miss, never the engine
            logger.exception("tieredkv: lookup for %s failed; answering a miss", request.request_id)
            return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Any, num_external_tokens: int) -> dict[CacheHitSource, int]:
        assert self._scheduler is not None
        if num_external_tokens == 0:
            return {}
        by_tier = self._scheduler.get_external_cache_hit_sources(request, num_external_tokens)
        sources = {_SOURCES[tier]: count for tier, count in by_tier.items()}
        if sum(sources.values()) != num_external_tokens:
            return {CacheHitSource.HOST: num_external_tokens}
        return sources

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request), None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM calls this instead of ``request_finished`` once the connector supports HMA."""
        assert self._scheduler is not None
        return self._scheduler.request_finished(request), None

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_work()

    # ------------------------------------------------------------------ metrics

    def get_kv_connector_stats(self):
        from tieredkv.vllm.stats import TieredKVStats

        half = self._scheduler if self._scheduler is not None else self._worker
        stats = TieredKVStats(data=half.stats_snapshot())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        from tieredkv.vllm.stats import TieredKVStats

        return TieredKVStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from tieredkv.vllm.prometheus import TieredKVPromMetrics

        return TieredKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """KV events of tieredkv's tiers since the last call (vLLM publishes them beside its
        own when ``--kv-events-config`` enables them; see :mod:`tieredkv.vllm.kv_events`)."""
        if self._scheduler is not None:
            return self._scheduler.take_events()
        return ()

    def reset_cache(self) -> bool | None:
        if self._scheduler is not None:
            return self._scheduler.reset_cache()
        return True
