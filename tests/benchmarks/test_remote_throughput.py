"""Smoke test of benchmarks.remote_throughput: its smallest profile against a real
redis-server and then a real 3-master Cluster.

The benchmark starts its own servers (``tieredkv.testing.redis_procs``) and runs tieredkv,
redis-benchmark (random keys, every one of them hit) and raw redis-py (asyncio) on one value
size with a few thousand items. Only the shape of the results is checked: the files, every
ratio a positive finite number, each target named, the verdict on the worse deployment.
Timings themselves are not judged here. tieredkv's GET pass is shown to be the worker's read
path: values land in the HostPool's slots through RemoteJobs, and a corrupted value is
RemoteJobs' failed job, not bytes the pass counts.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import redis

from benchmarks import remote_throughput as bench
from benchmarks.remote import report, workload
from benchmarks.remote.rbench import RedisBenchmark
from benchmarks.remote.worker_read import WorkerReads
from benchmarks.remote.workload import BenchError, Case, Shard
from tieredkv.remote.codec import HEADER_BYTES
from tieredkv.remote_url import parse_remote_url
from tieredkv.testing.redis_procs import RedisClusterProcs, RedisServer

MiB = 1 << 20


def test_value_sizes_are_real_shards_with_the_header() -> None:
    sizes = {s.name: s.payload_bytes for s in workload.SHARDS}
    assert sizes == {
        "Qwen2.5-0.5B-class, TP 2, 16-token chunk": 96 * 1024,
        "Qwen2.5-0.5B-class, TP 1, 256-token chunk": 3 * MiB,
        "Llama-3.1-8B-class, TP 4, 256-token chunk": 8 * MiB,
    }
    assert all(s.value_bytes == s.payload_bytes + HEADER_BYTES for s in workload.SHARDS)
    assert [s.batch for s in workload.SHARDS] == [256, 16, 16]  # one 4k-token prompt each
    assert report.verdict(0.9, 0.9) == "PASS" and report.verdict(0.89, 0.9) == "MISS"
    assert report.verdict(float("inf"), 0.8) == report.verdict(0.0, 0.8) == "n/a"
    assert workload.TARGETS == {"set": 0.8, "get": 0.9, "exists": 0.8}


def _row(deployment: str, op: str, baseline: str, ratio: float) -> dict[str, object]:
    target = workload.TARGETS[op.lower()] if baseline == workload.TARGET_BASELINE else None
    return {"deployment": deployment, "shard": "s", "size_label": "96 KiB (s)", "op": op,
            "clients": 1, "baseline": baseline, "ratio": ratio, "target": target}


def test_the_verdict_is_the_worse_deployment_against_raw_redis_py() -> None:
    rows = [_row("single", "GET", "redis-py", 0.95), _row("cluster", "GET", "redis-py", 0.85),
            _row("single", "GET", "redis-benchmark", 0.10),  # the reference: never judged
            _row("single", "EXISTS", "redis-py", 0.81), _row("cluster", "EXISTS", "redis-py", 0.99)]
    judged = {v["op"]: v for v in report.verdicts(rows)}
    assert judged["GET"]["ratio"] == 0.85 and judged["GET"]["worse_deployment"] == "cluster"
    assert judged["GET"]["verdict"] == "MISS"  # 0.85 < 0.9, although one node passed
    assert judged["EXISTS"]["ratio"] == 0.81 and judged["EXISTS"]["verdict"] == "PASS"
    assert judged["GET"]["ratios"] == {"single": 0.95, "cluster": 0.85}
    headline = report.headline(list(judged.values()))
    assert "MISS on 1 of 2" in headline and "GET 96 KiB c=1: 0.85 (cluster) < 0.9" in headline


def test_redis_benchmark_keys_span_the_same_key_count() -> None:
    bench = RedisBenchmark("redis-benchmark", 1, redis.Redis(port=1))  # one node: no network
    assert bench.prefixes == ["key:"] and bench.keyspace(5) == 5
    assert bench.names(3) == ["key:000000000000", "key:000000000001", "key:000000000002"]
    bench.prefixes = ["key:{a}:", "key:{b}:", "key:{c}:"]  # a Cluster: a tag per master
    assert bench.keyspace(7) == 3 and len(bench.names(7)) == 9


@pytest.mark.redis  # the benchmark starts its own redis-server
def test_smoke_profile_writes_sane_results(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--profile", "smoke", "--out-dir", str(tmp_path), "--quiet"]) == 0
    profile = workload.PROFILES["smoke"]

    data = json.loads((tmp_path / "remote_throughput.json").read_text())
    assert data["benchmark"] == "remote_throughput" and data["profile"] == "smoke"
    assert data["deployments"] == ["single", "cluster"]
    assert data["machine"]["name"] and data["date"] and "tieredkv_revision" in data
    assert data["targets"] == workload.TARGETS and data["target_baseline"] == "redis-py"
    assert data["verdict"] in ("PASS", "MISS")
    assert set(data["sides"]) == {"tieredkv", "redis-benchmark", "redis-py"}
    assert "-r <keyspace>" in data["sides"]["redis-benchmark"]
    assert data["versions"]["redis_server"]

    rows = data["rows"]
    expected = {(d, s.name, op.upper(), base, c) for d in workload.DEPLOYMENTS
                for s in profile.shards for op in workload.OPS
                for base in workload.BASELINES for c in profile.clients}
    assert {(r["deployment"], r["shard"], r["op"], r["baseline"], r["clients"]) for r in rows} == expected
    for row in rows:
        assert math.isfinite(row["ratio"]) and row["ratio"] > 0, row
        assert row["ratio"] == pytest.approx(row["tieredkv_ops_s"] / row["baseline_ops_s"])
        assert len(row["ratio_rounds"]) == profile.rounds
        assert all(math.isfinite(x) and x > 0 for x in row["ratio_rounds"]), row
        if row["baseline"] == "redis-py":
            target = workload.TARGETS[row["op"].lower()]
            assert row["target"] == target
            assert row["verdict"] == ("PASS" if row["ratio"] >= target else "MISS")
        else:  # redis-benchmark is the reference
            assert row["target"] is None and row["verdict"] == "info"
        if row["op"] == "EXISTS":
            assert row["tieredkv_mb_s"] is None
        else:
            assert row["tieredkv_mb_s"] > 0 and row["baseline_mb_s"] > 0

    judged = data["verdicts"]
    assert len(judged) == len(profile.shards) * len(workload.OPS) * len(profile.clients)
    for v in judged:
        mine = [r["ratio"] for r in rows if r["baseline"] == "redis-py"
                and (r["shard"], r["op"], r["clients"]) == (v["shard"], v["op"], v["clients"])]
        assert v["ratio"] == min(mine) and set(v["ratios"]) == {"single", "cluster"}
        assert v["verdict"] == ("PASS" if v["ratio"] >= v["target"] else "MISS")
    assert data["verdict"] == ("PASS" if all(v["verdict"] == "PASS" for v in judged) else "MISS")
    assert ("MISS" in data["headline"]) == (data["verdict"] == "MISS")

    markdown = (tmp_path / "remote_throughput.md").read_text()
    assert "GET >= 0.9" in markdown and "EXISTS >= 0.8" in markdown
    assert markdown.count("| reference |") == len(rows) // 2
    assert data["headline"] in markdown
    assert "redis-benchmark" in markdown and "redis-py" in markdown
    assert data["headline"] in capsys.readouterr().out


# 256 KiB values, 4 per prompt: three prompts of a small case through the worker's read path.
TINY = Shard("tiny", "1 layer, 1 KV head, head dim 64, bf16", 1, 1, 64, 2, 1, 1024)


def _written(deployment: RedisServer | RedisClusterProcs, case: Case) -> redis.Redis | redis.RedisCluster:
    if isinstance(deployment, RedisClusterProcs):
        client: redis.Redis | redis.RedisCluster = redis.RedisCluster(
            host="127.0.0.1", port=deployment.servers[0].port)
    else:
        client = redis.Redis(port=deployment.port)
    for name, value in zip(case.names, case.values, strict=True):
        client.set(name, value)
    return client


def _payload(case: Case, i: int) -> bytes:
    return case.values[i][HEADER_BYTES:]


def _slot(reader: WorkerReads, slot: int) -> bytes:
    return bytes(reader.host.slot_memoryview(slot)[:reader.case.shard.payload_bytes])


@pytest.mark.parametrize("clients", [1, 2])
def test_the_get_pass_lands_every_value_in_host_slots_through_remote_jobs(
        redis_deployment: RedisServer | RedisClusterProcs, clients: int) -> None:
    case = Case(TINY, 3 * TINY.batch, 1)
    client = _written(redis_deployment, case)
    reader = WorkerReads(parse_remote_url(redis_deployment.url), case, clients)
    try:
        assert reader.wait_connected(30.0)
        for _ in range(2):  # the reader is reused round after round
            result = reader.run_pass()
            assert result.failed == {} and result.reads == result.reads_ok == case.items
            assert result.bytes_landed == case.items * TINY.payload_bytes
            result.check(case)
        if clients == 1:  # one lane: its slots hold the last prompt's values, in order
            last = case.batches("get")[-1]
            assert [_slot(reader, s) for s in range(TINY.batch)] == [_payload(case, i) for i in last]
        assert reader.rate() > 0
    finally:
        reader.close()
        for name in case.names:  # one key per DEL: a Cluster refuses cross-slot ones
            client.delete(name)
        client.close()
    assert sorted(i for b in case.batches("get") for i in b) == list(range(case.items))
    assert case.batches("get")[0] != list(range(TINY.batch))  # GETs read in a random order


def test_a_corrupted_value_is_a_failed_read_not_bytes_moved(redis_server: RedisServer) -> None:
    """RemoteJobs verifies before anything is promised: the corrupted value fails its job
    (``checksum``; received in its slot, never counted as landed), the slots around it hold
    their own values, and the pass refuses to report a rate."""
    case = Case(TINY, 3 * TINY.batch, 1)
    client = _written(redis_server, case)
    prompts = case.batches("get")
    bad = prompts[-1][1]  # the last prompt's second read: slot 1 of the one lane
    corrupted = bytearray(case.values[bad])
    corrupted[HEADER_BYTES + 7] ^= 0xFF
    client.set(case.names[bad], bytes(corrupted))
    reader = WorkerReads(parse_remote_url(redis_server.url), case, 1)
    try:
        assert reader.wait_connected(30.0)
        result = reader.run_pass()
        assert result.failed == {"checksum": 1}
        assert result.reads_ok == case.items - 1
        assert result.bytes_landed == (case.items - 1) * TINY.payload_bytes
        assert _slot(reader, 0) == _payload(case, prompts[-1][0])
        with pytest.raises(BenchError, match="checksum"):
            result.check(case)
        with pytest.raises(BenchError, match="1 of 12 reads failed"):
            reader.rate()
    finally:
        reader.close()
        client.delete(*case.names)
        client.close()
