"""A hybrid load whose range holds a device block no stored row fills (#23.2).

vLLM 0.32 gives a sliding-window group real blocks only for the window before a hit's end,
exactly the rows tieredkv stores; if it ever kept more, those blocks would stay unwritten and
vLLM would attend to whatever they held. The load must then fail (vLLM recomputes the
request) and the request's next hit must end before that chunk.
"""

from __future__ import annotations

from tieredkv.config import TieredKVConfig
from tieredkv.keys import LazyChunkKeys
from tieredkv.protocol import (
    FULL,
    NO_BLOCK,
    SLIDING,
    FailureCause,
    JobResult,
    KVGroup,
    Move,
    SlotRows,
)
from tieredkv.scheduler.planner import Planner
from tieredkv.testing.hashing import sha256_block_hashes

BLOCK, C = 16, 4
CHUNK_TOKENS = BLOCK * C
FP = b"h" * 32
LAYOUT = SlotRows((KVGroup(SLIDING, 2), KVGroup(FULL)), chunk_blocks=C)
TOKENS = list(range(2 * CHUNK_TOKENS + 10))  # two whole chunks and a tail


def keys() -> LazyChunkKeys:
    # As the scheduler half makes them for hybrid models: whole chunks only.
    return LazyChunkKeys(FP, sha256_block_hashes(TOKENS, BLOCK), C, hashes_per_block=0)


def hit_tokens(planner: Planner) -> dict[str, int]:
    """The ``hit_tokens`` counters by tier, as exported (zeros left out)."""
    return planner.counters.snapshot().get("hit_tokens", {})


def planner_with_both_chunks_stored() -> Planner:
    config = TieredKVConfig.from_dict({"chunk_blocks": C})
    planner = Planner(config, block_size=BLOCK, num_host_slots=8, num_disk_slots=0,
                      world_size=1, slot_rows=LAYOUT)
    n = len(TOKENS) // BLOCK
    planner.set_block_ids("a", [list(range(100, 100 + n)), list(range(200, 200 + n))], replace=True)
    planner.plan_stores("a", keys(), len(TOKENS), computed_tokens=0)
    plan = planner.take_plan()
    assert len(plan.of(Move.STORE)) == 2
    planner.apply([JobResult.done(job.job_id) for job in plan.of(Move.STORE)])
    assert planner.host.ready_count == 2
    return planner


def test_a_load_that_would_leave_a_block_unwritten_fails_and_the_retry_ends_before_it():
    planner = planner_with_both_chunks_stored()
    assert planner.lookup("b", keys(), 0, len(TOKENS)) == 2 * CHUNK_TOKENS
    # vLLM hands the sliding group a real block at position 4 (chunk 1, row 0): a row the
    # store did not keep (the 2-block window keeps rows 2 and 3 of each chunk).
    sliding = [0, 0, 0, 0, 41, 0, 42, 43]
    full = list(range(300, 308))
    planner.on_alloc("b", [sliding, full], 2 * CHUNK_TOKENS)
    (load,) = planner.take_plan().of(Move.LOAD)
    assert load.src.unserved, "a load that leaves block 41 unwritten must not report success"
    assert planner.counters["load_rows_unserved"] == 1
    # Known now to fail, it is no hit: its tokens are recomputed, so no tier counts them
    # (vLLM's own stats still get the split of the hit it was told, which must sum to it).
    assert hit_tokens(planner) == {}
    assert planner.counters["partial_hits"] == 0 and planner.counters["lookups"] == 1
    assert sum(planner.hit_tokens("b").values()) == 2 * CHUNK_TOKENS
    # Every rank fails it (the worker copies nothing); vLLM recomputes the request.
    planner.apply([JobResult.fail(load.job_id, FailureCause.MISSING, load.block_ids)])
    assert planner.counters["load_failed", "missing"] == 1
    # The stored chunks are sound: both stay.
    assert planner.host.ready_count == 2
    # Asked again from its first token, the request's hit ends before chunk 1.
    assert planner.lookup("b", keys(), 0, len(TOKENS)) == CHUNK_TOKENS
    planner.on_alloc("b", [[0, 0, 51, 52], [310, 311, 312, 313]], CHUNK_TOKENS)
    (retry,) = planner.take_plan().of(Move.LOAD)
    assert not retry.src.unserved
    assert retry.src.chunks[0].block_ids == (NO_BLOCK, NO_BLOCK, 51, 52, 310, 311, 312, 313)
    # The retry is served: its chunk is the only hit the request counts.
    assert hit_tokens(planner) == {"host": CHUNK_TOKENS}
    assert planner.counters["lookups"] == 1  # one request, answered once


def test_a_load_vllm_allocates_as_expected_is_served():
    planner = planner_with_both_chunks_stored()
    assert planner.lookup("b", keys(), 0, len(TOKENS)) == 2 * CHUNK_TOKENS
    planner.on_alloc("b", [[0, 0, 0, 0, 0, 0, 42, 43], list(range(300, 308))], 2 * CHUNK_TOKENS)
    (load,) = planner.take_plan().of(Move.LOAD)
    assert not load.src.unserved and planner.counters["load_rows_unserved"] == 0
    assert hit_tokens(planner) == {"host": 2 * CHUNK_TOKENS}
