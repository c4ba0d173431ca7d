"""Hits as long as vLLM's own prefix cache would give: block granularity, on real vLLM.

A property-style check over a random history: prompts of random lengths (never a multiple of
the block or the chunk), each sharing a prefix of random length with an earlier prompt (or
extending one whole, as the next turn of a chat does). For every prompt, tieredkv's hit must
equal the hit vLLM's own prefix cache gives for the same history, measured on an engine with
prefix caching on and no connector (``RequestOutput.num_cached_tokens``), and its tokens and
logprobs must equal a run without tieredkv.

Each tieredkv engine resets vLLM's own prefix cache after every prompt, so every cached token
it reports is tieredkv's. Covered: the host tier; the disk tier after a restart (the second
engine's host tier starts empty: its hits are promoted from the first engine's slab files);
tensor parallelism (TP=2 against a TP=2 reference, greedy tokens differ between TP sizes).

Five engines in all, a few minutes on two cores. ``TIEREDKV_E2E_SEED`` picks another history.
"""

from __future__ import annotations

import os
import random
from functools import cache
from pathlib import Path

import pytest

from tests.e2e.conftest import (
    BLOCK_SIZE,
    CHUNK_TOKENS,
    MAX_TOKENS,
    assert_hits,
    assert_same_as_reference,
    run_engine,
    tieredkv_config,
)
from tieredkv.disk.format import slab_path

pytestmark = pytest.mark.vllm

SEED = int(os.environ.get("TIEREDKV_E2E_SEED", "12"))
NUM_PROMPTS = 10
RESTART_AT = 5  # the disk engine is restarted before prompt 5
RESET = {"kind": "reset_prefix"}
DRAIN = {"kind": "drain"}
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def _length(rnd: random.Random, low: int, high: int, tail: bool = False) -> int:
    """A length in [low, high) that is no multiple of the block or the chunk; with ``tail``,
    one that leaves at least one full block past the last full chunk."""
    while True:
        n = rnd.randrange(low, high)
        if n % BLOCK_SIZE and n % CHUNK_TOKENS and (not tail or n % CHUNK_TOKENS >= BLOCK_SIZE):
            return n


KINDS = {0: "fresh", 2: "extends", RESTART_AT + 1: "fresh", RESTART_AT + 2: "extends",
         RESTART_AT + 3: "repeat"}


@cache
def history() -> tuple[tuple[str, tuple[int, ...], str], ...]:
    """``(name, tokens, how)`` for each prompt, in the order every engine sees them.

    ``shares``: a prefix of random length of an earlier prompt, then new tokens; ``extends``:
    a whole earlier prompt with a tail (the next turn of a chat), then new tokens;
    ``repeat``: an earlier prompt again; ``fresh``: nothing shared. After the restart most
    prompts share with prompts the first engine wrote (on disk only by then).
    """
    rnd = random.Random(SEED)
    prompts: list[tuple[str, tuple[int, ...], str]] = []
    for i in range(NUM_PROMPTS):
        how = KINDS.get(i, "shares")
        prefix: tuple[int, ...] = ()
        if how != "fresh":
            pool = prompts[:RESTART_AT] if i >= RESTART_AT and rnd.random() < 0.75 else prompts
            if how == "extends":
                pool = [p for p in pool if len(p[1]) % CHUNK_TOKENS >= BLOCK_SIZE] or pool
            base = rnd.choice(pool)[1]
            prefix = base[: _length(rnd, 40, len(base))] if how == "shares" else base
        if how == "repeat":
            tokens = prefix
        else:
            length = _length(rnd, len(prefix) + 60, len(prefix) + 900, tail=True)
            tokens = prefix + tuple(rnd.randrange(3, 2000) for _ in range(length - len(prefix)))
        prompts.append((f"q{i}", tokens, how))
    return tuple(prompts)


def one_prompt(name: str, tokens: tuple[int, ...]) -> dict:
    return {"kind": "generate", "names": [name], "prompts": [{"tokens": list(tokens)}]}


def each_then_reset() -> list[dict]:
    phases: list[dict] = []
    for name, tokens, _ in history():
        phases += [one_prompt(name, tokens), RESET]
    return phases


def by_name(phases: list[dict]) -> dict[str, dict]:
    return {p["names"][0]: p["outputs"][0] for p in phases if p["kind"] == "generate"}


def vllm_baseline(model: str, **engine) -> tuple[dict[str, int], dict[str, dict]]:
    """One engine, prefix caching on, no connector: the history in order (each prompt's
    ``num_cached_tokens`` is vLLM's own hit), then every prompt again after a reset (outputs
    of a run that hits nothing)."""
    floor_phases = [one_prompt(name, tokens) for name, tokens, _ in history()]
    result = run_engine({
        "model": model, "max_tokens": MAX_TOKENS, "prefix_caching": True,
        "phases": [*floor_phases, RESET, *each_then_reset()], **engine,
    }, env=TP2_ENV if engine.get("tensor_parallel_size") == 2 else None)
    phases = result["phases"]
    floor = {name: out["num_cached_tokens"]
             for name, out in by_name(phases[: len(floor_phases)]).items()}
    cold = by_name(phases[len(floor_phases):])
    assert all(out["num_cached_tokens"] == 0 for out in cold.values())
    return floor, cold


@pytest.fixture(scope="module")
def baseline(tiny_model) -> tuple[dict[str, int], dict[str, dict]]:
    floor, cold = vllm_baseline(tiny_model)
    # The history exercises what it is meant to: hits that end inside a chunk, and more.
    ends = [hit % CHUNK_TOKENS for hit in floor.values() if hit]
    assert len(ends) >= 6 and any(ends), floor
    return floor, cold


def check_history(phases: list[dict], names: list[str], floor: dict[str, int],
                  reference: dict[str, dict]) -> dict[str, int]:
    """Every prompt: tieredkv's hit == vLLM's own, outputs == the run without tieredkv.

    Each prompt is its own phase, after a reset of vLLM's cache: its ``num_cached_tokens`` is
    the hit, all of it served by tieredkv, and tieredkv's counters grew by exactly that much
    during the phase (``assert_hits``)."""
    got = {}
    for index, phase in enumerate(phases):
        if phase["kind"] != "generate" or phase["names"][0] not in names:
            continue
        name = phase["names"][0]
        got[name] = phase["outputs"][0]["num_cached_tokens"]
        assert_same_as_reference(phase, [name], reference)
        assert_hits(phases, index, {name: floor[name]})
    assert got == {name: floor[name] for name in names}, {n: (got[n], floor[n]) for n in names}
    return got


def served(counters: dict, tier: str) -> int:
    return counters.get(f"hit_tokens_{tier}", 0)


def test_host_then_disk_after_restart_hit_what_vllm_prefix_cache_hits(
    tiny_model, baseline, tmp_path: Path
):
    floor, cold = baseline
    prompts = history()
    names = [name for name, _, _ in prompts]
    kv = tieredkv_config(host_bytes="256MiB", disk_path=str(tmp_path / "tier"), disk_bytes="256MiB")
    spec = {"model": tiny_model, "max_tokens": MAX_TOKENS, "kv_transfer_config": kv}
    phases = each_then_reset()
    split = 2 * RESTART_AT
    # Engine 1: the first prompts, every hit from the host tier; spills journaled.
    first = run_engine({**spec, "phases": [*phases[:split], DRAIN]})
    check_history(first["phases"], names[:RESTART_AT], floor, cold)
    counters = first["phases"][-1]["counters"]
    assert served(counters, "host") == sum(floor[n] for n in names[:RESTART_AT])
    assert served(counters, "disk") == 0
    assert counters.get("partial_hits", 0) >= 1, counters
    # The chat turn that extended an earlier prompt stored that prompt's tail chunk whole:
    # the tail was dropped from both tiers, not kept as a second copy.
    assert counters.get("superseded_host", 0) >= 1 and counters.get("superseded_disk", 0) >= 1
    # Engine 2 on the same disk_path: an empty host tier, the history on disk.
    second = run_engine({**spec, "phases": phases[split:]})
    check_history(second["phases"], names[RESTART_AT:], floor, cold)
    counters = second["phases"][-1]["counters"]
    from_disk = served(counters, "disk")
    assert from_disk > 0 and counters.get("promoted_chunks", 0) > 0, counters
    assert from_disk + served(counters, "host") == sum(floor[n] for n in names[RESTART_AT:])


def test_tensor_parallel_two_ranks_hit_what_vllm_prefix_cache_hits(tiny_model, baseline, tmp_path):
    floor, _ = baseline
    tp_floor, tp_cold = vllm_baseline(tiny_model, tensor_parallel_size=2)
    assert tp_floor == floor  # vLLM's own hits do not depend on the TP size
    kv = tieredkv_config(host_bytes="256MiB", disk_path=str(tmp_path / "tier"), disk_bytes="256MiB")
    result = run_engine(
        {"model": tiny_model, "max_tokens": MAX_TOKENS, "kv_transfer_config": kv,
         "tensor_parallel_size": 2, "phases": [*each_then_reset(), DRAIN]},
        env=TP2_ENV,
    )
    names = [name for name, _, _ in history()]
    check_history(result["phases"], names, floor, tp_cold)
    counters = result["phases"][-1]["counters"]
    assert served(counters, "host") + served(counters, "disk") == sum(floor.values())
    assert slab_path(tmp_path / "tier", 1).exists()
