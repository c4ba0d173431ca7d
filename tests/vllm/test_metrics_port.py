"""``metrics_port``: the scheduler half serves tieredkv's metrics outside vLLM's /metrics."""

from __future__ import annotations

import urllib.request
from types import SimpleNamespace

import pytest

from tests.vllm.test_worker_side import fake_configs
from tieredkv.config import ConfigError, TieredKVConfig
from tieredkv.protocol import JobResult, Move
from tieredkv.vllm.scheduler_side import SchedulerHalf
from tieredkv.vllm.stats import TieredKVStats


def scheduler_half(port: int) -> SchedulerHalf:
    vllm_config, kv_cache_config = fake_configs()
    vllm_config.kv_transfer_config = SimpleNamespace(kv_load_failure_policy="recompute")
    config = TieredKVConfig.from_dict({"host_bytes": "8MiB", "chunk_blocks": 2, "metrics_port": port})
    return SchedulerHalf(vllm_config, kv_cache_config, config)


def sample(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not served")


def test_scheduler_and_worker_counters_are_served_on_the_port():
    half = scheduler_half(0)  # 0: any free port
    try:
        planner = half.planner
        planner.set_block_ids("a", list(range(8)), replace=True)
        planner.plan_stores("a", [bytes([i]) * 32 for i in range(2)], 2 * 2 * 32)
        plan = planner.take_plan()
        planner.apply([JobResult(job.job_id, ok=1) for job in plan.of(Move.STORE)])
        half.stats_snapshot()
        worker = {"workers": {"0": {"bytes": {"d2h": 4096}, "ops": {"d2h": 2}}}}
        half.update_connector_output(SimpleNamespace(
            kv_connector_worker_meta=None, kv_connector_stats=TieredKVStats(data=worker),
        ))
        url = f"http://127.0.0.1:{half.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        assert sample(text, "vllm:tieredkv_chunks_total", op="stored") == 2
        assert sample(text, "vllm:tieredkv_bytes_total", direction="d2h") == 4096
        assert sample(text, "vllm:tieredkv_load_failures_total", cause="checksum") == 0
    finally:
        half.shutdown()


def test_a_port_in_use_fails_naming_the_key():
    first = scheduler_half(0)
    try:
        with pytest.raises(ConfigError, match="metrics_port"):
            scheduler_half(first.metrics_port)
    finally:
        first.shutdown()
