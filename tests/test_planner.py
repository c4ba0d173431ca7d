"""The scheduler-side planner, driven with plain data (no vLLM, no bytes moved)."""

from __future__ import annotations

import time

import pytest

from tieredkv.config import TieredKVConfig
from tieredkv.keys import chunk_keys, sha256_block_hashes
from tieredkv.planner import JobOutcome, Planner

BLOCK = 16
CHUNK_BLOCKS = 4
CHUNK_TOKENS = BLOCK * CHUNK_BLOCKS
FP = b"f" * 32


def keys_for(tokens: list[int], salt: str | None = None) -> list[bytes]:
    return chunk_keys(FP, sha256_block_hashes(tokens, BLOCK, salt), CHUNK_BLOCKS)


def make(host_slots: int = 8, disk_slots: int = 0, world: int = 1, **extra) -> Planner:
    cfg = TieredKVConfig.from_dict({"chunk_blocks": CHUNK_BLOCKS, **extra})
    return Planner(cfg, block_size=BLOCK, num_host_slots=host_slots, num_disk_slots=disk_slots, world_size=world)


def ok_all(planner: Planner, plan, ranks: int = 1) -> None:
    jobs = [*plan.stores, *plan.spills, *plan.promotes, *plan.loads]
    planner.apply({job.job_id: JobOutcome(ok=ranks) for job in jobs})


def store_prompt(planner: Planner, req: str, tokens: list[int], ranks: int = 1):
    n_blocks = len(tokens) // BLOCK
    planner.set_block_ids(req, list(range(100, 100 + n_blocks)), replace=True)
    planner.plan_stores(req, keys_for(tokens), len(tokens))
    plan = planner.take_plan()
    ok_all(planner, plan, ranks)
    return plan


def test_store_then_hit_loads_exact_blocks_and_unpins():
    planner = make()
    tokens = list(range(5 * CHUNK_TOKENS + 7))
    plan = store_prompt(planner, "a", tokens)
    assert len(plan.stores) == 5
    assert plan.stores[0].block_ids == (100, 101, 102, 103)
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
    (load,) = plan.loads
    assert load.chunks[0].first_block == 1
    assert load.chunks[0].block_ids == (501, 502, 503)
    assert load.chunks[1].block_ids == (504, 505, 506, 507)
    assert planner.hit_tokens("b") == {"host": hit, "disk": 0}
    ok_all(planner, plan)
    assert planner.host.pinned_count == 0
    planner.host.check_invariants()


def test_hit_never_covers_the_last_prompt_token():
    planner = make()
    tokens = list(range(2 * CHUNK_TOKENS))  # exactly on a chunk boundary
    store_prompt(planner, "a", tokens)
    hit = planner.lookup("b", keys_for(tokens), 0, len(tokens))
    assert hit == 2 * CHUNK_TOKENS - BLOCK  # last block left for vLLM to compute
    planner.on_alloc("b", list(range(2 * CHUNK_BLOCKS)), hit)
    (load,) = planner.take_plan().loads
    assert load.chunks[-1].block_ids == (4, 5, 6)


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
    assert len(plan.stores) == 2  # both slots pinned by in-flight writes
    assert planner.counters["store_skipped_host_full"] == 2


def test_failed_store_leaves_no_entry():
    planner = make()
    tokens = list(range(CHUNK_TOKENS + 1))
    planner.set_block_ids("a", list(range(8)), replace=True)
    planner.plan_stores("a", keys_for(tokens), len(tokens))
    (store,) = planner.take_plan().stores
    planner.apply({store.job_id: JobOutcome(failed=1, failure="copy_error")})
    assert len(planner.host) == 0 and planner.host.free_slots == 8


def test_tp_job_completes_only_when_every_rank_reported():
    planner = make(world=2)
    tokens = list(range(CHUNK_TOKENS + 1))
    planner.set_block_ids("a", list(range(8)), replace=True)
    planner.plan_stores("a", keys_for(tokens), len(tokens))
    (store,) = planner.take_plan().stores
    planner.apply({store.job_id: JobOutcome(ok=1)})
    assert planner.host.ready_count == 0  # one rank is not enough
    planner.apply({store.job_id: JobOutcome(ok=1)})
    assert planner.host.ready_count == 1


def test_tp_failure_on_any_rank_fails_the_job():
    planner = make(world=2)
    tokens = list(range(CHUNK_TOKENS + 1))
    planner.set_block_ids("a", list(range(8)), replace=True)
    planner.plan_stores("a", keys_for(tokens), len(tokens))
    (store,) = planner.take_plan().stores
    planner.apply({store.job_id: JobOutcome(ok=1)})
    planner.apply({store.job_id: JobOutcome(failed=1, failure="io_error")})
    assert len(planner.host) == 0


def test_store_spills_then_disk_hit_is_promoted_before_promise():
    planner = make(host_slots=2, disk_slots=8)
    a = list(range(2 * CHUNK_TOKENS + 1))
    plan = store_prompt(planner, "a", a)
    plan = planner.take_plan()
    assert len(plan.spills) == 2
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
    assert len(plan.promotes) == 2 and not plan.loads
    assert planner.lookup("c", keys_for(a), 0, len(a)) is None  # still in flight
    assert not planner.take_plan().promotes  # asking again issues nothing new
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
    (promote,) = planner.take_plan().promotes
    planner.apply({promote.job_id: JobOutcome(failed=1, failure="checksum")})
    assert planner.lookup("c", keys_for(a), 0, len(a)) == 0
    assert keys_for(a)[0] not in planner.disk
    assert planner.counters["disk_read_failed_checksum"] == 1


def test_disk_admission_requires_n_sightings():
    planner = make(host_slots=4, disk_slots=8, disk_admission=2)
    a = list(range(CHUNK_TOKENS + 1))
    store_prompt(planner, "a", a)
    assert not planner.take_plan().spills
    assert planner.counters["disk_admission_rejected"] == 1
    hit = planner.lookup("b", keys_for(a), 0, len(a))
    planner.on_alloc("b", list(range(8)), hit)
    assert len(planner.take_plan().spills) == 1  # second sighting admits it


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
    (load,) = planner.take_plan().loads
    failed = set(load.chunks[1].block_ids) | set(load.chunks[2].block_ids)
    planner.apply({load.job_id: JobOutcome(failed=1, failure="copy_error", failed_block_ids=failed)})
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
    planner.host.check_invariants()
    planner.disk.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_eviction_policies_make_room_for_new_chunks(policy):
    planner = make(host_slots=2, eviction=policy)
    for i in range(5):
        store_prompt(planner, f"r{i}", [i * 100_000 + t for t in range(CHUNK_TOKENS + 1)])
    assert planner.host.ready_count == 2
    assert planner.counters["evictions_host"] == 3


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
    assert {p.key for p in plan.promotes} == {keys[0], keys[1]}
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
    assert len(plan.promotes) == 1
    ok_all(planner, plan)
    assert planner.lookup("c", keys_for(a), 0, len(a)) == CHUNK_TOKENS
    assert planner.lookup("d", keys_for(a), 0, len(a)) == CHUNK_TOKENS
    planner.host.check_invariants()


def test_a_chunk_being_written_to_host_ends_the_run_instead_of_being_promoted():
    planner = make(host_slots=4, disk_slots=8)
    a = list(range(2 * CHUNK_TOKENS + 1))
    store_prompt(planner, "a", a)
    ok_all(planner, planner.take_plan())  # spilled, still in host
    keys = keys_for(a)
    planner.host.remove(keys[0])  # host copy gone, disk copy stays
    assert planner.host.allocate(keys[0]) is not None  # a write into host is in flight
    assert planner.lookup("c", keys, 0, len(a)) == 0  # no KeyError, no second allocation
    assert not planner.take_plan().promotes


def test_a_stuck_promotion_times_out_into_a_plain_answer():
    planner = make(host_slots=2, disk_slots=8, load_timeout_s=0.01)
    a = list(range(CHUNK_TOKENS + 1))
    store_prompt(planner, "a", a)
    ok_all(planner, planner.take_plan())
    store_prompt(planner, "b", [t + 10_000 for t in range(2 * CHUNK_TOKENS + 1)])
    assert planner.lookup("c", keys_for(a), 0, len(a)) is None
    time.sleep(0.05)
    assert planner.lookup("c", keys_for(a), 0, len(a)) == 0  # never an endless "ask me later"
