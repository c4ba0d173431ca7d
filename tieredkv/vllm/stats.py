"""tieredkv's stats on vLLM's own path: one ``KVConnectorStats`` for both halves.

Data shape (msgpack-safe: dicts of str -> numbers / lists of numbers)::

    {"scheduler": {"counters": {name: delta}, "gauges": {name: value},
                   "chunk_bytes": int, "chunk_tokens": int, "world_size": int},
     "workers": {"<rank>": {"bytes": {dir: n}, "ops": {dir: n}, "spills_dropped": n,
                             "failures": {kind: n}, "latency_s": {job_kind: [s, ...]},
                             "reads_retried": {kind: n}, "reads_recovered": n,
                             "queue_depths": {name: n}}}}

``reads_retried`` counts disk reads read a second time after a transient failure (by the
first read's failure kind); ``reads_recovered`` those whose second read succeeded. A read
that still fails is also counted in ``failures``, once, as its job's failure.

Counters are per-step deltas; ``aggregate`` adds them up, gauges keep the latest value.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from tieredkv.protocol import FAILURE_CAUSES  # noqa: F401 - re-exported


def _add_numbers(into: dict[str, Any], other: dict[str, Any]) -> None:
    for key, value in other.items():
        if isinstance(value, dict):
            _add_numbers(into.setdefault(key, {}), value)
        elif isinstance(value, list):
            into.setdefault(key, []).extend(value)
        else:
            into[key] = into.get(key, 0) + value


def _merge_worker(into: dict[str, Any], other: dict[str, Any]) -> None:
    gauges = other.get("queue_depths")
    _add_numbers(into, {k: v for k, v in other.items() if k != "queue_depths"})
    if gauges is not None:
        into["queue_depths"] = dict(gauges)


@dataclass
class TieredKVStats(KVConnectorStats):
    """Counter deltas and latest gauges from the scheduler half and every worker rank."""

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        sched = self.data.get("scheduler")
        workers = self.data.get("workers") or {}
        if sched and (sched.get("counters") or sched.get("gauges")):
            return False
        for snap in workers.values():
            if any(snap.get("queue_depths", {}).values()):
                return False  # a backlog must keep its gauge fresh even in a quiet step
            if any(snap.get("bytes", {}).values()) or any(snap.get("ops", {}).values()):
                return False
            if snap.get("failures") or snap.get("spills_dropped"):
                return False
            if snap.get("reads_retried") or snap.get("reads_recovered"):
                return False
            if any(snap.get("latency_s", {}).values()):
                return False
        return True

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        data = copy.deepcopy(self.data)
        other_data = other.data if other is not None else {}
        sched = other_data.get("scheduler")
        if sched:
            mine = data.setdefault("scheduler", {})
            _add_numbers(mine.setdefault("counters", {}), sched.get("counters", {}))
            for key in ("gauges", "chunk_bytes", "chunk_tokens", "world_size"):
                if key in sched:
                    mine[key] = copy.deepcopy(sched[key])
        for rank, snap in (other_data.get("workers") or {}).items():
            _merge_worker(data.setdefault("workers", {}).setdefault(rank, {}), snap)
        return TieredKVStats(data=data)

    def reduce(self) -> dict[str, int | float]:
        """A one-line summary for vLLM's periodic log."""
        sched = self.data.get("scheduler", {})
        counters = sched.get("counters", {})
        moved: dict[str, int] = {}
        failures = 0
        reads_retried = 0
        for snap in (self.data.get("workers") or {}).values():
            for direction, nbytes in snap.get("bytes", {}).items():
                moved[direction] = moved.get(direction, 0) + nbytes
            failures += sum(snap.get("failures", {}).values())
            reads_retried += sum(snap.get("reads_retried", {}).values())
        return {
            "hit_tokens_host": counters.get("hit_tokens_host", 0),
            "hit_tokens_disk": counters.get("hit_tokens_disk", 0),
            **{f"{d}_MiB": round(n / 2**20, 2) for d, n in sorted(moved.items())},
            "failures": failures,
            "reads_retried": reads_retried,
        }
