"""Where an entry's rows lie in a host slot and in its Redis value.

A host slot holds, for each layer, ``slot_rows`` rows of that layer's block bytes at the
layer's offset (``spans``: one ``(offset of row 0, bytes per row)`` per layer). A Redis value
holds either a whole slot's payload, laid out the same way, or, for a prompt's tail of ``n``
rows, just rows 0..n-1 of every layer, packed in layer order: never the slot's other rows,
which hold a previous tenant's bytes. These functions are the one place that layout is
spelled out, for writes (what to send) and reads (what lands where).
"""

from __future__ import annotations

import numpy as np

# (offset of row 0, bytes per row) of each layer's region in a slot.
Spans = tuple[tuple[int, int], ...]


def rows_bytes(rows: int, slot_rows: int | None, spans: Spans, payload_bytes: int) -> int | None:
    """Payload bytes of a value holding rows 0..rows-1 of every layer (0 or every row: a
    whole slot); None when no slot has that many rows or the row spans are unknown."""
    if rows == 0 or rows == slot_rows:
        return payload_bytes
    if not spans or not 0 < rows < (slot_rows or 0):
        return None
    return rows * sum(row_bytes for _, row_bytes in spans)


def rows_of(payload: memoryview, rows: int, spans: Spans) -> bytearray:
    """Rows 0..rows-1 of every layer of a slot's ``payload``, packed in layer order."""
    out = bytearray()
    for offset, row_bytes in spans:
        out += payload[offset:offset + rows * row_bytes]
    return out


def blankable(holes: tuple[int, ...], slot_rows: int | None, spans: Spans) -> bool:
    """Whether the rows ``holes`` can be blanked: rows of a slot, spans known."""
    return bool(spans) and all(0 <= row < (slot_rows or 0) for row in holes)


def blanked(payload: memoryview, holes: tuple[int, ...], spans: Spans) -> bytearray:
    """A copy of ``payload`` with every layer's bytes of rows ``holes`` zeroed."""
    out = bytearray(payload)
    for offset, row_bytes in spans:
        for row in holes:
            start = offset + row * row_bytes
            out[start:start + row_bytes] = bytes(row_bytes)
    return out


def entry_payload(slot: memoryview, rows: int, holes: tuple[int, ...], slot_rows: int | None,
                  spans: Spans) -> memoryview | bytearray | None:
    """What a write of an entry holding rows 0..rows-1 of the slot (``holes`` among them
    empty, written as zeros) sends: only its own rows. None: it names rows no value holds."""
    tail = slot_rows is not None and 0 < rows < slot_rows
    if (rows == 0 or rows_bytes(rows, slot_rows, spans, len(slot)) is None
            or (holes and (tail or not blankable(holes, slot_rows, spans)))):
        return None
    if holes:
        return blanked(slot, holes, spans)
    return rows_of(slot, rows, spans) if tail else slot


def land_rows(target: np.ndarray, source: np.ndarray, rows: int, source_rows: int | None,
              spans: Spans) -> None:
    """Copy rows 0..rows-1 of every layer from ``source`` into a slot (``target``).

    ``source_rows``: the rows per layer ``source`` holds packed (a tail's value); None: it is
    a whole slot's payload, laid out as the slot is. numpy copies without the GIL, so the
    store's thread keeps receiving meanwhile."""
    at = 0
    for offset, row_bytes in spans:
        n = rows * row_bytes
        start = offset if source_rows is None else at
        np.copyto(target[offset:offset + n], source[start:start + n])
        at += (source_rows or 0) * row_bytes
