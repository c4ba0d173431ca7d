"""Hybrid models' hits end where a stored prompt ended (#25.1), not only on chunk boundaries.

A prompt's tail (its full blocks past the last whole chunk, ``n`` of them) is stored with the
full-attention rows ``0 .. n-1`` and each sliding group's rows ``[max(0, n - W), n)``, the
window vLLM's prefix cache needs before a hit ending there; the whole chunk before it holds its
own last ``W``. A hit may end exactly at such an entry's end, and nowhere else inside a chunk
(an entry's sliding rows end at its end only). A prompt ending on a block boundary also
stores the entry one block shorter, where vLLM's prefix cache ends a repeat of it (it computes
the last token): a repeated prompt hits what vLLM's own prefix cache would. Real planner, host and disk indexes; the
device tables are the ones vLLM 0.32 hands out (a sliding group gets real blocks only for the
window before a hit's end).
"""

from __future__ import annotations

import pytest

from tieredkv.config import TieredKVConfig
from tieredkv.keys import LazyChunkKeys
from tieredkv.metrics.specs import Count
from tieredkv.protocol import (
    FULL,
    NO_BLOCK,
    SLIDING,
    FailureCause,
    JobResult,
    KVGroup,
    Move,
    SlotRows,
    Tier,
)
from tieredkv.scheduler.planner import Planner
from tieredkv.testing.hashing import sha256_block_hashes

BLOCK, C = 16, 4
CHUNK_TOKENS = BLOCK * C
FP = b"t" * 32
X = NO_BLOCK


def rows(window: int) -> SlotRows:
    return SlotRows((KVGroup(SLIDING, window), KVGroup(FULL)), chunk_blocks=C)


def keys(tokens: list[int]) -> LazyChunkKeys:
    # As the scheduler half makes them for every model: whole chunks, and any block.
    return LazyChunkKeys(FP, sha256_block_hashes(tokens, BLOCK), C, hashes_per_block=1)


def prompt(blocks: int, extra: int, seed: int = 0) -> list[int]:
    return [seed * 10_000 + i for i in range(blocks * BLOCK + extra)]


def make(window: int = 2, host_slots: int = 16, disk_slots: int = 0) -> Planner:
    config = TieredKVConfig.from_dict({"chunk_blocks": C})
    return Planner(config, block_size=BLOCK, num_host_slots=host_slots,
                   num_disk_slots=disk_slots, world_size=1, slot_rows=rows(window))


def done(planner: Planner, *moves: Move) -> list:
    plan = planner.take_plan()
    jobs = [job for move in moves for job in plan.of(move)]
    planner.apply([JobResult.done(job.job_id) for job in jobs])
    return jobs


def compute(planner: Planner, req: str, tokens: list[int], computed: int = 0) -> list:
    """One prefill step computing ``tokens[computed:]``: its stores (the prompt's tail too),
    all completed; vLLM gave both groups real blocks (sliding: 100.., full: 200..)."""
    n = -(-len(tokens) // BLOCK)
    planner.set_block_ids(req, [list(range(100, 100 + n)), list(range(200, 200 + n))], replace=True)
    planner.plan_stores(req, keys(tokens), len(tokens), tail=True, computed_tokens=computed)
    return done(planner, Move.STORE)


def vllm_tables(hit_blocks: int, total_blocks: int, window: int) -> list[list[int]]:
    """What vLLM allocates for a hit of ``hit_blocks``: the sliding group real blocks only for
    the ``window`` blocks before the hit's end (and the new tokens), the full group all."""
    sliding = [0 if i < hit_blocks - window else 500 + i for i in range(total_blocks)]
    return [sliding, [600 + i for i in range(total_blocks)]]


def load_after_hit(planner: Planner, req: str, tokens: list[int], hit: int, window: int):
    total = -(-len(tokens) // BLOCK)
    planner.on_alloc(req, vllm_tables(hit // BLOCK, total, window), hit)
    (load,) = planner.take_plan().of(Move.LOAD)
    return load


# --- SlotRows: what an entry of n blocks stores, loads, and cannot serve ---------------------


def test_a_tail_stores_its_full_rows_and_the_window_before_its_end():
    tables = [[10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 23, 24, 25, 26, 27]]
    layout = rows(2)
    assert layout.store_rows(tables, 1, 3) == (X, 15, 16, X, 24, 25, 26, X)
    assert layout.store_rows(tables, 1) == (X, X, 16, 17, 24, 25, 26, 27)  # whole: n = C
    assert layout.stored_rows(3) == 5 and layout.stored_rows() == 6 and layout.rows == 8


def test_a_window_larger_than_the_tail_keeps_every_row_of_the_tail():
    tables = [[10, 11, 12, 13, 14, 15, 16, 17], [20, 21, 22, 23, 24, 25, 26, 27]]
    layout = rows(3)
    assert layout.store_rows(tables, 1, 2) == (14, 15, X, X, 24, 25, X, X)
    assert layout.store_rows(tables, 1, 1) == (14, X, X, X, 24, X, X, X)  # a one-block tail
    assert layout.stored_rows(2) == 4 and layout.stored_rows(1) == 2


def test_a_tail_loads_only_its_rows_and_names_a_block_it_lacks_unserved():
    layout = rows(2)
    # A hit ending at the tail's end (block 7): vLLM's sliding blocks 5 and 6.
    tables = [[0, 0, 0, 0, 0, 55, 56, 57], [60, 61, 62, 63, 64, 65, 66, 67]]
    assert layout.load_rows(tables, 1, 4, 7, 3) == (X, 55, 56, X, 64, 65, 66, X)
    assert layout.unserved(tables, 1, 4, 7, 3) == []
    # A sliding block at row 0 of the tail: the store never kept it.
    wider = [[0, 0, 0, 0, 54, 55, 56, 57], tables[1]]
    assert layout.load_rows(wider, 1, 4, 7, 3)[0] == X
    assert layout.unserved(wider, 1, 4, 7, 3) == [54]
    # Read as a whole chunk (rows 2 and 3 kept), the same range would miss block 55.
    assert layout.unserved(tables, 1, 4, 7) == [55]


@pytest.mark.parametrize("n", [0, C + 1])
def test_an_entry_holds_one_to_chunk_blocks(n):
    with pytest.raises(ValueError, match="1..4 blocks"):
        rows(2).store_rows([[1] * 8, [2] * 8], 1, n)


# --- the planner: stores and hits ------------------------------------------------------------


def test_a_chats_next_turn_hits_where_the_previous_turn_ended():
    planner = make(window=2)
    turn1 = prompt(C + 3, 5)  # a whole chunk, a 3-block tail, 5 tokens
    stores = compute(planner, "t1", turn1)
    assert [s.block_ids for s in stores] == [
        (X, X, 102, 103, 200, 201, 202, 203),  # chunk 0: the sliding group's last 2 rows
        (X, 105, 106, X, 204, 205, 206, X),  # the tail: the window before its end
    ]
    assert planner.counters["stored_partial_chunks"] == 1
    turn2 = turn1 + [90_000 + i for i in range(70)]
    hit = (C + 3) * BLOCK
    assert planner.lookup("t2", keys(turn2), 0, len(turn2)) == hit  # vLLM's hit too
    load = load_after_hit(planner, "t2", turn2, hit, window=2)
    assert not load.src.unserved
    assert [c.block_ids for c in load.src.chunks] == [
        (X, X, X, X, 600, 601, 602, 603), (X, 505, 506, X, 604, 605, 606, X)]
    assert planner.counters["partial_hits"] == 1
    assert planner.counters.snapshot()["hit_tokens"] == {"host": hit}


def test_a_window_larger_than_the_tail_is_served_with_the_chunk_before_it():
    planner = make(window=3)
    turn1 = prompt(C + 2, 3)
    stores = compute(planner, "t1", turn1)
    assert [s.block_ids for s in stores] == [
        (X, 101, 102, 103, 200, 201, 202, 203), (104, 105, X, X, 204, 205, X, X)]
    turn2 = turn1 + [90_000 + i for i in range(40)]
    hit = (C + 2) * BLOCK
    assert planner.lookup("t2", keys(turn2), 0, len(turn2)) == hit
    load = load_after_hit(planner, "t2", turn2, hit, window=3)
    assert not load.src.unserved  # blocks 3 (chunk 0's last row), 4 and 5 (the tail)
    assert [c.block_ids[:C] for c in load.src.chunks] == [(X, X, X, 503), (504, 505, X, X)]


def test_a_one_block_tail_is_a_hit_end():
    planner = make(window=2)
    turn1 = prompt(C + 1, 7)
    stores = compute(planner, "t1", turn1)
    assert stores[-1].block_ids == (104, X, X, X, 204, X, X, X)
    turn2 = turn1 + [90_000 + i for i in range(20)]
    assert planner.lookup("t2", keys(turn2), 0, len(turn2)) == (C + 1) * BLOCK
    assert not load_after_hit(planner, "t2", turn2, (C + 1) * BLOCK, window=2).src.unserved


def test_a_hit_never_ends_mid_chunk_where_no_prompt_ended():
    planner = make(window=2)
    turn1 = prompt(C + 3, 5)
    compute(planner, "t1", turn1)
    # Shares turn1's chunk and two blocks of its tail, then differs: the tail holds those
    # blocks' full-attention rows but not the window before block 6. One chunk, not 6 blocks.
    other = turn1[: (C + 2) * BLOCK] + [80_000 + i for i in range(50)]
    assert planner.lookup("o", keys(other), 0, len(other)) == CHUNK_TOKENS
    # A longer prompt's whole chunk 1 lies under the same blocks: still no hit inside it.
    longer = make(window=2)
    compute(longer, "l", prompt(2 * C + 1, 3))
    assert longer.lookup("o", keys(prompt(C + 2, 9)), 0, (C + 2) * BLOCK + 9) == CHUNK_TOKENS


def test_a_tail_past_the_hit_limit_is_not_cut_short():
    """A tail ending past ``num_tokens - 1`` (a shorter prompt sharing it, ending inside its
    last block) has no window ending where that prompt's hit may end: no hit inside it."""
    planner = make(window=2)
    tokens = prompt(C + 3, 5)
    compute(planner, "a", tokens)
    shorter = tokens[: (C + 2) * BLOCK + 7]
    assert planner.lookup("b", keys(shorter), 0, len(shorter)) == CHUNK_TOKENS


def vllm_repeat_hit(tokens: list[int]) -> int:
    """vLLM's prefix-cache hit for a prompt all of whose blocks it holds: it computes the
    last token, so ``num_tokens - 1`` rounded down to a block."""
    return (len(tokens) - 1) // BLOCK * BLOCK


@pytest.mark.parametrize(("window", "blocks"), [(2, C + 2), (2, C + 1), (2, 2 * C), (1, 2 * C),
                                                (6, C + 3), (6, 2 * C), (9, 3 * C)])
def test_a_repeated_prompt_ending_on_a_block_boundary_hits_what_vllm_hits(window, blocks):
    """A prompt of whole blocks, repeated exactly: the hit is ``num_tokens - 1`` rounded down
    to a block, as vLLM's own prefix cache gives (it ended at a chunk boundary or one block
    short of the stored tail before #25b). Windows smaller and larger than a chunk (6 and 9
    blocks > 4), prompts ending inside a chunk and exactly on a chunk boundary."""
    planner = make(window=window)
    tokens = prompt(blocks, 0)
    compute(planner, "a", tokens)
    hit = vllm_repeat_hit(tokens)
    assert hit == (blocks - 1) * BLOCK
    assert planner.lookup("b", keys(tokens), 0, len(tokens)) == hit
    load = load_after_hit(planner, "b", tokens, hit, window=window)
    assert not load.src.unserved  # every block vLLM handed out is written
    assert planner.counters["partial_hits"] == ((blocks - 1) % C != 0)
    assert planner.counters.snapshot()["hit_tokens"] == {"host": hit}


def test_the_entry_a_repeat_hits_holds_the_window_before_its_end():
    planner = make(window=2)
    stores = compute(planner, "a", prompt(2 * C, 0))  # ends exactly on a chunk boundary
    assert [s.block_ids for s in stores] == [
        (X, X, 102, 103, 200, 201, 202, 203),
        (X, X, 106, 107, 204, 205, 206, 207),
        (X, 105, 106, X, 204, 205, 206, X),  # blocks 4..6: the sliding rows before block 7
    ]
    tokens = prompt(C + 3, 0)  # ends inside a chunk: its tail and the entry one block shorter
    other = make(window=2)
    stores = compute(other, "a", tokens)
    assert [s.block_ids for s in stores][1:] == [
        (104, 105, X, X, 204, 205, X, X), (X, 105, 106, X, 204, 205, 206, X)]
    assert other.counters["stored_partial_chunks"] == 2


def test_a_repeat_end_is_stored_only_when_its_window_is_still_held():
    """vLLM frees a sliding block once the next token to compute lies a window past it: a
    step that starts inside the prompt's last block may have freed the first block of the
    window before the block one short of the end, so that entry is not stored (a shorter
    hit, never a wrong one); the prompt's own tail still is."""
    tokens = prompt(C + 3, 0)
    for split, stored, hit in (((C + 2) * BLOCK + 1, 1, CHUNK_TOKENS),  # one token into it
                               ((C + 2) * BLOCK, 2, (C + 2) * BLOCK)):  # at its start
        planner = make(window=2)
        planner.set_block_ids("a", [list(range(100, 100 + C + 3)),
                                    list(range(200, 200 + C + 3))], replace=True)
        planner.plan_stores("a", keys(tokens), split, computed_tokens=0)  # a chunked prefill
        assert len(done(planner, Move.STORE)) == 1  # chunk 0
        compute(planner, "a", tokens, computed=split)  # the step that ends the prompt
        assert planner.counters["stored_partial_chunks"] == stored  # the 3-block tail (+ 2)
        assert planner.lookup("b", keys(tokens), 0, len(tokens)) == hit


def test_a_full_host_tier_skips_the_tail_before_the_entry_a_repeat_hits():
    """A host tier sized for the entries a hit reads (whole chunks and one partial entry): the
    entry a repeat hits is stored first, so the one the step cannot place is the tail."""
    planner = make(window=2, host_slots=2)
    tokens = prompt(C + 3, 0)
    compute(planner, "a", tokens)
    assert planner.counters["store_skipped_host_full"] == 1
    assert planner.lookup("b", keys(tokens), 0, len(tokens)) == vllm_repeat_hit(tokens)


def test_a_repeat_end_on_disk_is_promoted_and_ends_the_hit():
    planner = make(window=2, host_slots=3, disk_slots=8)
    tokens = prompt(C + 3, 0)
    compute(planner, "a", tokens)
    assert len(done(planner, Move.SPILL)) == 3  # the chunk, the tail, the entry a repeat hits
    compute(planner, "x", prompt(3 * C, 1, seed=7))  # evicts them from host
    done(planner, Move.SPILL)
    assert planner.lookup("b", keys(tokens), 0, len(tokens)) is None  # promoting
    assert len(done(planner, Move.PROMOTE)) == 2  # the chunk and the 2-block entry
    hit = vllm_repeat_hit(tokens)
    assert planner.lookup("b", keys(tokens), 0, len(tokens)) == hit == (C + 2) * BLOCK
    load = load_after_hit(planner, "b", tokens, hit, window=2)
    assert not load.src.unserved
    assert load.src.chunks[-1].block_ids == (504, 505, X, X, 604, 605, X, X)
    assert planner.counters.snapshot()["hit_tokens"] == {"disk": hit}
    # After a restart the disk tier keeps both entries of chunk 1 (test_disk_tier.py).
    assert planner.lower.supersedes is False


def test_a_hybrid_hit_is_never_longer_than_vllms():
    """Every prompt length around chunk and block boundaries, after the same prompt and after
    a longer one sharing it: the hit never passes ``num_tokens - 1`` rounded down to a block
    (vLLM's most), and every load writes each block vLLM hands out."""
    for window in (1, 2, 3, 6):
        for length in range(BLOCK + 1, 3 * CHUNK_TOKENS + 2, 5):
            for stored_length in (length, length + 17, 3 * CHUNK_TOKENS + 3):
                planner = make(window=window)
                stored = prompt(3 * C + 1, 3)[:stored_length]
                compute(planner, "a", stored)
                tokens = stored[:length]
                hit = planner.lookup("b", keys(tokens), 0, len(tokens))
                assert hit is not None and hit <= vllm_repeat_hit(tokens), (window, length)
                if hit:
                    load = load_after_hit(planner, "b", tokens, hit, window=window)
                    assert not load.src.unserved, (window, length, stored_length)


def test_a_tail_is_stored_only_in_the_step_that_computes_its_end():
    """vLLM frees a sliding window's older blocks without telling a connector: a tail whose
    end an earlier step computed may have lost the window before it."""
    tokens = prompt(C + 3, 5)
    late = make(window=2)
    n = -(-len(tokens) // BLOCK)
    late.set_block_ids("a", [list(range(100, 100 + n)), list(range(200, 200 + n))], replace=True)
    late.plan_stores("a", keys(tokens), (C + 3) * BLOCK + 2, computed_tokens=0)
    assert len(done(late, Move.STORE)) == 1  # chunk 0; the prompt is not done yet
    late.plan_stores("a", keys(tokens), len(tokens), tail=True, computed_tokens=(C + 3) * BLOCK + 2)
    assert done(late, Move.STORE) == [] and late.counters["stored_partial_chunks"] == 0
    in_time = make(window=2)
    compute(in_time, "a", tokens, computed=(C + 3) * BLOCK - 1)
    assert in_time.counters["stored_partial_chunks"] == 1


def test_a_longer_entry_neither_blocks_nor_supersedes_a_tail():
    """A whole chunk holds a tail's blocks but not the window before the tail's end: the tail
    is stored beside it, kept, and still ends a hit."""
    planner = make(window=2)
    long = prompt(2 * C + 1, 3)
    compute(planner, "long", long)
    short = long[: (C + 3) * BLOCK + 5]
    stores = compute(planner, "short", short)
    assert [s.block_ids for s in stores] == [(X, 105, 106, X, 204, 205, 206, X)]
    assert planner.host.ready_count == 4  # 2 chunks and 1-block tail of long, short's tail
    turn2 = short + [90_000 + i for i in range(40)]
    assert planner.lookup("t2", keys(turn2), 0, len(turn2)) == (C + 3) * BLOCK
    # And the longer prompt still hits its own chunks and tail.
    again = long + [70_000 + i for i in range(30)]
    assert planner.lookup("t3", keys(again), 0, len(again)) == (2 * C + 1) * BLOCK


def test_a_tail_on_disk_is_promoted_and_ends_the_hit():
    planner = make(window=2, host_slots=2, disk_slots=8)
    turn1 = prompt(C + 3, 5)
    compute(planner, "t1", turn1)
    assert len(done(planner, Move.SPILL)) == 2  # the chunk and the tail
    compute(planner, "x", prompt(2 * C, 1, seed=7))  # evicts both from host
    done(planner, Move.SPILL)
    turn2 = turn1 + [90_000 + i for i in range(40)]
    assert planner.lookup("t2", keys(turn2), 0, len(turn2)) is None  # promoting
    assert len(done(planner, Move.PROMOTE)) == 2
    hit = (C + 3) * BLOCK
    assert planner.lookup("t2", keys(turn2), 0, len(turn2)) == hit
    load = load_after_hit(planner, "t2", turn2, hit, window=2)
    assert not load.src.unserved
    assert load.src.chunks[-1].block_ids == (X, 505, 506, X, 604, 605, 606, X)
    assert planner.counters.snapshot()["hit_tokens"] == {"disk": hit}


def test_a_tail_whose_load_would_leave_a_block_unwritten_is_not_hit_again():
    """vLLM handing out more of a window than the tail keeps fails the load (#23.2); the
    request's next hit ends before that chunk, so not at the same tail either."""
    planner = make(window=2)
    turn1 = prompt(C + 3, 5)
    compute(planner, "t1", turn1)
    turn2 = turn1 + [90_000 + i for i in range(70)]
    hit = (C + 3) * BLOCK
    assert planner.lookup("t2", keys(turn2), 0, len(turn2)) == hit
    tables = vllm_tables(C + 3, -(-len(turn2) // BLOCK), window=3)  # block 4: not kept
    planner.on_alloc("t2", tables, hit)
    (load,) = planner.take_plan().of(Move.LOAD)
    assert load.src.unserved and planner.counters["load_rows_unserved"] == 1
    planner.apply([JobResult.fail(load.job_id, FailureCause.MISSING, load.block_ids)])
    assert planner.host.ready_count == 2  # the entries are sound: both stay
    assert planner.lookup("t2", keys(turn2), 0, len(turn2)) == CHUNK_TOKENS


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def on_slow_disk(tail_blocks: int, hybrid: bool = True) -> tuple[Planner, list[int]]:
    """A planner whose disk alone holds a prompt of 2 chunks and a ``tail_blocks`` tail
    (and 5 tokens): its reads are predicted at 2.64 ms (2.2 ms and the 20 % margin), and the
    engine prefills 64,000 tokens/s (a block recomputes in 0.25 ms). ``hybrid=False``: a
    one-group model (its partial hits end at any block an entry holds)."""
    clock = Clock()
    config = TieredKVConfig.from_dict({"chunk_blocks": C})
    planner = Planner(config, block_size=BLOCK, num_host_slots=3, num_disk_slots=8,
                      world_size=1, slot_rows=rows(2) if hybrid else None, clock=clock)

    def store(req: str, tokens: list[int]) -> None:
        if hybrid:
            compute(planner, req, tokens)
            return
        planner.set_block_ids(req, list(range(100, 100 + len(tokens) // BLOCK)), replace=True)
        planner.plan_stores(req, keys(tokens), len(tokens), tail=True)
        done(planner, Move.STORE)

    turn1 = prompt(2 * C + tail_blocks, 5)
    store("t1", turn1)
    assert len(done(planner, Move.SPILL)) == 3
    store("x", prompt(3 * C, 1, seed=7))  # evicts them from host
    done(planner, Move.SPILL)
    cost = planner.cost
    for round_ in range(3):  # disk: 3 rounds of 3 chunks, 2.2 ms each
        jobs = [10 * round_ + j for j in range(3)]
        cost.fills_started("disk", jobs)
        clock.now += 0.0022
        for job in jobs:
            cost.fill_done(job)
    for _ in range(3):  # prefill at 64,000 tokens/s
        cost.step_scheduled(640)
        clock.now += 0.01
        cost.step_done()
    return planner, turn1


DECLINED_DISK = (Count.HITS_DECLINED_SLOWER, Tier.DISK)


def test_the_cost_model_weighs_a_tail_that_ends_past_the_chunk_aligned_limit():
    """A hybrid tail in the prompt's last chunk ends past the last chunk boundary before the
    prompt's end: recomputing what the hit covers costs its tokens up to the tail's end, not to
    that boundary. Reads predicted at 2.64 ms for the 176 tokens a 2.75 ms recompute would
    take: taken (weighed against 128 tokens, 2 ms, it was declined)."""
    planner, turn1 = on_slow_disk(3)
    turn2 = turn1 + [90_000 + i for i in range(8)]  # its last chunk boundary: 128
    assert planner.lookup("t2", keys(turn2), 0, len(turn2)) is None  # promoting
    assert len(done(planner, Move.PROMOTE)) == 3
    assert planner.lookup("t2", keys(turn2), 0, len(turn2)) == (2 * C + 3) * BLOCK
    assert planner.counters[DECLINED_DISK] == 0


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "one_group"])
@pytest.mark.parametrize("more", [8, 200])
def test_a_tail_read_slower_than_recomputing_what_it_covers_is_declined(more: int, hybrid: bool):
    """A tail ending the hit at 144 tokens (2.25 ms to recompute) read in 2.64 ms: declined,
    however long the prompt goes on. Weighed up to its chunk's end (192 tokens, 3 ms, once
    the prompt passes it), it was taken: a hit slower than a miss."""
    planner, turn1 = on_slow_disk(1, hybrid)
    turn2 = turn1 + [90_000 + i for i in range(more)]
    assert planner.lookup("t2", keys(turn2), 0, len(turn2)) == 0
    assert planner.counters[DECLINED_DISK] == 1
    assert planner.counters[Count.HIT_TOKENS, Tier.DISK] == 0


def test_lookup_tokens_count_what_a_hybrid_hit_could_cover():
    """The tokens a lookup could hit (the hit ratio's denominator) reach the last full block
    before the prompt's last token, as a tail hit may: never fewer than the hit itself."""
    planner = make(window=2)
    turn1 = prompt(C + 3, 5)
    compute(planner, "t1", turn1)
    turn2 = turn1 + [90_000 + i for i in range(8)]  # its last chunk boundary: 64
    assert planner.lookup("t2", keys(turn2), 0, len(turn2)) == (C + 3) * BLOCK
    assert planner.counters["lookup_tokens"] == (C + 3) * BLOCK


def test_a_single_sliding_groups_table_grows_across_steps():
    """An all-sliding model (one KV-cache group, Mistral-style): vLLM reports a running
    request's new blocks only, to be appended. They replaced its table before, so a prompt
    prefilled over two steps stored its later chunks from the wrong table positions (or not
    at all, as the e2e test's fifth prompt in a batch)."""
    config = TieredKVConfig.from_dict({"chunk_blocks": C})
    planner = Planner(config, block_size=BLOCK, num_host_slots=16, num_disk_slots=0,
                      world_size=1, slot_rows=SlotRows((KVGroup(SLIDING, 7),), chunk_blocks=C))
    tokens = prompt(2 * C + 3, 0)
    planner.set_block_ids("a", [list(range(100, 105))], replace=True)  # step 1: 5 blocks
    planner.plan_stores("a", keys(tokens), 5 * BLOCK, computed_tokens=0)
    assert [s.block_ids for s in done(planner, Move.STORE)] == [(100, 101, 102, 103)]
    planner.set_block_ids("a", [list(range(105, 111))], replace=False)  # step 2: 6 more
    planner.plan_stores("a", keys(tokens), len(tokens), tail=True, computed_tokens=5 * BLOCK)
    assert [s.block_ids for s in done(planner, Move.STORE)] == [
        (104, 105, 106, 107),  # chunk 1: positions 4..7
        (108, 109, X, X),  # the entry a repeat hits (2 blocks of chunk 2)
        (108, 109, 110, X),  # the tail
    ]
    assert planner.lookup("b", keys(tokens), 0, len(tokens)) == vllm_repeat_hit(tokens)
