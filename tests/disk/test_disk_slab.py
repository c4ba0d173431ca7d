"""SlabFile on real files: geometry, round trips from host-tier slots, verification, O_DIRECT."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tieredkv.disk import slab as slab_mod
from tieredkv.disk.errors import SlabError
from tieredkv.disk.format import slab_name, slab_path, slot_stride
from tieredkv.disk.slab import SlabFile
from tieredkv.protocol import FailureCause
from tieredkv.testing.faulty_fileio import FaultyFileIO
from tieredkv.transfer.host_pool import HostPool

PAYLOAD = 100_000  # deliberately not a 4 KiB multiple: padding is exercised everywhere


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slab_mod, "_warned_buffered", set())


def open_slab(tmp_path: Path, fp: bytes, num_slots: int = 4, **kw: object) -> SlabFile:
    return SlabFile.open(slab_path(tmp_path / "tier", 0), num_slots, PAYLOAD, fp, **kw)  # type: ignore[arg-type]


def test_create_geometry_and_permissions(tmp_path: Path, fp: bytes) -> None:
    with open_slab(tmp_path, fp, num_slots=5) as slab:
        assert slab.slot_stride == slot_stride(PAYLOAD) == 106496
        assert slab.num_slots == 5 and slab.payload_bytes == PAYLOAD
        assert slab.slot_offset(3) == 3 * 106496
        assert slab.path.stat().st_size == 5 * 106496
        assert slab.path.stat().st_mode & 0o777 == 0o600
        assert slab.path.parent.stat().st_mode & 0o777 == 0o700
        assert slab.direct is True  # ext4/xfs under tmp_path; see the probe tests for fallback


def test_roundtrip_through_host_pool_slots(tmp_path: Path, fp: bytes, key: Callable[[int], bytes],
                                           payload: Callable[[bytes, int, int], bytes]) -> None:
    pool = HostPool(3, PAYLOAD, pin=False)
    with open_slab(tmp_path, fp) as slab:
        for slot in range(3):
            src = payload(key(slot), 0, PAYLOAD)
            pool.slot(slot).copy_(torch.frombuffer(bytearray(src), dtype=torch.uint8))
            slab.write_slot(slot, key(slot), pool.slot_memoryview(slot))
        pool.buffer.zero_()
        for slot in (2, 0, 1):
            header = slab.read_slot_into(slot, key(slot), pool.slot_memoryview(slot))
            assert header.key == key(slot) and header.payload_len == PAYLOAD
            assert bytes(pool.slot(slot).numpy()) == payload(key(slot), 0, PAYLOAD)
    pool.close()


def test_unaligned_and_exact_length_buffers_are_bounced(tmp_path: Path, fp: bytes) -> None:
    data = os.urandom(PAYLOAD)
    with open_slab(tmp_path, fp) as slab:
        slab.write_slot(1, b"k" * 32, data)  # read-only bytes, not padded
        slab.write_slot(2, b"j" * 32, memoryview(bytearray(b"\x00" + data))[1:])  # misaligned
        out = bytearray(PAYLOAD)
        slab.read_slot_into(1, b"k" * 32, out)
        assert out == data
        out2 = memoryview(bytearray(PAYLOAD + 1))[1:]
        slab.read_slot_into(2, b"j" * 32, out2)
        assert out2.tobytes() == data


def test_buffered_mode_roundtrip(tmp_path: Path, fp: bytes) -> None:
    data = os.urandom(PAYLOAD)
    with open_slab(tmp_path, fp, direct=False) as slab:
        assert slab.direct is False
        slab.write_slot(0, b"k" * 32, data)
        out = bytearray(PAYLOAD)
        slab.read_slot_into(0, b"k" * 32, out)
        assert out == data


def test_reopen_keeps_slots_and_resizes(tmp_path: Path, fp: bytes) -> None:
    data = os.urandom(PAYLOAD)
    with open_slab(tmp_path, fp, num_slots=4) as slab:
        slab.write_slot(1, b"k" * 32, data)
        path = slab.path
    with open_slab(tmp_path, fp, num_slots=8) as slab:
        assert path.stat().st_size == 8 * slab.slot_stride
        out = bytearray(PAYLOAD)
        slab.read_slot_into(1, b"k" * 32, out)
        assert out == data
        with pytest.raises(SlabError) as err:
            slab.read_slot_into(7, b"k" * 32, out)
        assert err.value.kind is FailureCause.MISSING
    with open_slab(tmp_path, fp, num_slots=2) as slab:
        assert path.stat().st_size == 2 * slab.slot_stride
        slab.read_slot_into(1, b"k" * 32, out)
        assert out == data


def test_verification_kinds(tmp_path: Path, fp: bytes, other_fp: bytes) -> None:
    data = os.urandom(PAYLOAD)
    out = bytearray(PAYLOAD)
    with open_slab(tmp_path, fp) as slab:
        with pytest.raises(SlabError) as err:
            slab.read_slot_into(0, b"k" * 32, out)
        assert err.value.kind is FailureCause.MISSING
        slab.write_slot(0, b"k" * 32, data)
        with pytest.raises(SlabError) as err:
            slab.read_slot_into(0, b"x" * 32, out)
        assert err.value.kind is FailureCause.WRONG_KEY
        assert "slot 0" in str(err.value) and slab_name(0) in str(err.value)
        assert slab.read_header(0, b"k" * 32).key == b"k" * 32
        with pytest.raises(SlabError) as err:
            slab.read_header(0, b"x" * 32)
        assert err.value.kind is FailureCause.WRONG_KEY
        slab.invalidate_slot(0)
        with pytest.raises(SlabError) as err:
            slab.read_slot_into(0, b"k" * 32, out)
        assert err.value.kind is FailureCause.MISSING
        slab.write_slot(0, b"k" * 32, data)
    with open_slab(tmp_path, other_fp) as other:
        with pytest.raises(SlabError) as err:
            other.read_slot_into(0, b"k" * 32, out)
        assert err.value.kind is FailureCause.WRONG_NAMESPACE
    with SlabFile.open(slab_path(tmp_path / "tier", 0), 4, PAYLOAD - 1, fp, create=False) as bad:
        with pytest.raises(SlabError) as err:  # another geometry: length does not match
            bad.read_header(0)
        assert err.value.kind is FailureCause.WRONG_NAMESPACE


def test_programming_errors_are_not_slab_errors(tmp_path: Path, fp: bytes) -> None:
    with open_slab(tmp_path, fp) as slab:
        with pytest.raises(IndexError):
            slab.write_slot(4, b"k" * 32, bytes(PAYLOAD))
        with pytest.raises(ValueError):
            slab.write_slot(0, b"k" * 31, bytes(PAYLOAD))
        with pytest.raises(ValueError):
            slab.write_slot(0, b"k" * 32, bytes(PAYLOAD - 1))
        with pytest.raises(ValueError):
            slab.read_slot_into(0, b"k" * 32, bytes(PAYLOAD))  # read-only out
    with pytest.raises(ValueError):
        SlabFile.open(tmp_path / "x.slab", 1, PAYLOAD, b"short")


def test_existing_only_and_readonly(tmp_path: Path, fp: bytes) -> None:
    with pytest.raises(SlabError) as err:
        SlabFile.open(tmp_path / "nope.slab", 4, PAYLOAD, fp, create=False)
    assert err.value.kind is FailureCause.MISSING
    data = os.urandom(PAYLOAD)
    with open_slab(tmp_path, fp) as slab:
        slab.write_slot(3, b"k" * 32, data)
    with SlabFile.open(slab_path(tmp_path / "tier", 0), 4, PAYLOAD, fp, create=False,
                       readonly=True) as ro:
        out = bytearray(PAYLOAD)
        ro.read_slot_into(3, b"k" * 32, out)
        assert out == data
        with pytest.raises(ValueError):
            ro.write_slot(0, b"k" * 32, data)


def test_closed_slab_fails_missing_and_close_waits_for_inflight(tmp_path: Path, fp: bytes) -> None:
    io = FaultyFileIO()
    slab = open_slab(tmp_path, fp, io=io)
    slab.write_slot(0, b"k" * 32, bytes(PAYLOAD))
    gate = io.hang("read", times=1)
    out = bytearray(PAYLOAD)
    result: list[object] = []
    reads0 = io.calls["read"]
    thread = threading.Thread(target=lambda: result.append(slab.read_slot_into(0, b"k" * 32, out)))
    thread.start()
    while io.calls["read"] == reads0:
        time.sleep(0.001)
    slab.close()  # must not close the descriptor under the running read
    assert slab.closed
    with pytest.raises(SlabError) as err:
        slab.read_slot_into(0, b"k" * 32, out)
    assert err.value.kind is FailureCause.MISSING
    gate.set()
    thread.join(5)
    assert result and result[0].key == b"k" * 32  # type: ignore[attr-defined]
    slab.close()  # idempotent


def test_concurrent_writes_and_reads_on_different_slots(
    tmp_path: Path, fp: bytes, key: Callable[[int], bytes],
    payload: Callable[[bytes, int, int], bytes],
) -> None:
    slots = 16
    errors: list[BaseException] = []
    with open_slab(tmp_path, fp, num_slots=slots) as slab:

        def worker(first: int) -> None:
            try:
                out = bytearray(PAYLOAD)
                for round_ in range(3):
                    for slot in range(first, slots, 4):
                        k = key(slot * 10 + round_)
                        slab.write_slot(slot, k, payload(k, 0, PAYLOAD))
                        slab.read_slot_into(slot, k, out)
                        assert out == payload(k, 0, PAYLOAD)
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors


# -- O_DIRECT probe ------------------------------------------------------------------------


def test_probe_falls_back_when_open_refuses_o_direct(
    tmp_path: Path, fp: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    io = FaultyFileIO()
    io.fail("open", errno.EINVAL, flags=os.O_DIRECT)
    data = os.urandom(PAYLOAD)
    with caplog.at_level(logging.WARNING, logger="tieredkv.disk.slab"):
        with open_slab(tmp_path, fp, io=io) as slab:
            assert slab.direct is False
            slab.write_slot(0, b"k" * 32, data)
            out = bytearray(PAYLOAD)
            slab.read_slot_into(0, b"k" * 32, out)
            assert out == data
        with SlabFile.open(slab_path(tmp_path / "tier", 1), 2, PAYLOAD, fp, io=io) as again:
            assert again.direct is False
    warnings = [r for r in caplog.records if "O_DIRECT unavailable" in r.getMessage()]
    assert len(warnings) == 1, "the fallback is said once"
    assert "EINVAL" in warnings[0].getMessage() or "Invalid argument" in warnings[0].getMessage()
    assert not list((tmp_path / "tier").glob(".odirect-probe-*")), "probe file cleaned up"


def test_probe_falls_back_when_o_direct_io_fails(tmp_path: Path, fp: bytes) -> None:
    io = FaultyFileIO()
    io.fail_writes(errno.EINVAL, path=".odirect-probe-")
    with open_slab(tmp_path, fp, io=io) as slab:
        assert slab.direct is False
    assert io.faults["write:error"] == 1


def test_direct_false_skips_the_probe(tmp_path: Path, fp: bytes) -> None:
    io = FaultyFileIO()
    with open_slab(tmp_path, fp, io=io, direct=False) as slab:
        assert slab.direct is False
    assert io.calls["open"] == 1


def test_tmpfs_works_whatever_it_says_about_o_direct(small_tmpfs: Path, fp: bytes) -> None:
    data = os.urandom(PAYLOAD)
    with SlabFile.open(slab_path(small_tmpfs, 0), 4, PAYLOAD, fp) as slab:
        slab.write_slot(2, b"k" * 32, data)
        out = bytearray(PAYLOAD)
        slab.read_slot_into(2, b"k" * 32, out)
        assert out == data
