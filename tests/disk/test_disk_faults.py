"""Fault injection on the slab path: every fault ends in a typed SlabError, never wrong bytes.

Faults come from FaultyFileIO (ENOSPC, EIO, short I/O, bit flips, latency) and from real
damage to real files between "runs" (truncation, flipped bytes, deletion, a full tmpfs).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tieredkv.disk.errors import SlabError
from tieredkv.disk.format import HEADER_BYTES, payload_offset, slab_path, slot_stride
from tieredkv.disk.private_files import FileIO
from tieredkv.disk.slab import SlabFile
from tieredkv.protocol import FailureCause
from tieredkv.testing.faulty_fileio import FaultyFileIO

PAYLOAD = 20_000
SLOTS = 4
K = [bytes([i]) * 32 for i in range(6)]


def data(key: bytes) -> bytes:
    import hashlib

    seed = hashlib.blake2b(key, digest_size=64).digest()
    return (seed * (PAYLOAD // 64 + 1))[:PAYLOAD]


def open_slab(path: Path, fp: bytes, io: FileIO | None = None, **kw: object) -> SlabFile:
    return SlabFile.open(path, SLOTS, PAYLOAD, fp, io=io, **kw)  # type: ignore[arg-type]


def kind_of(fn: Callable[[], object]) -> FailureCause:
    with pytest.raises(SlabError) as err:
        fn()
    assert str(err.value).startswith(err.value.kind.value)
    return err.value.kind


@pytest.fixture
def slab(tmp_path: Path, fp: bytes, faulty: FaultyFileIO):
    slab = open_slab(slab_path(tmp_path, 0), fp, faulty)
    yield slab
    faulty.release_all()
    slab.close()


def read(slab: SlabFile, slot: int, key: bytes) -> bytes:
    out = bytearray(PAYLOAD)
    slab.read_slot_into(slot, key, out)
    return bytes(out)


# -- injected faults -------------------------------------------------------------------------


def test_enospc_on_write_is_no_space_and_leaves_the_old_slot(slab: SlabFile, faulty: FaultyFileIO) -> None:
    slab.write_slot(0, K[0], data(K[0]))
    faulty.fail_writes(errno.ENOSPC, times=1, at=slab.slot_offset(0))
    assert kind_of(lambda: slab.write_slot(0, K[1], data(K[1]))) is FailureCause.NO_SPACE
    assert read(slab, 0, K[0]) == data(K[0])
    assert kind_of(lambda: read(slab, 0, K[1])) is FailureCause.WRONG_KEY
    slab.write_slot(1, K[1], data(K[1]))  # only that call failed


def test_eio_on_write_and_read(slab: SlabFile, faulty: FaultyFileIO) -> None:
    faulty.fail_writes(errno.EIO, times=1)
    assert kind_of(lambda: slab.write_slot(0, K[0], data(K[0]))) is FailureCause.IO_ERROR
    slab.write_slot(0, K[0], data(K[0]))
    faulty.fail_reads(errno.EIO, at=slab.slot_offset(0))
    assert kind_of(lambda: read(slab, 0, K[0])) is FailureCause.IO_ERROR
    assert kind_of(lambda: slab.read_header(0, K[0])) is FailureCause.IO_ERROR
    faulty.clear()
    assert read(slab, 0, K[0]) == data(K[0])


def test_short_read(slab: SlabFile, faulty: FaultyFileIO) -> None:
    slab.write_slot(0, K[0], data(K[0]))
    faulty.short_reads(PAYLOAD // 2, times=1)
    assert kind_of(lambda: read(slab, 0, K[0])) is FailureCause.SHORT_READ
    faulty.short_reads(HEADER_BYTES + PAYLOAD, times=1)
    assert kind_of(lambda: slab.read_header(0)) is FailureCause.SHORT_READ


def test_short_write_leaves_a_torn_slot_that_never_verifies(slab: SlabFile, faulty: FaultyFileIO) -> None:
    slab.write_slot(0, K[0], data(K[0]))
    faulty.short_writes(8192, times=1)  # the new header and part of the payload land
    assert kind_of(lambda: slab.write_slot(0, K[1], data(K[1]))) is FailureCause.IO_ERROR
    assert kind_of(lambda: read(slab, 0, K[1])) is FailureCause.CHECKSUM
    assert kind_of(lambda: read(slab, 0, K[0])) is FailureCause.WRONG_KEY
    # Same key rewritten, torn: the header checksum no longer matches the half-new payload.
    slab.write_slot(1, K[2], data(K[2]))
    faulty.short_writes(8192, times=1)
    with pytest.raises(SlabError):
        slab.write_slot(1, K[2], bytes(PAYLOAD))
    assert kind_of(lambda: read(slab, 1, K[2])) is FailureCause.CHECKSUM


def test_bit_flips_while_reading(slab: SlabFile, faulty: FaultyFileIO) -> None:
    slab.write_slot(0, K[0], data(K[0]))
    faulty.flip_read_bit(HEADER_BYTES + 777, bit=5, times=1)  # payload
    assert kind_of(lambda: read(slab, 0, K[0])) is FailureCause.CHECKSUM
    faulty.flip_read_bit(60, times=1)  # inside the key field of the header
    assert kind_of(lambda: read(slab, 0, K[0])) is FailureCause.CHECKSUM
    assert read(slab, 0, K[0]) == data(K[0])  # the file itself is fine


def test_latency_is_only_latency(slab: SlabFile, faulty: FaultyFileIO) -> None:
    slab.write_slot(0, K[0], data(K[0]))
    faulty.delay("read", 0.02, times=2)
    assert read(slab, 0, K[0]) == data(K[0])


def test_open_failures(tmp_path: Path, fp: bytes, faulty: FaultyFileIO) -> None:
    faulty.fail("fallocate", errno.ENOSPC, times=1)
    assert kind_of(lambda: open_slab(tmp_path / "a.slab", fp, faulty, direct=False)) is FailureCause.NO_SPACE
    faulty.fail("open", errno.EIO, path="b.slab", times=1)
    assert kind_of(lambda: open_slab(tmp_path / "b.slab", fp, faulty, direct=False)) is FailureCause.IO_ERROR
    assert kind_of(lambda: open_slab(tmp_path / "c.slab", fp, faulty, create=False)) is FailureCause.MISSING


# -- real damage to real files between runs ----------------------------------------------


def _write_all(path: Path, fp: bytes) -> None:
    with open_slab(path, fp) as slab:
        for slot in range(SLOTS):
            slab.write_slot(slot, K[slot], data(K[slot]))


def test_truncated_slab_file(tmp_path: Path, fp: bytes) -> None:
    path = slab_path(tmp_path, 0)
    _write_all(path, fp)
    stride = slot_stride(PAYLOAD)
    os.truncate(path, payload_offset(2, stride) + 100)  # slot 2 cut mid-payload
    with open_slab(path, fp, create=False) as slab:
        assert read(slab, 1, K[1]) == data(K[1])
        assert kind_of(lambda: read(slab, 2, K[2])) is FailureCause.SHORT_READ
        assert kind_of(lambda: read(slab, 3, K[3])) is FailureCause.SHORT_READ
        assert kind_of(lambda: slab.read_header(3)) is FailureCause.SHORT_READ
    with open_slab(path, fp) as slab:  # a worker re-opening grows it back: zeros read as missing
        assert kind_of(lambda: read(slab, 3, K[3])) is FailureCause.MISSING
        assert kind_of(lambda: read(slab, 2, K[2])) is FailureCause.CHECKSUM


@pytest.mark.parametrize("where", ["magic", "fingerprint", "key", "length", "checksum_field", "payload"])
def test_flipped_byte_in_the_file(tmp_path: Path, fp: bytes, where: str) -> None:
    path = slab_path(tmp_path, 0)
    _write_all(path, fp)
    offset = {"magic": 3, "fingerprint": 20, "key": 50, "length": 78, "checksum_field": 88,
              "payload": HEADER_BYTES + 12345}[where]
    stride = slot_stride(PAYLOAD)
    with open(path, "r+b") as f:
        f.seek(stride + offset)
        old = f.read(1)[0]
        f.seek(stride + offset)
        f.write(bytes([old ^ 0x04]))
    with open_slab(path, fp) as slab:
        assert kind_of(lambda: read(slab, 1, K[1])) is FailureCause.CHECKSUM
        assert read(slab, 0, K[0]) == data(K[0]) and read(slab, 2, K[2]) == data(K[2])


def test_slab_file_deleted_between_runs(tmp_path: Path, fp: bytes) -> None:
    path = slab_path(tmp_path, 0)
    _write_all(path, fp)
    path.unlink()
    assert kind_of(lambda: open_slab(path, fp, create=False)) is FailureCause.MISSING
    with open_slab(path, fp) as slab:  # recreated empty
        assert kind_of(lambda: read(slab, 0, K[0])) is FailureCause.MISSING


def test_slab_file_deleted_while_open_keeps_serving_its_inode(tmp_path: Path, fp: bytes) -> None:
    path = slab_path(tmp_path, 0)
    with open_slab(path, fp) as slab:
        slab.write_slot(0, K[0], data(K[0]))
        path.unlink()
        assert read(slab, 0, K[0]) == data(K[0])  # POSIX: the open file lives on, still verified


def test_real_enospc_on_a_full_tmpfs(small_tmpfs: Path, fp: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    # Preallocation reports a full disk at open, before any spill is attempted.
    too_big = SLOTS * 1000
    kind = kind_of(lambda: SlabFile.open(small_tmpfs / "big.slab", too_big, PAYLOAD, fp))
    assert kind is FailureCause.NO_SPACE
    (small_tmpfs / "big.slab").unlink(missing_ok=True)

    # Without preallocation (a filesystem that cannot fallocate), the write itself hits ENOSPC.
    def unsupported(fd: int, off: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "unsupported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    with SlabFile.open(small_tmpfs / "sparse.slab", SLOTS, PAYLOAD, fp, direct=False) as slab:
        with open(small_tmpfs / "filler", "wb") as filler:
            try:
                while True:
                    filler.write(b"\xff" * 65536)
                    filler.flush()
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
        assert kind_of(lambda: slab.write_slot(0, K[0], data(K[0]))) is FailureCause.NO_SPACE
        assert kind_of(lambda: read(slab, 0, K[0])) in (FailureCause.MISSING, FailureCause.CHECKSUM)


# -- properties --------------------------------------------------------------------------------

_FAULTS = st.sampled_from(
    ["none", "none", "enospc", "eio", "short_read", "short_write", "flip_header", "flip_payload"]
)
_OPS = st.lists(
    st.tuples(st.sampled_from(["write", "read"]), st.integers(0, SLOTS - 1),
              st.integers(0, len(K) - 1), _FAULTS),
    min_size=1, max_size=25,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
def test_any_fault_sequence_never_returns_wrong_bytes(tmp_path_factory, fp: bytes, ops) -> None:
    """Whatever faults hit whatever writes, a successful read returns exactly the key's bytes."""
    io = FaultyFileIO()
    path = slab_path(tmp_path_factory.mktemp("prop"), 0)
    with open_slab(path, fp, io, direct=False) as slab:
        last_good: dict[int, bytes] = {}
        for op, slot, key_index, fault in ops:
            key = K[key_index]
            at = slab.slot_offset(slot)
            if fault == "enospc":
                io.fail(op, errno.ENOSPC, times=1, at=at)
            elif fault == "eio":
                io.fail(op, errno.EIO, times=1, at=at)
            elif fault == "short_read":
                io.short_reads(1000, times=1, at=at)
            elif fault == "short_write":
                io.short_writes(9000, times=1, at=at)
            elif fault == "flip_header":
                io.flip_read_bit(key_index * 13 % 104, times=1, at=at)
            elif fault == "flip_payload":
                io.flip_read_bit(HEADER_BYTES + key_index * 997, times=1, at=at)
            try:
                if op == "write":
                    slab.write_slot(slot, key, data(key))
                    last_good[slot] = key
                else:
                    assert read(slab, slot, key) == data(key)
            except SlabError:
                if op == "write":
                    last_good.pop(slot, None)
            io.clear()
        for slot, key in last_good.items():  # untouched by faults afterwards: still readable
            assert read(slab, slot, key) == data(key)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(position=st.integers(0, SLOTS * slot_stride(PAYLOAD) - 1), bit=st.integers(0, 7))
def test_any_flipped_bit_in_the_file_is_caught_or_harmless(tmp_path_factory, fp: bytes, position: int, bit: int) -> None:
    path = slab_path(tmp_path_factory.mktemp("flip"), 0)
    _write_all(path, fp)
    with open(path, "r+b") as f:
        f.seek(position)
        old = f.read(1)[0]
        f.seek(position)
        f.write(bytes([old ^ (1 << bit)]))
    with open_slab(path, fp, direct=False) as slab:
        for slot in range(SLOTS):
            try:
                assert read(slab, slot, K[slot]) == data(K[slot])
            except SlabError as exc:
                assert exc.kind in (FailureCause.CHECKSUM, FailureCause.WRONG_NAMESPACE,
                                    FailureCause.WRONG_KEY, FailureCause.MISSING)
                assert position // slot_stride(PAYLOAD) == slot  # only the damaged slot fails
