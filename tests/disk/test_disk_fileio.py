"""FileIO loops and fallbacks, and FaultyFileIO's programmable faults, on real files."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tieredkv.disk.private_files import FileIO
from tieredkv.testing import faulty_fileio
from tieredkv.testing.faulty_fileio import FaultyFileIO


def _file(tmp_path: Path, io: FileIO, size: int = 16384) -> int:
    fd = io.open(tmp_path / "f.bin", os.O_RDWR | os.O_CREAT)
    io.fallocate(fd, size)
    return fd


def test_open_is_0600_and_cloexec(tmp_path: Path) -> None:
    io = FileIO()
    fd = io.open(tmp_path / "f.bin", os.O_RDWR | os.O_CREAT)
    try:
        assert (tmp_path / "f.bin").stat().st_mode & 0o777 == 0o600
        assert not os.get_inheritable(fd)
    finally:
        io.close(fd)


def test_pwrite_loops_on_partial_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    io = FileIO()
    fd = _file(tmp_path, io)
    real = os.pwritev
    calls = []

    def at_most_1000(fd: int, bufs: list[memoryview], offset: int) -> int:
        calls.append(offset)
        first = memoryview(bufs[0])[:1000]
        return real(fd, [first], offset)

    monkeypatch.setattr(os, "pwritev", at_most_1000)
    data = [memoryview(b"a" * 2500), memoryview(b"b" * 1500)]
    assert io.pwrite(fd, data, 100) == 4000
    monkeypatch.undo()
    assert os.pread(fd, 4000, 100) == b"a" * 2500 + b"b" * 1500
    assert len(calls) == 5
    io.close(fd)


def test_pwrite_stops_when_nothing_more_is_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    io = FileIO()
    fd = _file(tmp_path, io)
    monkeypatch.setattr(os, "pwritev", lambda fd, bufs, off: 0)
    assert io.pwrite(fd, [memoryview(b"x" * 10)], 0) == 0
    io.close(fd)


def test_pread_loops_and_reports_eof(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    io = FileIO()
    fd = io.open(tmp_path / "f.bin", os.O_RDWR | os.O_CREAT)
    os.pwrite(fd, bytes(range(256)) * 20, 0)  # 5120 bytes
    real = os.preadv

    def at_most_700(fd: int, bufs: list[memoryview], offset: int) -> int:
        return real(fd, [memoryview(bufs[0])[:700]], offset)

    monkeypatch.setattr(os, "preadv", at_most_700)
    a, b = bytearray(3000), bytearray(3000)
    got = io.pread_into(fd, [memoryview(a), memoryview(b)], 0)
    assert got == 5120  # stopped at end of file, not at the first partial read
    assert bytes(a) + bytes(b)[:2120] == (bytes(range(256)) * 20)
    io.close(fd)


def test_fallocate_falls_back_to_ftruncate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    io = FileIO()
    fd = io.open(tmp_path / "f.bin", os.O_RDWR | os.O_CREAT)

    def unsupported(fd: int, off: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "no")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    io.fallocate(fd, 1 << 20)
    assert io.size(fd) == 1 << 20
    io.close(fd)


def test_fallocate_enospc_is_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    io = FileIO()
    fd = io.open(tmp_path / "f.bin", os.O_RDWR | os.O_CREAT)

    def full(fd: int, off: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "full")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError) as err:
        io.fallocate(fd, 1 << 20)
    assert err.value.errno == errno.ENOSPC
    io.close(fd)


def test_faults_fire_the_programmed_number_of_times(tmp_path: Path) -> None:
    io = FaultyFileIO()
    fd = _file(tmp_path, io)
    io.fail_writes(errno.ENOSPC, times=2)
    buf = [memoryview(b"z" * 4096)]
    for _ in range(2):
        with pytest.raises(OSError) as err:
            io.pwrite(fd, buf, 0)
        assert err.value.errno == errno.ENOSPC
    assert io.pwrite(fd, buf, 0) == 4096
    assert io.faults["write:error"] == 2 and io.calls["write"] == 3
    io.close(fd)


def test_faults_match_offsets_and_paths(tmp_path: Path) -> None:
    io = FaultyFileIO()
    fd = _file(tmp_path, io)
    io.fail_reads(errno.EIO, at=8192)
    io.fail_reads(errno.EIO, path="other.bin")
    out = [memoryview(bytearray(4096))]
    assert io.pread_into(fd, out, 0) == 4096
    with pytest.raises(OSError):
        io.pread_into(fd, out, 8192)
    with pytest.raises(OSError):  # every time: times=None
        io.pread_into(fd, out, 8192)
    io.clear()
    assert io.pread_into(fd, out, 8192) == 4096
    io.close(fd)


def test_open_fault_matches_flags(tmp_path: Path) -> None:
    io = FaultyFileIO()
    io.fail("open", errno.EINVAL, flags=os.O_DIRECT)
    with pytest.raises(OSError) as err:
        io.open(tmp_path / "d.bin", os.O_RDWR | os.O_CREAT | os.O_DIRECT)
    assert err.value.errno == errno.EINVAL
    io.close(io.open(tmp_path / "d.bin", os.O_RDWR | os.O_CREAT))


def test_short_read_and_bit_flip(tmp_path: Path) -> None:
    io = FaultyFileIO()
    fd = _file(tmp_path, io)
    io.pwrite(fd, [memoryview(bytes(8192))], 0)
    io.short_reads(100, times=1)
    out = bytearray(8192)
    assert io.pread_into(fd, [memoryview(out)], 0) == 8092
    io.flip_read_bit(5000, bit=3, times=1)
    a, b = bytearray(4096), bytearray(4096)
    assert io.pread_into(fd, [memoryview(a), memoryview(b)], 0) == 8192
    assert a == bytes(4096) and b[904] == 8 and b.count(0) == 4095
    io.close(fd)


def test_short_write_leaves_an_aligned_prefix(tmp_path: Path) -> None:
    io = FaultyFileIO()
    fd = _file(tmp_path, io)
    io.short_writes(5000, times=1)
    data = [memoryview(b"h" * 4096), memoryview(b"p" * 8192)]
    assert io.pwrite(fd, data, 0) == 4096  # 12288 - 5000 = 7288, rounded down to 4096
    assert os.pread(fd, 8192, 0) == b"h" * 4096 + bytes(4096)
    io.close(fd)


def test_delay_and_hang_with_release(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    io = FaultyFileIO()
    fd = _file(tmp_path, io)
    slept: list[float] = []
    clock = SimpleNamespace(sleep=slept.append, monotonic=time.monotonic)
    monkeypatch.setattr(faulty_fileio, "time", clock)
    io.delay("read", 0.05, times=1)
    out = [memoryview(bytearray(4096))]
    assert io.pread_into(fd, out, 0) == 4096
    assert slept == [0.05]  # the read waited its delay once, then was done
    io.pread_into(fd, out, 0)
    assert slept == [0.05]  # times=1: the next read is not delayed
    event = io.hang("read", times=1)
    done = threading.Event()
    thread = threading.Thread(target=lambda: (io.pread_into(fd, out, 0), done.set()))
    thread.start()
    assert not done.wait(0.1)  # really blocked
    event.set()
    assert done.wait(5)
    thread.join()
    io.hang("read")
    thread = threading.Thread(target=lambda: io.pread_into(fd, out, 0))
    thread.start()
    io.release_all()
    thread.join(5)
    assert not thread.is_alive()
    io.close(fd)


def test_unknown_op_is_rejected() -> None:
    with pytest.raises(ValueError):
        FaultyFileIO().fail("rename")


class _OnlyThroughFileIO(FileIO):
    """A FileIO that says when it is the caller: the OS's file calls work only inside it."""

    inside = threading.local()

    def __getattribute__(self, name: str):
        attr = super().__getattribute__(name)
        if name.startswith("_") or not callable(attr):
            return attr

        def through_fileio(*args, **kwargs):
            _OnlyThroughFileIO.inside.depth = getattr(_OnlyThroughFileIO.inside, "depth", 0) + 1
            try:
                return attr(*args, **kwargs)
            finally:
                _OnlyThroughFileIO.inside.depth -= 1

        return through_fileio


def test_the_slab_reaches_the_file_only_through_its_fileio(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Injected faults (FaultyFileIO) reach every read, write, sync and close of a slab only
    if the slab never calls the OS for them itself."""
    from tieredkv.disk.format import slab_path
    from tieredkv.disk.slab import SlabFile

    bypassed: list[str] = []
    for name in ("pread", "pwrite", "preadv", "pwritev", "fsync", "fdatasync", "close"):
        real = getattr(os, name)

        def guarded(*args, _real=real, _name=name):
            if not getattr(_OnlyThroughFileIO.inside, "depth", 0):
                bypassed.append(_name)
            return _real(*args)

        monkeypatch.setattr(os, name, guarded)
    payload, key = 8192, b"k" * 32
    data = memoryview(bytes(range(256)) * (payload // 256))
    with SlabFile.open(slab_path(tmp_path, 0), 2, payload, b"f" * 32, io=_OnlyThroughFileIO()) as slab:
        slab.write_slot(1, key, data)
        slab.sync()
        out = memoryview(bytearray(payload))
        slab.read_slot_into(1, key, out)
        assert slab.read_header(1, key).key == key and out == data
        slab.invalidate_slot(1)
    assert slab.closed
    monkeypatch.undo()
    assert not bypassed, f"the slab called os.{bypassed[0]} itself, past its FileIO"
