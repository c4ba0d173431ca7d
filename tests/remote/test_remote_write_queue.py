"""The bounded write queue: caps by entries and bytes, drops (never blocks), keeps prefixes."""

from __future__ import annotations

import threading

import pytest

from tieredkv.remote.write_queue import BoundedWriteQueue, WriteEntry


def _entries(n: int, size: int = 10, start: int = 0) -> list[WriteEntry]:
    return [WriteEntry(f"k{i}".encode(), bytes(size)) for i in range(start, start + n)]


def test_item_cap_drops_the_rest_of_the_batch() -> None:
    queue = BoundedWriteQueue(max_items=3, max_bytes=1 << 20)
    assert queue.offer(_entries(5)) == (3, 2)
    assert queue.offer(_entries(1, start=9)) == (0, 1)
    assert [e.key for e in queue.take(10, 1 << 20)] == [b"k0", b"k1", b"k2"]
    assert len(queue) == 0 and queue.nbytes == 0


def test_byte_cap_keeps_a_prefix() -> None:
    queue = BoundedWriteQueue(max_items=100, max_bytes=25)
    # 10 + 10 fit, 10 more would not; the small one after it is dropped too (prefix only).
    batch = [*_entries(3), WriteEntry(b"small", b"x")]
    assert queue.offer(batch) == (2, 2)
    assert queue.nbytes == 20


def test_take_respects_limits_but_always_moves() -> None:
    queue = BoundedWriteQueue(max_items=100, max_bytes=1 << 20)
    queue.offer(_entries(5, size=100))
    assert len(queue.take(2, 1 << 20)) == 2
    assert len(queue.take(10, 150)) == 1  # a second entry would pass the byte budget
    assert len(queue.take(10, 1)) == 1  # an entry larger than the budget still goes alone
    assert queue.clear() == 1 and len(queue) == 0


def test_bad_bounds() -> None:
    with pytest.raises(ValueError):
        BoundedWriteQueue(0, 10)


def test_concurrent_offers_never_exceed_caps() -> None:
    queue = BoundedWriteQueue(max_items=500, max_bytes=1 << 30)
    results: list[tuple[int, int]] = []
    lock = threading.Lock()

    def offer() -> None:
        for _ in range(50):
            got = queue.offer(_entries(3))
            with lock:
                results.append(got)

    threads = [threading.Thread(target=offer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    accepted = sum(a for a, _ in results)
    dropped = sum(d for _, d in results)
    assert accepted == len(queue) <= 500
    assert accepted + dropped == 8 * 50 * 3
