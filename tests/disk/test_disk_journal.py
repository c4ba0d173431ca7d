"""Journal: durable batched appends, replay, torn and corrupt tails, atomic compaction."""

from __future__ import annotations

import errno
import os
import struct
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import wide_key as k
from tieredkv.disk.errors import SlabError
from tieredkv.disk.format import JOURNAL_NAME, journal_path
from tieredkv.disk.journal import Journal
from tieredkv.disk.journal_file import (
    FILE_HEADER_BYTES,
    RECORD_BYTES,
    Op,
    encode_record,
)
from tieredkv.disk.private_files import JournalFiles
from tieredkv.protocol import FailureCause


def test_records_replay_in_order(tmp_path: Path) -> None:
    path = journal_path(tmp_path / "j")
    with Journal(path) as journal:
        journal.record_add(k(1), 10)
        journal.record_add(k(2), 11)
        journal.record_remove(k(1))
        journal.record_add(k(3), 12)
        journal.flush()
        assert Journal.replay(path).entries == {k(2): 11, k(3): 12}
        journal.clear()
        journal.record_add(k(4), 3)
    replay = Journal.replay(path)
    assert replay.entries == {k(4): 3}
    # The reset cut the file back to its header: only the record after it is left.
    assert replay.records == 1 and replay.bad_tail_bytes == 0
    assert path.stat().st_size == FILE_HEADER_BYTES + RECORD_BYTES
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700


def test_latest_add_to_a_slot_wins(tmp_path: Path) -> None:
    path = journal_path(tmp_path)
    with Journal(path) as journal:
        journal.record_add(k(1), 5)
        journal.record_add(k(2), 5)  # the REMOVE of k(1) was lost: slot 5 holds k(2) now
        journal.record_add(k(3), 6)
        journal.record_add(k(3), 7)  # moved
    assert Journal.replay(path).entries == {k(2): 5, k(3): 7}


class GatedFiles(JournalFiles):
    """Journal file calls whose writes, once ``armed``, wait for ``gate`` (a disk that hangs)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.writing, self.gate = threading.Event(), threading.Event()

    def write(self, fd: int, data: bytes) -> None:
        if self.armed:
            self.writing.set()
            assert self.gate.wait(60), "the test never opened the gate"
        super().write(fd, data)


def test_appends_are_batched_not_blocking(tmp_path: Path) -> None:
    path = journal_path(tmp_path)
    files = GatedFiles()
    with Journal(path, flush_interval_s=0.05, files=files) as journal:
        files.armed = True
        journal.record_add(k(0), 0)
        assert files.writing.wait(30)  # the flusher took it and is stuck in the write
        # Recording while the disk hangs: every call returns (queueing only), nothing written.
        adder = threading.Thread(target=lambda: [journal.record_add(k(i), i) for i in range(1, 2000)])
        adder.start()
        adder.join(30)
        assert not adder.is_alive(), "record_add waited on the hung disk write"
        assert journal.records_written == 0
        files.gate.set()
        journal.flush()
        assert len(Journal.replay(path).entries) == 2000
        assert journal.records_written == 2000
        # Without flush(), the background flusher still makes records durable (every ~50 ms).
        journal.record_add(k(5000), 1)
        deadline = time.monotonic() + 30  # only so a flusher that never runs fails, not hangs
        while k(5000) not in Journal.replay(path).entries:
            assert time.monotonic() < deadline, "the background flusher never wrote the record"
            time.sleep(0.01)
        assert Journal.replay(path).entries[k(5000)] == 1


def test_concurrent_recorders(tmp_path: Path) -> None:
    path = journal_path(tmp_path)
    with Journal(path) as journal:
        def add(base: int) -> None:
            for i in range(base, base + 250):
                journal.record_add(k(i), i)

        threads = [threading.Thread(target=add, args=(n * 1000,)) for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(Journal.replay(path).entries) == 1000


def test_torn_tail_is_ignored_counted_and_cut(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = journal_path(tmp_path)
    with Journal(path) as journal:
        for i in range(5):
            journal.record_add(k(i), i)
    with open(path, "ab") as f:
        f.write(encode_record(Op.ADD, k(99), 99, 6)[:30])  # a crash mid-append
    replay = Journal.replay(path)
    assert replay.entries == {k(i): i for i in range(5)}
    assert replay.bad_tail_bytes == 30
    assert "torn or corrupt tail of 30 bytes" in caplog.text
    with Journal(path) as journal:  # cut on open, then appends continue cleanly
        assert path.stat().st_size == FILE_HEADER_BYTES + 5 * RECORD_BYTES
        journal.record_add(k(7), 7)
    replay = Journal.replay(path)
    assert replay.bad_tail_bytes == 0 and replay.entries[k(7)] == 7 and len(replay.entries) == 6


def test_crc_mismatch_stops_replay(tmp_path: Path) -> None:
    path = journal_path(tmp_path)
    with Journal(path) as journal:
        for i in range(6):
            journal.record_add(k(i), i)
    data = bytearray(path.read_bytes())
    data[FILE_HEADER_BYTES + 3 * RECORD_BYTES + 10] ^= 0xFF  # corrupt record 3
    path.write_bytes(bytes(data))
    replay = Journal.replay(path)
    assert replay.entries == {k(0): 0, k(1): 1, k(2): 2}
    assert replay.bad_tail_bytes == 3 * RECORD_BYTES


def test_replayed_sequence_must_increase(tmp_path: Path) -> None:
    path = journal_path(tmp_path)
    with Journal(path) as journal:
        journal.record_add(k(1), 1)
        journal.record_add(k(2), 2)
    data = path.read_bytes()
    # A stale but internally valid record (sequence going back) is not trusted.
    path.write_bytes(data + encode_record(Op.ADD, k(3), 3, 1))
    assert Journal.replay(path).entries == {k(1): 1, k(2): 2}


def test_bad_file_header_starts_over(tmp_path: Path) -> None:
    path = journal_path(tmp_path)
    path.write_bytes(b"not a journal at all" * 10)
    replay = Journal.replay(path)
    assert not replay.header_ok and replay.entries == {}
    with Journal(path) as journal:
        journal.record_add(k(1), 1)
    assert Journal.replay(path).entries == {k(1): 1}


def test_missing_or_empty_journal(tmp_path: Path) -> None:
    assert Journal.replay(tmp_path / "absent.bin").entries == {}
    (tmp_path / "empty.bin").write_bytes(b"")
    assert Journal.replay(tmp_path / "empty.bin").entries == {}


def test_compaction_rewrites_atomically(tmp_path: Path) -> None:
    path = journal_path(tmp_path)
    with Journal(path) as journal:
        for i in range(100):
            journal.record_add(k(i), i)
            journal.record_remove(k(i + 1000))
        journal.flush()
        before = path.stat().st_size
        inode = path.stat().st_ino
        journal.compact({k(99): 99, k(42): 1})
        assert path.stat().st_ino != inode  # renamed over, never rewritten in place
        assert path.stat().st_size == FILE_HEADER_BYTES + 2 * RECORD_BYTES < before
        assert path.stat().st_mode & 0o777 == 0o600
        assert not (tmp_path / (JOURNAL_NAME + ".tmp")).exists()
        journal.record_add(k(500), 500)  # appends continue after the rewrite
    replay = Journal.replay(path)
    assert replay.entries == {k(99): 99, k(42): 1, k(500): 500}
    assert replay.bad_tail_bytes == 0


def test_leftover_tmp_from_crashed_compaction_is_harmless(tmp_path: Path) -> None:
    path = journal_path(tmp_path)
    with Journal(path) as journal:
        journal.record_add(k(1), 1)
    (tmp_path / (JOURNAL_NAME + ".tmp")).write_bytes(b"half a compaction")
    assert Journal.replay(path).entries == {k(1): 1}
    with Journal(path) as journal:
        journal.compact({k(2): 2})
    assert Journal.replay(path).entries == {k(2): 2}


def test_failed_fsync_is_reported_then_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = journal_path(tmp_path)
    with Journal(path, flush_interval_s=0.02) as journal:
        real = os.fsync
        failures = {"left": 1}

        def flaky(fd: int) -> None:
            if failures["left"]:
                failures["left"] -= 1
                raise OSError(errno.EIO, "injected")
            real(fd)

        monkeypatch.setattr(os, "fsync", flaky)
        journal.record_add(k(1), 1)
        with pytest.raises(SlabError) as err:
            journal.flush(timeout=5)
        assert err.value.kind is FailureCause.IO_ERROR
        journal.flush(timeout=5)  # retried by the flusher; nothing lost, nothing doubled
        assert journal.write_errors == 1
    replay = Journal.replay(path)
    assert replay.entries == {k(1): 1} and replay.records == 1 and replay.bad_tail_bytes == 0


def test_record_after_close_and_bad_key(tmp_path: Path) -> None:
    journal = Journal(journal_path(tmp_path))
    with pytest.raises(ValueError):
        journal.record_add(b"short", 1)
    journal.close()
    journal.close()
    # vLLM may still record an entry while it shuts down: dropped and counted, never raised.
    journal.record_add(k(1), 1)
    journal.record_remove(k(1))
    assert journal.dropped_after_close == 2
    assert Journal.replay(journal_path(tmp_path)).entries == {}


def test_record_layout(tmp_path: Path) -> None:
    record = encode_record(Op.REMOVE, k(9), 0, 77)
    assert len(record) == RECORD_BYTES == 56
    op, key, slot, seq = struct.unpack_from("<B3x32sQQ", record)
    assert (op, key, slot, seq) == (2, k(9), 0, 77)
