"""Pure pieces of benchmarks.e2e_ttft's hybrid-model rows (H1-H3): the hit they expect
(vLLM's own, #25), the bytes a hybrid hit copies, their specs, the hit check and the verdicts.

No engine is started; nothing here judges a timing.
"""

from __future__ import annotations

import argparse

import pytest

from benchmarks.ttft import judging, targets, workload
from benchmarks.ttft import specs as ttft_specs


def args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"profile": "quick", "trace": False, "switch_interval": None,
                                 "recompute_repeats": None, **kw})


def test_hybrid_geometry_alternates_with_a_window_below_the_chunk():
    assert len(workload.HYBRID_LAYER_TYPES) == workload.MODEL["num_layers"]
    assert workload.HYBRID_LAYER_TYPES[:2] == ["sliding_attention", "full_attention"]
    assert workload.HYBRID_WINDOW < workload.CHUNK_TOKENS


def test_hybrid_hit_is_vllms_prefix_cache_hit():
    # A: whole blocks (its repeat hits one block short of its end); B: a partial last block.
    assert workload.hybrid_hit(4000) == workload.prefix_hit(4000) == 3968
    assert workload.hybrid_hit(3676) == workload.prefix_hit(3676) == 3648
    assert workload.hybrid_hit(8000) == workload.prefix_hit(8000) == 7968
    assert workload.hybrid_hit(1024) == workload.prefix_hit(1024) == 992
    assert workload.hybrid_hit(511) == 480


def test_hybrid_host_slots_hold_the_entries_one_prompts_hit_reads():
    # A: 7 whole chunks and the 12-block entry its repeat ends in; B: 7 and its 2-block tail.
    assert workload.hybrid_host_slots({"A": 4000, "B": 3676}) == 8
    assert workload.hybrid_host_slots({"A": 1100, "B": 2100}) == 5  # 2048 + a 1-block tail
    assert workload.hybrid_host_slots({"A": 1056, "B": 1040}) == 2  # 1024 + 1 block; 1024 whole


def test_hybrid_kv_bytes_counts_the_sliding_layers_window_only():
    per_layer_token = 8192 // 8  # bf16, 4 KV heads of 64, K and V
    full_layers, sliding_layers = 4, 4
    # window 256, block 32: 8 of a chunk's 16 blocks for each sliding layer
    assert workload.hybrid_kv_bytes(3584) == (full_layers * 3584 + sliding_layers * 7 * 256) * per_layer_token
    # a hit ending inside a chunk: the partial entry's window too (at most its own blocks)
    assert workload.hybrid_kv_bytes(3968) == (
        full_layers * 3968 + sliding_layers * (7 * 8 + 8) * 32) * per_layer_token
    assert workload.hybrid_kv_bytes(3648) == (
        full_layers * 3648 + sliding_layers * (7 * 8 + 2) * 32) * per_layer_token
    # a window of a whole chunk or more: every block, as full attention
    assert workload.hybrid_kv_bytes(1024, window=600) == 1024 * 8192
    assert workload.hybrid_kv_bytes(1024, layer_types=["full_attention"] * 8) == 1024 * 8192


def test_hybrid_specs_use_the_hybrid_model_and_one_prompts_whole_chunks(tmp_path):
    lengths = {"A": 4000, "B": 3676}
    without = ttft_specs.build_specs(args(), tmp_path / "model", tmp_path, lengths)
    assert not set(workload.HYBRID_CONFIGS) & set(without)
    specs = ttft_specs.build_specs(args(), tmp_path / "model", tmp_path, lengths, None, tmp_path / "hyb")
    assert set(without) | set(workload.HYBRID_CONFIGS) == set(specs)
    for config in workload.HYBRID_CONFIGS:
        assert specs[config]["model"] == str(tmp_path / "hyb")
        assert specs[config]["config"] == config
        assert specs[config]["round"] == specs[config.removeprefix("hybrid_")]["round"]
    assert specs["vllm_prefix"]["model"] == str(tmp_path / "model")
    assert "kv_transfer_config" not in specs["hybrid_vllm_prefix"]
    extra = specs["hybrid_tieredkv_disk"]["kv_transfer_config"]["kv_connector_extra_config"]
    assert extra["host_bytes"] == 8 * workload.CHUNK_TOKENS * 8192
    assert extra["disk_path"] != specs["tieredkv_disk"]["kv_transfer_config"][
        "kv_connector_extra_config"]["disk_path"]


def record(label: str, prompt: str, cached: int, seconds: float = 1.0, **tk) -> dict:
    return {"label": label, "prompt": prompt, "seconds": seconds, "num_cached_tokens": cached,
            "tieredkv": tk, "forward_s": seconds / 2}


def test_a_hybrid_hit_is_checked_against_vllms_prefix_cache_hit():
    expected_hit = {"A": 3968, "B": 3648}
    expected_hybrid = {name: workload.hybrid_hit(n) for name, n in {"A": 4000, "B": 3676}.items()}
    assert expected_hybrid == expected_hit
    good = {"records": [record("hit0", "A", 3968, hit_tokens_disk=3968),
                        record("hosthit0", "A", 3968, hit_tokens_host=3968)]}
    row = judging.summarize("hybrid_tieredkv_disk", good, expected_hit, None, expected_hybrid)
    assert row["hit_ok"] and row["host_hits_same_engine"]["hit_ok"]
    # a hit that did not happen, was chunk-aligned, or not from the tier is a FAIL
    for bad in (record("hit0", "A", 0), record("hit0", "A", 3584, hit_tokens_disk=3584),
                record("hit0", "A", 3968, hit_tokens_host=3968)):
        row = judging.summarize("hybrid_tieredkv_disk", {"records": [bad]}, expected_hit, None,
                            expected_hybrid)
        assert not row["hit_ok"] and row["problems"]
    # the hybrid floor: vLLM's own prefix-cache hit
    floor = judging.summarize("hybrid_vllm_prefix", {"records": [record("hit0", "B", 3648)]},
                          expected_hit, None, expected_hybrid)
    assert floor["hit_ok"]


def _row(median: float, overhead: float, ok: bool = True, pairs=None) -> dict:
    row = {"median_s": median, "overhead_median_s": overhead, "forward_median_s": median - overhead,
           "hit_ok": ok, "problems": [] if ok else ["num_cached_tokens wrong"]}
    if pairs is not None:
        row["paired_floor"] = {"pairs_s": pairs}
    return row


def test_hybrid_host_is_a_target_on_the_worse_of_and_disk_a_reference():
    rows = {"hybrid_vllm_prefix": _row(0.2, 0.01),
            # cross-engine 0.25 / 0.2 = 1.25 (within 1.3), same engine 0.3 / 0.2 = 1.5 (not)
            "hybrid_tieredkv_host": _row(0.25, 0.02, pairs=[("A", 0.3, 0.2), ("B", 0.3, 0.2)]),
            "hybrid_tieredkv_disk": _row(0.25, 0.1, ok=False)}
    out = {v["config"]: v for v in targets.hybrid_verdicts(rows, read_s=0.01)}
    host, disk = out["hybrid_tieredkv_host"], out["hybrid_tieredkv_disk"]
    assert host["cross_engine_ratio"] == pytest.approx(1.25)
    assert host["same_engine_ratio"] == pytest.approx(1.5)
    assert host["worse_ratio"] == pytest.approx(1.5) and not host["pass"]  # the worse decides
    assert not host.get("reference") and targets.counts(host)  # a target: in the exit status
    assert host["equal_compute_ratio"] == pytest.approx((0.19 + 0.02) / 0.2)
    assert disk["reference"] and not targets.counts(disk)
    assert not disk["pass"] and "did not happen" in disk["note"]
    assert disk["cross_engine_ratio"] == pytest.approx(0.25 / 0.21)
    rows["hybrid_tieredkv_host"]["paired_floor"]["pairs_s"] = [("A", 0.24, 0.2)]
    assert targets.hybrid_verdicts(rows, read_s=0.01)[0]["pass"]
    assert targets.hybrid_verdicts({}, 0.01) == []
