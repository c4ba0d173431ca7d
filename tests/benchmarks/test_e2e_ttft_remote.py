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
    assert labels == ["touch3", "hit3", "pfloor3", "hosthit3"]
    assert {p["prompt"] for p in ttft_specs.round_phases(reader, 3) if "prompt" in p} == {"touch", "B"}
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


def test_row_6c_reads_replica_as_redis_through_a_throttling_proxy(tmp_path):
    lengths = {"A": 4000, "B": 3676}
    url, slow_url = "redis://127.0.0.1:7/0", "redis://127.0.0.1:8/0"
    assert workload.SLOW_REMOTE_CONFIG not in ttft_specs.build_specs(
        args(), tmp_path / "model", tmp_path, lengths, url)  # no proxy: no row
    assert workload.SLOW_REMOTE_CONFIG not in ttft_specs.build_specs(
        args(), tmp_path / "model", tmp_path, lengths, slow_remote_url=slow_url)  # no Redis
    specs = ttft_specs.build_specs(args(), tmp_path / "model", tmp_path, lengths, url,
                                   slow_remote_url=slow_url)
    spec, writer = specs[workload.SLOW_REMOTE_CONFIG], specs["tieredkv_remote_writer"]
    extra = spec["kv_transfer_config"]["kv_connector_extra_config"]
    writer_extra = writer["kv_transfer_config"]["kv_connector_extra_config"]
    # The same keys as replica A wrote, through the proxy; replica B's host tier (one prompt);
    # a deadline the slow reads meet (a timed-out read would be a failure, not a decline).
    assert extra["remote_url"] == slow_url and "disk_path" not in extra and "cost_model" not in extra
    assert extra["remote_key_prefix"] == writer_extra["remote_key_prefix"]
    assert extra["host_bytes"] == writer_extra["host_bytes"]
    assert extra["remote_timeout_s"] == workload.SLOW_REMOTE_TIMEOUT_S > runner.default_remote_timeout_s()
    # Cold prompts (the prefill rate), then remote hits of A and B (never computed here).
    from tieredkv.scheduler.policies import MIN_SAMPLES

    gens = [p for p in spec["setup"] if p["kind"] == "generate"]
    cold = [p["prompt"] for p in gens if p["label"].startswith("cold")]
    learned = [p["prompt"] for p in gens if p["label"].startswith("learn")]
    assert len(cold) >= MIN_SAMPLES and all(len(spec["prompts"][c]) >= workload.CHUNK_TOKENS for c in cold)
    assert len(learned) >= MIN_SAMPLES and set(learned) == {"A", "B"} and learned[-1] == "B"
    assert {p["prompt"] for p in gens} == {"warmup", *cold, "A", "B"}
    assert workload.SLOW_REMOTE_CONFIG in ttft_specs.OWN_ROUND_NUMBERS
    # A fresh filler before each measured hit takes every host slot: the hit is in Redis only.
    rounds = [[(p["prompt"], p["label"]) for p in ttft_specs.round_phases(spec, i)
               if p["kind"] == "generate" and p["prompt"] != "touch"] for i in range(10)]
    assert rounds[0] == [("F0", "fill0"), ("A", "hit0")] and rounds[1] == [("F1", "fill1"), ("B", "hit1")]
    fillers = {r[0][0] for r in rounds}
    assert len(fillers) == 10
    # Each filler as long as the prompt its round measures (the same-engine recompute beside it).
    assert all(len(spec["prompts"][f]) == lengths[p] for (f, _), (p, _) in rounds)
    others = [p for c, s in specs.items() if c != workload.SLOW_REMOTE_CONFIG
              for n, p in s["prompts"].items() if n not in ("warmup", "A", "B")]
    assert not any(spec["prompts"][n] in others for n in (*fillers, *cold))  # in no other row


def slow_redis(declined: str | None = judging.DECLINED_REMOTE[0], cached: int = 0) -> dict:
    records = [record("learn0", "A", 6.0, 3968, hit_tokens_remote=3968),
               record("learn1", "B", 1.3, 0, hits_declined_slower_than_recompute_remote=1)]
    for i in range(4):
        counters = {declined: 1} if declined else {"hit_tokens_remote": 3968}
        records.append(record(f"fill{i}", "F", 1.4, 0, 1.4))
        records.append(record(f"hit{i}", "AB"[i % 2], 1.45, cached if declined else 3968, 1.4,
                              **counters))
    return {"records": records}


def slow_rows(**slow: dict) -> dict:
    recompute = {"records": [record("recompute0", "A", 1.4, 0, 1.4),
                             record("recompute1", "B", 1.3, 0, 1.3)]}
    return {c: judging.summarize(c, r, EXPECTED, EXPECTED)
            for c, r in {"recompute": recompute, **slow}.items()}


def test_slow_redis_hits_must_be_declined_and_are_judged_against_recompute():
    config = workload.SLOW_REMOTE_CONFIG
    for reason in judging.DECLINED_REMOTE:  # declined once the probe answered, or at the probe
        rows = slow_rows(**{config: slow_redis(reason)})
        assert rows[config]["hit_ok"] and rows[config]["explored_runs"] == 0, reason
        assert rows[config]["learning_s"] == [6.0, 1.3]
        assert rows[config]["learning_hit_tokens"] == [3968, 0]
        (v,) = targets.slow_verdicts(rows)
        assert v["target"] == "slow Redis <= 1.1 x recompute" and v["config"] == config
        assert v["worse_ratio"] == pytest.approx(1.45 / 1.35) and v["factor"] == 1.1 and v["pass"]
    taken = slow_rows(**{config: slow_redis(None)})
    assert not taken[config]["hit_ok"]
    assert "4 run(s) without a declined remote hit" in taken[config]["problems"][0]
    (v,) = targets.slow_verdicts(taken)
    assert not v["pass"] and v["note"].startswith("not declined as it should be")
    # A disk decline does not count for Redis; one explored chunk is allowed, more is not.
    assert not slow_rows(**{config: slow_redis(judging.DECLINED_DISK)})[config]["hit_ok"]
    assert slow_rows(**{config: slow_redis(cached=512)})[config]["hit_ok"]
    loaded = slow_rows(**{config: slow_redis(cached=1024)})[config]
    assert not loaded["hit_ok"] and "loaded from the slow remote" in loaded["problems"][0]
    # Slower than 1.1 x recompute although declined: a FAIL, in the exit status.
    slow = slow_redis()
    for r in slow["records"]:
        r["seconds"] *= 1.2
    (v,) = targets.slow_verdicts(slow_rows(**{config: slow}))
    assert v["worse_ratio"] == pytest.approx(1.74 / 1.35) and not v["pass"]
    assert judging.exit_status({"rows": {}, "remote": {}, "verdicts": [v]}) == 1


def test_the_report_states_row_6c_its_delay_and_its_verdict():
    config = workload.SLOW_REMOTE_CONFIG
    rows = slow_rows(**{config: slow_redis()})
    payload = {"rows": rows, "params": {
        "slow_disk": {"skipped": "--no-slow-disk"},
        "slow_remote": {"proxy_delay_s": 0.005, "block_bytes": 16384, "remote_timeout_s": 30.0,
                        "learning_hits": 4}}}
    text = targets.slow_rows_text(payload)
    assert "**Row 5c (slow disk) not run**: --no-slow-disk." in text
    assert "**Row 6c, a slow Redis.**" in text and "`remote_timeout_s` 30.0 s" in text
    assert "every 16 KiB block of a value it sends back 0.005 s first (0.32 s per MiB" in text
    assert "4 unmeasured remote hits" in text
    assert ("their TTFTs 6,000.0 ms (3,968 tokens read), 1,300.0 ms (declined), against "
            "recompute's median 1,350.0 ms") in text
    assert targets.slow_row_hit(config, rows[config]) == (
        "declined, every run (0 run(s) still loaded a remote chunk)")
    assert targets.slow_row_hit("tieredkv_remote", rows[config]) is None
    table = targets.verdict_table(targets.slow_verdicts(rows))
    assert "| slow Redis <= 1.1 x recompute | 1.1 x recompute | 1.07 | 1.04 | **1.07** vs 1.10 | **PASS** |" in table
    skipped = {"rows": {"recompute": rows["recompute"]},
               "params": {"slow_remote": {"skipped": "needs row 6 (no redis-server)"}}}
    assert "**Row 6c (slow Redis) not run**: needs row 6 (no redis-server)." in targets.slow_rows_text(skipped)


def test_row_6c_proxy_reaches_row_6s_redis_and_delays_values(fresh_server, tmp_path):
    import redis as redis_py

    server = fresh_server()
    direct = redis_py.Redis(host="127.0.0.1", port=server.port)
    direct.set("e2e:0", b"v" * (1 << 20))
    direct.close()
    proxy = runner.start_slow_proxy(server, tmp_path, 0.0)
    try:
        assert (tmp_path / "redis-is-slow").exists()  # throttled for the whole run
        via = redis_py.Redis.from_url(proxy.url)
        assert via.get("e2e:0") == b"v" * (1 << 20) and via.exists("e2e:0") == 1
        via.close()
    finally:
        proxy.close()
