"""The bounded read's receive buffers (tieredkv.remote.read_buffers.ReadBuffers): reused only
once nothing refers to the value they hold, kept up to a bound, freed when reads stop."""

from __future__ import annotations

import ctypes
import gc
import time

from tieredkv.remote.read_buffers import ReadBuffers

SIZE = 1 << 16


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def test_a_buffer_comes_back_only_when_its_last_view_is_gone() -> None:
    pool = ReadBuffers()
    lent = pool.take(SIZE)
    where = _address(lent)
    value = lent[10:20]  # what a read hands out: a slice of the buffer
    narrower = memoryview(value).cast("B")[2:]  # what decode makes of it
    del lent, value
    gc.collect()
    assert pool.idle_bytes == 0  # a view of it is alive: not reusable
    other = pool.take(SIZE)
    assert _address(other) != where
    del narrower
    assert pool.idle_bytes == SIZE
    again = pool.take(SIZE)
    assert _address(again) == where and pool.idle_bytes == 0
    del other, again


def test_buffers_past_the_idle_bound_are_freed_not_kept() -> None:
    pool = ReadBuffers(idle_bytes=2 * SIZE)
    lent = [pool.take(SIZE) for _ in range(5)]
    del lent
    assert pool.idle_bytes == 2 * SIZE


def test_kept_buffers_are_freed_once_reads_stop() -> None:
    pool = ReadBuffers()
    pool.take(SIZE)  # dropped at once: kept for reuse
    assert pool.idle_bytes == SIZE
    assert pool.release_if_idle(60.0) == 0 and pool.idle_bytes == SIZE  # read a moment ago
    time.sleep(0.02)
    assert pool.release_if_idle(0.01) == SIZE and pool.idle_bytes == 0


def test_batches_of_many_sizes_keep_no_more_than_was_lent_at_once() -> None:
    """A batch's buffer holds all its values, so buffers come in many sizes (a prompt's last
    batch, each Cluster node's share). A read reuses a slice of a kept buffer up to twice its
    size, and the kept total never exceeds the most bytes ever asked at once: one read at a
    time keeps one buffer, the biggest, whatever the sizes."""
    pool = ReadBuffers()
    big = pool.take(4 * SIZE)
    where = _address(big)
    del big
    for size, reused in ((3 * SIZE, True), (SIZE, False), (4 * SIZE, True),
                         (2 * SIZE + 7, True), (5, False)):
        lent = pool.take(size)
        assert len(lent) == size and (_address(lent) == where) is reused
        del lent
        assert pool.idle_bytes == 4 * SIZE
    bigger = pool.take(6 * SIZE)  # a new one; the smaller kept one is freed for it
    assert _address(bigger) != where
    del bigger
    assert pool.idle_bytes == 6 * SIZE
    two = [pool.take(6 * SIZE), pool.take(6 * SIZE)]  # lent at once: both may be kept
    del two
    assert pool.idle_bytes == 12 * SIZE


def test_small_reads_taking_big_buffers_do_not_ratchet_the_kept_total() -> None:
    """Small batches beside a big one, round after round: what is kept never exceeds the most
    bytes the reads asked for at once (a small read is not lent a buffer over twice its size,
    which would make the big read beside it allocate a new one every round)."""
    pool = ReadBuffers()
    most = 0
    for k in range(1, 6):
        lent = [pool.take(SIZE) for _ in range(k)] + [pool.take(64 * SIZE)]
        most = max(most, k * SIZE + 64 * SIZE)
        del lent
        gc.collect()
        assert pool.idle_bytes <= most, (pool.idle_bytes, most)
