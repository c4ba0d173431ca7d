"""The scheduler half's brain: every placement decision, made once, shipped as concrete jobs.

The planner owns the host tier and the tier below it (disk). It turns lookups into promises,
allocations into load jobs, newly computed chunks into store jobs, finished stores into
spills, and worker results back into index state. It never touches KV bytes and never
imports vLLM: the connector feeds it plain data (request ids, chunk keys, device block ids,
token counts).

This class is the facade; the work is done by its parts, which share small explicit objects
(:class:`~tieredkv.scheduler.ledger.PlannerParts`: the host :class:`TierIndex`, the
:class:`DiskTier`, the :class:`RequestTable`, the :class:`HitEpoch` and the counters):

* :mod:`~tieredkv.scheduler.lookup` -- lookups, hits -> load jobs;
* :class:`~tieredkv.scheduler.lower_tier.Fill` -- chunks of a lower tier (disk or remote) into host slots;
* :mod:`~tieredkv.scheduler.placement` -- stores, tails, spills, one copy per tier;
* :mod:`~tieredkv.scheduler.ledger` -- jobs in flight, the step plan, results -> completions;
* :mod:`~tieredkv.scheduler.lower_tier` -- the tiers below host (the disk tier: index,
  catalog, admission);
* :mod:`~tieredkv.scheduler.remote_tier` -- the shared remote tier (probes, write admission).

Rules it keeps:
* Only ``READY`` host chunks are promised. Disk chunks are first promoted into host slots
  (verified by checksum on the worker) while the lookup answers ``None``.
* Every slot a job touches is pinned in its index until every rank reported the job.
* A failed job drops its entry; nothing that failed is ever promised again.
* Allocation failure is a miss, never a wait.
* Hits end at the last block held, not at a chunk boundary: an entry holds the first ``n``
  blocks of one chunk (``n`` = ``chunk_blocks`` for a whole chunk, fewer for a prompt's tail)
  and is found by the key of any block it holds (see ``TierIndex``). Within a tier, an entry
  whose blocks another READY entry holds too is dropped once that entry is ready
  (``superseded_host``/``superseded_disk``): a tail that grows leaves one copy, not two.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tieredkv.config import TieredKVConfig
from tieredkv.metrics.specs import Count, CountKey, Counts
from tieredkv.protocol import JobResult, Move, SlotRows, StepPlan, Tier
from tieredkv.scheduler.ledger import HitEpoch, JobLedger, PlannerParts, RequestTable
from tieredkv.scheduler.lookup import Lookup
from tieredkv.scheduler.lower_tier import DiskTier, Fill
from tieredkv.scheduler.placement import Placer
from tieredkv.scheduler.policies import CostModel
from tieredkv.scheduler.remote_tier import RemoteTier
from tieredkv.scheduler.tier_index import TierIndex

logger = logging.getLogger(__name__)

EMPTY_DISK_GAUGES = {"disk_slots_capacity": 0, "disk_slots_used": 0, "disk_entries": 0}


class Planner:
    """Scheduler-side index owner and job planner (one per engine).

    ``config`` must be resolved for the engine's block size (:meth:`TieredKVConfig.resolved`,
    done once by :func:`tieredkv.vllm.geometry.engine_geometry`). The indexed tier below host
    is the disk tier (``num_disk_slots``, journaled by ``catalog``), or another ``lower_tier``
    of its class. Beside it, optionally, the shared ``remote`` tier (not indexed).
    """

    def __init__(
        self,
        config: TieredKVConfig,
        *,
        block_size: int,
        num_host_slots: int,
        num_disk_slots: int = 0,
        world_size: int = 1,
        catalog=None,
        lower_tier: DiskTier | None = None,
        remote: RemoteTier | None = None,
        slot_rows: SlotRows | None = None,
        chunk_bytes: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not config.chunk_blocks:
            raise ValueError(
                "tieredkv: Planner needs a resolved config (chunk_blocks is 0, 'auto'): pass "
                "config.resolved(block_size), as engine_geometry() returns it"
            )
        self.config = config
        self.block_size = block_size
        self.chunk_blocks = config.chunk_blocks
        self.chunk_tokens = block_size * config.chunk_blocks
        self.world_size = world_size
        self.counters = Counts()
        self._reported: Counter[CountKey] = Counter()
        self._probe_latency: list[float] = []
        self.host = TierIndex(Tier.HOST, num_host_slots, config.eviction)
        self.catalog = catalog
        self.lower: DiskTier | None = lower_tier
        if lower_tier is not None and (num_disk_slots or catalog is not None):
            raise ValueError(
                "tieredkv: a Planner has one tier below host that it indexes: disk slots or "
                "lower_tier")
        if num_disk_slots:
            disk = DiskTier(
                num_disk_slots,
                policy=config.eviction,
                admission=config.disk_admission,
                seen_limit=max(1024, 4 * (num_host_slots + num_disk_slots)),
                catalog=catalog, supersedes=slot_rows is None or not slot_rows.hybrid,
            )
            self.counters.update(disk.recovery_counts)
            self.lower = disk
        self.remote = remote
        self.slot_rows = slot_rows if slot_rows is not None and slot_rows.hybrid else None
        if remote is not None:  # a hybrid tail's value is a whole slot (placement.py)
            remote.whole_slot_tails = self.slot_rows is not None
        # The cost model (scheduler/policies.py) declines a lower tier's hit predicted slower
        # than recomputing it. ``chunk_bytes``: one chunk, all ranks (0: unknown; bandwidth in
        # chunks/s); ``clock``: its clock (tests pass a fake one).
        self.cost = CostModel(
            self.counters, chunk_tokens=self.chunk_tokens, chunk_bytes=chunk_bytes,
            margin=config.cost_model_margin, enabled=config.cost_model,
            probe_timeout_s=config.remote_timeout_s, clock=clock,
        )
        # vLLM scheduled a step of N tokens / that step's output came back: the cost model's
        # prefill rate (its own methods, called every step: one frame less).
        self.step_scheduled: Callable[[int], int] = self.cost.step_scheduled
        self.step_done: Callable[[int | None], None] = self.cost.step_done
        self._requests = RequestTable()
        self._ledger = JobLedger(world_size, self._requests)
        epoch = HitEpoch()
        parts = PlannerParts(
            config=config, block_size=block_size, host=self.host, lower=self.lower,
            requests=self._requests, ledger=self._ledger, epoch=epoch, counters=self.counters,
            remote=remote, slot_rows=self.slot_rows, cost=self.cost,
        )
        self._placer = Placer(parts)
        fill = Fill(parts, placer=self._placer)
        self._lookup = Lookup(parts, placer=self._placer, fill=fill)
        # Store every full chunk below ``storable_tokens`` not stored yet (and, with ``tail``,
        # the full blocks past them): :meth:`Placer.plan_stores`, called for every scheduled
        # request every step.
        self.plan_stores: Callable[..., None] = self._placer.plan_stores
        # Tokens beyond ``num_computed_tokens`` that can be loaded from the host tier; None
        # while lower-tier chunks of the hit are being filled (:meth:`Lookup.lookup` itself:
        # vLLM asks this for every waiting request every step, one frame less).
        self.lookup: Callable[[str, Sequence[bytes], int, int], int | None] = self._lookup.lookup
        self._epoch = epoch
        self._ledger.set_handlers({
            Move.STORE: self._placer.complete_store,
            Move.SPILL: self._placer.complete_spill,
            Move.PROMOTE: fill.complete,
            Move.LOAD: self._lookup.complete_load,
            Move.REMOTE_READ: fill.complete,
            Move.REMOTE_WRITE: self._placer.complete_remote_write,
        })

    @property
    def disk(self) -> DiskTier | None:
        """The disk tier (its index), or None without a disk tier."""
        return self.lower

    # ------------------------------------------------------------------ requests

    def set_block_ids(self, req_id: str, block_ids: Sequence[Any], replace: bool) -> None:
        """Track the request's device blocks, as the scheduler output reports them: a list
        (one group), or one list per KV-cache group (hybrid models)."""
        state = self._requests.ensure(req_id)
        if self.slot_rows is None:
            if replace:
                state.block_ids = list(block_ids)
            else:
                state.block_ids.extend(block_ids)
            return
        self._fence_reused(block_ids)
        if replace or not state.block_ids:
            state.set_tables([list(ids) for ids in block_ids])
        else:  # (one sliding group: its table is block_ids, appended to like any other)
            for table, ids in zip(state.tables, block_ids, strict=True):
                table.extend(ids)

    def _fence_reused(self, tables: Sequence[Sequence[int]]) -> None:
        """Hybrid models: vLLM frees a sliding window's blocks mid-request, without telling a
        connector; one handed out again while a store still reads it is fenced this step."""
        reading = self._ledger.sliding_sources
        if reading:
            self._ledger.plan.fence_block_ids.extend(
                b for ids in tables for b in ids if b in reading)

    def prefetch_remote(self, req_id: str, keys: Sequence[bytes], num_tokens: int) -> None:
        """A request arrived: probe the remote tier for its prompt now (never waits)."""
        self._lookup.prefetch_remote(req_id, keys, num_tokens)

    def wait_idle(self, timeout_s: float) -> None:
        """A step scheduled no tokens: sleep until a remote probe in flight answers
        (``timeout_s`` at most) instead of letting an in-process engine spin on empty steps
        while it is sent and received. Not while an earlier step's output is outstanding
        (async scheduling, pipeline parallel: something computes, vLLM waits on it anyway)
        nor while bytes a request waits for are moving (the workers wait on those)."""
        if (self.remote is not None and not self.cost.computing()
                and not self._ledger.bringing_up()):
            self.remote.probe.wait(timeout_s)

    def on_alloc(self, req_id: str, block_ids: Sequence[Any], num_external_tokens: int,
                 sync: bool = False) -> None:
        """vLLM allocated device blocks (a list; hybrid models: one per group): turn the
        pending hit into a load job (``sync``: vLLM was told the load is synchronous, so it
        runs before this step's forward; see :class:`~tieredkv.protocol.HostChunks`)."""
        if self.slot_rows is not None:
            self._fence_reused(block_ids)
        self._lookup.on_alloc(req_id, block_ids, num_external_tokens, sync)

    def hit_tokens(self, req_id: str) -> dict[str, int]:
        """The request's loaded tokens by the tier they came from."""
        return self._lookup.hit_tokens(req_id)

    def finish_tail(self, req_id: str, keys: Sequence[bytes], storable_tokens: int) -> None:
        """A request finished normally: store what its last steps computed before its blocks
        are freed; see :meth:`Placer.finish_tail`."""
        self._placer.finish_tail(req_id, keys, storable_tokens)

    # ------------------------------------------------------------------ lifecycle

    def preempted(self, req_id: str) -> None:
        """vLLM freed the request's blocks: fence in-flight stores that read them. The
        request computes its chunks again once resumed: a chunk whose store the fence cancelled
        is stored then (one already held is only touched)."""
        state = self._requests.get(req_id)
        self.counters[Count.PREEMPTIONS] += 1
        if state is None:
            return
        self._ledger.fence_stores(state)
        state.set_tables([])
        state.next_store_chunk = 0
        state.new_lookup()
        self.cost.forget(req_id, declines=False)  # its probe wait was the first lookup's

    def finished(self, req_id: str) -> bool:
        """The request finished; True when its blocks must wait for in-flight stores."""
        self.cost.forget(req_id)
        if self.remote is not None:
            if self._lookup.remote_hits is not None:
                self._lookup.remote_hits.settle(req_id)
            self.remote.forget(req_id)
        state = self._requests.get(req_id)
        if state is None:
            return False
        self._lookup.release_hit(state)
        state.finished = True
        if state.load_job is not None:
            # vLLM frees blocks of a request aborted during its load itself, later.
            self._requests.maybe_forget(state)
            return False
        if state.store_jobs:
            self._ledger.plan.delayed_req_ids.append(req_id)
            return True
        self._requests.maybe_forget(state)
        return False

    def reset(self) -> None:
        """Empty both tiers (weights changed or an operator asked); safe with jobs in flight.

        The shared remote tier is never flushed (other replicas serve from it): this engine
        only forgets what it believed was there. New weights change the namespace, and with
        it every remote key name, so stale entries there are never read."""
        for state in self._requests:
            self._lookup.release_hit(state)
            state.next_store_chunk = 0
        self._epoch.bump()
        self.host.clear()
        if self.lower is not None:
            self.lower.clear()
        self._placer.clear_spill_queue()
        if self.remote is not None:
            self.remote.reset()
        self.counters[Count.RESETS] += 1
        logger.info("tieredkv: cache reset: both tiers emptied")

    # ------------------------------------------------------------------ steps

    def take_plan(self) -> StepPlan:
        """This step's jobs; queued spills get their disk slots now."""
        self._placer.plan_spills()
        self._placer.plan_remote_writes()
        return self._ledger.take_plan()

    def apply(self, results: Iterable[JobResult]) -> None:
        """Fold the ranks' reports in; a job completes once every rank has reported it."""
        self._ledger.apply(results)

    # ------------------------------------------------------------------ metrics

    def take_counter_deltas(self) -> dict[str, Any]:
        """Counter increments since the last call (vLLM's stats path carries deltas), in the
        stats snapshot's shape (see :meth:`~tieredkv.metrics.specs.Counts.snapshot`)."""
        if self.remote is not None:
            self._probe_latency += self.remote.take_stats(self.counters)
        deltas = Counts({k: v - self._reported.get(k, 0) for k, v in self.counters.items()})
        self._reported = Counter(self.counters)
        return deltas.snapshot()

    def take_latency(self) -> dict[str, list[float]]:
        """Latency samples since the last call: the remote probes' round trips."""
        samples, self._probe_latency = self._probe_latency, []
        return {"remote_probe": samples} if samples else {}

    def gauges(self) -> dict[str, int]:
        """Current occupancy, for usage-vs-capacity panels."""
        host = self.host
        remote: dict[str, int] = {}
        if self.remote is not None:
            remote = {"remote_up": int(self.remote.up), **self.remote.server_gauges(self.counters)}
        return {
            **remote,
            "host_slots_capacity": host.num_slots,
            "host_slots_used": host.used_slots,
            "host_slots_pinned": host.pinned_count,
            "host_entries": len(host),
            **(self.lower.gauges() if self.lower is not None else EMPTY_DISK_GAUGES),
            "requests_waiting_on_load": sum(1 for r in self._requests if r.waiting_on_load),
            "jobs_in_flight": len(self._ledger),
        }

    @property
    def pending_jobs(self) -> int:
        return len(self._ledger)

    def has_pending_work(self) -> bool:
        return bool(len(self._ledger) or self._placer.spills_queued)
