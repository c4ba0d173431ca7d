"""multi_replica's method (#27): only the two servers under test run, each shared session
starts with a cold Redis, the per-request breakdown is derived from the scrapes and the
client's timings, and the targets are judged outside the spread of the rounds. Stand-in
servers and client: nothing is started."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from benchmarks import common
from benchmarks.replicas import breakdown
from benchmarks.replicas import judging as replica_judging
from benchmarks.replicas import report as replica_report
from benchmarks.replicas import runner as replica_runner
from benchmarks.replicas import workload as replica_workload
from benchmarks.serve import workload

QUICK = replica_workload.PROFILES["quick"]


@dataclass
class FakeServer:
    name: str
    up: set[str]
    log_path: Path = field(default_factory=lambda: Path("x.log"))
    url: str = ""
    scrapes: int = 0

    def start(self, timeout_s: float = 0.0) -> FakeServer:
        self.up.add(self.name)
        self.url = self.name
        return self

    def stop(self, timeout_s: float = 0.0) -> None:
        self.up.discard(self.name)

    def metrics(self) -> str:
        """Histograms that grow by a fixed amount per scrape pair (one run)."""
        self.scrapes += 1
        k = self.scrapes // 2
        return "\n".join([
            f'vllm:time_to_first_token_seconds_sum{{engine="0"}} {0.3 * k}',
            f'vllm:request_queue_time_seconds_sum{{engine="0"}} {0.1 * k}',
            f'vllm:request_prefill_time_seconds_sum{{engine="0"}} {0.2 * k}',
            f'vllm:tieredkv_remote_probe_latency_seconds_sum{{engine="0"}} {0.01 * k}',
            f'vllm:tieredkv_transfer_latency_seconds_sum{{kind="remote_read"}} {0.04 * k}',
            f'vllm:tieredkv_transfer_latency_seconds_sum{{kind="store"}} {5.0 * k}',
            f'vllm:tieredkv_load_latency_seconds_sum{{engine="0"}} {0.02 * k}',
        ])


def test_the_quick_profile_runs_at_least_three_rounds():
    assert QUICK["rounds"] >= 3 and replica_workload.PROFILES["full"]["rounds"] >= 3


def test_only_the_pair_under_test_runs_and_each_shared_session_starts_cold(tmp_path, monkeypatch):
    spec = workload.ChatWorkload(turns=2, jitter=0.0)
    up: set[str] = set()
    servers = {c: [FakeServer(f"{c}-{i}", up) for i in range(2)] for c in replica_workload.CONFIGS}
    conversations = {(lv, r): replica_workload.level_conversations(spec, lv, 16, r) for lv in (2, 4) for r in range(2)}
    seen: list[tuple[tuple[str, ...], frozenset[str]]] = []
    resets: list[str] = []

    def run_level_rr(urls, spec, convs, **_kw):
        seen.append((tuple(urls), frozenset(up)))
        return [{"ok": True, "ttft_s": 0.5, "prompt_tokens": 10, "user": 0, "turn": 0}], 1.0

    monkeypatch.setattr(replica_runner, "run_level_rr", run_level_rr)
    done = replica_runner.sweep(servers, spec, conversations, (2, 4), 2,
                                progress=common.Progress(100, "t", enabled=False), budget_s=1e9,
                                started_wall=time.monotonic(), prof=QUICK,
                                reset=lambda config: resets.append(f"{config} with {sorted(up)} up"))
    assert [urls for urls, _ in seen] == [("shared_remote-0", "shared_remote-1")] * 2 + [
        ("separate-0", "separate-1")] * 4 + [("shared_remote-0", "shared_remote-1")] * 2
    assert all(others == set(urls) for urls, others in seen)  # nothing else up
    assert resets == ["shared_remote with [] up", "separate with [] up", "separate with [] up",
                      "shared_remote with [] up"]  # before the pair starts
    assert not up
    # Each run's breakdown: histogram growth over both replicas / completed requests.
    parts = done.runs["separate"][(2, 0)]["breakdown"]
    assert parts["requests"] == 1 and parts["client_ttft"] == pytest.approx(0.5)
    assert parts["server_ttft"] == pytest.approx(0.6) and parts["read"] == pytest.approx(0.08)
    assert parts["http"] == pytest.approx(0.5 - 0.6)
    assert all(s["servers_up"] == 2 for s in done.slots)


def test_breakdown_derivation_and_pooling():
    before = ['vllm:request_prefill_time_seconds_sum{engine="0"} 1.0',
              'vllm:request_prefill_time_seconds_sum{engine="0"} 2.0']
    after = ['vllm:request_prefill_time_seconds_sum{engine="0"} 1.5\n'
             'vllm:tieredkv_transfer_latency_seconds_sum{kind="load"} 9',
             'vllm:request_prefill_time_seconds_sum{engine="0"} 2.5']
    recs = [{"ok": True, "ttft_s": 0.2}, {"ok": True, "ttft_s": 0.4}, {"ok": False}]
    parts = breakdown.per_request(before, after, recs)
    assert parts["requests"] == 2 and parts["compute"] == pytest.approx(0.5)  # (0.5 + 0.5) / 2
    assert parts["client_ttft"] == pytest.approx(0.3) and parts["read"] == 0.0
    pooled = breakdown.pool([parts, {**parts, "requests": 6.0, "compute": 1.0}])
    assert pooled["requests"] == 8 and pooled["compute"] == pytest.approx((2 * 0.5 + 6 * 1.0) / 8)
    assert set(breakdown.derivations()) == set(breakdown.ORDER)
    where = breakdown.where_time_goes({**parts, "probe": 0.05}, {**parts, "probe": 0.0, "compute": 0.6})
    assert where.startswith("shared - separate per request (ms): probe +50.0") and "compute -100.0" in where


def _level(p50s, p99s, rates, parts=None):
    rounds = [{"round": i, "ttft_p50_s": a, "ttft_p99_s": b, "hit_rate": h}
              for i, (a, b, h) in enumerate(zip(p50s, p99s, rates, strict=True))]
    out: dict[str, Any] = {"rounds": rounds}
    if parts is not None:
        out["breakdown"] = parts
    return out


def test_targets_count_only_outside_the_spread_and_a_miss_says_where_the_time_goes():
    parts = {k: 0.1 for k in breakdown.ORDER}
    results = {
        "shared_remote": {2: _level([0.1, 0.12, 0.11], [0.3, 0.5, 0.4], [0.8, 0.85, 0.9], {**parts, "read": 0.3}),
                          4: _level([0.4, 0.5, 0.6], [1.0, 1.1, 1.2], [0.5, 0.6, 0.7], parts)},
        "separate": {2: _level([0.2, 0.25, 0.3], [0.45, 0.6, 0.7], [0.5, 0.55, 0.6], parts),
                     4: _level([0.1, 0.2, 0.3], [0.5, 0.6, 0.7], [0.55, 0.6, 0.65], parts)},
    }
    rows = {(t["users"], t["target"].split(" ")[1] + t["target"].split(" ")[2]): t
            for t in replica_judging.targets(results)}
    assert rows[2, "TTFTp50"]["verdict"] == "PASS"  # every shared round beats every separate one
    assert rows[2, "TTFTp99"]["verdict"] == "MISS"  # the rounds overlap: no win shown
    assert "read +200.0" in rows[2, "TTFTp99"]["where"]
    assert rows[2, "hitrate"]["verdict"] == "PASS"
    assert rows[4, "TTFTp50"]["verdict"] == "FAIL" and rows[4, "TTFTp99"]["verdict"] == "FAIL"
    assert rows[4, "hitrate"]["verdict"] == "MISS"
    assert "where" not in rows[2, "TTFTp50"]
    assert replica_judging.hit_rate({"device_rate": 0.25, "tieredkv_rate": 0.5}) == 0.75
    assert math.isnan(replica_judging.hit_rate({}))


def test_report_prints_targets_and_the_breakdown_with_its_derivation():
    parts = {"requests": 4.0, **{k: 0.1 for k in breakdown.ORDER}}
    results = {"shared_remote": {2: {**_level([0.1, 0.2], [0.2, 0.3], [0.5, 0.5]), "breakdown": parts}}}
    rows = replica_report.breakdown_rows(results)
    assert rows == [{"config": "shared_remote", "users": 2, "n": "4",
                     **{k: pytest.approx(100.0) for k in breakdown.ORDER}}]
    section = replica_report.breakdown_section({"results": results})
    assert "Per-request breakdown" in section and "`probe`: tieredkv's remote probe" in section
    lines = replica_report.target_lines([{"users": 2, "target": "t", "measured": "m", "verdict": "MISS",
                                          "where": "w"}])
    assert lines == ["- 2 users: t: m — **MISS**", "  - where the time goes: w"]


def test_results_page_shows_each_target_with_its_verdict():
    from benchmarks.render_results import multi_replica_rows

    targets = [{"users": 2, "target": "shared TTFT p50 < separate, outside the spread", "measured": "m",
                "verdict": "MISS", "where": "read +5.0 ms"},
               {"users": 2, "target": "shared hit rate > separate", "measured": "h", "verdict": "PASS"}]
    rows, _ = multi_replica_rows({"checks": [], "ratios": [], "targets": targets})
    assert [(r["verdict"], r["measured"]) for r in rows] == [
        ("MISS", "m; where the time goes: read +5.0 ms"), ("PASS", "h")]
    assert multi_replica_rows({"checks": [], "ratios": []})[0] == []  # an older file: no targets
