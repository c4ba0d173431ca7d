"""Pure pieces of benchmarks.multi_replica: round-robin assignment, random prompt lengths,
hit aggregation over replicas, pooling, the shared/separate ratios and the report.

No vLLM server or Redis is started (the client runs against a stand-in for the HTTP call);
nothing here judges a timing.
"""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import multi_replica as mr
from benchmarks.replicas import judging as replica_judging
from benchmarks.replicas import report as replica_report
from benchmarks.replicas import runner as replica_runner
from benchmarks.replicas import workload as replica_workload
from benchmarks.serve import client, judging, workload


def spec(**kw) -> workload.ChatWorkload:
    base = dict(system_tokens=100, user_tokens=48, reply_tokens=4, turns=5, think_mean_s=0.0, seed=3)
    return workload.ChatWorkload(**{**base, **kw})


# ---------------------------------------------------------------------------- assignment


def test_round_robin_puts_consecutive_turns_on_different_replicas():
    for user in range(8):
        replicas = [replica_workload.replica_for(user, turn) for turn in range(10)]
        assert all(a != b for a, b in zip(replicas, replicas[1:], strict=False))
        assert set(replicas) == {0, 1}
    # At any turn, the users are split evenly over the two replicas.
    for turn in range(6):
        assert sorted(replica_workload.replica_for(u, turn) for u in range(8)) == [0] * 4 + [1] * 4
    assert [replica_workload.replica_for(0, t, 3) for t in range(4)] == [0, 1, 2, 0]


def test_each_replica_binds_its_worker_to_cores_of_its_own():
    """vLLM's automatic binding put both replicas' workers on core 0, where one waited for the
    other's (0.05-0.8 s per engine step): each replica gets a disjoint share instead."""
    two = [replica_workload.replica_cpu_env(i, 2, cpus={0, 1}) for i in range(2)]
    assert two == [{"VLLM_CPU_OMP_THREADS_BIND": "0"}, {"VLLM_CPU_OMP_THREADS_BIND": "1"}]
    shares = [replica_workload.replica_cpu_env(i, 2, cpus=range(16))["VLLM_CPU_OMP_THREADS_BIND"]
              for i in range(2)]
    cores = [set(map(int, share.split(","))) for share in shares]
    assert cores[0].isdisjoint(cores[1]) and cores[0] | cores[1] == set(range(16))
    assert replica_workload.replica_cpu_env(1, 2, cpus={3}) == {}  # too few: vLLM's own binding


def test_client_sends_each_turn_to_its_replica_with_the_grown_history(monkeypatch):
    s = spec(turns=4)
    convs = replica_workload.level_conversations(s, 2, 20)
    calls = []

    def fake(url, tokens, max_tokens, timeout_s):
        calls.append((url, list(tokens)))
        return 0.01, [7] * max_tokens

    monkeypatch.setattr(client, "stream_completion", fake)  # the client multi_replica uses
    records, _ = replica_runner.run_level_rr(["http://a", "http://b"], s, convs, timeout_s=30, request_timeout_s=5)
    assert len(records) == 2 * 4 and all(r["ok"] for r in records)
    for r in records:
        assert r["replica"] == replica_workload.replica_for(r["user"], r["turn"])
    system = list(workload.system_prompt(s))
    for conv in convs:
        mine = [c for c in calls if c[1][len(system):len(system) + len(conv.user_texts[0])]
                == list(conv.user_texts[0])]
        assert [url for url, _ in mine] == [("http://a", "http://b")[replica_workload.replica_for(conv.user, t)]
                                            for t in range(4)]
        # Turn t's prompt = system + text 0 + reply 0 + ... + text t.
        expected = list(system)
        for turn, (_, prompt) in enumerate(mine):
            expected += list(conv.user_texts[turn])
            assert prompt == expected
            expected += [7] * s.reply_tokens
    lengths = {r["prompt_tokens"] for r in records}
    assert lengths == {n for c in convs for n in replica_workload.prompt_lengths(s.system_tokens, c, s.reply_tokens)}


# ---------------------------------------------------------------------------- workload


def test_user_lengths_are_random_seeded_and_bounded():
    s = spec(user_tokens=64)
    a = replica_workload.level_conversations(s, 4, 16)
    assert a == replica_workload.level_conversations(s, 4, 16)
    plain = workload.make_conversations(s, 4)
    lens = [len(t) for c in a for t in c.user_texts]
    assert all(16 <= n <= 64 for n in lens) and len(set(lens)) > 3
    for mine, orig in zip(a, plain, strict=True):  # a prefix of serve_bench's text, same think times
        assert mine.think_s == orig.think_s
        assert all(o[: len(m)] == m for m, o in zip(mine.user_texts, orig.user_texts, strict=True))
    assert replica_workload.level_conversations(spec(user_tokens=64, seed=4), 4, 16) != a


def test_rounds_get_fresh_conversations_and_interleave_the_configurations():
    s = spec(user_tokens=64)
    r0, r1 = replica_workload.level_conversations(s, 4, 16, 0), replica_workload.level_conversations(s, 4, 16, 1)
    assert r0 == replica_workload.level_conversations(s, 4, 16) and r0 != r1
    assert [c.user_texts for c in r1] == [c.user_texts for c in replica_workload.level_conversations(s, 4, 16, 1)]
    assert replica_workload.sessions(2) == [(0, "shared_remote"), (0, "separate"),
                                            (1, "separate"), (1, "shared_remote")]
    order = replica_workload.schedule((2, 4), 2)
    assert order == [(0, 2, "shared_remote"), (0, 4, "shared_remote"), (0, 2, "separate"),
                     (0, 4, "separate"), (1, 2, "separate"), (1, 4, "separate"),
                     (1, 2, "shared_remote"), (1, 4, "shared_remote")]
    assert replica_workload.schedule((2, 4, 8), 2, ["separate"]) == [(r, lv, "separate") for r in (0, 1) for lv in (2, 4, 8)]


def test_prompt_lengths_follow_the_conversation_and_are_not_chunk_aligned():
    s = workload.ChatWorkload(system_tokens=1000, user_tokens=448, reply_tokens=48, turns=6, seed=0)
    convs = replica_workload.level_conversations(s, 8, 160)
    conv = convs[0]
    got = replica_workload.prompt_lengths(1000, conv, 48)
    texts = [len(t) for t in conv.user_texts]
    assert got[0] == 1000 + texts[0]
    assert got[3] == 1000 + sum(texts[:4]) + 3 * 48
    lengths = [n for c in convs for n in replica_workload.prompt_lengths(1000, c, 48)]
    assert sum(1 for n in lengths if n % workload.CHUNK_TOKENS == 0) < len(lengths) // 10
    assert len(set(n % workload.CHUNK_TOKENS for n in lengths)) > 10


def test_host_tier_is_the_same_formula_for_both_configurations():
    s = workload.ChatWorkload(system_tokens=1000, user_tokens=448, reply_tokens=48, turns=6)
    host = replica_workload.host_bytes_per_replica(s, (2, 4, 8))
    chunk = workload.CHUNK_TOKENS * 4096
    assert host == 2 * workload.chunks_of(s, 14) * chunk
    assert replica_workload.host_bytes_per_replica(s, (2, 4, 8), 2) == 2 * workload.chunks_of(s, 28) * chunk
    shared, separate = replica_workload.kv_config(host, "redis://127.0.0.1:1/0"), replica_workload.kv_config(host, None)
    assert shared["kv_connector_extra_config"]["host_bytes"] == separate["kv_connector_extra_config"]["host_bytes"]
    assert shared["kv_connector_extra_config"]["remote_url"] == "redis://127.0.0.1:1/0"
    assert not any(k.startswith("remote") for k in separate["kv_connector_extra_config"])
    assert replica_workload.default_remote_timeout_s() > 0


# ---------------------------------------------------------------------------- statistics


def scrape(device: float, host: float, remote: float, read: float = 0, failures: float = 0) -> str:
    return "\n".join([
        "# HELP vllm:prefix_cache_hits_total x",
        f'vllm:prefix_cache_hits_total{{engine="0",model_name="tiny"}} {device}',
        f'vllm:tieredkv_hit_tokens_total{{engine="0",tier="host"}} {host}',
        'vllm:tieredkv_hit_tokens_total{engine="0",tier="disk"} 0.0',
        f'vllm:tieredkv_hit_tokens_total{{engine="0",tier="remote"}} {remote}',
        f'vllm:tieredkv_chunks_total{{engine="0",op="remote_read"}} {read}',
        'vllm:tieredkv_chunks_total{engine="0",op="stored"} 99',
        f'vllm:tieredkv_remote_probe_failures_total{{cause="timeout"}} {failures}',
        f'vllm:tieredkv_remote_probe_failures_total{{cause="network"}} {failures}',
    ])


def test_hits_are_summed_over_both_replicas():
    before = [scrape(100, 10, 0), scrape(50, 0, 5, read=1)]
    after = [scrape(400, 110, 256, read=1), scrape(150, 60, 517, read=4, failures=1)]
    hits = replica_judging.aggregate_hits(before, after, 2000)
    assert hits["device_tokens"] == 300 + 100
    assert hits["tieredkv_host_tokens"] == 100 + 60
    assert hits["tieredkv_remote_tokens"] == 256 + 512
    assert hits["tieredkv_tokens"] == 160 + 768
    assert hits["device_rate"] == pytest.approx(0.2)
    assert hits["tieredkv_remote_rate"] == pytest.approx(768 / 2000)
    assert hits["remote_read_chunks"] == 1 + 3
    assert hits["remote_probe_failures"] == 2  # both causes
    assert hits["remote_written_chunks"] == 0  # absent from the scrapes
    assert math.isnan(replica_judging.aggregate_hits(before, after, 0)["device_rate"])
    with pytest.raises(ValueError):
        replica_judging.aggregate_hits(before, after[:1], 10)


def test_pooling_sums_tokens_and_recomputes_rates():
    a = replica_judging.aggregate_hits([scrape(0, 0, 0)], [scrape(100, 50, 0)], 1000)
    b = replica_judging.aggregate_hits([scrape(0, 0, 0)], [scrape(300, 0, 200, read=2)], 1000)
    pooled = replica_judging.pool_hits([a, b], 2000)
    assert pooled["device_tokens"] == 400 and pooled["device_rate"] == pytest.approx(0.2)
    assert pooled["tieredkv_remote_rate"] == pytest.approx(0.1)
    assert pooled["tieredkv_rate"] == pytest.approx(250 / 2000)
    assert pooled["remote_read_chunks"] == 2


def level(ttfts, prompt=1000, wall=2.0, hits=None):
    recs = [{"ok": True, "turn": i, "user": 0, "replica": i % 2, "ttft_s": t, "prompt_tokens": prompt,
             "output": [1, 2]} for i, t in enumerate(ttfts)]
    summary = judging.level_summary(recs, wall)
    summary["hits"] = hits or replica_judging.aggregate_hits([scrape(0, 0, 0)], [scrape(0, 0, 0)], summary["prompt_tokens"])
    return recs, summary


def test_ratios_shared_over_separate_and_pooled_rows():
    recs_s2, s2 = level([0.1, 0.2, 0.3])
    recs_s4, s4 = level([0.2, 0.4, 0.6, 0.8])
    recs_p2, p2 = level([0.2, 0.4, 0.6])
    recs_p4, p4 = level([0.4, 0.8, 1.2, 1.6])
    results = {"shared_remote": {2: s2, 4: s4}, "separate": {2: p2, 4: p4}}
    results["shared_remote"]["all"] = replica_judging.pooled_summary({2: recs_s2, 4: recs_s4}, results["shared_remote"])
    results["separate"]["all"] = replica_judging.pooled_summary({2: recs_p2, 4: recs_p4}, results["separate"])
    rows = {r["users"]: r for r in replica_judging.shared_vs_separate(results)}
    assert list(rows) == [2, 4, "all"]
    assert rows[2]["ttft_p50_ratio"] == pytest.approx(0.5)
    assert rows[4]["ttft_p99_ratio"] == pytest.approx(0.5)
    assert rows["all"]["ttft_p50_ratio"] == pytest.approx(0.5)
    assert rows[2]["prompt_tps_ratio"] == pytest.approx(1.0)
    pooled = results["shared_remote"]["all"]
    assert pooled["completed"] == 7 and pooled["wall_s"] == pytest.approx(4.0)
    assert pooled["output_tokens_per_s"] == pytest.approx(14 / 4.0)
    assert math.isnan(replica_judging.ratio(1.0, 0.0)) and math.isnan(replica_judging.ratio(None, 1.0))
    assert math.isnan(replica_judging.ratio(math.nan, 1.0)) and replica_judging.ratio(3.0, 2.0) == 1.5
    assert replica_judging.shared_vs_separate({"shared_remote": {2: s2}}) == []
    assert rows[2]["ttft_p50_ratio_per_round"] == []
    s2["rounds"] = [{"round": 0, "ttft_p50_s": 0.1}, {"round": 1, "ttft_p50_s": 0.3}]
    p2["rounds"] = [{"round": 0, "ttft_p50_s": 0.2}, {"round": 1, "ttft_p50_s": 0.2}]
    again = {r["users"]: r for r in replica_judging.shared_vs_separate(results)}
    assert again[2]["ttft_p50_ratio_per_round"] == pytest.approx([0.5, 1.5])


def test_replies_compared_where_both_have_one():
    replies = {"shared_remote": {2: {"0:0": [1, 2], "0:1": [3], "1:0": [5]}},
               "separate": {2: {"0:0": [1, 2], "0:1": [4]}}}
    assert replica_judging.replies_agree(replies) == (1, 2)


def test_first_divergence_per_conversation():
    replies = {
        "shared_remote": {4: {"0:0": [1], "0:1": [2, 3, 9], "0:2": [8], "1:0": [5], "1:1": [6]}},
        "separate": {4: {"0:0": [1], "0:1": [2, 3, 4], "0:2": [7], "1:0": [5], "1:1": [6]}},
    }
    assert replica_judging.first_divergences(replies) == [
        {"users": 4, "round": 0, "user": 0, "turn": 1, "token": 2, "replica": 1}]  # not turn 2 again
    by_round = {c: {(4, 1): v[4]} for c, v in replies.items()}
    assert replica_judging.first_divergences(by_round)[0]["round"] == 1
    assert replica_judging.first_divergences({"shared_remote": replies["shared_remote"],
                                 "separate": replies["shared_remote"]}) == []


def test_checks_fail_without_remote_hits_and_pass_with_them():
    hits_shared = {"tieredkv_remote_tokens": 512, "remote_read_chunks": 2, "remote_written_chunks": 9,
                   "remote_probe_failures": 0, "remote_read_failures": 0, "remote_writes_dropped": 0}
    ok = replica_judging.checks({"shared_remote": {"all": {"hits": hits_shared}},
                    "separate": {"all": {"hits": {"tieredkv_remote_tokens": 0}}}})
    assert [c["verdict"] for c in ok] == ["PASS", "PASS", "PASS", "PASS", "PASS"]
    bad = replica_judging.checks({"shared_remote": {"all": {"hits": {**hits_shared, "tieredkv_remote_tokens": 0,
                                                        "remote_probe_failures": 3}}},
                     "separate": {"all": {"hits": {"tieredkv_remote_tokens": 256, "evictions_host": 3}}}})
    assert [c["verdict"] for c in bad] == ["FAIL", "INFO", "PASS", "FAIL", "FAIL"]


# ---------------------------------------------------------------------------- report


def test_report_renders_and_reloads(tmp_path, monkeypatch):
    monkeypatch.setattr(mr.common, "plot_panels", lambda path, *a, **k: path)  # no matplotlib here
    _, s2 = level([0.1, 0.2])
    _, p2 = level([0.2, 0.4])
    results = {"shared_remote": {2: s2, "all": s2}, "separate": {2: p2, "all": p2}}
    payload = {
        "benchmark": replica_workload.NAME, "profile": "quick", "started": "now", "git": "abc", "wall_s": 12.0,
        "machine": {"name": "test box"}, "workload": {"seed": 0, "system_tokens": 1000, "turns": 6,
                                                      "user_tokens": 448, "reply_tokens": 48,
                                                      "think_mean_s": 0.5},
        "user_tokens_min": 160, "levels": [2], "prompt_tokens_range": [1200, 3900],
        "prompts_planned": 12, "chunk_aligned_prompts": 0, "device_blocks": 200,
        "host_bytes_per_replica": 342 << 20, "layout": "all four", "server_env": {"X": "1"},
        "replica_env": [{"VLLM_CPU_OMP_THREADS_BIND": "0"}, {"VLLM_CPU_OMP_THREADS_BIND": "1"}],
        "redis": {"server": "redis-server 7", "timeout_s": 0.5}, "rounds": 2,
        "schedule": [{"config": "shared_remote", "load_1m_start": 1.0, "load_1m_end": 2.5},
                     {"config": "separate", "load_1m_start": 0.5, "load_1m_end": 3.0}],
        "results": results, "ratios": replica_judging.shared_vs_separate(results),
        "checks": replica_judging.checks(results), "errors": [],
    }
    json_path, md_path, _ = replica_report.write_outputs(payload, tmp_path)
    text = md_path.read_text()
    assert "host tier 342 MiB per replica in both configurations" in text
    assert "float32, **4,096 bytes (4 KiB) of KV per token**, block 32" in text  # #27: KV size stated
    assert "0 of 12 a multiple of the chunk" in text and "| shared_remote | 2 |" in text
    assert "Targets" not in text  # a file from before the targets: none invented
    assert "0.5" in text  # the p50 ratio
    assert "`shared_remote` 1.0–2.5; `separate` 0.5–3.0" in text
    assert "replica 1's servers `VLLM_CPU_OMP_THREADS_BIND=1`" in text
    again = replica_report.load_payload(json_path)
    assert set(again["results"]["shared_remote"]) == {2, "all"}
    assert json.loads(json_path.read_text())["benchmark"] == "multi_replica"
