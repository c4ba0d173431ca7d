"""The scheduler-side planner, driven with plain data (no vLLM, no bytes moved)."""

from __future__ import annotations

import time

import pytest

from tests.scheduler.index_checks import check_invariants
from tieredkv.config import TieredKVConfig
from tieredkv.keys import LazyChunkKeys, chunk_keys
from tieredkv.protocol import JobResult, Move
from tieredkv.scheduler.planner import Planner
from tieredkv.testing.hashing import sha256_block_hashes

BLOCK = 16
CHUNK_BLOCKS = 4
CHUNK_TOKENS = BLOCK * CHUNK_BLOCKS
FP = b"f" * 32


def keys_for(tokens: list[int], salt: str | None = None) -> LazyChunkKeys:
    """Keys as the scheduler half makes them: whole chunks, and any block (one hash each)."""
    return LazyChunkKeys(FP, sha256_block_hashes(tokens, BLOCK, salt), CHUNK_BLOCKS,
                         hashes_per_block=1)


def chunk_list(tokens: list[int]) -> list[bytes]:
    return chunk_keys(FP, sha256_block_hashes(tokens, BLOCK), CHUNK_BLOCKS)


def make(host_slots: int = 8, disk_slots: int = 0, world: int = 1, catalog=None, **extra) -> Planner:
    cfg = TieredKVConfig.from_dict({"chunk_blocks": CHUNK_BLOCKS, **extra})
    return Planner(cfg, block_size=BLOCK, num_host_slots=host_slots, num_disk_slots=disk_slots,
                   world_size=world, catalog=catalog)


def ok_all(planner: Planner, plan, ranks: int = 1) -> None:
    jobs = [*plan.of(Move.STORE), *plan.of(Move.SPILL), *plan.of(Move.PROMOTE), *plan.of(Move.LOAD)]
    planner.apply([JobResult(job.job_id, ok=ranks) for job in jobs])


def store_prompt(planner: Planner, req: str, tokens: list[int], ranks: int = 1):
    """The prompt's whole chunks and its tail (its full blocks past them), all stored."""
    n_blocks = len(tokens) // BLOCK
    planner.set_block_ids(req, list(range(100, 100 + n_blocks)), replace=True)
    planner.plan_stores(req, keys_for(tokens), len(tokens), tail=True)
    plan = planner.take_plan()
    ok_all(planner, plan, ranks)
    return plan


def test_store_then_hit_loads_exact_blocks_and_unpins():
    planner = make()
    tokens = list(range(5 * CHUNK_TOKENS + 7))
    plan = store_prompt(planner, "a", tokens)
    assert len(plan.of(Move.STORE)) == 5
    assert plan.of(Move.STORE)[0].block_ids == (100, 101, 102, 103)
    assert planner.host.ready_count == 5
    # A new request with the same prompt and a 1-block local hit.
    hit = planner.lookup("b", keys_for(tokens), num_computed_tokens=BLOCK, num_tokens=len(tokens))
    assert hit == 5 * CHUNK_TOKENS - BLOCK
    assert planner.host.pinned_count == 5
    # Asking twice changes nothing.
    assert planner.lookup("b", keys_for(tokens), BLOCK, len(tokens)) == hit
    assert planner.host.pinned_count == 5
    device = list(range(500, 500 + len(tokens) // BLOCK + 1))
    planner.on_alloc("b", device, hit)
    plan = planner.take_plan()
    (load,) = plan.of(Move.LOAD)
    assert load.src.chunks[0].first_block == 1
    assert load.src.chunks[0].block_ids == (501, 502, 503)
    assert load.src.chunks[1].block_ids == (504, 505, 506, 507)
    assert planner.hit_tokens("b") == {"host": hit, "disk": 0}
    ok_all(planner, plan)
    assert planner.host.pinned_count == 0
    check_invariants(planner.host)


def test_hit_never_covers_the_last_prompt_token():
    planner = make()
    tokens = list(range(2 * CHUNK_TOKENS))  # exactly on a chunk boundary
    store_prompt(planner, "a", tokens)
    hit = planner.lookup("b", keys_for(tokens), 0, len(tokens))
    assert hit == 2 * CHUNK_TOKENS - BLOCK  # last block left for vLLM to compute
    planner.on_alloc("b", list(range(2 * CHUNK_BLOCKS)), hit)
    (load,) = planner.take_plan().of(Move.LOAD)
    assert load.src.chunks[-1].block_ids == (4, 5, 6)


def test_salted_prompt_never_hits():
    planner = make()
    tokens = list(range(3 * CHUNK_TOKENS + 1))
    store_prompt(planner, "a", tokens)
    salted = chunk_keys(FP, sha256_block_hashes(tokens, BLOCK, "tenant-b"), CHUNK_BLOCKS)
    assert planner.lookup("b", salted, 0, len(tokens)) == 0


def test_full_host_tier_is_a_miss_not_a_wait():
    planner = make(host_slots=2)
    tokens = list(range(4 * CHUNK_TOKENS + 1))
    planner.set_block_ids("a", list(range(20)), replace=True)
    planner.plan_stores("a", keys_for(tokens), len(tokens))
    plan = planner.take_plan()
    assert len(plan.of(Move.STORE)) == 2  # both slots pinned by in-flight writes
    assert planner.counters["store_skipped_host_full"] == 2


def test_failed_store_leaves_no_entry():
    planner = make()
    tokens = list(range(CHUNK_TOKENS + 1))
    planner.set_block_ids("a", list(range(8)), replace=True)
    planner.plan_stores("a", keys_for(tokens), len(tokens))
    (store,) = planner.take_plan().of(Move.STORE)
    planner.apply([JobResult(store.job_id, failed=1, failure="copy_error")])
    assert len(planner.host) == 0 and planner.host.free_slots == 8


def test_tp_job_completes_only_when_every_rank_reported():
    planner = make(world=2)
    tokens = list(range(CHUNK_TOKENS + 1))
    planner.set_block_ids("a", list(range(8)), replace=True)
    planner.plan_stores("a", keys_for(tokens), len(tokens))
    (store,) = planner.take_plan().of(Move.STORE)
    planner.apply([JobResult(store.job_id, ok=1)])
    assert planner.host.ready_count == 0  # one rank is not enough
    planner.apply([JobResult(store.job_id, ok=1)])
    assert planner.host.ready_count == 1


def test_tp_failure_on_any_rank_fails_the_job():
    planner = make(world=2)
    tokens = list(range(CHUNK_TOKENS + 1))
    planner.set_block_ids("a", list(range(8)), replace=True)
    planner.plan_stores("a", keys_for(tokens), len(tokens))
    (store,) = planner.take_plan().of(Move.STORE)
    planner.apply([JobResult(store.job_id, ok=1)])
    planner.apply([JobResult(store.job_id, failed=1, failure="io_error")])
    assert len(planner.host) == 0


def test_store_spills_then_disk_hit_is_promoted_before_promise():
    planner = make(host_slots=2, disk_slots=8)
    a = list(range(2 * CHUNK_TOKENS + 1))
    plan = store_prompt(planner, "a", a)
    plan = planner.take_plan()
    assert len(plan.of(Move.SPILL)) == 2
    ok_all(planner, plan)
    assert planner.disk.ready_count == 2
    # Another prompt takes over the host tier.
    b = [t + 10_000 for t in a]
    store_prompt(planner, "b", b)
    ok_all(planner, planner.take_plan())
    assert not any(planner.host.is_ready(k) for k in keys_for(a))
    # Lookup of a: disk-only chunks are promoted first; the answer is None meanwhile.
    assert planner.lookup("c", keys_for(a), 0, len(a)) is None
    plan = planner.take_plan()
    assert len(plan.of(Move.PROMOTE)) == 2 and not plan.of(Move.LOAD)
    assert planner.lookup("c", keys_for(a), 0, len(a)) is None  # still in flight
    assert not planner.take_plan().of(Move.PROMOTE)  # asking again issues nothing new
    ok_all(planner, plan)
    hit = planner.lookup("c", keys_for(a), 0, len(a))
    assert hit == 2 * CHUNK_TOKENS
    planner.on_alloc("c", list(range(9)), hit)
    assert planner.hit_tokens("c") == {"host": 0, "disk": hit}


def test_failed_promotion_is_a_plain_miss_and_drops_the_disk_entry():
    planner = make(host_slots=2, disk_slots=8)
    a = list(range(CHUNK_TOKENS + 1))
    store_prompt(planner, "a", a)
    ok_all(planner, planner.take_plan())  # spill
    store_prompt(planner, "b", [t + 10_000 for t in range(2 * CHUNK_TOKENS + 1)])
    assert planner.lookup("c", keys_for(a), 0, len(a)) is None
    (promote,) = planner.take_plan().of(Move.PROMOTE)
    planner.apply([JobResult(promote.job_id, failed=1, failure="checksum")])
    assert planner.lookup("c", keys_for(a), 0, len(a)) == 0
    assert keys_for(a)[0] not in planner.disk
    assert planner.counters["disk_read_failed", "checksum"] == 1


def test_disk_admission_requires_n_sightings():
    planner = make(host_slots=4, disk_slots=8, disk_admission=2)
    a = list(range(CHUNK_TOKENS + 1))
    store_prompt(planner, "a", a)
    assert not planner.take_plan().of(Move.SPILL)
    assert planner.counters["disk_admission_rejected"] == 1
    hit = planner.lookup("b", keys_for(a), 0, len(a))
    planner.on_alloc("b", list(range(8)), hit)
    assert len(planner.take_plan().of(Move.SPILL)) == 1  # second sighting admits it


def test_delayed_free_while_store_in_flight():
    planner = make()
    tokens = list(range(CHUNK_TOKENS + 1))
    planner.set_block_ids("a", list(range(8)), replace=True)
    planner.plan_stores("a", keys_for(tokens), len(tokens))
    plan = planner.take_plan()
    assert planner.finished("a") is True
    assert planner.take_plan().delayed_req_ids == ["a"]
    ok_all(planner, plan)
    assert planner.finished("never-seen") is False


def test_preemption_fences_blocks_of_in_flight_stores():
    planner = make()
    tokens = list(range(2 * CHUNK_TOKENS + 1))
    planner.set_block_ids("a", list(range(40, 50)), replace=True)
    planner.plan_stores("a", keys_for(tokens), len(tokens))
    planner.take_plan()
    planner.preempted("a")
    plan = planner.take_plan()
    assert sorted(plan.fence_block_ids) == list(range(40, 48))


def test_a_store_the_preemption_fence_cancelled_is_stored_when_the_chunk_is_recomputed():
    planner = make()
    tokens = list(range(2 * CHUNK_TOKENS + 1))
    keys = keys_for(tokens)
    planner.set_block_ids("a", list(range(40, 50)), replace=True)
    planner.plan_stores("a", keys, len(tokens))
    first = planner.take_plan()
    planner.preempted("a")
    planner.take_plan()
    planner.apply([JobResult(first.of(Move.STORE)[0].job_id, failed=1, failure="cancelled"),
                   JobResult(first.of(Move.STORE)[1].job_id, ok=1)])
    assert not planner.host.is_ready(keys[0]) and planner.host.is_ready(keys[1])
    # Resumed with new blocks, it computes the prompt again: chunk 0 is stored this time.
    planner.set_block_ids("a", list(range(60, 70)), replace=True)
    planner.plan_stores("a", keys, len(tokens))
    (store,) = planner.take_plan().of(Move.STORE)
    assert (store.key, store.block_ids) == (keys[0], (60, 61, 62, 63))


def test_abort_during_load_is_not_delayed_and_unpins_after_result():
    planner = make()
    tokens = list(range(2 * CHUNK_TOKENS + 1))
    store_prompt(planner, "a", tokens)
    hit = planner.lookup("b", keys_for(tokens), 0, len(tokens))
    planner.on_alloc("b", list(range(9)), hit)
    plan = planner.take_plan()
    assert planner.finished("b") is False
    ok_all(planner, plan)
    assert planner.host.pinned_count == 0


def test_failed_load_drops_only_the_failed_chunks():
    planner = make()
    tokens = list(range(3 * CHUNK_TOKENS + 1))
    store_prompt(planner, "a", tokens)
    hit = planner.lookup("b", keys_for(tokens), 0, len(tokens))
    planner.on_alloc("b", list(range(13)), hit)
    (load,) = planner.take_plan().of(Move.LOAD)
    failed = set(load.src.chunks[1].block_ids) | set(load.src.chunks[2].block_ids)
    planner.apply([JobResult(load.job_id, failed=1, failure="copy_error", failed_block_ids=failed)])
    keys = keys_for(tokens)
    assert planner.host.is_ready(keys[0])
    assert not planner.host.is_ready(keys[1]) and not planner.host.is_ready(keys[2])


def test_reset_with_jobs_in_flight_frees_everything_once_jobs_report():
    planner = make(host_slots=4, disk_slots=4)
    tokens = list(range(2 * CHUNK_TOKENS + 1))
    store_prompt(planner, "a", tokens)
    spills = planner.take_plan()
    hit = planner.lookup("b", keys_for(tokens), 0, len(tokens))
    planner.on_alloc("b", list(range(9)), hit)
    loads = planner.take_plan()
    planner.reset()
    assert planner.lookup("c", keys_for(tokens), 0, len(tokens)) == 0
    ok_all(planner, spills)
    ok_all(planner, loads)
    assert planner.host.free_slots == 4 and planner.disk.free_slots == 4
    check_invariants(planner.host)
    check_invariants(planner.disk)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_eviction_policies_make_room_for_new_chunks(policy):
    planner = make(host_slots=2, eviction=policy)
    for i in range(5):
        store_prompt(planner, f"r{i}", [i * 100_000 + t for t in range(CHUNK_TOKENS + 1)])
    assert planner.host.ready_count == 2
    assert planner.counters["evictions", "host"] == 3


def test_promotion_never_evicts_resident_chunks_of_its_own_prefix():
    planner = make(host_slots=3, disk_slots=8)
    a = list(range(3 * CHUNK_TOKENS + 1))
    store_prompt(planner, "a", a)
    ok_all(planner, planner.take_plan())  # spills of a
    store_prompt(planner, "b", [t + 10_000 for t in range(2 * CHUNK_TOKENS + 1)])
    keys = keys_for(a)
    assert [planner.host.is_ready(k) for k in keys] == [False, False, True]
    assert planner.lookup("c", keys, 0, len(a)) is None
    plan = planner.take_plan()
    assert {p.key for p in plan.of(Move.PROMOTE)} == {keys[0], keys[1]}
    ok_all(planner, plan)
    assert planner.lookup("c", keys, 0, len(a)) == 3 * CHUNK_TOKENS


def test_two_requests_sharing_a_disk_only_prefix_wait_for_one_promotion():
    # Found by the soak: the second lookup tried to allocate a key being promoted -> KeyError.
    planner = make(host_slots=2, disk_slots=8)
    a = list(range(CHUNK_TOKENS + 1))
    store_prompt(planner, "a", a)
    ok_all(planner, planner.take_plan())  # spill a
    store_prompt(planner, "b", [t + 10_000 for t in range(2 * CHUNK_TOKENS + 1)])
    ok_all(planner, planner.take_plan())
    assert planner.lookup("c", keys_for(a), 0, len(a)) is None
    assert planner.lookup("d", keys_for(a), 0, len(a)) is None  # waits, never a second promote
    plan = planner.take_plan()
    assert len(plan.of(Move.PROMOTE)) == 1
    ok_all(planner, plan)
    assert planner.lookup("c", keys_for(a), 0, len(a)) == CHUNK_TOKENS
    assert planner.lookup("d", keys_for(a), 0, len(a)) == CHUNK_TOKENS
    check_invariants(planner.host)


def test_a_chunk_being_written_to_host_ends_the_run_instead_of_being_promoted():
    planner = make(host_slots=4, disk_slots=8)
    a = list(range(2 * CHUNK_TOKENS + 1))
    store_prompt(planner, "a", a)
    ok_all(planner, planner.take_plan())  # spilled, still in host
    keys = keys_for(a)
    planner.host.remove(keys[0])  # host copy gone, disk copy stays
    assert planner.host.allocate(keys[0]) is not None  # a write into host is in flight
    assert planner.lookup("c", keys, 0, len(a)) == 0  # no KeyError, no second allocation
    assert not planner.take_plan().of(Move.PROMOTE)


def test_a_stuck_promotion_times_out_into_a_plain_answer():
    planner = make(host_slots=2, disk_slots=8, load_timeout_s=0.01)
    a = list(range(CHUNK_TOKENS + 1))
    store_prompt(planner, "a", a)
    ok_all(planner, planner.take_plan())
    store_prompt(planner, "b", [t + 10_000 for t in range(2 * CHUNK_TOKENS + 1)])
    assert planner.lookup("c", keys_for(a), 0, len(a)) is None
    time.sleep(0.05)
    assert planner.lookup("c", keys_for(a), 0, len(a)) == 0  # never an endless "ask me later"


# ---------------------------------------------------------------------------- block granularity
# A hit ends at the last block held, as vLLM's own prefix cache would end it, not at a chunk
# boundary: a prompt's tail is stored as an entry holding part of its chunk, and any stored
# entry is found by the key of any block it holds.


def vllm_prefix_hit(stored: list[list[int]], tokens: list[int], computed: int = 0) -> int:
    """What vLLM's own prefix cache would hit for ``tokens`` after ``stored`` were prefilled:
    the longest run of full blocks equal to a stored prompt's, never the last token."""
    best = 0
    for old in stored:
        blocks = 0
        while (blocks + 1) * BLOCK <= min(len(old), len(tokens)) and \
                old[: (blocks + 1) * BLOCK] == tokens[: (blocks + 1) * BLOCK]:
            blocks += 1
        best = max(best, blocks)
    return max(0, min(best * BLOCK, (len(tokens) - 1) // BLOCK * BLOCK) - computed)


def load(planner: Planner, req: str, tokens: list[int], hit: int, computed: int = 0):
    planner.on_alloc(req, list(range(500, 500 + len(tokens) // BLOCK + 1)), hit)
    plan = planner.take_plan()
    (job,) = plan.of(Move.LOAD)
    return job, plan


def test_prompt_tail_is_stored_and_a_repeat_hits_up_to_its_last_block():
    planner = make()
    tokens = list(range(2 * CHUNK_TOKENS + 2 * BLOCK + 5))  # 2 chunks, 2 blocks, 5 tokens
    plan = store_prompt(planner, "a", tokens)
    assert [s.block_ids for s in plan.of(Move.STORE)] == [
        (100, 101, 102, 103), (104, 105, 106, 107), (108, 109)]
    assert plan.of(Move.STORE)[-1].key == keys_for(tokens).block_key(9)  # keyed by its last block
    assert planner.counters["stored_partial_chunks"] == 1
    hit = planner.lookup("b", keys_for(tokens), 0, len(tokens))
    assert hit == 2 * CHUNK_TOKENS + 2 * BLOCK == vllm_prefix_hit([tokens], tokens)
    job, plan = load(planner, "b", tokens, hit)
    assert [(c.first_block, c.block_ids) for c in job.src.chunks] == [
        (0, (500, 501, 502, 503)), (0, (504, 505, 506, 507)), (0, (508, 509))]
    assert planner.hit_tokens("b") == {"host": hit, "disk": 0}
    assert planner.counters["partial_hits"] == 1
    ok_all(planner, plan)
    assert planner.host.pinned_count == 0
    check_invariants(planner.host)


def test_tail_is_stored_only_when_asked_and_only_once():
    planner = make()
    tokens = list(range(CHUNK_TOKENS + 3 * BLOCK))
    planner.set_block_ids("a", list(range(7)), replace=True)
    planner.plan_stores("a", keys_for(tokens), len(tokens))  # mid-prefill: whole chunks only
    assert [len(s.block_ids) for s in planner.take_plan().of(Move.STORE)] == [4]
    planner.plan_stores("a", keys_for(tokens), len(tokens), tail=True)
    assert [len(s.block_ids) for s in planner.take_plan().of(Move.STORE)] == [3]
    planner.plan_stores("a", keys_for(tokens), len(tokens), tail=True)  # held already
    assert not planner.take_plan().of(Move.STORE)


def test_hit_ends_inside_another_prompts_whole_chunk():
    """The prefix shared with an earlier, longer prompt ends in the middle of one of its
    chunks: the hit takes that chunk's leading blocks (vLLM's prefix cache would)."""
    planner = make()
    a = list(range(4 * CHUNK_TOKENS + 1))
    store_prompt(planner, "a", a)
    shared = CHUNK_TOKENS + 2 * BLOCK + 7  # diverges inside block 6, chunk 1
    b = a[:shared] + [t + 50_000 for t in range(300 - shared)]
    hit = planner.lookup("b", keys_for(b), 0, len(b))
    assert hit == CHUNK_TOKENS + 2 * BLOCK == vllm_prefix_hit([a], b)
    job, _ = load(planner, "b", b, hit)
    assert [c.key for c in job.src.chunks] == chunk_list(a)[:2]  # a's chunk 1 serves 2 blocks
    assert job.src.chunks[1].first_block == 0 and job.src.chunks[1].block_ids == (504, 505)


def test_hit_starting_and_ending_in_the_same_chunk():
    planner = make()
    a = list(range(2 * CHUNK_TOKENS + 1))
    store_prompt(planner, "a", a)
    b = a[: CHUNK_TOKENS + 3 * BLOCK] + [9_999] * 40
    computed = CHUNK_TOKENS + BLOCK  # vLLM's own cache had chunk 0 and one more block
    hit = planner.lookup("b", keys_for(b), computed, len(b))
    assert hit == 2 * BLOCK == vllm_prefix_hit([a], b, computed)
    job, _ = load(planner, "b", b, hit, computed)
    (chunk,) = job.src.chunks
    assert chunk.key == chunk_list(a)[1]
    assert (chunk.first_block, chunk.block_ids) == (1, (505, 506))


def test_block_granular_hits_match_vllm_prefix_cache_on_random_prompts():
    """Random lengths and shared prefixes of random length: every hit equals vLLM's."""
    import random

    rnd = random.Random(7)
    planner = make(host_slots=256)
    stored: list[list[int]] = []
    for i in range(40):
        if stored and rnd.random() < 0.7:
            base = rnd.choice(stored)
            prefix = base[: rnd.randrange(1, len(base) + 1)]
        else:
            prefix = []
        length = rnd.randrange(len(prefix) + 2, len(prefix) + 400)
        tokens = prefix + [rnd.randrange(10**6) for _ in range(length - len(prefix))]
        req = f"r{i}"
        hit = planner.lookup(req, keys_for(tokens), 0, len(tokens))
        assert hit == vllm_prefix_hit(stored, tokens), (i, len(prefix), len(tokens))
        if hit:
            _, plan = load(planner, req, tokens, hit)
            ok_all(planner, plan)
        else:
            planner.on_alloc(req, [], 0)
        store_prompt(planner, req, tokens)
        planner.finished(req)
        stored.append(tokens)
        check_invariants(planner.host)
    assert planner.counters["partial_hits"] > 0


def test_a_tail_held_by_a_longer_entry_is_not_stored_again():
    planner = make()
    a = list(range(3 * CHUNK_TOKENS + 1))
    store_prompt(planner, "a", a)
    b = a[: CHUNK_TOKENS + 2 * BLOCK + 3]  # a shorter prompt: its tail lies in a's chunk 1
    plan = store_prompt(planner, "b", b)
    assert not plan.of(Move.STORE)
    assert planner.counters["stored_partial_chunks"] == 0
    assert planner.lookup("c", keys_for(b), 0, len(b)) == CHUNK_TOKENS + 2 * BLOCK


def test_a_tail_that_grows_leaves_one_copy():
    """Turn 1 stores its tail (chunk 1, 2 blocks); turn 2 extends the prompt, hits the tail
    and stores chunk 1 whole: the tail is dropped (superseded), never kept as a 2nd copy."""
    planner = make()
    turn1 = list(range(CHUNK_TOKENS + 2 * BLOCK + 3))
    store_prompt(planner, "t1", turn1)
    tail = keys_for(turn1).block_key(5)
    assert planner.host.is_ready(tail)
    turn2 = turn1 + [t + 70_000 for t in range(3 * CHUNK_TOKENS + 1 - len(turn1))]
    hit = planner.lookup("t2", keys_for(turn2), 0, len(turn2))
    assert hit == CHUNK_TOKENS + 2 * BLOCK == vllm_prefix_hit([turn1], turn2)
    _, plan = load(planner, "t2", turn2, hit)
    ok_all(planner, plan)
    plan = store_prompt(planner, "t2", turn2)
    assert [len(s.block_ids) for s in plan.of(Move.STORE)] == [4, 4]  # chunks 1 and 2, no tail
    assert tail not in planner.host and not planner.host.is_doomed(tail)
    assert planner.counters["superseded", "host"] == 1
    assert len(planner.host) == 3  # chunks 0, 1, 2: one copy of every block
    # Turn 1's prompt still hits its blocks, now through turn 2's chunk 1.
    assert planner.lookup("again", keys_for(turn1), 0, len(turn1)) == CHUNK_TOKENS + 2 * BLOCK
    check_invariants(planner.host)


def test_a_superseded_tail_being_loaded_keeps_its_slot_until_the_load_ends():
    planner = make(host_slots=8)
    turn1 = list(range(CHUNK_TOKENS + 2 * BLOCK + 3))
    store_prompt(planner, "t1", turn1)
    tail = keys_for(turn1).block_key(5)
    slot = planner.host.get(tail).slot
    # A repeat of turn 1 is loading the tail ...
    hit = planner.lookup("r", keys_for(turn1), 0, len(turn1))
    _, loading = load(planner, "r", turn1, hit)
    # ... while turn 2 stores chunk 1 whole.
    turn2 = turn1 + [t + 70_000 for t in range(2 * CHUNK_TOKENS + 1 - len(turn1))]
    planner.set_block_ids("t2", list(range(200, 208)), replace=True)
    planner.plan_stores("t2", keys_for(turn2), len(turn2), tail=True)
    ok_all(planner, planner.take_plan())
    assert tail not in planner.host and planner.host.is_doomed(tail)  # out of lookups ...
    assert planner.host.used_slots == 3  # ... but its slot is still held by the load
    assert planner.lookup("x", keys_for(turn1), 0, len(turn1)) == hit  # via chunk 1 now
    planner.lookup("x", keys_for([1, 2]), 0, 2)  # let x's pins go
    allocate = planner.host.allocate(b"z" * 32)
    assert allocate is not None and allocate[0] != slot  # never the loading slot
    planner.host.abort(b"z" * 32)
    ok_all(planner, loading)
    assert not planner.host.is_doomed(tail) and planner.host.used_slots == 2
    check_invariants(planner.host)


def test_a_tail_that_grows_leaves_one_copy_on_disk_too():
    planner = make(host_slots=8, disk_slots=8)
    turn1 = list(range(CHUNK_TOKENS + 2 * BLOCK + 3))
    store_prompt(planner, "t1", turn1)
    ok_all(planner, planner.take_plan())  # spills: chunk 0 and the tail
    tail = keys_for(turn1).block_key(5)
    assert planner.disk.is_ready(tail)
    turn2 = turn1 + [t + 70_000 for t in range(2 * CHUNK_TOKENS + 1 - len(turn1))]
    store_prompt(planner, "t2", turn2)
    plan = planner.take_plan()
    assert [s.key for s in plan.of(Move.SPILL)] == [keys_for(turn2)[1]]
    assert plan.of(Move.SPILL)[0].dst.aliases == keys_for(turn2).block_keys(4, 7)
    ok_all(planner, plan)
    assert tail not in planner.disk and planner.counters["superseded", "disk"] == 1
    assert len(planner.disk) == 2
    check_invariants(planner.disk)


def test_plain_key_lists_keep_whole_chunk_hits():
    planner = make()
    tokens = list(range(2 * CHUNK_TOKENS + 2 * BLOCK + 5))
    store_prompt(planner, "a", tokens)
    assert planner.lookup("b", chunk_list(tokens), 0, len(tokens)) == 2 * CHUNK_TOKENS


def test_finish_tail_stores_generated_blocks_and_delays_the_free():
    planner = make(store_generated=True)
    tokens = list(range(CHUNK_TOKENS + 3 * BLOCK + 2))  # prompt and generated text
    planner.set_block_ids("a", list(range(8)), replace=True)
    planner.plan_stores("a", keys_for(tokens), CHUNK_TOKENS)
    ok_all(planner, planner.take_plan())
    planner.finish_tail("a", keys_for(tokens), len(tokens) - 1)
    assert planner.finished("a") is True
    plan = planner.take_plan()
    assert [s.block_ids for s in plan.of(Move.STORE)] == [(4, 5, 6)] and plan.delayed_req_ids == ["a"]
    ok_all(planner, plan)
    planner.finish_tail("gone", keys_for(tokens), len(tokens) - 1)  # unknown: nothing
    assert not planner.take_plan().of(Move.STORE)


def _run_spills(planner: Planner, plan, slab, payload: int) -> None:
    """Be the worker for a plan's spills: write each slot with its header's aliases."""
    for spill in plan.of(Move.SPILL):
        data = bytes([spill.host_slot + 1]) * payload
        slab.write_slot(spill.dst.slot, spill.key, memoryview(data), aliases=spill.dst.aliases)
    ok_all(planner, plan)


def test_disk_tail_and_mid_chunk_hits_survive_a_restart(tmp_path):
    from tieredkv.disk.catalog import DiskCatalog
    from tieredkv.disk.slab import SlabFile

    payload, slots = 8192, 16
    disk = tmp_path / "tier"
    a = list(range(2 * CHUNK_TOKENS + 1))
    tailed = [t + 90_000 for t in range(CHUNK_TOKENS + 3 * BLOCK + 1)]
    with DiskCatalog.open(disk, FP, payload, slots, 1) as catalog:
        with SlabFile.open(catalog.slab_path(0), slots, payload, FP) as slab:
            planner = make(host_slots=8, disk_slots=slots, catalog=catalog)
            store_prompt(planner, "a", a)
            _run_spills(planner, planner.take_plan(), slab, payload)
            store_prompt(planner, "t", tailed)
            _run_spills(planner, planner.take_plan(), slab, payload)
            assert planner.disk.ready_count == 4
    with DiskCatalog.open(disk, FP, payload, slots, 1) as catalog:
        assert len(catalog.recovered) == 4
        planner = make(host_slots=8, disk_slots=slots, catalog=catalog)
        check_invariants(planner.disk)
        # A prompt sharing a's first 1 chunk + 2 blocks + 7 tokens: promoted, then served.
        b = a[: CHUNK_TOKENS + 2 * BLOCK + 7] + [77_777] * 50
        assert planner.lookup("b", keys_for(b), 0, len(b)) is None
        plan = planner.take_plan()
        assert [p.key for p in plan.of(Move.PROMOTE)] == chunk_list(a)
        ok_all(planner, plan)
        hit = planner.lookup("b", keys_for(b), 0, len(b))
        assert hit == CHUNK_TOKENS + 2 * BLOCK == vllm_prefix_hit([a], b)
        planner.on_alloc("b", list(range(10)), hit)
        assert planner.hit_tokens("b") == {"host": 0, "disk": hit}
        # The other prompt's tail, found through one of its aliases (a shorter prompt) ...
        shorter = tailed[: CHUNK_TOKENS + BLOCK + 9]
        planner.take_plan()
        assert planner.lookup("s", keys_for(shorter), 0, len(shorter)) is None
        plan = planner.take_plan()
        assert [p.key for p in plan.of(Move.PROMOTE)] == [keys_for(tailed)[0], keys_for(tailed).block_key(6)]
        ok_all(planner, plan)
        hit = planner.lookup("s", keys_for(shorter), 0, len(shorter))
        assert hit == CHUNK_TOKENS + BLOCK == vllm_prefix_hit([tailed], shorter)
        planner.on_alloc("s", [], 0)
        # ... and by its own key (the same prompt again), from host slots now.
        hit = planner.lookup("t", keys_for(tailed), 0, len(tailed))
        assert hit == CHUNK_TOKENS + 3 * BLOCK == vllm_prefix_hit([tailed], tailed)


def test_recovery_keeps_the_longer_of_two_entries_holding_the_same_blocks(tmp_path):
    from tieredkv.disk.catalog import DiskCatalog
    from tieredkv.disk.slab import SlabFile

    payload, slots = 8192, 8
    disk = tmp_path / "tier"
    tokens = list(range(CHUNK_TOKENS + BLOCK * 4))
    keys = keys_for(tokens)
    short, full = keys.block_key(5), keys[1]
    with DiskCatalog.open(disk, FP, payload, slots, 1) as catalog:
        with SlabFile.open(catalog.slab_path(0), slots, payload, FP) as slab:
            # As if a crash came between the longer entry's record and the shorter's removal.
            slab.write_slot(0, short, memoryview(bytes(payload)), aliases=keys.block_keys(4, 5))
            slab.write_slot(1, full, memoryview(bytes(payload)), aliases=keys.block_keys(4, 7))
        catalog.record_written(short, 0)
        catalog.record_written(full, 1)
    with DiskCatalog.open(disk, FP, payload, slots, 1) as catalog:
        planner = make(host_slots=4, disk_slots=slots, catalog=catalog)
        assert short not in planner.disk and full in planner.disk
        assert planner.counters["superseded", "disk"] == 1
        catalog.flush()
    with DiskCatalog.open(disk, FP, payload, slots, 1) as catalog:
        assert set(catalog.recovered) == {full}  # the removal was journaled


def test_a_request_preempted_after_a_disk_hit_is_promoted_again_on_resume(caplog):
    # The first lookup's promotion deadline must not outlive it: once preempted (its blocks
    # freed) and evicted from host meanwhile, the resumed request's disk hit is promoted
    # again, not cut short by a deadline that ran out while it was computing.
    planner = make(host_slots=2, disk_slots=8, load_timeout_s=0.01)
    a = list(range(2 * CHUNK_TOKENS + 1))
    store_prompt(planner, "a", a)
    ok_all(planner, planner.take_plan())
    store_prompt(planner, "b", [t + 10_000 for t in a])
    ok_all(planner, planner.take_plan())
    assert planner.lookup("c", keys_for(a), 0, len(a)) is None
    ok_all(planner, planner.take_plan())
    hit = planner.lookup("c", keys_for(a), 0, len(a))
    assert hit == 2 * CHUNK_TOKENS
    planner.on_alloc("c", list(range(9)), hit)
    ok_all(planner, planner.take_plan())
    # c computes; another prompt takes the host tier; then c is preempted.
    store_prompt(planner, "d", [t + 20_000 for t in a])
    ok_all(planner, planner.take_plan())
    assert not any(planner.host.is_ready(k) for k in keys_for(a))
    planner.preempted("c")
    planner.take_plan()
    time.sleep(0.05)  # past the first lookup's deadline
    with caplog.at_level("WARNING", logger="tieredkv"):
        assert planner.lookup("c", keys_for(a), 0, len(a)) is None
        promote = planner.take_plan()
        assert len(promote.of(Move.PROMOTE)) == 2
    assert "timed out" not in caplog.text
    ok_all(planner, promote)
    assert planner.lookup("c", keys_for(a), 0, len(a)) == 2 * CHUNK_TOKENS
