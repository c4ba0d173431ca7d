"""What the planner's parts share: one small object instead of eight constructor arguments."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from tieredkv.config import TieredKVConfig
from tieredkv.kv_groups import GroupLayout
from tieredkv.scheduler.ledger import JobLedger
from tieredkv.scheduler.lower_tier import LowerTier
from tieredkv.scheduler.remote_tier import RemoteTier
from tieredkv.scheduler.requests import HitEpoch, RequestTable
from tieredkv.scheduler.tier_index import TierIndex


@dataclass(frozen=True)
class PlannerParts:
    """The state :class:`~tieredkv.scheduler.lookup.Lookup` and
    :class:`~tieredkv.scheduler.placement.Placer` both read and update (one scheduler thread)."""

    config: TieredKVConfig
    block_size: int
    host: TierIndex
    lower: LowerTier | None
    requests: RequestTable
    ledger: JobLedger
    epoch: HitEpoch
    counters: Counter[str]
    remote: RemoteTier | None = None
    layout: GroupLayout | None = None  # None: one full-attention group
