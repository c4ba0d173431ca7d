"""serve_bench's sweep runs only the configuration it measures (#27): each (repeat,
configuration) starts its server alone, measures every level, stops it; its tiers are cleared
first; each comparison carries its spread. Stand-in servers and client: nothing is started."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from benchmarks import common, serve_bench
from benchmarks.serve import judging, runner, workload
from benchmarks.serve.configs import BenchConfig


@dataclass
class FakeServer:
    name: str
    up: set[str]
    fail: bool = False
    starts: int = 0
    log_path: Path = field(default_factory=lambda: Path("x.log"))
    proc: Any = None
    url: str = ""

    def start(self, timeout_s: float = 0.0) -> FakeServer:
        self.starts += 1
        if self.fail:
            raise RuntimeError("exited")
        self.up.add(self.name)
        self.url = self.name
        return self

    def stop(self, timeout_s: float = 0.0) -> None:
        self.up.discard(self.name)

    def metrics(self) -> str:
        return ""


def _config(name: str, disk: Path | None = None) -> BenchConfig:
    kv = {"kv_connector_extra_config": {"disk_path": str(disk)}} if disk else None
    return BenchConfig(name=name, label=name, kv_config=kv, role="baseline")


def test_only_the_measured_configuration_runs_and_each_repeat_starts_cold(tmp_path, monkeypatch):
    spec = workload.ChatWorkload(turns=2, jitter=0.0)
    plan = workload.make_plan(spec, (1, 2), 2, tmp_path)
    disk = tmp_path / "disk"
    disk.mkdir()
    configs = [_config("a"), _config("b", disk), _config("broken")]
    up: set[str] = set()
    servers = [FakeServer(c.name, up, fail=c.name == "broken") for c in configs]
    seen: list[tuple[str, int, frozenset[str], bool]] = []

    def run_level(url, spec, level, *, conversations, **_kw):
        seen.append((url, level, frozenset(up), (disk / "old.slab").exists()))
        if url == "b":
            (disk / "old.slab").write_bytes(b"x")  # what a disk tier leaves behind
        return [{"ok": True, "ttft_s": 0.1, "prompt_tokens": 10, "user": 0, "turn": 0}], 1.0

    monkeypatch.setattr(runner, "run_level", run_level)
    monkeypatch.setattr(runner, "warm_up", lambda url: None)
    progress = common.Progress(100, "t", enabled=False)
    done = runner.sweep(plan, configs, servers, [None] * 3, progress=progress, budget_s=1e9,
                        started_wall=time.monotonic(), prof=workload.PROFILES["quick"],
                        reset=serve_bench.clear_tiers)
    # Every level ran with its own server and nothing else up.
    assert [(u, lv) for u, lv, _, _ in seen] == [
        ("a", 1), ("a", 2), ("b", 1), ("b", 2), ("b", 1), ("b", 2), ("a", 1), ("a", 2)]
    assert all(others == {url} for url, _, others, _ in seen)
    assert not up  # all stopped
    # The disk tier is emptied before each start: repeat 1 does not find repeat 0's files.
    assert [stale for url, lv, _, stale in seen if url == "b" and lv == 1] == [False, False]
    # A server that fails to start is reported once and not started again.
    assert servers[2].starts == 1
    assert [e for e in done.errors if e.startswith("broken")] and len(done.errors) == 1
    assert [s.starts for s in servers[:2]] == [2, 2]
    assert all(o["servers_up"] == 1 for o in done.order)


def test_a_spent_budget_skips_whole_sessions(tmp_path, monkeypatch):
    plan = workload.make_plan(workload.ChatWorkload(turns=1, jitter=0.0), (1,), 1, tmp_path)
    up: set[str] = set()
    servers = [FakeServer("a", up)]
    monkeypatch.setattr(runner, "run_level", lambda *a, **k: pytest.fail("ran past the budget"))
    done = runner.sweep(plan, [_config("a")], servers, [None], progress=common.Progress(5, "t", enabled=False),
                        budget_s=10.0, started_wall=time.monotonic(),
                        prof=workload.PROFILES["quick"])
    assert servers[0].starts == 0 and "time budget" in done.errors[0]


def test_each_comparison_carries_the_spread_of_its_ratio():
    assert judging.ratio_range([1.0, 2.0], [4.0, 5.0]) == (0.2, 0.5)
    assert all(math.isnan(x) for x in judging.ratio_range([], [1.0]))

    def reps(*p50s):
        return [{"ttft_p50_s": v, "ttft_p99_s": v, "prompt_tokens_per_s": 100.0} for v in p50s]

    runs = {"prefix_cache": {4: reps(0.9, 1.0, 1.1)}, "tieredkv_host": {4: reps(0.5, 0.6, 0.95)}}
    (row,) = judging.comparisons(runs, (4,), {"prefix_cache": "baseline", "tieredkv_host": "tieredkv"})
    low, high = row["ttft_p50_s_ratio_spread"]
    assert (low, high) == (pytest.approx(0.5 / 1.1), pytest.approx(0.95 / 0.9))
    # The spread reaches above 1, so this is no win, and the cell says both.
    assert row["ttft_p50_s"] == "within spread"
    assert row["ttft_p50_s_cell"] == "within spread (0.60x, spread 0.45–1.06x)"
