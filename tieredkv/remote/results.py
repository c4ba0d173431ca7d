"""What a remote-tier call gives back: values, or a typed failure that reads as misses.

A remote call never raises to its caller. It returns a :class:`BatchResult` whose ``values``
always has one entry per key (``False``/``None`` where nothing usable came back), so a caller
can treat a failed call exactly like a batch of misses, and whose ``cause`` says why, for the
counters. Causes are :class:`tieredkv.protocol.FailureCause` values; ``unavailable`` means the store
was known to be down, so the call did not touch the network.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from tieredkv.protocol import FailureCause

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class BatchResult(Generic[T]):
    """One batched call's answer: ``values[i]`` belongs to ``keys[i]``.

    ``cause`` is ``None`` when every item got a real answer; otherwise the (first) reason some
    or all items did not, and ``failed`` how many items that was.
    """

    values: list[T]
    cause: FailureCause | None = None
    failed: int = 0
    latency_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.cause is None


@dataclass(frozen=True)
class RemoteStats:
    """A snapshot of the store's counters (taken under its lock, safe from any thread)."""

    up: bool
    calls: dict[str, int] = field(default_factory=dict)          # by op
    failed_calls: dict[str, int] = field(default_factory=dict)   # by op
    failures: dict[str, int] = field(default_factory=dict)       # by cause, items not calls
    round_trips: int = 0          # pipelines executed (one per batched call, per cluster node set)
    went_down: int = 0            # up -> down transitions
    reconnect_attempts: int = 0
    reconnects: int = 0           # down -> up transitions (the first connect included)
    writes_submitted: int = 0
    writes_dropped: int = 0       # queue full or store closing
    writes_done: int = 0
    writes_failed: int = 0
    tails_superseded: int = 0     # tails replaced by a pointer to a longer entry (WriteEntry.then)
    queue_items: int = 0
    queue_bytes: int = 0
    probe_latency_s: tuple[float, ...] = ()  # recent successful batch_exists round trips
    ping_latency_s: tuple[float, ...] = ()   # recent successful connect/health pings
