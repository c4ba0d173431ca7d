"""Smoke test of benchmarks.remote_throughput: its smallest profile against a real redis-server.

The benchmark starts its own server (``tieredkv.testing.redis_procs``) and runs tieredkv,
redis-benchmark and redis-py on one value size with a few thousand items. Only the shape of
the results is checked: the files, every ratio a positive finite number, the target named.
Timings themselves are not judged here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import remote_throughput as bench
from benchmarks.remote import report, workload
from tieredkv.remote.codec import HEADER_BYTES

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
    assert report.verdict(0.8) == "PASS" and report.verdict(0.79) == "MISS"
    assert report.verdict(float("inf")) == report.verdict(0.0) == "n/a"


@pytest.mark.redis  # the benchmark starts its own redis-server
def test_smoke_profile_writes_sane_results(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--profile", "smoke", "--out-dir", str(tmp_path), "--quiet"]) == 0
    profile = workload.PROFILES["smoke"]

    data = json.loads((tmp_path / "remote_throughput.json").read_text())
    assert data["benchmark"] == "remote_throughput" and data["profile"] == "smoke"
    assert data["deployment"] == "single redis-server"
    assert data["machine"]["name"] and data["date"] and "tieredkv_revision" in data
    assert data["target"] == workload.TARGET
    assert data["verdict"] in ("PASS", "MISS")
    assert set(data["sides"]) == {"tieredkv", "redis-benchmark", "redis-py"}
    assert data["versions"]["redis_server"]

    rows = data["rows"]
    expected = {(s.name, op.upper(), base, c) for s in profile.shards for op in workload.OPS
                for base in workload.BASELINES for c in profile.clients}
    assert {(r["shard"], r["op"], r["baseline"], r["clients"]) for r in rows} == expected
    for row in rows:
        assert math.isfinite(row["ratio"]) and row["ratio"] > 0, row
        assert row["ratio"] == pytest.approx(row["tieredkv_ops_s"] / row["baseline_ops_s"])
        assert len(row["ratio_rounds"]) == profile.rounds
        assert all(math.isfinite(x) and x > 0 for x in row["ratio_rounds"]), row
        assert row["verdict"] == ("PASS" if row["ratio"] >= workload.TARGET else "MISS")
        assert row["target"] == workload.TARGET
        if row["op"] == "EXISTS":
            assert row["tieredkv_mb_s"] is None
        else:
            assert row["tieredkv_mb_s"] > 0 and row["baseline_mb_s"] > 0
    misses = [r for r in rows if r["verdict"] == "MISS"]
    assert ("MISS" in data["headline"]) == bool(misses)

    markdown = (tmp_path / "remote_throughput.md").read_text()
    assert "Target tieredkv / baseline >= 0.8" in markdown
    assert markdown.count("| >= 0.8 |") == len(rows)
    assert data["headline"] in markdown
    assert "redis-benchmark" in markdown and "redis-py" in markdown
    assert data["headline"] in capsys.readouterr().out
