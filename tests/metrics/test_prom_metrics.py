"""TieredKVPromMetrics on vLLM's own path, into a fresh registry: exact sample values.

vLLM's ``KVConnectorProm`` passes ``{Gauge: cls, Counter: cls, Histogram: cls}`` keyed by
prometheus_client's classes (Ray's logger swaps the values); a subclass here swaps them for
classes bound to a private registry, so nothing touches the global one.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from tieredkv.metrics.exporter import registry_classes
from tieredkv.metrics.specs import (
    COUNTER,
    DIRECTIONS,
    HISTOGRAM,
    JOB_KINDS,
    METRIC_SPECS,
    QUEUES,
    TIERS,
)
from tieredkv.protocol import FAILURE_CAUSES

pytestmark = pytest.mark.vllm

LABELS = {"model_name": "tiny", "engine": "0"}


@pytest.fixture(scope="module")
def vllm_modules(require_vllm):
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    from tieredkv.vllm.plugin import register

    register()
    config = VllmConfig(
        kv_transfer_config=KVTransferConfig(kv_connector="TieredKVConnector", kv_role="kv_both")
    )
    return SimpleNamespace(config=config, KVConnectorProm=KVConnectorProm)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def connector_prom(vllm_modules, registry):
    """vLLM's KVConnectorProm building TieredKVPromMetrics, as PrometheusStatLogger does."""
    classes = registry_classes(registry)

    class PrivateRegistryProm(vllm_modules.KVConnectorProm):
        _gauge_cls = classes["gauge"]
        _counter_cls = classes["counter"]
        _histogram_cls = classes["histogram"]

    per_engine = {0: ["tiny", "0"], 1: ["tiny", "1"]}
    return PrivateRegistryProm(vllm_modules.config, ["model_name", "engine"], per_engine)


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {**LABELS, **labels})


def stats_payload(scheduler: dict | None = None, workers: dict | None = None) -> dict:
    """Scheduler and worker snapshots combined the way vLLM does: TieredKVStats.aggregate."""
    from tieredkv.vllm.stats import TieredKVStats

    total = TieredKVStats(data={})
    for part in (workers, scheduler):
        if part is not None:
            total = total.aggregate(TieredKVStats(data=part))
    return total.to_dict()


def test_failure_metrics_label_every_failure_cause() -> None:
    for key in ("load_failures", "store_failures", "spill_failures", "disk_reads_retried"):
        assert METRIC_SPECS[key].values == tuple(FAILURE_CAUSES), key


def test_connector_builds_tieredkv_metrics(connector_prom) -> None:
    from tieredkv.vllm.prometheus import TieredKVPromMetrics

    assert isinstance(connector_prom.prom_metrics, TieredKVPromMetrics)


def test_every_metric_exists_at_zero_with_vllm_labels(connector_prom, registry) -> None:
    families = {family.name: family for family in registry.collect()}
    for spec in METRIC_SPECS.values():
        assert spec.name.startswith("vllm:tieredkv_")
        assert not spec.name.startswith("vllm:kv_offload")
        family = families[spec.name]
        assert family.documentation == spec.help and spec.help
        values = spec.values if spec.label else (None,)
        values2 = spec.values2 if spec.label2 else (None,)
        for engine in ("0", "1"):
            for value in values:
                for value2 in values2:
                    labels = {"model_name": "tiny", "engine": engine}
                    if value is not None:
                        labels[spec.label] = value
                    if value2 is not None:
                        labels[spec.label2] = value2
                    name = spec.exposed_names[0] if spec.kind != HISTOGRAM else spec.name + "_count"
                    assert registry.get_sample_value(name, labels) == 0.0, (name, labels)
    for kind in ("load_failures", "store_failures", "spill_failures"):
        name = METRIC_SPECS[kind].name + "_total"
        for cause in FAILURE_CAUSES:
            assert sample(registry, name, cause=cause) == 0.0
    for direction in DIRECTIONS:
        assert sample(registry, "vllm:tieredkv_bytes_total", direction=direction) == 0.0
        assert sample(registry, "vllm:tieredkv_operations_total", direction=direction) == 0.0
    for tier in TIERS:
        for name in ("vllm:tieredkv_hit_tokens_total", "vllm:tieredkv_evictions_total",
                     "vllm:tieredkv_capacity_bytes", "vllm:tieredkv_used_bytes"):
            assert sample(registry, name, tier=tier) == 0.0
    for queue in QUEUES:
        assert sample(registry, "vllm:tieredkv_queue_depth", queue=queue) == 0.0
    for job in JOB_KINDS:
        assert sample(registry, "vllm:tieredkv_transfer_latency_seconds_count", kind=job) == 0.0


def test_observe_counts_sets_and_observes_exactly(connector_prom, registry) -> None:
    step1 = stats_payload(
        scheduler={"scheduler": {
            "counters": {"lookups": 3, "hit_tokens": {"host": 256, "disk": 128},
                         "evictions": {"host": 2}, "stored_chunks": 5, "spilled_chunks": 4,
                         "disk_read_failed": {"checksum": 1}, "load_failed": {"timeout": 2},
                         "store_failed": {"copy_error": 1}, "spill_failed": {"no_space": 3},
                         "dropped_at_recovery": 7, "disk_admission_rejected": 1,
                         "store_skipped_host_full": 6, "resets": 1,
                         "a_counter_from_the_future": 9},
            "gauges": {"host_slots_capacity": 8, "host_slots_used": 6, "host_slots_pinned": 2,
                       "disk_slots_capacity": 100, "disk_slots_used": 4,
                       "requests_waiting_on_load": 1, "jobs_in_flight": 3},
            "chunk_bytes": 1000, "chunk_tokens": 128, "world_size": 2}},
        workers={"workers": {
            "0": {"bytes": {"d2h": 5000, "h2d": 3000, "spill": 4000, "restore": 1000},
                  "ops": {"d2h": 5, "h2d": 1, "spill": 4, "restore": 1}, "spills_dropped": 2,
                  "failures": {"checksum": 1},
                  "latency_s": {"store": [0.003, 0.02], "load": [0.0004], "promote": [],
                                "spill": [0.5]},
                  "queue_depths": {"spill_queue": 3, "d2h_queue": 1}},
            "1": {"bytes": {"d2h": 5000}, "ops": {"d2h": 5}, "spills_dropped": 0,
                  "failures": {}, "latency_s": {"store": [0.004]},
                  "queue_depths": {"spill_queue": 2, "d2h_queue": 0}}}},
    )
    connector_prom.observe(step1, 0)

    assert sample(registry, "vllm:tieredkv_lookups_total") == 3
    assert sample(registry, "vllm:tieredkv_hit_tokens_total", tier="host") == 256
    assert sample(registry, "vllm:tieredkv_hit_tokens_total", tier="disk") == 128
    assert sample(registry, "vllm:tieredkv_evictions_total", tier="host") == 2
    assert sample(registry, "vllm:tieredkv_chunks_total", op="stored") == 5
    assert sample(registry, "vllm:tieredkv_chunks_total", op="spilled") == 4
    # Promotion (disk read) failures and load failures share one metric, by cause.
    assert sample(registry, "vllm:tieredkv_load_failures_total", cause="checksum") == 1
    assert sample(registry, "vllm:tieredkv_load_failures_total", cause="timeout") == 2
    assert sample(registry, "vllm:tieredkv_store_failures_total", cause="copy_error") == 1
    assert sample(registry, "vllm:tieredkv_spill_failures_total", cause="no_space") == 3
    assert sample(registry, "vllm:tieredkv_recovery_dropped_total") == 7
    assert sample(registry, "vllm:tieredkv_disk_admission_rejected_total") == 1
    assert sample(registry, "vllm:tieredkv_skipped_total", reason="store_host_full") == 6
    assert sample(registry, "vllm:tieredkv_resets_total") == 1
    # Gauges: slots x chunk bytes x world size.
    assert sample(registry, "vllm:tieredkv_capacity_bytes", tier="host") == 8 * 1000 * 2
    assert sample(registry, "vllm:tieredkv_used_bytes", tier="host") == 6 * 1000 * 2
    assert sample(registry, "vllm:tieredkv_capacity_bytes", tier="disk") == 100 * 1000 * 2
    assert sample(registry, "vllm:tieredkv_used_bytes", tier="disk") == 4 * 1000 * 2
    assert sample(registry, "vllm:tieredkv_pinned_host_slots") == 2
    assert sample(registry, "vllm:tieredkv_requests_waiting_on_load") == 1
    # Worker counters are summed over ranks.
    assert sample(registry, "vllm:tieredkv_bytes_total", direction="d2h") == 10000
    assert sample(registry, "vllm:tieredkv_bytes_total", direction="h2d") == 3000
    assert sample(registry, "vllm:tieredkv_bytes_total", direction="spill") == 4000
    assert sample(registry, "vllm:tieredkv_bytes_total", direction="restore") == 1000
    assert sample(registry, "vllm:tieredkv_operations_total", direction="d2h") == 10
    assert sample(registry, "vllm:tieredkv_spills_dropped_total") == 2
    assert sample(registry, "vllm:tieredkv_queue_depth", queue="spill_queue") == 5
    assert sample(registry, "vllm:tieredkv_queue_depth", queue="d2h_queue") == 1
    # Histograms observe every sample.
    assert sample(registry, "vllm:tieredkv_transfer_latency_seconds_count", kind="store") == 3
    assert sample(registry, "vllm:tieredkv_transfer_latency_seconds_sum", kind="store") == (
        pytest.approx(0.027)
    )
    assert sample(registry, "vllm:tieredkv_transfer_latency_seconds_bucket",
                  kind="store", le="0.005") == 2
    assert sample(registry, "vllm:tieredkv_transfer_latency_seconds_bucket",
                  kind="store", le="0.025") == 3
    assert sample(registry, "vllm:tieredkv_transfer_latency_seconds_count", kind="spill") == 1
    assert sample(registry, "vllm:tieredkv_transfer_latency_seconds_count", kind="promote") == 0
    assert sample(registry, "vllm:tieredkv_load_latency_seconds_count") == 1
    assert sample(registry, "vllm:tieredkv_load_latency_seconds_bucket", le="0.0005") == 1
    assert sample(registry, "vllm:tieredkv_load_latency_seconds_bucket", le="0.00025") == 0
    # Untouched causes stay at 0; an unknown scheduler counter is not exported.
    for cause in FAILURE_CAUSES:
        if cause not in ("checksum", "timeout"):
            assert sample(registry, "vllm:tieredkv_load_failures_total", cause=cause) == 0
    assert "future" not in "".join(f.name for f in registry.collect())

    # Second step: counters add the new deltas, gauges take the latest value; a rank that
    # does not report keeps its last queue depth in the sum.
    step2 = stats_payload(
        scheduler={"scheduler": {
            "counters": {"lookups": 2, "hit_tokens": {"host": 128},
                         "disk_read_failed": {"checksum": 2},
                         "load_failed": {"an_unlisted_cause": 1}},
            "gauges": {"host_slots_capacity": 8, "host_slots_used": 1, "host_slots_pinned": 0,
                       "disk_slots_capacity": 100, "disk_slots_used": 9,
                       "requests_waiting_on_load": 0},
            "chunk_bytes": 1000, "chunk_tokens": 128, "world_size": 2}},
        workers={"workers": {"0": {"bytes": {"h2d": 500}, "ops": {"h2d": 1}, "spills_dropped": 1,
                                   "failures": {}, "latency_s": {"load": [2.0]},
                                   "queue_depths": {"spill_queue": 0, "d2h_queue": 0}}}},
    )
    connector_prom.observe(step2, 0)

    assert sample(registry, "vllm:tieredkv_lookups_total") == 5
    assert sample(registry, "vllm:tieredkv_hit_tokens_total", tier="host") == 384
    assert sample(registry, "vllm:tieredkv_hit_tokens_total", tier="disk") == 128
    assert sample(registry, "vllm:tieredkv_load_failures_total", cause="checksum") == 3
    assert sample(registry, "vllm:tieredkv_load_failures_total", cause="an_unlisted_cause") == 1
    assert sample(registry, "vllm:tieredkv_used_bytes", tier="host") == 1 * 1000 * 2
    assert sample(registry, "vllm:tieredkv_used_bytes", tier="disk") == 9 * 1000 * 2
    assert sample(registry, "vllm:tieredkv_pinned_host_slots") == 0
    assert sample(registry, "vllm:tieredkv_requests_waiting_on_load") == 0
    assert sample(registry, "vllm:tieredkv_bytes_total", direction="h2d") == 3500
    assert sample(registry, "vllm:tieredkv_spills_dropped_total") == 3
    assert sample(registry, "vllm:tieredkv_queue_depth", queue="spill_queue") == 2  # rank 1's 2
    assert sample(registry, "vllm:tieredkv_load_latency_seconds_count") == 2
    assert sample(registry, "vllm:tieredkv_load_latency_seconds_bucket", le="1.0") == 1
    assert sample(registry, "vllm:tieredkv_load_latency_seconds_bucket", le="2.5") == 2

    # Engine 1 was never observed: all of its samples are still 0.
    engine1 = {"model_name": "tiny", "engine": "1"}
    assert registry.get_sample_value("vllm:tieredkv_lookups_total", engine1) == 0
    assert registry.get_sample_value(
        "vllm:tieredkv_bytes_total", {**engine1, "direction": "h2d"}) == 0


def test_observe_routes_by_engine_index(connector_prom, registry) -> None:
    connector_prom.observe({"scheduler": {"counters": {"lookups": 4}}}, 1)
    assert registry.get_sample_value(
        "vllm:tieredkv_lookups_total", {"model_name": "tiny", "engine": "1"}) == 4
    assert sample(registry, "vllm:tieredkv_lookups_total") == 0


def test_empty_or_partial_payloads_change_nothing(connector_prom, registry) -> None:
    before = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in registry.collect() for s in f.samples if not s.name.endswith("_created")}
    for payload in ({}, {"scheduler": {}}, {"workers": {}}, {"scheduler": {"counters": {}}},
                    {"workers": {"0": {}}}):
        connector_prom.observe(payload, 0)
    after = {(s.name, tuple(sorted(s.labels.items()))): s.value
             for f in registry.collect() for s in f.samples if not s.name.endswith("_created")}
    assert after == before


def test_vllm_unregisters_tieredkv_collectors_between_loggers(vllm_modules) -> None:
    """With vLLM's default classes (global REGISTRY), a second logger needs vLLM's unregister."""
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    from tieredkv.vllm.prometheus import TieredKVPromMetrics

    types = {Gauge: Gauge, Counter: Counter, Histogram: Histogram}
    config = vllm_modules.config
    unregister_vllm_metrics()
    try:
        TieredKVPromMetrics(config, types, ["model_name", "engine"], {0: ["tiny", "0"]})
        with pytest.raises(ValueError, match="Duplicated timeseries"):
            TieredKVPromMetrics(config, types, ["model_name", "engine"], {0: ["tiny", "0"]})
        unregister_vllm_metrics()
        second = TieredKVPromMetrics(config, types, ["model_name", "engine"], {0: ["tiny", "0"]})
        second.observe({"scheduler": {"counters": {"lookups": 1}}}, 0)
        assert REGISTRY.get_sample_value("vllm:tieredkv_lookups_total", LABELS) == 1
    finally:
        unregister_vllm_metrics()
    assert REGISTRY.get_sample_value("vllm:tieredkv_lookups_total", LABELS) is None


def test_counter_specs_expose_total_suffix() -> None:
    for spec in METRIC_SPECS.values():
        if spec.kind == COUNTER:
            assert not spec.name.endswith("_total")
            assert spec.exposed_names == (spec.name + "_total",)
