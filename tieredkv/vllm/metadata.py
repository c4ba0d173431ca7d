"""What travels between the two halves each step: jobs down, per-rank results up."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from tieredkv.protocol import JobResult, StepPlan, merge_results

# In a step that computes nothing, how long either half may sleep on its own transfers (the
# scheduler on remote probes, a worker on its loads and fills) before returning. vLLM would
# otherwise run empty steps back to back, holding the GIL (and a core) that every transfer
# thread needs for each hand-off (up to 5 ms per hand-off). New requests wait at most this
# long to be scheduled; the sleep ends with the first answer.
IDLE_WAIT_S = 0.005

# On CPU, host-tier loads up to this many bytes per rank and step are copied inline (~3-5 ms
# at memory speed): synchronous loads (``sync_loads``, planned by the scheduler half) before
# the forward, other loads of a step that computes something after it. A bigger load goes to
# the h2d lane, so a long context's load does not stall every other request's step. In a step
# that computes nothing, any load is copied inline: nobody else is waiting.
INLINE_LOAD_MAX_BYTES = 32 * 1024 * 1024

# A synchronous load when no other request is running (the last step scheduled none but it):
# nobody's forward waits on the copy, and an asynchronous load would cost the same copy plus
# an engine step, so the bound is larger; it still keeps one step's copy to ~25-50 ms at host
# memory speed, so a request arriving meanwhile is not held up for long.
IDLE_SYNC_LOAD_MAX_BYTES = 256 * 1024 * 1024


@dataclass
class TieredKVMetadata(KVConnectorMetadata):
    """Scheduler -> workers: this step's concrete jobs (same for every rank)."""

    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class TieredKVWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler: job results of this step, merged over ranks by ``aggregate``.

    Ranks may finish one job in different steps; the scheduler keeps counting across steps.
    ``step``: the plan's number (:attr:`StepPlan.step`) of the step this output ends. Sent
    every step, so vLLM delivers every step's output, which times the prefill rate exactly.
    """

    results: dict[int, JobResult] = field(default_factory=dict)
    step: int = 0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, TieredKVWorkerMetadata)
        merged = merge_results(dict(self.results), other.results.values())
        return TieredKVWorkerMetadata(results=merged, step=max(self.step, other.step))
