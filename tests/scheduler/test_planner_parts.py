"""The planner's parts on their own: a resolved config, the lower-tier ABC (the job ledger:
test_ledger.py)."""

from __future__ import annotations

import pytest
from test_planner import BLOCK, CHUNK_BLOCKS, CHUNK_TOKENS, keys_for, ok_all, store_prompt

from tests.scheduler.index_checks import check_invariants
from tieredkv.config import TieredKVConfig
from tieredkv.protocol import Move
from tieredkv.scheduler.lower_tier import DiskTier, LowerTier
from tieredkv.scheduler.planner import Planner


def test_planner_refuses_a_config_that_is_not_resolved():
    with pytest.raises(ValueError, match="resolved"):
        Planner(TieredKVConfig(), block_size=BLOCK, num_host_slots=4)
    planner = Planner(TieredKVConfig().resolved(BLOCK), block_size=BLOCK, num_host_slots=4)
    assert planner.chunk_blocks == 256 // BLOCK


class MemoryTier(DiskTier):
    """Another tier below host (no catalog, its own name): what a remote tier would plug in."""

    name = "remote"
    max_aliases = 0


def test_disk_tier_is_a_lower_tier():
    assert isinstance(DiskTier(2, policy="lru", admission=1, seen_limit=8), LowerTier)


def test_the_planner_runs_on_any_lower_tier():
    cfg = TieredKVConfig.from_dict({"chunk_blocks": CHUNK_BLOCKS})
    planner = Planner(cfg, block_size=BLOCK, num_host_slots=2,
                      lower_tier=MemoryTier(8, policy="lru", admission=1, seen_limit=64))
    a = list(range(CHUNK_TOKENS + 1))
    store_prompt(planner, "a", a)
    plan = planner.take_plan()
    (spill,) = plan.of(Move.SPILL)
    ok_all(planner, plan)
    store_prompt(planner, "b", [t + 10_000 for t in range(2 * CHUNK_TOKENS + 1)])  # evicts a
    ok_all(planner, planner.take_plan())
    assert planner.lookup("c", keys_for(a), 0, len(a)) is None
    plan = planner.take_plan()
    (promote,) = plan.of(Move.PROMOTE)
    assert promote.src.slot == spill.dst.slot
    ok_all(planner, plan)
    assert planner.lookup("c", keys_for(a), 0, len(a)) == CHUNK_TOKENS
    planner.on_alloc("c", list(range(20, 20 + CHUNK_BLOCKS + 1)), CHUNK_TOKENS)
    ok_all(planner, planner.take_plan())
    assert planner.hit_tokens("c") == {"remote": CHUNK_TOKENS, "host": 0}
    assert planner.counters["hit_tokens", "remote"] == CHUNK_TOKENS
    assert planner.counters["evictions", "host"] >= 1
    gauges = planner.gauges()
    assert gauges["remote_slots_capacity"] == 8 and gauges["jobs_in_flight"] == 0
    check_invariants(planner.host)
    with pytest.raises(ValueError, match="one tier below host"):
        Planner(cfg, block_size=BLOCK, num_host_slots=2, num_disk_slots=4,
                lower_tier=MemoryTier(8, policy="lru", admission=1, seen_limit=64))


def test_a_lower_tier_that_does_not_admit_is_counted_by_its_name():
    cfg = TieredKVConfig.from_dict({"chunk_blocks": CHUNK_BLOCKS})
    planner = Planner(cfg, block_size=BLOCK, num_host_slots=4,
                      lower_tier=MemoryTier(8, policy="lru", admission=2, seen_limit=64))
    store_prompt(planner, "a", list(range(CHUNK_TOKENS + 1)))
    assert not planner.take_plan().of(Move.SPILL)
    assert planner.counters["remote_admission_rejected"] == 1
