"""Pure pieces of benchmarks.e2e_ttft's remote-tier row (row 6): the chunk-aligned hit it
expects, the two replicas' specs, the hit check, its ratios and its report.

No engine or Redis is started; nothing here judges a timing.
"""

from __future__ import annotations

import argparse

import pytest

from benchmarks.ttft import judging, report, runner, targets, workload
from benchmarks.ttft import specs as ttft_specs


def test_remote_hit_is_as_long_as_vllms_hit():
    # The prompt's tail is in Redis too (#25 point 1): no longer cut at the last whole chunk.
    assert workload.CHUNK_TOKENS == 512
    assert workload.remote_hit(4000) == workload.prefix_hit(4000) == 3968
    assert workload.remote_hit(3676) == workload.prefix_hit(3676) == 3648
    assert workload.remote_hit(1100) == 1088
    assert workload.remote_hit(1024) == workload.prefix_hit(1024) == 992  # vLLM computes the last token


def args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"profile": "quick", "trace": False, "switch_interval": None,
                                 "recompute_repeats": None, **kw})


def test_specs_two_replicas_on_one_redis(tmp_path):
    lengths = {"A": 4000, "B": 3676}
    without = ttft_specs.build_specs(args(), tmp_path / "model", tmp_path, lengths)
    assert not set(workload.REMOTE_CONFIGS) & set(without)
    specs = ttft_specs.build_specs(args(), tmp_path / "model", tmp_path, lengths, "redis://127.0.0.1:7/0")
    assert set(without) | set(workload.REMOTE_CONFIGS) == set(specs)
    writer, reader = specs["tieredkv_remote_writer"], specs["tieredkv_remote"]
    extra = writer["kv_transfer_config"]["kv_connector_extra_config"]
    assert reader["kv_transfer_config"] == writer["kv_transfer_config"]
    assert extra["remote_url"] == "redis://127.0.0.1:7/0"
    assert extra["remote_key_prefix"] == workload.REMOTE_KEY_PREFIX
    assert "disk_path" not in extra
    # Host tier: one prompt's slots (as the disk rows), so A and B evict each other.
    slots = max(workload.host_entries(n) for n in lengths.values())
    assert extra["host_bytes"] == specs["tieredkv_disk"]["kv_transfer_config"][
        "kv_connector_extra_config"]["host_bytes"] == slots * workload.CHUNK_TOKENS * 8192
    # Replica A computes both prompts and only writes; replica B never computes them in
    # its set-up, and its rounds are the disk rows' (hit, same-engine floor, host hit).
    gens = [p["prompt"] for p in writer["setup"] if p["kind"] == "generate"]
    assert gens == ["warmup", "A", "B"] and writer["round"] == []
    assert writer["setup"][-1]["kind"] == "counters"
    assert [p["prompt"] for p in reader["setup"] if p["kind"] == "generate"] == ["warmup"]
    assert reader["round"] == specs["tieredkv_disk"]["round"]
    labels = [p["label"] for p in ttft_specs.round_phases(reader, 3) if "label" in p]
    assert labels == ["hit3", "pfloor3", "hosthit3"]
    assert {p["prompt"] for p in ttft_specs.round_phases(reader, 3) if "prompt" in p} == {"B"}
    assert "tieredkv_remote" in ttft_specs.OWN_ROUND_NUMBERS


def record(label, prompt, seconds, cached, forward=0.1, **tieredkv):
    return {"label": label, "prompt": prompt, "seconds": seconds, "num_cached_tokens": cached,
            "forward_s": forward, "tieredkv": tieredkv}


EXPECTED = {"A": 3968, "B": 3648}
REMOTE = {"A": 3584, "B": 3584}


def remote_result(hit_a=3584, tier="hit_tokens_remote", **extra):
    records = [
        record("hit0", "A", 0.9, hit_a, forward=0.8, **{tier: hit_a}, remote_read_chunks=7, **extra),
        record("pfloor0", "A", 0.15, 3968),
        record("hosthit0", "A", 0.16, 3968, hit_tokens_host=3968),
        record("hit1", "B", 0.4, 3584, forward=0.3, hit_tokens_remote=3584, remote_read_chunks=7),
        record("pfloor1", "B", 0.14, 3648),
        record("hosthit1", "B", 0.15, 3648, hit_tokens_host=3648),
    ]
    return {"records": records, "startup_s": 3.0}


def test_remote_hits_are_checked_against_the_chunk_aligned_length():
    row = judging.summarize("tieredkv_remote", remote_result(), EXPECTED, REMOTE)
    assert row["hit_ok"], row["problems"]
    assert row["hit_tokens_by_prompt"] == {"A": [3584], "B": [3584]}
    assert row["host_hits_same_engine"]["hit_ok"]  # the tail is in host after the remote hit
    assert row["paired_floor"]["ratio_median"] == pytest.approx((0.9 / 0.15 + 0.4 / 0.14) / 2)
    # A hit that did not happen is a FAIL, not a number: nothing cached, ...
    assert not judging.summarize("tieredkv_remote", remote_result(hit_a=0), EXPECTED, REMOTE)["hit_ok"]
    # ... the floor's length (it cannot come from the remote tier), ...
    assert not judging.summarize("tieredkv_remote", remote_result(hit_a=3968), EXPECTED, REMOTE)["hit_ok"]
    # ... served by the host tier, ...
    host = judging.summarize("tieredkv_remote", remote_result(tier="hit_tokens_host"), EXPECTED, REMOTE)
    assert not host["hit_ok"] and "remote tier" in host["problems"][0]
    # ... or with a failed remote read.
    failed = judging.summarize("tieredkv_remote", remote_result(remote_read_failed_timeout=1), EXPECTED, REMOTE)
    assert not failed["hit_ok"] and "remote_read_failed_timeout" in failed["problems"][-1]


def test_remote_ratios_to_floor_and_recompute():
    row = {"median_s": 0.6, "paired_floor": {"ratio_median": 4.0}}
    r = judging.remote_ratios(row, {"median_s": 0.15}, {"median_s": 12.0})
    assert r["cross_engine_ratio"] == pytest.approx(4.0)
    assert r["same_engine_ratio"] == 4.0
    assert r["x_recompute"] == pytest.approx(0.05)
    assert r["speedup_vs_recompute"] == pytest.approx(20.0)
    none = judging.remote_ratios({"median_s": None}, {"median_s": 0.15}, {"median_s": 12.0})
    assert none["x_recompute"] is None and none["cross_engine_ratio"] is None


def test_figures_per_prompt():
    # A's chunk-aligned hit leaves 416 tokens to compute, B's 92: their TTFTs are apart.
    row = judging.summarize("tieredkv_remote", remote_result(), EXPECTED, REMOTE)
    assert row["by_prompt"]["A"]["median_s"] == 0.9 and row["by_prompt"]["B"]["median_s"] == 0.4
    assert row["by_prompt"]["A"]["overhead_median_s"] == pytest.approx(0.1)
    assert row["by_prompt"]["A"]["same_engine_ratio"] == pytest.approx(0.9 / 0.15)
    floor = judging.summarize("vllm_prefix", {"records": [record("hit0", "A", 0.15, 3968),
                                                       record("hit1", "B", 0.2, 3648)]}, EXPECTED)
    recompute = judging.summarize("recompute", {"records": [record("recompute0", "A", 12.0, 0),
                                                        record("recompute1", "B", 8.0, 0)]}, EXPECTED)
    q = judging.remote_ratios_by_prompt(row, floor, recompute)
    assert q["A"]["cross_engine_ratio"] == pytest.approx(6.0)
    assert q["B"]["cross_engine_ratio"] == pytest.approx(2.0)
    assert q["A"]["speedup_vs_recompute"] == pytest.approx(12.0 / 0.9)
    assert q["B"]["x_recompute"] == pytest.approx(0.05)


def test_writer_summary_takes_cold_runs_and_final_counters():
    result = {"records": [
        record("warmup", "warmup", 0.1, 0), record("cold A", "A", 12.0, 0), record("cold B", "B", 11.0, 0),
        {"label": "counters", "counters": {"remote_written_chunks": 14, "stored_chunks": 16, "lookups": 3}},
    ], "startup_s": 9.0}
    s = runner.writer_summary(result)
    assert s["cold_s"] == [12.0, 11.0]
    assert s["counters"] == {"remote_written_chunks": 14, "stored_chunks": 16}
    assert s["num_cached_tokens"] == {"warmup": 0, "cold A": 0, "cold B": 0}


def test_report_states_the_shorter_hit_and_a_missing_row():
    rows = {
        "recompute": judging.summarize("recompute", {"records": [record("recompute0", "A", 12.0, 0)]}, EXPECTED),
        "vllm_prefix": judging.summarize("vllm_prefix", {"records": [record("hit0", "A", 0.15, 3968),
                                                                  record("hit1", "B", 0.14, 3648)]}, EXPECTED),
        "tieredkv_remote": judging.summarize("tieredkv_remote", remote_result(), EXPECTED, REMOTE),
    }
    payload = {"rows": rows, "params": {"prompt_lengths": {"A": 4000, "B": 3676},
                                        "expected_hit_tokens": EXPECTED,
                                        "expected_remote_hit_tokens": REMOTE},
               "remote": {"server": "redis-server 7.0.15", "timeout_s": 0.5, "host_slots": 8,
                          "expected_keys": 14, "keys_after_writer": 14,
                          "writer": {"cold_s": [12.0, 11.0], "counters": {"remote_written_chunks": 14}}}}
    text = report.remote_markdown(payload)
    assert "A 3,584 tokens, against vLLM's prefix-cache hit of 3,968" in text
    assert "416 tokens for A and 92 tokens for B" in text
    assert "A 416 vs 32; B 92 vs 28" in text
    assert "Redis held 14 keys" in text and "| yes |" in text
    assert "↳ prompt A only (4,000 tokens" in text and "| 416 vs 32 |" in text
    bad = dict(rows, tieredkv_remote=judging.summarize("tieredkv_remote", remote_result(hit_a=0), EXPECTED, REMOTE))
    assert "**NO — FAIL**" in report.remote_markdown({**payload, "rows": bad})
    missing = {k: v for k, v in rows.items() if k != "tieredkv_remote"}
    assert "not run**: no redis-server" in report.remote_markdown(
        {**payload, "rows": missing, "remote": {"skipped": "no redis-server"}})


def test_the_report_bounds_the_remote_row_by_what_plain_gets_deliver():
    raw = {"keys": 17, "bytes": 56 << 20, "way": "sequential", "median_s": 0.035,
           "samples_s": [0.035] * 5, "medians_s": {"sequential": 0.035, "pipelined": 0.041},
           "gb_per_s": 1.6}
    text = targets.raw_get_markdown(raw, 31 << 20, 0.034)
    assert "The 17 values replica A wrote (56.0 MiB) read by redis-py" in text
    assert "(medians of 5: sequential 35.0 ms and pipelined 41.0 ms); the faster, sequential: " \
           "**1.60 GB/s**" in text
    assert "A hit's KV (31.0 MiB) takes 20.3 ms" in text
    assert "would be 1.60 x the floor (34.0 ms), against the 1.5 x target" in text
    assert "not measured" in targets.raw_get_markdown(None, 31 << 20, 0.034)


def test_raw_gets_read_every_value_under_the_prefix(fresh_server):
    import redis as redis_py

    server = fresh_server()
    client = redis_py.Redis(host="127.0.0.1", port=server.port)
    for i in range(3):
        client.set(f"e2e:{i}", bytes(1000 * (i + 1)))
    client.set("other:0", bytes(5000))
    client.close()
    raw = runner.raw_redis_get(server, "e2e", repeats=3)
    assert (raw["keys"], raw["bytes"], len(raw["samples_s"])) == (3, 6000, 3)
    assert raw["way"] in ("sequential", "pipelined") and set(raw["medians_s"]) == {
        "sequential", "pipelined"}
    assert raw["median_s"] == min(raw["medians_s"].values()) and raw["gb_per_s"] > 0
