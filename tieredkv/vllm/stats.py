"""tieredkv's stats on vLLM's own path: one ``KVConnectorStats`` for both halves.

``data`` is a stats snapshot (its shape, and how snapshots merge and sum up, are in
:mod:`tieredkv.metrics.snapshot`, which does not import vLLM); this subclass only plugs those
functions into vLLM's ``KVConnectorStats`` interface.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from tieredkv.metrics import snapshot


@dataclass
class TieredKVStats(KVConnectorStats):
    """Counter deltas and latest gauges from the scheduler half and every worker rank."""

    def reset(self) -> None:
        self.data = {}

    def is_empty(self) -> bool:
        return snapshot.is_empty(self.data)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        return TieredKVStats(data=snapshot.merge(self.data, other.data if other is not None else None))

    def reduce(self) -> dict[str, int | float]:
        """A one-line summary for vLLM's periodic log."""
        return snapshot.summary(self.data)
