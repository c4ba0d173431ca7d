"""The standalone exporter: same metrics as inside vLLM, plain prometheus_client, no vLLM."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from tieredkv.metrics.exporter import build_exporter_metrics, start_exporter
from tieredkv.metrics.specs import HISTOGRAM, METRIC_SPECS
from tieredkv.protocol import FAILURE_CAUSES

PAYLOAD = {
    "scheduler": {
        "counters": {"lookups": 2, "hit_tokens": {"disk": 256}, "evictions": {"disk": 1},
                     "spill_failed": {"io_error": 1}, "disk_read_failed": {"wrong_key": 1}},
        "gauges": {"host_slots_capacity": 4, "host_slots_used": 4, "host_slots_pinned": 1,
                   "disk_slots_capacity": 10, "disk_slots_used": 3,
                   "requests_waiting_on_load": 2},
        "chunk_bytes": 4096, "chunk_tokens": 64, "world_size": 1,
    },
    "workers": {"0": {"bytes": {"spill": 8192, "restore": 4096},
                      "ops": {"spill": 2, "restore": 1}, "spills_dropped": 1, "failures": {},
                      "latency_s": {"spill": [0.01, 0.2], "promote": [0.05]},
                      "queue_depths": {"spill_queue": 7}}},
}


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, {"model_name": "bench", **labels})


def test_exporter_does_not_import_vllm() -> None:
    code = (
        "import sys, tieredkv.metrics.exporter, tieredkv.metrics.snapshot\n"
        "bad = [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_exporter_records_a_stats_payload_exactly() -> None:
    registry = CollectorRegistry()
    metrics = build_exporter_metrics(registry, PAYLOAD, model_name="bench")
    assert value(registry, "vllm:tieredkv_lookups_total") == 2
    assert value(registry, "vllm:tieredkv_hit_tokens_total", tier="disk") == 256
    assert value(registry, "vllm:tieredkv_hit_tokens_total", tier="host") == 0
    assert value(registry, "vllm:tieredkv_evictions_total", tier="disk") == 1
    assert value(registry, "vllm:tieredkv_spill_failures_total", cause="io_error") == 1
    assert value(registry, "vllm:tieredkv_load_failures_total", cause="wrong_key") == 1
    assert value(registry, "vllm:tieredkv_capacity_bytes", tier="disk") == 10 * 4096
    assert value(registry, "vllm:tieredkv_used_bytes", tier="host") == 4 * 4096
    assert value(registry, "vllm:tieredkv_pinned_host_slots") == 1
    assert value(registry, "vllm:tieredkv_requests_waiting_on_load") == 2
    assert value(registry, "vllm:tieredkv_bytes_total", direction="spill") == 8192
    assert value(registry, "vllm:tieredkv_operations_total", direction="restore") == 1
    assert value(registry, "vllm:tieredkv_spills_dropped_total") == 1
    assert value(registry, "vllm:tieredkv_queue_depth", queue="spill_queue") == 7
    assert value(registry, "vllm:tieredkv_transfer_latency_seconds_count", kind="spill") == 2
    assert value(registry, "vllm:tieredkv_transfer_latency_seconds_bucket",
                 kind="spill", le="0.1") == 1
    assert value(registry, "vllm:tieredkv_transfer_latency_seconds_count", kind="promote") == 1
    assert value(registry, "vllm:tieredkv_load_latency_seconds_count") == 0
    for cause in FAILURE_CAUSES:
        assert value(registry, "vllm:tieredkv_store_failures_total", cause=cause) == 0

    metrics.observe(PAYLOAD)  # deltas again: counters double, gauges stay
    assert value(registry, "vllm:tieredkv_lookups_total") == 4
    assert value(registry, "vllm:tieredkv_bytes_total", direction="spill") == 16384
    assert value(registry, "vllm:tieredkv_used_bytes", tier="host") == 4 * 4096
    assert value(registry, "vllm:tieredkv_transfer_latency_seconds_count", kind="spill") == 4


def test_exporter_and_vllm_share_names_help_and_label_values() -> None:
    registry = CollectorRegistry()
    build_exporter_metrics(registry, model_name="bench")
    families = {family.name: family for family in registry.collect()}
    assert set(families) == {spec.name for spec in METRIC_SPECS.values()}
    for spec in METRIC_SPECS.values():
        family = families[spec.name]
        assert family.documentation == spec.help
        wanted = {spec.name + "_count" if spec.kind == HISTOGRAM else spec.exposed_names[0]}
        labels_seen = {
            sample.labels.get(spec.label) if spec.label else None
            for sample in family.samples if sample.name in wanted
        }
        assert labels_seen == (set(spec.values) if spec.label else {None})
        assert all(s.labels["model_name"] == "bench" for s in family.samples)


def test_building_twice_in_one_registry_is_refused() -> None:
    registry = CollectorRegistry()
    build_exporter_metrics(registry)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        build_exporter_metrics(registry)


# What Prometheus 2.x sends: it prefers OpenMetrics, which prometheus_client >= 0.22 answers
# with names escaped (vllm: -> vllm_), so the exporter must answer in the text format.
PROMETHEUS_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                     "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def test_start_exporter_serves_the_registry_on_loopback(parse_samples) -> None:
    registry = CollectorRegistry()
    build_exporter_metrics(registry, PAYLOAD, model_name="bench")
    server, thread = start_exporter(0, registry)
    try:
        host, port = server.server_address[:2]
        assert host == "127.0.0.1"
        request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                         headers={"Accept": PROMETHEUS_ACCEPT})
        with urllib.request.urlopen(request, timeout=10) as reply:
            assert reply.headers["Content-Type"].startswith("text/plain")
            text = reply.read().decode()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    samples = parse_samples(text)
    assert "vllm_tieredkv" not in text
    assert samples.value("vllm:tieredkv_lookups_total", model_name="bench") == 2
    assert samples.labelled("vllm:tieredkv_load_failures_total", "cause") == {
        cause: (1.0 if cause == "wrong_key" else 0.0) for cause in FAILURE_CAUSES
    }


REMOTE_PAYLOAD = {
    "scheduler": {
        "counters": {"hit_tokens": {"remote": 384}, "remote_probes": 3, "remote_read_chunks": 3,
                     "remote_written_chunks": 5,
                     "remote_probe_failed": {"timeout": 1, "unavailable": 2},
                     "remote_read_failed": {"checksum": 1},
                     "remote_writes_dropped": 4, "remote_write_failed": 1,
                     "remote_admission_rejected": 6, "evictions": {"remote": 9}},
        "gauges": {"remote_up": 1, "remote_used_bytes": 5_000_000,
                   "remote_capacity_bytes": 64 << 20},
        "latency_s": {"remote_probe": [0.0004, 0.002, 0.3]},
        "chunk_bytes": 4096, "chunk_tokens": 64, "world_size": 2,
    },
    "workers": {"0": {"bytes": {"remote_read": 4096, "remote_write": 8192},
                      "ops": {"remote_read": 1, "remote_write": 2},
                      "latency_s": {"remote_read": [0.001]}, "remote_writes_failed": 2,
                      "queue_depths": {"remote_write_queue": 3}}},
}


def test_exporter_records_the_remote_tier() -> None:
    registry = CollectorRegistry()
    build_exporter_metrics(registry, REMOTE_PAYLOAD, model_name="bench")
    assert value(registry, "vllm:tieredkv_hit_tokens_total", tier="remote") == 384
    assert value(registry, "vllm:tieredkv_remote_up") == 1
    assert value(registry, "vllm:tieredkv_used_bytes", tier="remote") == 5_000_000
    assert value(registry, "vllm:tieredkv_capacity_bytes", tier="remote") == 64 << 20
    assert value(registry, "vllm:tieredkv_evictions_total", tier="remote") == 9
    assert value(registry, "vllm:tieredkv_remote_probes_total") == 3
    assert value(registry, "vllm:tieredkv_remote_probe_latency_seconds_count") == 3
    assert value(registry, "vllm:tieredkv_remote_probe_latency_seconds_bucket", le="0.001") == 1
    assert value(registry, "vllm:tieredkv_remote_probe_failures_total", cause="timeout") == 1
    assert value(registry, "vllm:tieredkv_remote_probe_failures_total", cause="unavailable") == 2
    assert value(registry, "vllm:tieredkv_remote_read_failures_total", cause="checksum") == 1
    assert value(registry, "vllm:tieredkv_remote_read_failures_total", cause="missing") == 0
    assert value(registry, "vllm:tieredkv_remote_writes_dropped_total") == 4
    assert value(registry, "vllm:tieredkv_remote_write_failures_total") == 3  # 1 job + 2 queued
    assert value(registry, "vllm:tieredkv_remote_admission_rejected_total") == 6
    assert value(registry, "vllm:tieredkv_chunks_total", op="remote_read") == 3
    assert value(registry, "vllm:tieredkv_chunks_total", op="remote_written") == 5
    assert value(registry, "vllm:tieredkv_bytes_total", direction="remote_write") == 8192
    assert value(registry, "vllm:tieredkv_operations_total", direction="remote_read") == 1
    assert value(registry, "vllm:tieredkv_transfer_latency_seconds_count", kind="remote_read") == 1
    assert value(registry, "vllm:tieredkv_queue_depth", queue="remote_write_queue") == 3
