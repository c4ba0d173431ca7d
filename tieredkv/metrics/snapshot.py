"""tieredkv's stats snapshots: the plain data both connector halves report, and how it merges.

Data shape (msgpack-safe: dicts of str -> numbers / lists of numbers)::

    {"scheduler": {"counters": {name: delta, name: {label: delta}}, "gauges": {name: value},
                   "latency_s": {"remote_probe": [s, ...]},
                   "chunk_bytes": int, "chunk_tokens": int, "world_size": int},
     "workers": {"<rank>": {"bytes": {dir: n}, "ops": {dir: n}, "spills_dropped": n,
                             "failures": {kind: n}, "latency_s": {job_kind: [s, ...]},
                             "reads_retried": {kind: n}, "reads_recovered": n,
                             "remote_writes_failed": n, "queue_depths": {name: n}}}}

The scheduler's counter names are :class:`tieredkv.metrics.specs.Count`'s; one counted by tier
or cause carries ``{label: delta}``. ``reads_retried`` counts disk reads read a second time
after a transient failure (by the first read's failure kind); ``reads_recovered`` those whose
second read succeeded. A read that still fails is also counted in ``failures``, once, as its
job's failure.

Counters are per-step deltas; :func:`merge` adds them up, gauges keep the latest value.
vLLM carries these snapshots in :class:`tieredkv.vllm.stats.TieredKVStats` (a thin
``KVConnectorStats`` over the functions here); :class:`~tieredkv.metrics.recorder.TieredKVMetrics`
turns them into Prometheus samples. Imports nothing from vLLM.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from tieredkv.protocol import Tier

# Scheduler fields that hold the latest value rather than a delta.
SCHEDULER_LATEST = ("gauges", "chunk_bytes", "chunk_tokens", "world_size")


def add_numbers(into: dict[str, Any], other: Mapping[str, Any]) -> None:
    """Add ``other`` into ``into``: numbers summed, lists extended, dicts recursively."""
    for key, value in other.items():
        if isinstance(value, dict):
            add_numbers(into.setdefault(key, {}), value)
        elif isinstance(value, list):
            into.setdefault(key, []).extend(value)
        else:
            into[key] = into.get(key, 0) + value


def merge_worker(into: dict[str, Any], other: Mapping[str, Any]) -> None:
    """Fold one worker snapshot into another: counters added, queue depths the latest."""
    gauges = other.get("queue_depths")
    add_numbers(into, {k: v for k, v in other.items() if k != "queue_depths"})
    if gauges is not None:
        into["queue_depths"] = dict(gauges)


def merge(data: Mapping[str, Any], other: Mapping[str, Any] | None) -> dict[str, Any]:
    """A new snapshot: ``data`` followed by ``other`` (neither is modified)."""
    merged = copy.deepcopy(dict(data))
    other = other or {}
    sched = other.get("scheduler")
    if sched:
        mine = merged.setdefault("scheduler", {})
        add_numbers(mine.setdefault("counters", {}), sched.get("counters", {}))
        add_numbers(mine.setdefault("latency_s", {}), sched.get("latency_s", {}))
        for key in SCHEDULER_LATEST:
            if key in sched:
                mine[key] = copy.deepcopy(sched[key])
    for rank, snap in (other.get("workers") or {}).items():
        merge_worker(merged.setdefault("workers", {}).setdefault(rank, {}), snap)
    return merged


def is_empty(data: Mapping[str, Any]) -> bool:
    """True when a snapshot has nothing worth reporting (vLLM then skips the step's stats)."""
    sched = data.get("scheduler")
    workers = data.get("workers") or {}
    if sched and (sched.get("counters") or sched.get("gauges")):
        return False
    if sched and any((sched.get("latency_s") or {}).values()):
        return False
    for snap in workers.values():
        if any(snap.get("queue_depths", {}).values()):
            return False  # a backlog must keep its gauge fresh even in a quiet step
        if any(snap.get("bytes", {}).values()) or any(snap.get("ops", {}).values()):
            return False
        if snap.get("failures") or snap.get("spills_dropped") or snap.get("remote_writes_failed"):
            return False
        if snap.get("reads_retried") or snap.get("reads_recovered"):
            return False
        if any(snap.get("latency_s", {}).values()):
            return False
    return True


def summary(data: Mapping[str, Any]) -> dict[str, int | float]:
    """A one-line summary for vLLM's periodic log: hits, MiB moved per direction, failures."""
    sched = data.get("scheduler", {})
    hit_tokens = sched.get("counters", {}).get("hit_tokens", {})
    moved: dict[str, int] = {}
    failures = 0
    reads_retried = 0
    for snap in (data.get("workers") or {}).values():
        for direction, nbytes in snap.get("bytes", {}).items():
            moved[direction] = moved.get(direction, 0) + nbytes
        failures += sum(snap.get("failures", {}).values())
        reads_retried += sum(snap.get("reads_retried", {}).values())
    return {
        **{f"hit_tokens_{tier}": hit_tokens.get(tier, 0) for tier in Tier},
        **{f"{d}_MiB": round(n / 2**20, 2) for d, n in sorted(moved.items())},
        "failures": failures,
        "reads_retried": reads_retried,
    }
