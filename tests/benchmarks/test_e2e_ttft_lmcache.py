"""Pure pieces of benchmarks.e2e_ttft's LMCache peer row (row 7): LMCache's chunk-aligned hit,
the row's spec (the peer venv's python, row 4's memory budget, LMCache's settings), the engine
launch with another python, the hit checks, the info comparison with row 4 and the report.

No engine, no lmcache server and no peer venv is needed; nothing here judges a timing.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import stat
from pathlib import Path

import pytest

from benchmarks.ttft import judging, report, runner, workload
from benchmarks.ttft import specs as ttft_specs


@pytest.fixture(scope="module")
def peer():
    return importlib.import_module("benchmarks.peers.lmcache")


LENGTHS = {"A": 4000, "B": 3676}  # the quick profile's prompts
FLOOR = {"A": 3968, "B": 3648}
LMCACHE = {"A": 3840, "B": 3584}


def test_lmcache_hit_is_whole_256_token_chunks(peer):
    assert peer.CHUNK_SIZE == 256
    # The quick prompts: 15 and 14 whole chunks, short of vLLM's hit by 128 and 64 tokens.
    for name, n in LENGTHS.items():
        assert workload.lmcache_hit(n, 256) == LMCACHE[name] < workload.prefix_hit(n) == FLOOR[name]
    assert workload.lmcache_hit(2000, 256) == 1792 == (2000 - 1) // 256 * 256  # lmcache_smoke's prompt
    assert workload.lmcache_hit(8000, 256) == 7936
    assert workload.lmcache_hit(255, 256) == 0  # no whole chunk: nothing stored
    # Chunks covering the whole prompt: the connector leaves the last token to compute.
    assert workload.lmcache_hit(512, 256) == 511
    # Whole 256-token chunks: shorter than tieredkv's hits, which end where vLLM's does.
    assert workload.lmcache_hit(4000, 256) < workload.remote_hit(4000) == workload.prefix_hit(4000)


def test_llm_kwargs_from_lmcache_flags(peer):
    _, _, flags = peer.vllm_settings(1234)
    kwargs, not_applied = workload.lmcache_llm_kwargs(flags)
    assert kwargs == {"disable_hybrid_kv_cache_manager": True}
    assert not_applied == ["--no-enable-prefix-caching"]  # prefix cache on, reset per hit
    with pytest.raises(ValueError, match="--kv-offloading-size"):
        workload.lmcache_llm_kwargs([*flags, "--kv-offloading-size"])


def args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"profile": "quick", "trace": False, "switch_interval": None,
                                 "recompute_repeats": None, **kw})


def lmcache_row(peer, tmp_path: Path, python: str = "/peer/venv/bin/python"):
    server = peer.LMCacheServer(budget_bytes=workload.host_tier_bytes(LENGTHS),
                                log_path=tmp_path / "lmcache_server.log", python=Path(python))
    info = ttft_specs.lmcache_peer(server, python, peer.LMCACHE_VERSION)
    specs = ttft_specs.build_specs(args(), tmp_path / "model", tmp_path, LENGTHS, lmcache=info)
    return server, info, specs


def test_spec_uses_the_peer_python_and_row_4s_budget(peer, tmp_path):
    without = ttft_specs.build_specs(args(), tmp_path / "model", tmp_path, LENGTHS)
    assert workload.LMCACHE_CONFIG not in without
    server, info, specs = lmcache_row(peer, tmp_path)
    assert set(specs) == set(without) | {workload.LMCACHE_CONFIG, workload.LMCACHE_FLOOR_CONFIG}
    spec, host = specs[workload.LMCACHE_CONFIG], specs["tieredkv_host"]
    # LMCache's own floor: row 2's phases, no connector, in the peer's environment.
    floor = specs[workload.LMCACHE_FLOOR_CONFIG]
    assert "kv_transfer_config" not in floor
    assert (floor["setup"], floor["round"]) == (specs["vllm_prefix"]["setup"], specs["vllm_prefix"]["round"])
    assert {k: floor[k] for k in ("python", "cwd", "env", "llm_kwargs")} == {
        k: spec[k] for k in ("python", "cwd", "env", "llm_kwargs")}
    assert floor["model"] == spec["model"] and floor["prompts"] == spec["prompts"]
    host_bytes = host["kv_transfer_config"]["kv_connector_extra_config"]["host_bytes"]
    # The same memory budget as row 4: the server's L1 size, in bytes, and on its command line.
    assert host_bytes == workload.host_tier_bytes(LENGTHS) == server.budget_bytes
    assert spec["lmcache_budget_bytes"] == info["budget_bytes"] == host_bytes
    command = server.command()
    assert command[0] == "/peer/venv/bin/python"
    assert command[command.index("--l1-size-gb") + 1] == repr(host_bytes / (1 << 30))
    assert command[command.index("--chunk-size") + 1] == "256" and info["chunk_tokens"] == 256
    assert info["server_command"] == " ".join(command)
    # The peer's python, LMCache's connector, env and flags; no tieredkv anywhere.
    assert spec["python"] == info["python"] == "/peer/venv/bin/python"
    kv_config, env, _ = peer.vllm_settings(server.port)
    assert spec["kv_transfer_config"] == kv_config == info["kv_transfer_config"]
    assert spec["kv_transfer_config"]["kv_connector"] == "LMCacheMPConnector"
    assert spec["env"] == {**env, "PYTHONPATH": spec["cwd"]}
    assert spec["llm_kwargs"] == {"disable_hybrid_kv_cache_manager": True}
    assert "TieredKV" not in json.dumps(spec)
    # Its sys.path holds only the benchmarks package: not tieredkv, not its egg-info (a vLLM
    # plugin entry point that the peer's vLLM would otherwise load).
    sys_path = Path(spec["cwd"])
    assert [p.name for p in sys_path.iterdir()] == ["benchmarks"]
    assert (sys_path / "benchmarks").resolve() == workload.HERE
    # Measured as row 4: the same prompts, engine size, set-up and rounds, prefix cache on.
    for key in ("prompts", "model", "max_model_len", "kv_cache_memory_bytes", "setup", "round",
                "prefix_caching"):
        assert spec[key] == host[key], key
    assert [p["kind"] for p in ttft_specs.round_phases(spec, 1)] == ["generate", "reset_prefix", "generate",
                                                             "drain", "generate"]
    assert [p["label"] for p in ttft_specs.round_phases(spec, 1) if "label" in p] == ["touch1", "hit1", "pfloor1"]
    assert workload.LMCACHE_CONFIG not in ttft_specs.OWN_ROUND_NUMBERS  # numbered on, as row 4
    # Building twice in one work dir (the link exists) is fine.
    ttft_specs.build_specs(args(), tmp_path / "model", tmp_path, LENGTHS, lmcache=info)


def test_engine_starts_the_child_with_the_specs_python(peer, tmp_path):
    """Engine runs ``<python> -m benchmarks.e2e_ttft --child SPEC`` from the spec's cwd, with
    its env on top of the parent's (a stand-in python records what it got)."""
    fake = tmp_path / "python"
    record = tmp_path / "record.json"
    fake.write_text("#!/bin/sh\nprintf '{\"argv\": \"%s\", \"cwd\": \"%s\", \"pythonpath\": \"%s\", "
                    f"\"banner\": \"%s\"}}' \"$*\" \"$PWD\" \"$PYTHONPATH\" \"$LMCACHE_DISABLE_BANNER\" > {record}\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    _, _, specs = lmcache_row(peer, tmp_path, str(fake))
    spec = {**specs[workload.LMCACHE_CONFIG], "log": str(tmp_path / "child.log")}
    engine = runner.Engine(spec, {"PATH": os.environ.get("PATH", ""), "PARENT": "1"}, progress=None)
    try:
        assert engine.proc.wait(timeout=30) == 0
        got = json.loads(record.read_text())
    finally:
        engine.kill()
        os.unlink(engine._spec_path)
    assert got["argv"].startswith("-m benchmarks.e2e_ttft --child ")
    assert Path(got["cwd"]).resolve() == Path(spec["cwd"]).resolve()
    assert got["pythonpath"] == spec["cwd"] and got["banner"] == "1"


def record(label, prompt, seconds, cached, forward=0.1, **tieredkv):
    return {"label": label, "prompt": prompt, "seconds": seconds, "num_cached_tokens": cached,
            "forward_s": forward, "tieredkv": tieredkv}


def rounds(hits: dict[str, int], seconds: float = 0.05, n: int = 4, tieredkv: bool = False) -> dict:
    """``n`` measured rounds (hit, same-engine floor); ``tieredkv``: row 4's, its host hits counted."""
    records = []
    for i in range(n):
        prompt = "AB"[i % 2]
        counters = {"hit_tokens_host": hits[prompt]} if tieredkv else {}
        records += [record(f"hit{i}", prompt, seconds, hits[prompt], **counters),
                    record(f"pfloor{i}", prompt, 0.04, FLOOR[prompt])]
    return {"records": records}


def test_summarize_checks_the_chunk_aligned_hit_not_equal_hits():
    row = judging.summarize(workload.LMCACHE_CONFIG, rounds(LMCACHE), FLOOR, expected_lmcache=LMCACHE)
    assert row["hit_ok"] and not row["problems"]
    assert row["hit_tokens_by_prompt"] == {"A": [3840, 3840], "B": [3584, 3584]}
    assert row["paired_floor"]["hit_ok"]  # the same-engine floor hits vLLM's full prefix hit
    assert "tieredkv_counters" not in row
    # The floor's (longer) hit is not what LMCache stores: it fails, as does a miss.
    for hits in (FLOOR, {"A": 0, "B": 0}):
        row = judging.summarize(workload.LMCACHE_CONFIG, rounds(hits), FLOOR, expected_lmcache=LMCACHE)
        assert not row["hit_ok"] and "LMCache's whole-chunk hit" in row["problems"][0]


def test_server_check_counts_what_the_hits_took():
    row = judging.summarize(workload.LMCACHE_CONFIG, rounds(LMCACHE), FLOOR, expected_lmcache=LMCACHE)
    taken = 2 * 3840 + 2 * 3584
    assert judging.lmcache_server_check(row, {"stored_tokens": 7424, "retrieved_tokens": taken}) == []
    short = judging.lmcache_server_check(row, {"stored_tokens": 7424, "retrieved_tokens": taken - 256})
    assert short and "not the 14848" in short[0]
    assert judging.lmcache_server_check(row, {"stored_tokens": 7424, "retrieved_tokens": taken + 256})
    assert judging.lmcache_server_check(row, None)


def test_comparison_is_info_and_needs_both_hits():
    host = judging.summarize("tieredkv_host", rounds(FLOOR, 0.05, tieredkv=True), FLOOR)
    peer_row = judging.summarize(workload.LMCACHE_CONFIG, rounds(LMCACHE, 0.10), FLOOR, expected_lmcache=LMCACHE)
    assert judging.lmcache_comparison({"tieredkv_host": host}) is None
    out = judging.lmcache_comparison({"tieredkv_host": host, workload.LMCACHE_CONFIG: peer_row})
    assert out["tieredkv_host_over_lmcache"] == pytest.approx(0.5)
    assert out["by_prompt"]["A"] == {"tieredkv_host_hit_tokens": 3968, "lmcache_hit_tokens": 3840,
                                     "lmcache_fewer_tokens": 128,
                                     "tieredkv_host_over_lmcache": pytest.approx(0.5)}
    assert out["by_prompt"]["B"]["lmcache_fewer_tokens"] == 64
    assert out["text"].startswith("info (ratio of raw medians")
    assert "= 0.50" in out["text"] and "LMCache 128 fewer" in out["text"]
    missed = judging.summarize(workload.LMCACHE_CONFIG, rounds(FLOOR, 0.10), FLOOR, expected_lmcache=LMCACHE)
    out = judging.lmcache_comparison({"tieredkv_host": host, workload.LMCACHE_CONFIG: missed})
    assert out["tieredkv_host_over_lmcache"] is None and not out["hits_ok"]
    assert "no ratio, LMCache's hits did not happen" in out["text"]


def test_report_states_the_settings_and_skips(peer, tmp_path):
    _, info, _ = lmcache_row(peer, tmp_path)
    info["expected_hit_tokens"] = LMCACHE
    info["server_log_counts"] = {"stored_tokens": 7424, "retrieved_tokens": 14848}
    rows = {"vllm_prefix": judging.summarize("vllm_prefix", rounds(FLOOR), FLOOR),
            "tieredkv_host": judging.summarize("tieredkv_host", rounds(FLOOR, tieredkv=True), FLOOR),
            workload.LMCACHE_CONFIG: judging.summarize(workload.LMCACHE_CONFIG, rounds(LMCACHE), FLOOR,
                                              expected_lmcache=LMCACHE)}
    payload = {"rows": rows, "lmcache": info,
               "params": {"prompt_lengths": LENGTHS, "expected_hit_tokens": FLOOR}}
    text = report.lmcache_markdown(payload)
    for needed in ("lmcache 0.5.6", "chunk 256 tokens", f"{workload.host_tier_bytes(LENGTHS) / 2**20:.0f} MiB",
                   "A 3,840 tokens (the floor's 3,968; computed 160 vs 32)",
                   "LMCacheMPConnector", "`disable_hybrid_kv_cache_manager=True`", "--chunk-size 256",
                   "14848 tokens retrieved", "info (ratio of raw medians"):
        assert needed in text, needed
    brief = report.brief_table(rows, FLOOR, LMCACHE)
    assert "| lmcache | 50.0 | 4 |" in brief and "A 3840 ×2; B 3584 ×2 | A 3840; B 3584 | A 3968 ×2" in brief
    skipped = {"rows": {}, "lmcache": {"skipped": f"build it with `{workload.LMCACHE_BUILD}`"}}
    assert "bash benchmarks/peers/lmcache_env.sh" in report.lmcache_markdown(skipped)
