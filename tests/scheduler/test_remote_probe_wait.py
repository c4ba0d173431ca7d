"""The remote probe never makes a request wait longer than a remote hit could save (#25):
the saving counts from what is computed or held here already, not from the chunk boundary."""

from __future__ import annotations

import pytest

from tests.scheduler.test_cost_model_planner import Clock, fast_engine
from tests.scheduler.test_planner import BLOCK
from tests.scheduler.test_remote_hybrid_tails import (  # noqa: F401 (make_replica: a fixture)
    HOST_SLOTS,
    LAYOUT,
    TURN1,
    C,
    a_tables,
    keys,
    make_replica,
)
from tests.scheduler.test_remote_tier import FP as STORE_FP
from tests.scheduler.test_remote_tier import Store
from tieredkv.config import TieredKVConfig
from tieredkv.protocol import JobResult, Move, SlotRows
from tieredkv.scheduler.planner import Planner
from tieredkv.scheduler.remote_tier import RemoteProbe, RemoteTier

# TURN1 is chunk 0, 3 blocks and 5 tokens (C = 4 blocks of 16): a hit ends by 112 tokens.
# The fast engine prefills 64,000 tokens/s: one block (16 tokens) is 0.25 ms to recompute.


def planner_over(store: Store, clock: Clock, layout: SlotRows | None, cost: bool = True) -> Planner:
    probe = RemoteProbe(store, STORE_FP, 1, deadline_s=10.0, clock=clock)
    tier = RemoteTier(probe, is_up=lambda: True, writes=False, admission=1, seen_limit=64,
                      clock=clock)
    planner = Planner(TieredKVConfig.from_dict({"chunk_blocks": C, "cost_model": cost}),
                      block_size=BLOCK, num_host_slots=HOST_SLOTS, remote=tier, slot_rows=layout,
                      clock=clock)
    fast_engine(planner, clock)
    return planner


@pytest.mark.parametrize("layout", [LAYOUT, None], ids=["hybrid", "one_group"])
def test_the_wait_counts_from_what_vllm_computed(layout: SlotRows | None) -> None:
    """vLLM's own cache covers 6 blocks; Redis's 3-block tail can add one block (0.25 ms):
    a probe still out after 0.5 ms is given up, however far the chunk boundary lies back."""
    clock, store = Clock(), Store()
    planner = planner_over(store, clock, layout)
    computed = (C + 2) * BLOCK
    store.put(keys(TURN1).block_key(C + 2))
    store.hold = True
    assert planner.lookup("r", keys(TURN1), computed, len(TURN1)) is None  # probe out
    clock.now += 0.0005
    assert planner.lookup("r", keys(TURN1), computed, len(TURN1)) == 0  # computed instead


def test_the_wait_counts_from_the_tail_host_holds_already() -> None:
    """Host holds chunk 0 and a 2-block tail (a shorter prompt's); Redis's 3-block tail adds
    one block past it (0.25 ms): after 0.5 ms the request takes what host holds."""
    clock, store = Clock(), Store()
    planner = planner_over(store, clock, LAYOUT)
    shorter = TURN1[:(C + 2) * BLOCK + 5]
    planner.set_block_ids("w", a_tables(shorter), replace=True)
    planner.plan_stores("w", keys(shorter), len(shorter), tail=True, computed_tokens=0)
    planner.apply([JobResult.done(job.job_id) for job in planner.take_plan().of(Move.STORE)])
    planner.finished("w")
    assert planner.host.is_ready(keys(TURN1).block_key(C + 1))  # the 2-block tail
    store.put(keys(TURN1).block_key(C + 2))
    store.hold = True
    assert planner.lookup("r", keys(TURN1), 0, len(TURN1)) is None  # probe out
    clock.now += 0.0005
    assert planner.lookup("r", keys(TURN1), 0, len(TURN1)) == (C + 2) * BLOCK  # host's hit


def test_a_hybrid_prompts_chunks_and_tail_go_in_the_one_probe_sent_on_arrival() -> None:
    clock, store = Clock(), Store()
    planner = planner_over(store, clock, LAYOUT, cost=False)
    store.put(keys(TURN1)[0])
    store.put(keys(TURN1).block_key(C + 2))
    planner.prefetch_remote("r", keys(TURN1), len(TURN1))
    assert len(store.calls) == 1
    assert planner.lookup("r", keys(TURN1), 0, len(TURN1)) is None  # reading chunk + tail
    assert len(store.calls) == 1, store.calls  # no second round trip


ON_BOUNDARY = list(range((C + 3) * BLOCK))  # chunk 0 and 3 blocks; a repeat hits 6 blocks


def test_a_repeat_on_a_block_boundary_hits_the_shorter_entry_in_redis(make_replica) -> None:  # noqa: F811
    """Redis holds the 3-block tail and the 2-block entry a repeat hits: the longer one,
    ending past the repeat's limit, does not hide the shorter."""
    a = make_replica(5)
    a.compute_and_store("a", ON_BOUNDARY)
    assert a.planner.counters["remote_written_chunks"] == 3  # chunk 0, 3-block tail, 2-block end
    b = make_replica(9)
    assert b.lookup("b", ON_BOUNDARY) == (C + 2) * BLOCK
