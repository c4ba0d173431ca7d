"""SlabExecutor: slab I/O from asyncio on bounded daemon threads, with timeouts that hold."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
import time
from pathlib import Path

import pytest

from tieredkv.disk.errors import SlabError
from tieredkv.disk.format import slab_path
from tieredkv.disk.slab import SlabFile
from tieredkv.protocol import FailureCause
from tieredkv.testing.faulty_fileio import FaultyFileIO
from tieredkv.transfer.disk_jobs import SlabExecutor

PAYLOAD = 64 * 1024


@pytest.fixture
def slab(tmp_path: Path, fp: bytes, faulty: FaultyFileIO):
    slab = SlabFile.open(slab_path(tmp_path, 0), 8, PAYLOAD, fp, io=faulty)
    yield slab
    faulty.release_all()
    slab.close()


@pytest.fixture
def executor():
    ex = SlabExecutor(io_threads=2)
    yield ex
    ex.shutdown(wait_s=2)


async def test_write_then_read(slab: SlabFile, executor: SlabExecutor, key, payload) -> None:
    data = {slot: payload(key(slot), 0, PAYLOAD) for slot in range(8)}
    await asyncio.gather(*(executor.write(slab, s, key(s), d) for s, d in data.items()))
    outs = {slot: bytearray(PAYLOAD) for slot in range(8)}
    headers = await asyncio.gather(*(executor.read_into(slab, s, key(s), outs[s]) for s in data))
    assert [h.key for h in headers] == [key(s) for s in range(8)]
    assert all(outs[s] == data[s] for s in data)
    assert (await executor.read_header(slab, 3, key(3))).key == key(3)
    assert executor.in_flight == 0


async def test_io_runs_on_pool_threads_only(slab: SlabFile, executor: SlabExecutor, faulty: FaultyFileIO) -> None:
    seen: list[str] = []
    original = faulty.pwrite

    def spy(fd: int, bufs: list[memoryview], offset: int) -> int:
        seen.append(threading.current_thread().name)
        return original(fd, bufs, offset)

    faulty.pwrite = spy  # type: ignore[method-assign]
    await executor.write(slab, 0, b"k" * 32, bytes(PAYLOAD))
    assert seen and all(name.startswith("tieredkv-io-") for name in seen)


async def test_errors_arrive_typed(slab: SlabFile, executor: SlabExecutor, faulty: FaultyFileIO) -> None:
    faulty.fail_writes(errno.ENOSPC, times=1)
    with pytest.raises(SlabError) as err:
        await executor.write(slab, 0, b"k" * 32, bytes(PAYLOAD))
    assert err.value.kind is FailureCause.NO_SPACE
    with pytest.raises(SlabError) as err:
        await executor.read_into(slab, 1, b"k" * 32, bytearray(PAYLOAD))
    assert err.value.kind is FailureCause.MISSING


async def test_hung_read_times_out_on_time(slab: SlabFile, executor: SlabExecutor, faulty: FaultyFileIO) -> None:
    await executor.write(slab, 0, b"k" * 32, os.urandom(PAYLOAD))
    gate = faulty.hang("read", times=1)
    out = bytearray(PAYLOAD)
    # The read hangs until the gate opens, which only this test does (below): the call must end
    # by its own timeout. The outer bound only turns a call that waits for the read into a failure.
    with pytest.raises(SlabError) as err:
        await asyncio.wait_for(executor.read_into(slab, 0, b"k" * 32, out, timeout=0.2), 30)
    assert err.value.kind is FailureCause.TIMEOUT
    pending = err.value.pending
    assert pending is not None and not pending.done()  # out is still owned by the stuck read
    assert executor.timeouts == 1
    # The other thread still serves I/O meanwhile.
    await executor.read_into(slab, 0, b"k" * 32, bytearray(PAYLOAD), timeout=2)
    gate.set()
    pending.result(timeout=5)  # now the buffer may be reused


async def test_queued_call_that_times_out_never_runs(
    slab: SlabFile, faulty: FaultyFileIO
) -> None:
    executor = SlabExecutor(io_threads=1)
    try:
        await executor.write(slab, 0, b"k" * 32, bytes(PAYLOAD))
        gate = faulty.hang("read", times=1)
        reads0 = faulty.calls["read"]
        blocker = asyncio.ensure_future(executor.read_into(slab, 0, b"k" * 32, bytearray(PAYLOAD)))
        while faulty.calls["read"] == reads0:
            await asyncio.sleep(0.01)
        reads_before = faulty.calls["read"]
        with pytest.raises(SlabError) as err:
            await executor.read_into(slab, 0, b"k" * 32, bytearray(PAYLOAD), timeout=0.1)
        assert err.value.pending.cancelled()  # type: ignore[union-attr]
        gate.set()
        await blocker
        await asyncio.sleep(0.05)
        assert faulty.calls["read"] == reads_before, "the cancelled read never touched the disk"
    finally:
        executor.shutdown(2)


async def test_caller_cancellation_propagates(slab: SlabFile, executor: SlabExecutor, faulty: FaultyFileIO) -> None:
    faulty.delay("write", 0.2, times=1)
    task = asyncio.ensure_future(executor.write(slab, 0, b"k" * 32, bytes(PAYLOAD)))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_shutdown_does_not_wait_forever_on_a_hung_thread(slab: SlabFile, faulty: FaultyFileIO) -> None:
    executor = SlabExecutor(io_threads=1)
    gate = faulty.hang("read", times=1)
    reads0 = faulty.calls["read"]
    stuck = executor.submit(slab.read_header, 0)
    queued = executor.submit(slab.read_header, 1)
    while faulty.calls["read"] == reads0:
        time.sleep(0.01)
    # The read stays hung until the gate opens (below): shutdown must give up on it by itself.
    finished: list[bool] = []
    closer = threading.Thread(target=lambda: finished.append(executor.shutdown(wait_s=0.2)))
    closer.start()
    closer.join(30)  # only so a shutdown that waits for the hung read fails instead of hanging
    assert not closer.is_alive(), "shutdown waited for the hung thread"
    assert finished == [False] and not stuck.done()
    assert queued.cancelled()
    with pytest.raises(RuntimeError):
        executor.submit(slab.read_header, 0)
    gate.set()
    with pytest.raises(SlabError):
        stuck.result(timeout=5)  # slot 0 was never written: missing


def test_io_threads_validated() -> None:
    with pytest.raises(ValueError):
        SlabExecutor(io_threads=0)
