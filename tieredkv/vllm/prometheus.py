"""``TieredKVPromMetrics``: tieredkv's metrics on vLLM's own Prometheus path.

vLLM's ``PrometheusStatLogger`` calls ``TieredKVConnector.build_prom_metrics`` once per stat
logger with the metric classes it uses (``prometheus_client``'s, or Ray wrappers), the base
label names (``model_name``, ``engine``) and each engine's label values; then, for every engine
step that produced :class:`~tieredkv.vllm.stats.TieredKVStats`, it calls :meth:`observe` with the
step's payload (``TieredKVStats.data``: counter deltas, latest gauges, latency samples).

Everything but that interface lives in :mod:`tieredkv.metrics` (shared with the standalone
exporter, which must work without vLLM): the metric definitions in
:mod:`~tieredkv.metrics.specs`, the way a payload becomes samples in
:class:`~tieredkv.metrics.recorder.TieredKVMetrics`. Every name starts with ``vllm:``, so
vLLM's ``unregister_vllm_metrics`` removes these collectors from the global registry before it
builds the next stat logger.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    PromMetric,
    PromMetricT,
)

from tieredkv.metrics.recorder import TieredKVMetrics
from tieredkv.metrics.specs import COUNTER, GAUGE, HISTOGRAM

__all__ = ["TieredKVPromMetrics"]


class TieredKVPromMetrics(KVConnectorPromMetrics):
    """Registers ``vllm:tieredkv_*`` with vLLM's metric classes; records each step's stats."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.metrics = TieredKVMetrics(
            {COUNTER: self._counter_cls, GAUGE: self._gauge_cls, HISTOGRAM: self._histogram_cls},
            labelnames,
            per_engine_labelvalues,
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self.metrics.observe(transfer_stats_data, engine_idx)
