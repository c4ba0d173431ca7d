"""A model's KV-cache groups as tieredkv sees them, and where each group's blocks sit in a slot.

vLLM's hybrid KV-cache manager gives each kind of attention layer its own group of block ids
(full attention; sliding window). tieredkv keeps one slot per entry holding every group:
group ``g``'s block ``j`` of the chunk is row ``g * chunk_blocks + j`` of the slot. An entry
holds the first ``n`` blocks of its chunk (``n = chunk_blocks`` for a whole chunk, fewer for a
prompt's tail). A full-attention group stores rows ``0 .. n-1``; a sliding-window group only
the rows a hit ending at the entry's end needs, ``[max(0, n - window_blocks), n)`` (vLLM's
prefix cache needs exactly ``cdiv(window - 1 + extra, block_size)`` contiguous blocks ending
at the hit; the chunk before holds its own last ``window_blocks``). So a hybrid hit ends on a
chunk boundary or exactly where a stored prompt ended, nowhere else. The rows an entry does
not store are holes (:data:`NO_BLOCK`), never copied.

With one full-attention group (every model before hybrids) rows are block positions, as they
always were: nothing here changes for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tieredkv.protocol import NO_BLOCK

FULL, SLIDING = "full", "sliding"
NULL_BLOCK = 0  # vLLM's placeholder block id (a sliding window's freed blocks)


@dataclass(frozen=True)
class KVGroup:
    """One KV-cache group: ``kind`` FULL or SLIDING; ``window_blocks``: for SLIDING, the blocks
    before a hit's end that the hit needs (0 for FULL: all of them)."""

    kind: str
    window_blocks: int = 0

    def describe(self) -> str:
        return self.kind if self.kind == FULL else f"{self.kind}:{self.window_blocks}"


@dataclass(frozen=True)
class SlotRows:
    """The groups of an engine and the slot rows of their blocks (one chunk of ``chunk_blocks``)."""

    groups: tuple[KVGroup, ...]
    chunk_blocks: int

    @property
    def hybrid(self) -> bool:
        """More than one group, or a sliding window: hits end on chunk boundaries or at an
        entry's end only."""
        return len(self.groups) > 1 or any(g.kind != FULL for g in self.groups)

    @property
    def rows(self) -> int:
        """Rows of one slot: ``chunk_blocks`` per group."""
        return len(self.groups) * self.chunk_blocks

    def describe(self) -> str:
        """For the namespace: settings that change what a slot holds change the fingerprint."""
        return ",".join(g.describe() for g in self.groups)

    def _kept(self, group: KVGroup, j: int, n: int) -> bool:
        """Whether an entry holding ``n`` blocks stores row ``j`` of ``group``."""
        return j < n and (group.kind == FULL or j >= n - group.window_blocks)

    def _held(self, n: int | None) -> int:
        C = self.chunk_blocks
        if n is None:
            return C
        if not 0 < n <= C:
            raise ValueError(f"an entry holds 1..{C} blocks of its chunk, not {n}")
        return n

    def stored_rows(self, n: int | None = None) -> int:
        """Rows an entry of ``n`` blocks (None: a whole chunk) fills: its payload, in blocks
        of one layer (the slot it occupies always has :attr:`rows` rows)."""
        n = self._held(n)
        return sum(n if g.kind == FULL else min(n, g.window_blocks) for g in self.groups)

    def store_rows(
        self, tables: Sequence[Sequence[int]], chunk: int, n: int | None = None
    ) -> tuple[int, ...]:
        """Device block per slot row for storing the first ``n`` blocks (None: all) of chunk
        ``chunk`` (holes: NO_BLOCK)."""
        C, n = self.chunk_blocks, self._held(n)
        rows: list[int] = []
        for group, table in zip(self.groups, tables, strict=True):
            ids = table[chunk * C:(chunk + 1) * C]
            for j in range(C):
                block = ids[j] if j < len(ids) else NULL_BLOCK
                rows.append(block if block != NULL_BLOCK and self._kept(group, j, n) else NO_BLOCK)
        return tuple(rows)

    def sliding_blocks(self, rows: Sequence[int]) -> tuple[int, ...]:
        """The real blocks of sliding-window groups among a chunk's ``rows`` (vLLM may free
        and hand them out again while a store still reads them)."""
        C = self.chunk_blocks
        return tuple(
            b for g, group in enumerate(self.groups) if group.kind != FULL
            for b in rows[g * C:(g + 1) * C] if b != NO_BLOCK
        )

    def load_rows(
        self, tables: Sequence[Sequence[int]], chunk: int, lo: int, hi: int, n: int | None = None
    ) -> tuple[int, ...]:
        """Device block per slot row for loading blocks ``[lo, hi)`` (table positions) of chunk
        ``chunk`` from an entry of ``n`` blocks (None: whole): the rows its store kept, where
        vLLM gave a real block (holes: NO_BLOCK)."""
        C, n = self.chunk_blocks, self._held(n)
        rows = [NO_BLOCK] * self.rows
        for g, (group, table) in enumerate(zip(self.groups, tables, strict=True)):
            for pos in range(lo, min(hi, len(table))):
                j = pos - chunk * C
                block = table[pos]
                if block != NULL_BLOCK and self._kept(group, j, n):
                    rows[g * C + j] = block
        return tuple(rows)

    def unserved(
        self, tables: Sequence[Sequence[int]], chunk: int, lo: int, hi: int, n: int | None = None
    ) -> list[int]:
        """Real blocks in ``[lo, hi)`` that no stored row of an entry of ``n`` blocks (None:
        whole) fills (a sliding group's block the store did not keep): a load that left them
        unwritten would poison vLLM's cache."""
        C, n = self.chunk_blocks, self._held(n)
        return [
            table[pos]
            for group, table in zip(self.groups, tables, strict=True)
            for pos in range(lo, min(hi, len(table)))
            if table[pos] != NULL_BLOCK and not self._kept(group, pos - chunk * C, n)
        ]
