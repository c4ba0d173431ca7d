"""Turns for bounded reads: how many bytes of values one node is asked for at once.

The transfer layer sends a prompt's reads as several batches (bounded by its read budget,
128 MiB per rank) and lands each batch as soon as it arrived, while the next is received.
That overlap only happens if batches arrive one after another; these turns make them.
"""

from __future__ import annotations

import asyncio
from collections import deque

# Bytes of values bounded reads ask of one node at once: two transfer batches of 4 MiB.
READ_BYTES_PER_NODE = 9 << 20
# Bounded reads asking one node at once, whatever their size: one received, one landed.
READS_PER_NODE = 2


class ReadTurns:
    """At most ``reads_per_node`` bounded reads and ``bytes_per_node`` of values asked of one
    node at once (a read asking for more bytes goes alone); the others wait their turn, in the
    order they came. Used on the store's event loop only.

    A server answers its connections round robin, so a prompt's batches read side by side on
    connections of their own all finish near the end of the lot, and none can land while the
    next is read (96 KiB values on one node: 0.85 of raw redis-py with a prompt's 7 batches
    at once, 0.99 two at a time; the server also spends a third more CPU on the many
    connections). Two transfer batches (4 MiB each) fit: one is received while the reader
    lands the one before, with no idle round trip between them. On a Cluster a batch asks
    each node for a part of it, a third of its bytes on three nodes: counted in bytes alone,
    six parts went to a node at once and the round robin came back (96 KiB values on a
    Cluster, remote_throughput's worst row, read faster two at a time).
    """

    def __init__(self, bytes_per_node: int = READ_BYTES_PER_NODE,
                 reads_per_node: int = READS_PER_NODE) -> None:
        if bytes_per_node < 1 or reads_per_node < 1:
            raise ValueError(f"read bytes and reads per node must be positive, got "
                             f"{bytes_per_node} and {reads_per_node}")
        self._limit, self._reads = bytes_per_node, reads_per_node
        self._nodes: dict[str, _NodeTurns] = {}

    def of(self, node: str, size: int) -> _Turn:
        """A turn of ``size`` bytes on the node named ``node`` (``async with`` it)."""
        turns = self._nodes.get(node)
        if turns is None:
            turns = self._nodes[node] = _NodeTurns(self._limit, self._reads)
        return _Turn(turns, size)

    def asked(self, node: str) -> int:
        """Bytes asked of ``node`` by reads holding a turn now."""
        turns = self._nodes.get(node)
        return turns.out if turns is not None else 0


class _NodeTurns:
    def __init__(self, limit: int, reads: int) -> None:
        self.limit, self.reads = limit, reads
        self.out = 0  # bytes asked by the reads holding a turn
        self.holders = 0  # reads holding a turn
        self.waiting: deque[tuple[int, asyncio.Future[None]]] = deque()

    def fits(self, size: int) -> bool:
        return not self.holders or (self.holders < self.reads and self.out + size <= self.limit)

    def take(self, size: int) -> None:
        self.out += size
        self.holders += 1

    def release(self, size: int) -> None:
        self.out -= size
        self.holders -= 1
        self.grant()

    def grant(self) -> None:
        """Hand turns to the waiting reads, in order, while they fit."""
        while self.waiting:
            size, waiter = self.waiting[0]
            if waiter.done():  # cancelled while waiting
                self.waiting.popleft()
                continue
            if not self.fits(size):
                return
            self.waiting.popleft()
            self.take(size)
            waiter.set_result(None)


class _Turn:
    def __init__(self, turns: _NodeTurns, size: int) -> None:
        self._turns, self._size = turns, size

    async def __aenter__(self) -> None:
        turns, size = self._turns, self._size
        if not turns.waiting and turns.fits(size):
            turns.take(size)
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        turns.waiting.append((size, waiter))
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # granted, then cancelled: give it back
                turns.release(size)
            else:
                turns.grant()  # the reads behind this one may fit now
            raise

    async def __aexit__(self, *exc: object) -> None:
        self._turns.release(self._size)
