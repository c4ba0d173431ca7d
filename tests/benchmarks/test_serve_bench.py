"""Pure pieces of benchmarks.serve_bench: random prompt lengths, sizing from the generated
conversations, the equal-memory control, repeats / spread / verdicts, the configuration list
and the report round trip.

No vLLM server is started (the client runs against a stand-in for the HTTP call).
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
from dataclasses import asdict
from pathlib import Path

import pytest

from benchmarks import serve_bench
from benchmarks.serve import client, judging, report, servers, workload
from benchmarks.serve import configs as bench_configs
from tieredkv.tools.vllm_server import BLOCK_SIZE, Server

QUICK = workload.PROFILES["quick"]


def quick_spec(**kw) -> workload.ChatWorkload:
    base = {k: QUICK[k] for k in ("system_tokens", "user_tokens", "reply_tokens", "turns", "think_mean_s", "jitter")}
    return workload.ChatWorkload(**{**base, **kw})


def all_lengths(spec: workload.ChatWorkload, levels=(1, 4, 8), repeats=3) -> list[int]:
    return [n for r in range(repeats) for lv in levels for c in workload.make_conversations(spec, lv, r)
            for n in workload.prompt_lengths(spec, c)]


# ---------------------------------------------------------------------------- workload


def test_random_lengths_are_no_chunk_or_block_multiples_and_deterministic():
    spec = quick_spec()
    lengths = all_lengths(spec)
    assert all(n % BLOCK_SIZE for n in lengths)  # hence no chunk multiple either
    assert len({n % workload.CHUNK_TOKENS for n in lengths}) > 40
    stats = workload.length_stats(lengths)
    assert stats["chunk_multiple_frac"] == 0 and stats["block_multiple_frac"] == 0
    assert stats["min"] < stats["median"] < stats["max"] and stats["prompts"] == len(lengths)
    # Deterministic per seed; another seed or repeat gives other conversations and lengths.
    first = workload.make_conversations(spec, 4, 1)
    random.seed(99)  # the global generator's state does not matter: the spec's seed does
    assert all_lengths(quick_spec()) == lengths
    assert workload.make_conversations(quick_spec(), 4, 1) == first
    assert all_lengths(quick_spec(seed=1)) != lengths
    assert workload.make_conversations(spec, 4, 0) != workload.make_conversations(spec, 4, 1)
    # Within +-40 % of the profile's sizes, and actually spread over that range.
    sys_lo, sys_hi = round(0.6 * spec.system_tokens), round(1.4 * spec.system_tokens)
    convs = [c for r in range(3) for lv in (1, 4, 8) for c in workload.make_conversations(spec, lv, r)]
    assert all(sys_lo <= c.system_len <= sys_hi for c in convs)
    assert len({c.system_len for c in convs}) > 20
    users = [len(t) for c in convs for t in c.user_texts]
    assert min(users) >= round(0.6 * spec.user_tokens) and max(users) <= round(1.4 * spec.user_tokens)
    assert len(set(users)) > 50
    assert len(workload.system_prompt(spec)) == spec.max_system_tokens == sys_hi


def test_no_jitter_keeps_the_nominal_workload():
    spec = workload.ChatWorkload(system_tokens=1024, user_tokens=192, reply_tokens=32, turns=4)
    convs = workload.make_conversations(spec, 3)
    assert all(c.system_len is None and all(len(t) == 192 for t in c.user_texts) for c in convs)
    assert workload.prompt_lengths(spec, convs[0]) == [spec.prompt_tokens(t) for t in range(4)]
    assert workload.working_set_blocks_of(spec, convs, 32) == workload.working_set_blocks(spec, 3, 32)
    assert workload.chunks_of_convs(spec, convs, 256) == workload.chunks_of(spec, 3, 256)
    assert len(workload.system_prompt(spec)) == 1024


def test_working_set_counts_shared_system_blocks_once():
    spec = workload.ChatWorkload(system_tokens=100, user_tokens=10, reply_tokens=4, turns=2, jitter=0.5)
    a = workload.Conversation(1, 0, ((0,) * 10, (0,) * 10), (0.0, 0.0), system_len=70)  # ends at 70+10+4+10+4 = 98
    b = workload.Conversation(1, 1, ((1,) * 10, (1,) * 10), (0.0, 0.0), system_len=130)  # ends at 158
    # 32-token blocks: system-only blocks 2 (a) and 4 (b), shared: 4 distinct; a adds 4 - 2, b 5 - 4.
    assert workload.working_set_blocks_of(spec, [a, b], 32) == 4 + 2 + 1
    # 64-token chunks of the last prompts (94 and 154 tokens): system-only 1 and 2, distinct 2.
    assert workload.chunks_of_convs(spec, [a, b], 64) == 2 + 0 + 0


def test_client_sends_each_conversation_its_own_system_prefix(monkeypatch):
    spec = quick_spec(think_mean_s=0.0, turns=3, system_tokens=100, user_tokens=40, reply_tokens=4)
    convs = workload.make_conversations(spec, 3, 2)
    calls = []

    def fake(url, tokens, max_tokens, timeout_s):
        calls.append(list(tokens))
        return 0.01, [7] * max_tokens

    monkeypatch.setattr(client, "stream_completion", fake)
    records, _ = client.run_level("http://x", spec, 3, conversations=convs, timeout_s=30, request_timeout_s=5)
    assert len(records) == 9 and all(r["ok"] for r in records)
    system = list(workload.system_prompt(spec))
    for conv in convs:
        want = workload.prompt_lengths(spec, conv)
        got = [r["prompt_tokens"] for r in records if r["user"] == conv.user]
        assert got == want
        first = next(c for c in calls if c[conv.system_len:conv.system_len + len(conv.user_texts[0])]
                     == list(conv.user_texts[0]) and len(c) == want[0])
        assert first[:conv.system_len] == system[:conv.system_len]


def test_plan_sizes_the_device_and_tiers_from_the_generated_conversations(tmp_path):
    spec = quick_spec()
    plan = workload.make_plan(spec, (1, 4, 8), 3, tmp_path)
    for r in range(3):  # every repeat's two conversations fit, with vLLM's null block
        assert workload.working_set_blocks_of(spec, workload.make_conversations(spec, 2, r)) <= plan.device_blocks - 1
    assert plan.exceeding == [4, 8]  # the point of the benchmark: larger levels do not fit
    assert max(plan.working_set[1]) <= plan.device_blocks - 1
    convs = [c for cs in plan.conversations.values() for c in cs]
    assert max(workload.conversation_tokens_of(spec, c) for c in convs) <= plan.max_model_len
    assert plan.max_model_len % BLOCK_SIZE == 0
    assert plan.total_chunks == workload.chunks_of_convs(spec, convs)
    assert plan.host_all == 2 * plan.total_chunks * plan.chunk_bytes
    assert plan.host_half < plan.host_all
    assert plan.conversations[8, 2] == workload.make_conversations(spec, 8, 2)


# ---------------------------------------------------------------------------- configurations


def test_equal_memory_block_arithmetic(tmp_path):
    block = 32 * 4096  # 32 tokens x 4 KiB of K+V per token (4 layers, 2 KV heads, 64 dims, fp32)
    assert workload.equal_mem_blocks(159, 534 << 20, block) == (159 + 4272, 4272)
    assert workload.equal_mem_blocks(10, 3 * block + 5, block) == (13, 3)  # whole blocks only
    assert workload.equal_mem_blocks(10, 0, block) == (10, 0)
    plan = workload.make_plan(quick_spec(), (1, 4, 8), 3, tmp_path)
    assert plan.block_bytes == block
    configs = {c.name: c for c in bench_configs.make_configs(plan)}
    eq, host = configs["prefix_cache_equal_mem"], configs["tieredkv_host"]
    args = servers.config_server_args(plan, eq)
    assert args.count("--num-gpu-blocks-override") == 1
    blocks = int(args[args.index("--num-gpu-blocks-override") + 1])
    assert (blocks - plan.device_blocks) * plan.block_bytes == host.kv_config["kv_connector_extra_config"]["host_bytes"]
    assert eq.role == "equal_mem" and eq.prefix_caching and eq.kv_config is None
    assert "disk" in eq.notes  # says the disk tier is not matched
    assert eq.sizes["budget_of"] == "tieredkv_host"
    # tieredkv_disk gets a control of its own, given exactly its (smaller) host RAM.
    eq_disk, disk = configs["prefix_cache_equal_mem_disk"], configs["tieredkv_disk"]
    args = servers.config_server_args(plan, eq_disk)
    blocks = int(args[args.index("--num-gpu-blocks-override") + 1])
    assert (blocks - plan.device_blocks) * plan.block_bytes == disk.kv_config["kv_connector_extra_config"]["host_bytes"]
    assert 0 < disk.kv_config["kv_connector_extra_config"]["host_bytes"] < plan.host_all
    assert eq_disk.role == "equal_mem" and eq_disk.sizes["budget_of"] == "tieredkv_disk"
    assert judging.infer_role("prefix_cache_equal_mem_disk") == "equal_mem"
    same = servers.config_server_args(plan, configs["prefix_cache"])
    assert same[same.index("--num-gpu-blocks-override") + 1] == str(plan.device_blocks)


def test_merge_args_replaces_named_flags():
    base = ["--dtype", "float32", "--num-gpu-blocks-override", "10", "--disable-uvicorn-access-log"]
    assert servers.merge_args(base, ["--num-gpu-blocks-override", "20"]) == [
        "--dtype", "float32", "--disable-uvicorn-access-log", "--num-gpu-blocks-override", "20"]
    assert servers.merge_args(base, ["--enable-prefix-caching"]) == base + ["--enable-prefix-caching"]


def test_default_configs_drop_example_connector_and_take_registered_peers(tmp_path):
    assert bench_configs.DEFAULT_CONFIGS == ["no_cache", "prefix_cache", "prefix_cache_equal_mem",
                                  "prefix_cache_equal_mem_disk", "tieredkv_host", "tieredkv_disk"]
    assert "example_connector" not in bench_configs.DEFAULT_CONFIGS and "example_connector" in bench_configs.CONFIG_BUILDERS
    plan = workload.make_plan(quick_spec(), (1, 4), 1, tmp_path)
    assert [c.name for c in bench_configs.make_configs(plan)] == bench_configs.DEFAULT_CONFIGS
    example = bench_configs.make_configs(plan, ["example_connector"])[0]
    assert example.kv_config["kv_connector"] == "ExampleConnector" and example.role == "baseline"
    defaults = list(bench_configs.DEFAULT_CONFIGS)
    try:
        bench_configs.register_config("peer", lambda p: bench_configs.BenchConfig(
            "peer", "a peer connector", {"kv_connector": "Peer", "kv_role": "kv_both"},
            ["--enable-prefix-caching"], env={"PEER": "1"}, python="/opt/peer/bin/python"))
        assert bench_configs.DEFAULT_CONFIGS == defaults  # not a default unless asked
        peer = bench_configs.make_configs(plan, ["prefix_cache", "peer"])[1]
        assert (peer.python, peer.env, peer.role) == ("/opt/peer/bin/python", {"PEER": "1"}, "baseline")
        assert "--enable-prefix-caching" in servers.config_server_args(plan, peer)
        server = servers.make_server(peer, tmp_path, tmp_path / "log", [])
        assert type(server) is Server and str(server.python) == "/opt/peer/bin/python"
    finally:
        bench_configs.CONFIG_BUILDERS.pop("peer", None)
        bench_configs.DEFAULT_CONFIGS[:] = defaults


# ---------------------------------------------------------------------------- LMCache peer

PEER_PYTHON = Path("/opt/lmcache-venv/bin/python")


@pytest.fixture
def peer_venv(monkeypatch):
    """``benchmarks.peers.lmcache.env_python()`` answering a built venv (nothing is started)."""
    from benchmarks.peers import lmcache

    monkeypatch.setattr(lmcache, "env_python", lambda: PEER_PYTHON)
    return lmcache


def test_lmcache_config_peer_python_same_budget_chunk_256_clean_cwd(tmp_path, peer_venv):
    plan = workload.make_plan(quick_spec(), (1, 4), 1, tmp_path)
    host, peer = bench_configs.make_configs(plan, ["tieredkv_host", "lmcache"])
    assert peer.name == "lmcache" and peer.role == "peer" and peer.python == str(PEER_PYTHON)
    # The same memory budget as tieredkv_host's host tier, LMCache's default 256-token chunk.
    assert peer.sidecar.budget_bytes == peer.sizes["budget_bytes"] == host.sizes["host_bytes"] == plan.host_all
    assert peer.sidecar.chunk_size == peer.sizes["chunk_tokens"] == 256 == peer_venv.CHUNK_SIZE
    assert "chunk 256 tokens" in peer.label and "--chunk-size 256" in peer.notes
    assert peer.sidecar.python == PEER_PYTHON and peer.sizes["budget_of"] == "tieredkv_host"
    # vLLM's side: LMCache's MP connector on the sidecar's port, its env and flags, prefix cache
    # on and the same device blocks as tieredkv_host.
    assert peer.kv_config["kv_connector"] == "LMCacheMPConnector"
    assert peer.kv_config["kv_connector_extra_config"]["lmcache.mp.port"] == peer.sidecar.port
    assert peer.env["LMCACHE_MP_TRANSFER_MODE"] == "engine_driven"
    args = servers.config_server_args(plan, peer)
    assert "--disable-hybrid-kv-cache-manager" in args and "--no-enable-prefix-caching" not in args
    assert peer.prefix_caching and host.prefix_caching
    blocks = args[args.index("--num-gpu-blocks-override") + 1]
    host_args = servers.config_server_args(plan, host)
    assert blocks == host_args[host_args.index("--num-gpu-blocks-override") + 1] == str(plan.device_blocks)
    # A clean working directory: not the repository root (its tieredkv.egg-info would load
    # tieredkv's vLLM plugin into the peer's vLLM).
    repo = Path(serve_bench.HERE).parent
    assert peer.cwd and Path(peer.cwd).resolve() != repo.resolve() and Path(peer.cwd).is_relative_to(tmp_path)
    server = servers.make_server(peer, tmp_path / "model", tmp_path / "logs" / "lmcache.log", args)
    assert isinstance(server, servers.SidecarServer) and server.sidecar is peer.sidecar
    assert server.python == str(PEER_PYTHON) and server.cwd == Path(peer.cwd)
    record = peer.record()
    assert "sidecar" not in record and record["prefix_caching"] and record["python"] == str(PEER_PYTHON)
    json.dumps(record)


def test_lmcache_is_a_default_only_where_its_venv_is_built():
    assert bench_configs.default_names(available=lambda: True) == [*bench_configs.DEFAULT_CONFIGS, "lmcache"]
    assert bench_configs.default_names(available=lambda: False) == bench_configs.DEFAULT_CONFIGS
    assert bench_configs.default_names(lmcache=False, available=lambda: True) == bench_configs.DEFAULT_CONFIGS
    assert "lmcache" not in bench_configs.DEFAULT_CONFIGS and "lmcache" in bench_configs.CONFIG_BUILDERS
    yes, no = (lambda: True), (lambda: False)
    assert bench_configs.select_configs(None, available=yes) == ([*bench_configs.DEFAULT_CONFIGS, "lmcache"], "")
    names, note = bench_configs.select_configs(None, available=no)
    assert names == bench_configs.DEFAULT_CONFIGS and "bash benchmarks/peers/lmcache_env.sh" in note  # one line, goes on
    assert bench_configs.select_configs(None, no_lmcache=True, available=yes) == (bench_configs.DEFAULT_CONFIGS, "")
    assert bench_configs.select_configs("prefix_cache,lmcache", available=yes) == (["prefix_cache", "lmcache"], "")
    assert bench_configs.select_configs("prefix_cache,lmcache", available=no)[0] == ["prefix_cache"]
    assert bench_configs.select_configs("prefix_cache,lmcache", no_lmcache=True, available=yes) == (["prefix_cache"], "")
    assert bench_configs.select_configs("prefix_cache", available=lambda: pytest.fail("probed")) == (["prefix_cache"], "")


def test_sidecar_starts_before_and_stops_after_its_server(tmp_path, monkeypatch):
    events = []

    class Sidecar:
        def start(self):
            events.append("sidecar start")

        def stop(self):
            events.append("sidecar stop")

    monkeypatch.setattr(Server, "start", lambda self, timeout_s=0: events.append("vllm start") or self)
    monkeypatch.setattr(Server, "stop", lambda self, timeout_s=0: events.append("vllm stop"))
    server = servers.SidecarServer(tmp_path, None, tmp_path / "log", sidecar=Sidecar())
    server.start()
    server.stop()
    assert events == ["sidecar start", "vllm start", "vllm stop", "sidecar stop"]
    events.clear()

    def fail(self, timeout_s=0):
        events.append("vllm start")
        raise RuntimeError("vLLM exited")

    monkeypatch.setattr(Server, "start", fail)
    with pytest.raises(RuntimeError):
        server.start()
    assert events == ["sidecar start", "vllm start", "vllm stop", "sidecar stop"]  # stopped on errors too


def test_server_runs_the_given_python_in_the_given_cwd(tmp_path, monkeypatch):
    from tieredkv.tools import vllm_server

    seen = {}

    class Exited:
        def __init__(self, args, **kw):
            seen.update(args=args, cwd=kw.get("cwd"))

        def poll(self):
            return 1

    monkeypatch.setattr(vllm_server.subprocess, "Popen", Exited)
    with pytest.raises(RuntimeError, match="exited"):
        vllm_server.Server(tmp_path, None, tmp_path / "a.log").start()
    assert seen["args"][0] == vllm_server.sys.executable and seen["cwd"] is None  # as before
    with pytest.raises(RuntimeError, match="exited"):
        vllm_server.Server(tmp_path, None, tmp_path / "b.log", python=PEER_PYTHON, cwd=tmp_path / "clean").start()
    assert seen["args"][0] == str(PEER_PYTHON) and seen["cwd"] == tmp_path / "clean"
    assert (tmp_path / "clean").is_dir()


def test_schedule_runs_repeat_r_of_everything_before_repeat_r_plus_1():
    assert workload.sessions(2, ["a", "b"]) == [(0, "a"), (0, "b"), (1, "b"), (1, "a")]
    order = workload.schedule((1, 4), 2, ["a", "b"])
    assert order == [(0, 1, "a"), (0, 4, "a"), (0, 1, "b"), (0, 4, "b"),
                     (1, 1, "b"), (1, 4, "b"), (1, 1, "a"), (1, 4, "a")]
    assert sorted(order) == sorted((r, lv, c) for r in (0, 1) for lv in (1, 4) for c in "ab")


# ---------------------------------------------------------------------------- spread, verdicts


def test_spread_and_compare():
    s = judging.spread([3.0, 1.0, math.nan, 2.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.0, 1.0, 3.0, 3)
    assert judging.spread([])["n"] == 0 and math.isnan(judging.spread([])["median"])
    assert judging.compare([1, 2, 3], [4, 5, 6]) == "better"  # worst (3) beats the other's best (4)
    assert judging.compare([4, 5, 6], [1, 2, 3]) == "worse"
    assert judging.compare([1, 2, 5], [4, 5, 6]) == "within spread"  # overlap
    assert judging.compare([1, 2, 4], [4, 5, 6]) == "within spread"  # touching is not a win
    assert judging.compare([10, 11], [5, 6], higher_is_better=True) == "better"
    assert judging.compare([1], []) == "n/a"
    assert judging.compare([1], [5, 6]) == judging.compare([1, 2], [5]) == judging.NO_SPREAD  # one run: no spread
    assert judging.ratio_verdict([4.0], [1.0], 2.0)[0] == judging.NO_SPREAD
    assert judging.ratio_verdict([4.0, 4.4], [1.0, 1.1], 2.0)[0] == "PASS"  # worst 4 / 1.1 = 3.6
    assert judging.ratio_verdict([2.0, 2.2], [1.0, 1.2], 2.0)[0] == "within spread"  # 1.67-2.2
    verdict, mid, worst, best = judging.ratio_verdict([1.5, 1.6], [1.0, 1.1], 2.0)
    assert verdict == "FAIL" and worst == pytest.approx(1.5 / 1.1) and best == pytest.approx(1.6)
    assert mid == pytest.approx(1.55 / 1.05)
    assert judging.ratio_verdict([], [1.0], 2.0)[0] == "n/a"


def reps(*p50s, p99=None, tput=100.0, hits=0.0):
    return [{"ttft_p50_s": v, "ttft_p99_s": p99 or 2 * v, "prompt_tokens_per_s": tput,
             "completed": 4, "requests": 4, "prompt_tokens": 1000,
             "hits": {"tieredkv_host_tokens": hits, "tieredkv_disk_tokens": 0.0}} for v in p50s]


ROLES = {"no_cache": "baseline", "prefix_cache": "baseline", "prefix_cache_equal_mem": "equal_mem",
         "tieredkv_host": "tieredkv"}


def test_judge_counts_a_win_only_outside_the_spread():
    runs = {
        "no_cache": {4: reps(2.0, 2.1, 2.2)},
        "prefix_cache": {4: reps(0.9, 1.0, 1.1)},
        "prefix_cache_equal_mem": {4: reps(0.2, 0.25, 0.3)},  # better than tieredkv: no target
        "tieredkv_host": {4: reps(0.5, 0.6, 0.7)},
    }
    rows = judging.judge(runs, [4], roles=ROLES)
    assert [r["verdict"] for r in rows] == ["PASS", "PASS"]  # 2.0 / 0.7 = 2.9x; 0.7 < 0.9
    assert judging.overall_verdict(rows) == "PASS"
    runs["prefix_cache"][4] = reps(0.6, 0.8, 1.0)  # overlaps 0.5-0.7
    rows = judging.judge(runs, [4], roles=ROLES)
    assert rows[1]["verdict"] == "within spread" and "within spread" in rows[1]["measured"]
    assert judging.overall_verdict(rows) == "within spread"
    runs["prefix_cache"][4] = reps(0.3, 0.35, 0.4)
    assert judging.judge(runs, [4], roles=ROLES)[1]["verdict"] == "FAIL"
    assert judging.overall_verdict([{"verdict": "FAIL"}, {"verdict": "within spread"}]) == "FAIL"
    assert judging.overall_verdict([]) == "n/a"
    assert judging.overall_verdict([{"verdict": "PASS"}, {"verdict": judging.NO_SPREAD}]) == judging.NO_SPREAD


def test_comparisons_and_noise_floor():
    runs = {
        "no_cache": {1: reps(0.6, 0.7, 0.8), 4: reps(2.0, 2.1, 2.2)},
        "prefix_cache": {1: reps(0.20, 0.22, 0.25), 4: reps(0.9, 1.0, 1.1, tput=80.0)},
        "prefix_cache_equal_mem": {1: reps(0.21, 0.23, 0.24), 4: reps(0.5, 0.6, 0.75)},
        "tieredkv_host": {1: reps(0.19, 0.22, 0.26), 4: reps(0.5, 0.6, 0.7, tput=120.0)},
    }
    rows = {(r["users"], r["kind"]): r for r in judging.comparisons(runs, (1, 4), ROLES)}
    assert set(rows) == {(1, "same device"), (1, "equal memory"), (4, "same device"), (4, "equal memory")}
    same, equal = rows[4, "same device"], rows[4, "equal memory"]
    assert same["reference"] == "prefix_cache" and equal["reference"] == "prefix_cache_equal_mem"
    assert same["ttft_p50_s"] == "better" and same["ttft_p50_s_ratio"] == pytest.approx(0.6)
    assert same["prompt_tokens_per_s"] == "better"  # higher is better for throughput
    assert rows[1, "same device"]["prompt_tokens_per_s"] == "within spread"  # equal figures: no win
    assert equal["ttft_p50_s"] == "within spread"
    assert rows[1, "same device"]["ttft_p50_s"] == "within spread"
    noise = judging.noise_floor(runs, 1, ["prefix_cache", "prefix_cache_equal_mem", "tieredkv_host"])
    assert noise["ttft_p50_s"]["min"] == 0.19 and noise["ttft_p50_s"]["max"] == 0.26
    assert noise["ttft_p50_s"]["n"] == 9 and noise["ttft_p50_s"]["rel"] == pytest.approx(0.07 / 0.22)
    assert noise["tieredkv_hit_tokens"] == 0
    # A peer is compared with the tieredkv configuration whose budget it got, never judged.
    runs["lmcache"] = {1: reps(0.2, 0.21, 0.22), 4: reps(0.8, 0.9, 1.0)}
    roles = {**ROLES, "lmcache": "peer"}
    peer_rows = [r for r in judging.comparisons(runs, (1, 4), roles, peers={"lmcache": "tieredkv_host"})
                 if r["kind"] == "peer"]
    assert [(r["config"], r["users"], r["reference"]) for r in peer_rows] == [
        ("tieredkv_host", 1, "lmcache"), ("tieredkv_host", 4, "lmcache")]
    assert peer_rows[1]["ttft_p50_s"] == "better" and peer_rows[0]["ttft_p50_s"] == "within spread"
    assert all("lmcache" not in r["measured"] for r in judging.judge(runs, [4], roles=roles))
    assert any(line.startswith("peer:") for line in report.comparison_lines(peer_rows))
    del runs["lmcache"]
    # Each tieredkv configuration meets only the equal-memory control sized from its own RAM.
    runs["tieredkv_disk"] = {4: reps(0.55, 0.6, 0.65)}
    runs["prefix_cache_equal_mem_disk"] = {4: reps(0.9, 1.0, 1.1)}
    split = {**ROLES, "tieredkv_disk": "tieredkv", "prefix_cache_equal_mem_disk": "equal_mem"}
    budget_of = {"prefix_cache_equal_mem": "tieredkv_host", "prefix_cache_equal_mem_disk": "tieredkv_disk"}
    pairs = {(r["config"], r["reference"]) for r in judging.comparisons(runs, (4,), split, budget_of=budget_of)
             if r["kind"] == "equal memory"}
    assert pairs == {("tieredkv_host", "prefix_cache_equal_mem"), ("tieredkv_disk", "prefix_cache_equal_mem_disk")}
    # A results file from before the split names no budget: its one control meets every config.
    legacy = {(r["config"], r["reference"]) for r in judging.comparisons(runs, (4,), split)
              if r["kind"] == "equal memory"}
    assert ("tieredkv_disk", "prefix_cache_equal_mem") in legacy
    del runs["tieredkv_disk"], runs["prefix_cache_equal_mem_disk"]
    lines = report.noise_lines(noise)
    assert lines and lines[0].startswith("NOISE FLOOR (1 user(s)")
    assert "TTFT p50 190–260 ms" in lines[0] and "throughput 100–100 prompt tok/s" in lines[0]


# ---------------------------------------------------------------------------- report


def payload_for(tmp_path: Path) -> dict:
    plan = workload.make_plan(quick_spec(), (1, 4), 3, tmp_path)
    configs = bench_configs.make_configs(plan)
    runs = {c.name: {1: reps(0.2, 0.22, 0.25), 4: reps(0.9, 1.0, 1.1)} for c in configs}
    runs["no_cache"] = {1: reps(0.6, 0.7, 0.8), 4: reps(2.0, 2.1, 2.2)}
    runs["tieredkv_host"][4] = reps(0.4, 0.45, 0.5, hits=300.0)
    return {
        "benchmark": workload.NAME, "profile": "quick", "started": "now", "git": "abc",
        "machine": {"name": "test machine"}, "workload": asdict(plan.spec), "levels": [1, 4],
        "repeats": 3, "device_blocks": plan.device_blocks, "exceeding_levels": plan.exceeding,
        "working_set_blocks": plan.working_set, "wall_s": 1.0,
        "memory": {"block_bytes": plan.block_bytes, "chunk_bytes": plan.chunk_bytes,
                   "host_all": plan.host_all, "host_half": plan.host_half, "disk_bytes": plan.disk_bytes,
                   "equal_mem_extra_blocks": plan.host_all // plan.block_bytes},
        "prompt_lengths": {"planned": workload.length_stats([1001, 1500, 2300]), "sent": workload.length_stats([1001])},
        "configs": [{**asdict(c), "prefix_caching": c.prefix_caching} for c in configs],
        "runs": runs, "requests": {}, "errors": [],
    }


def test_report_round_trip_and_from_json(tmp_path, capsys):
    payload = payload_for(tmp_path)
    json_path, md_path, _ = report.write_outputs(payload, tmp_path / "a")
    md = md_path.read_text()
    assert "NOISE FLOOR (1 user(s)" in md and "equal memory" in md and "same device" in md
    assert "0.0 % a multiple of the 256-token chunk" in md
    assert "| 220 (200–250) |" in md  # TTFT cells in ms, median (min–max)
    verdicts = {(r["config"], r["target"].split()[4]): r["verdict"] for r in payload["targets"]}
    assert verdicts[("tieredkv_host", "better")] == verdicts[("tieredkv_host", "every")] == "PASS"
    assert verdicts[("tieredkv_disk", "better")] == verdicts[("tieredkv_disk", "every")] == "within spread"
    assert payload["verdict"] == "within spread"
    report.print_report(payload)
    out = capsys.readouterr().out
    assert "same device: (GPU users read this one)" in out and "equal memory:" in out
    assert serve_bench.main(["--from-json", str(json_path), "--out", str(tmp_path / "b")]) == 0
    again = json.loads((tmp_path / "b" / "serve_bench.json").read_text())
    assert again["verdict"] == payload["verdict"] and again["repeats"] == 3
    assert (tmp_path / "b" / "serve_bench.md").read_text() == md


def test_exit_status_says_a_missed_target():
    # run_all records each benchmark's exit status: a kept run with a MISS must not read "ok".
    assert serve_bench.exit_status([], "PASS") == 0
    assert serve_bench.exit_status([], "within spread") == 1 and serve_bench.exit_status([], "FAIL") == 1
    assert serve_bench.exit_status(["tieredkv_host: server died"], "PASS") == 2


def test_from_json_reads_a_run_from_before_repeats(tmp_path):
    old = {
        "benchmark": workload.NAME, "profile": "quick", "started": "then", "git": "old",
        "machine": {"name": "m"}, "levels": [1, 4], "exceeding_levels": [4], "device_blocks": 173,
        "workload": {"system_tokens": 1024, "user_tokens": 384, "reply_tokens": 64, "turns": 5,
                     "think_mean_s": 0.5, "seed": 0},
        "configs": [{"name": n, "kv_config": None, "prefix_caching": n != "no_cache", "notes": "", "sizes": {}}
                    for n in ("no_cache", "prefix_cache", "tieredkv_host")],
        "results": {"no_cache": {"1": reps(0.7)[0], "4": reps(2.2)[0]},
                    "prefix_cache": {"1": reps(0.2)[0], "4": reps(0.5)[0]},
                    "tieredkv_host": {"1": reps(0.2)[0], "4": reps(0.3)[0]}},
        "requests": {}, "targets": [], "verdict": "PASS",
    }
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    payload = report.load_payload(path)
    assert payload["runs"]["tieredkv_host"][4][0]["ttft_p50_s"] == 0.3 and payload["repeats"] == 1
    _, md_path, _ = report.write_outputs(payload, tmp_path / "out")
    assert "TieredKVConnector host only" in md_path.read_text()
    assert {t["verdict"] for t in payload["targets"]} == {judging.NO_SPREAD}  # one repeat: nothing called
    assert payload["verdict"] == judging.NO_SPREAD


# ---------------------------------------------------------------------------- disk space


def test_a_run_whose_disk_tier_cannot_fit_stops_before_any_server_naming_the_need(tmp_path, monkeypatch):
    plan = workload.make_plan(quick_spec(), (1, 4), 1, tmp_path)
    configs = bench_configs.make_configs(plan)
    need = plan.disk_bytes
    usage = shutil.disk_usage(tmp_path)
    free = need + serve_bench.FREE_SPACE_MARGIN - 1
    monkeypatch.setattr(serve_bench.shutil, "disk_usage", lambda path: usage._replace(free=free))
    problem = serve_bench.free_space_problem(tmp_path, configs)
    assert problem is not None and "--workdir" in problem and f"{need / 2**30:.1f} GiB" in problem
    # Without a disk configuration nothing is written to the tier's filesystem.
    assert serve_bench.free_space_problem(tmp_path, [c for c in configs if c.name != "tieredkv_disk"]) is None
    monkeypatch.setattr(serve_bench.shutil, "disk_usage", lambda path: usage._replace(free=free + 1))
    assert serve_bench.free_space_problem(tmp_path, configs) is None

    # main refuses before it builds the model or starts a server.
    monkeypatch.setattr(serve_bench.shutil, "disk_usage", lambda path: usage._replace(free=0))
    monkeypatch.setattr(serve_bench, "sweep", lambda *a, **k: pytest.fail("a server was started"))
    workdir = tmp_path / "work"
    assert serve_bench.main(["--workdir", str(workdir), "--levels", "1", "--repeats", "1",
                             "--out", str(tmp_path / "out"), "--no-progress", "--no-lmcache"]) == 2
    assert not (workdir / "model").exists()


def test_a_sigterm_mid_sweep_deletes_the_tier_files(tmp_path, monkeypatch):
    """A killed run (run_all's timeout, an operator's kill) leaves no disk tier behind: with
    the 8b-kv shape one is tens of GiB."""
    tier_files = []

    def sweep_then_sigterm(plan, configs, *args, **kwargs):
        for config in configs:
            extra = serve_bench.connector_settings(config)
            if extra.get("disk_path"):
                tier = Path(extra["disk_path"])
                tier.mkdir(parents=True, exist_ok=True)
                (tier / "rank0.slab").write_bytes(b"\0" * 4096)
                tier_files.append(tier / "rank0.slab")
        os.kill(os.getpid(), signal.SIGTERM)
        pytest.fail("SIGTERM did not stop the sweep")

    monkeypatch.setattr(serve_bench, "sweep", sweep_then_sigterm)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as stopped:
            serve_bench.main(["--workdir", str(tmp_path / "work"), "--levels", "1", "--repeats", "1",
                              "--configs", "prefix_cache,tieredkv_disk", "--out", str(tmp_path / "out"),
                              "--no-progress", "--no-lmcache"])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert tier_files and not any(f.exists() for f in tier_files)
    assert (tmp_path / "work" / "model").exists()  # the workdir named by the caller stays
