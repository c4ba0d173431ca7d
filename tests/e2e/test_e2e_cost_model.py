"""The cost model on real vLLM (issue 25 point 2): a disk that reads slower than the engine
recomputes has its hits declined and counted, the outputs stay those of the reference, and
once the disk is fast again its hits return. No time is measured here: the disk is made slow
by fault injection (every slab read sleeps while a flag file exists), far slower than the
tiny model recomputes."""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import (
    MAX_TOKENS,
    PROMPTS,
    assert_same_as_reference,
    cached_tokens,
    counter_delta,
    expected_hit_tokens,
    generate,
    run_engine,
    tieredkv_config,
)
from tieredkv.scheduler.cost_model import EXPLORE_INTERVAL_S

pytestmark = pytest.mark.vllm

RESET = {"kind": "reset_prefix"}
DRAIN = {"kind": "drain"}
DECLINED = "hits_declined_slower_than_recompute_disk"
# 16 host slots: the five cold prompts below push p1..p3 out to disk only.
SMALL_HOST = "8MiB"
COLD = ["p1", "p2", "p3", "on_boundary", "boundary_plus_1"]


def test_a_slow_disk_is_declined_counted_and_used_again_once_fast(tiny_model, reference,
                                                                   tmp_path):
    slow = tmp_path / "disk-is-slow"
    slow.touch()
    phases_in = [
        *(generate(name) for name in COLD), DRAIN,  # 0-5: cold, stored, spilled
        # 6-11: three disk hits while nothing is known: taken (each read sleeps 0.5 s).
        RESET, generate("p1"), RESET, generate("p2"), RESET, generate("p3"),
        # 12-15: the disk is now known slow: the hits are declined (one chunk explored).
        RESET, generate("on_boundary"), RESET, generate("boundary_plus_1"),
        # 16-17: the fault is removed; an exploration interval passes.
        {"kind": "remove_file", "path": str(slow)},
        {"kind": "sleep", "seconds": EXPLORE_INTERVAL_S + 0.5},
        # 18-21: one chunk explored, read fast: the estimate starts over, hits return.
        RESET, generate("p1"), RESET, generate("p2"),
    ]
    result = run_engine({
        "model": tiny_model, "max_tokens": MAX_TOKENS, "phases": phases_in,
        "kv_transfer_config": tieredkv_config(
            host_bytes=SMALL_HOST, disk_path=str(tmp_path / "tier"), disk_bytes="128MiB"),
    }, env={"TIEREDKV_FAULTS": json.dumps(
        {"disk_read_delay_s": 0.5, "disk_read_delay_while": str(slow)})})
    phases = result["phases"]
    generated = [(i, p["names"]) for i, p in enumerate(phases) if p["kind"] == "generate"]
    for index, names in generated:
        assert_same_as_reference(phases[index], names, reference)
    full = expected_hit_tokens(len(PROMPTS["p1"]))
    # Nothing known yet: every disk hit is taken, whole.
    for index in (7, 9, 11):
        assert counter_delta(phases, index, DECLINED) == 0, index
        assert counter_delta(phases, index, "hit_tokens_disk") > 0, index
        assert sum(cached_tokens(phases[index]).values()) == full, index
    # Known slow: each request's disk hit is declined once and counted; what it still loads
    # is at most the one chunk explored (and what host holds).
    for index, name in ((13, "on_boundary"), (15, "boundary_plus_1")):
        assert counter_delta(phases, index, DECLINED) == 1, index
        assert sum(cached_tokens(phases[index]).values()) < expected_hit_tokens(
            len(PROMPTS[name])), index
    # The fault removed: the exploration reads fast, and the next disk hit is whole again.
    assert counter_delta(phases, 19, DECLINED) == 1
    assert counter_delta(phases, 21, DECLINED) == 0
    assert counter_delta(phases, 21, "hit_tokens_disk") > 0
    assert sum(cached_tokens(phases[21]).values()) == full
