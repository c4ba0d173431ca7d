"""What travels between the two halves each step: jobs down, per-rank results up."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from tieredkv.planner import JobOutcome, StepPlan

# job_id -> (ranks ok, ranks failed, failure kind, failed device block ids)
OutcomeTuple = tuple[int, int, str | None, tuple[int, ...]]


@dataclass
class TieredKVMetadata(KVConnectorMetadata):
    """Scheduler -> workers: this step's concrete jobs (same for every rank)."""

    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class TieredKVWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler: job results of this step, summed over ranks by ``aggregate``.

    Ranks may finish one job in different steps; the scheduler keeps counting across steps.
    """

    outcomes: dict[int, OutcomeTuple] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, TieredKVWorkerMetadata)
        merged = dict(self.outcomes)
        for job_id, (ok, failed, failure, blocks) in other.outcomes.items():
            if job_id in merged:
                ok0, failed0, failure0, blocks0 = merged[job_id]
                merged[job_id] = (
                    ok0 + ok,
                    failed0 + failed,
                    failure0 or failure,
                    tuple(sorted(set(blocks0) | set(blocks))),
                )
            else:
                merged[job_id] = (ok, failed, failure, blocks)
        return TieredKVWorkerMetadata(outcomes=merged)

    def to_outcomes(self) -> dict[int, JobOutcome]:
        return {
            job_id: JobOutcome(ok, failed, failure, set(blocks))
            for job_id, (ok, failed, failure, blocks) in self.outcomes.items()
        }
