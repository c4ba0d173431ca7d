"""Journal faults at every step: a record that flush() reported durable is replayed after a restart.

Faults are injected one system call at a time (write, fsync, the cut-back truncate, the
compaction's temporary file, rename, directory fsync, reopen, close) by a JournalFiles whose
other calls are real, against real files; a full tmpfs gives a real ENOSPC in mid-batch.
The flusher runs with a long interval so that each flush() is exactly one write attempt.
"""

from __future__ import annotations

import errno
import os
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import wide_key as k
from tieredkv.disk.errors import SlabError
from tieredkv.disk.format import JOURNAL_NAME, journal_path
from tieredkv.disk.journal import Journal
from tieredkv.disk.journal_file import FILE_HEADER_BYTES, RECORD_BYTES
from tieredkv.disk.private_files import JournalFiles
from tieredkv.protocol import FailureCause

ONE_ATTEMPT_PER_FLUSH = 3600.0


@dataclass
class Fault:
    step: str
    err: int
    on: str | None = None  # "log" (the journal) or "temp" (a compaction's file); None: any
    times: int = 1
    partial: int = 0  # write: bytes that reach the file before the error
    after: bool = False  # do the call, then report the error (close always frees the fd)


class FaultyJournalFiles(JournalFiles):
    """Real system calls on real files, except the ones a test told to fail."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._faults: list[Fault] = []
        self._role: dict[int, str] = {}
        self.fired: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()  # every call made, failed or not
        self._gates: dict[str, tuple[threading.Event, threading.Event]] = {}

    def fail(self, step: str, err: int, **kw: object) -> None:
        with self._lock:
            self._faults.append(Fault(step, err, **kw))  # type: ignore[arg-type]

    def clear(self) -> None:
        """Every armed fault is forgotten: the disk has room again."""
        with self._lock:
            self._faults.clear()

    def gate(self, step: str) -> tuple[threading.Event, threading.Event]:
        """Hold the next ``step`` call until the second event is set; the first is set once
        it is held."""
        held, release = threading.Event(), threading.Event()
        with self._lock:
            self._gates[step] = (held, release)
        return held, release

    def armed(self) -> int:
        with self._lock:
            return sum(f.times for f in self._faults)

    def _take(self, step: str, fd: int | None = None) -> Fault | None:
        with self._lock:
            self.calls[step] += 1
            gate = self._gates.pop(step, None)
        if gate is not None:
            gate[0].set()
            assert gate[1].wait(60), f"{step} held for a minute"
        with self._lock:
            for fault in self._faults:
                if fault.step != step or fault.times <= 0:
                    continue
                if fault.on is not None and self._role.get(fd) != fault.on:  # type: ignore[arg-type]
                    continue
                fault.times -= 1
                self.fired[step] += 1
                return fault
        return None

    @staticmethod
    def _raise(fault: Fault) -> None:
        raise OSError(fault.err, f"injected: {os.strerror(fault.err)}")

    def _check(self, step: str, fd: int | None = None) -> None:
        fault = self._take(step, fd)
        if fault is not None:
            self._raise(fault)

    def open_log(self, path: Path) -> int:
        self._check("open_log")
        fd = super().open_log(path)
        self._role[fd] = "log"
        return fd

    def create_temp(self, path: Path) -> int:
        self._check("create_temp")
        fd = super().create_temp(path)
        self._role[fd] = "temp"
        return fd

    def write(self, fd: int, data: bytes) -> None:
        fault = self._take("write", fd)
        if fault is not None:
            if fault.partial:
                super().write(fd, data[: fault.partial])
            self._raise(fault)
        super().write(fd, data)

    def fsync(self, fd: int) -> None:
        self._check("fsync", fd)
        super().fsync(fd)

    def truncate(self, fd: int, size: int) -> None:
        self._check("truncate", fd)
        super().truncate(fd, size)

    def replace(self, src: Path, dst: Path) -> None:
        self._check("replace")
        super().replace(src, dst)

    def fsync_dir(self, directory: Path) -> None:
        self._check("fsync_dir")
        super().fsync_dir(directory)

    def close(self, fd: int) -> None:
        fault = self._take("close", fd)
        self._role.pop(fd, None)
        super().close(fd)
        if fault is not None:
            self._raise(fault)


class Model:
    """What the journal must replay: every record applied in order."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self.entries: dict[bytes, int] = {}

    def add(self, first: int, count: int) -> None:
        for i in range(first, first + count):
            self.journal.record_add(k(i), i)
            self.entries[k(i)] = i

    def remove(self, *ids: int) -> None:
        for i in ids:
            self.journal.record_remove(k(i))
            self.entries.pop(k(i), None)


def flush_until_durable(journal: Journal, attempts: int) -> list[SlabError]:
    """Flush, tolerating up to ``attempts - 1`` failed attempts; returns their errors."""
    errors: list[SlabError] = []
    for _ in range(attempts):
        try:
            journal.flush(timeout=30)
            return errors
        except SlabError as exc:
            errors.append(exc)
    pytest.fail(f"journal never became durable: {errors}")


def assert_replays(path: Path, entries: dict[bytes, int]) -> None:
    replay = Journal.replay(path)
    assert replay.entries == entries
    assert replay.bad_tail_bytes == 0  # no torn or duplicated record anywhere in the file


APPEND_FAULTS = {
    "write ENOSPC after 3.5 records": [Fault("write", errno.ENOSPC, on="log",
                                             partial=3 * RECORD_BYTES + RECORD_BYTES // 2)],
    "write EIO": [Fault("write", errno.EIO, on="log")],
    "fsync EIO": [Fault("fsync", errno.EIO, on="log")],
    "fsync ENOSPC": [Fault("fsync", errno.ENOSPC, on="log")],
    "write ENOSPC, then the cut-back fails": [
        Fault("write", errno.ENOSPC, on="log", partial=2 * RECORD_BYTES + 7),
        Fault("truncate", errno.EIO, on="log"),
    ],
}


@pytest.mark.parametrize("faults", APPEND_FAULTS.values(), ids=APPEND_FAULTS.keys())
def test_a_failed_append_is_retried_without_losing_or_doubling(tmp_path: Path, faults: list[Fault]) -> None:
    path = journal_path(tmp_path)
    files = FaultyJournalFiles()
    with Journal(path, flush_interval_s=ONE_ATTEMPT_PER_FLUSH, files=files) as journal:
        model = Model(journal)
        model.add(0, 10)
        journal.flush()
        for fault in faults:
            files.fail(fault.step, fault.err, on=fault.on, partial=fault.partial)
        model.add(10, 20)
        model.remove(3, 12)
        with pytest.raises(SlabError) as err:
            journal.flush(timeout=30)
        assert err.value.kind in (FailureCause.NO_SPACE, FailureCause.IO_ERROR)
        model.add(30, 5)
        flush_until_durable(journal, attempts=len(faults) + 1)
        assert files.armed() == 0  # every injected fault really happened
        assert_replays(path, model.entries)  # what a restart right now would find
    assert_replays(path, model.entries)
    assert journal.write_errors == len(faults)


COMPACTION_FAULTS = {
    "temp create ENOSPC": (Fault("create_temp", errno.ENOSPC), True),
    "temp write ENOSPC": (Fault("write", errno.ENOSPC, on="temp", partial=100), True),
    "temp fsync EIO": (Fault("fsync", errno.EIO, on="temp"), True),
    "rename EIO": (Fault("replace", errno.EIO), True),
    "rename ENOSPC": (Fault("replace", errno.ENOSPC), True),
    "directory fsync EIO": (Fault("fsync_dir", errno.EIO), True),
    "reopen EIO": (Fault("open_log", errno.EIO), True),
    "reopen ENOSPC": (Fault("open_log", errno.ENOSPC), True),
    "old file close EIO": (Fault("close", errno.EIO, on="log", after=True), False),
}


@pytest.mark.parametrize(("fault", "reported"), COMPACTION_FAULTS.values(), ids=COMPACTION_FAULTS.keys())
def test_a_failed_compaction_loses_nothing_after_it(tmp_path: Path, fault: Fault, reported: bool) -> None:
    path = journal_path(tmp_path)
    files = FaultyJournalFiles()
    with Journal(path, flush_interval_s=ONE_ATTEMPT_PER_FLUSH, files=files) as journal:
        model = Model(journal)
        model.add(0, 40)
        model.remove(*range(0, 40, 3))
        journal.flush()
        files.fail(fault.step, fault.err, on=fault.on, partial=fault.partial, after=fault.after)
        if reported:
            with pytest.raises(SlabError):
                journal.compact(dict(model.entries))
        else:
            journal.compact(dict(model.entries))  # logged; the rewrite itself is durable
        assert files.armed() == 0
        model.add(100, 10)  # the next appends must reach the file the journal path names
        model.remove(1, 101)
        flush_until_durable(journal, attempts=2)
        assert not path.with_name(JOURNAL_NAME + ".tmp").exists()
        assert_replays(path, model.entries)
        journal.compact(dict(model.entries))  # and the journal can still be rewritten
        model.add(200, 3)
        journal.flush()
        assert_replays(path, model.entries)
    assert_replays(path, model.entries)


def test_nothing_after_an_unsynced_rename_is_reported_durable_until_the_directory_syncs(
    tmp_path: Path,
) -> None:
    path = journal_path(tmp_path)
    files = FaultyJournalFiles()
    with Journal(path, flush_interval_s=ONE_ATTEMPT_PER_FLUSH, files=files) as journal:
        model = Model(journal)
        model.add(0, 5)
        journal.flush()
        files.fail("fsync_dir", errno.EIO, times=2)
        with pytest.raises(SlabError):
            journal.compact(dict(model.entries))
        model.add(5, 5)
        # The rename may not survive a crash, so these records are not durable yet either.
        with pytest.raises(SlabError) as err:
            journal.flush(timeout=30)
        assert err.value.kind is FailureCause.IO_ERROR
        journal.flush(timeout=30)
        # Both injected failures fired (the rename's sync, then the retry before the first
        # append); the third try, before the next append, succeeded.
        assert files.fired["fsync_dir"] == 2 and files.armed() == 0
        assert_replays(path, model.entries)
    assert_replays(path, model.entries)


def _fill(directory: Path) -> Path:
    """Fill the filesystem holding ``directory``, to the last page."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as out:
        try:
            while True:
                out.write(b"\xff" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    return filler


def test_real_enospc_in_mid_batch_loses_nothing(small_tmpfs: Path) -> None:
    path = journal_path(small_tmpfs)
    with Journal(path, flush_interval_s=ONE_ATTEMPT_PER_FLUSH) as journal:
        model = Model(journal)
        model.add(0, 10)
        journal.flush()
        filler = _fill(small_tmpfs)
        model.add(10, 200)  # 11 KiB: part of it fits in the journal's last page, the rest not
        with pytest.raises(SlabError) as err:
            journal.flush(timeout=30)
        assert err.value.kind is FailureCause.NO_SPACE
        assert path.stat().st_size > FILE_HEADER_BYTES + 10 * RECORD_BYTES  # torn
        filler.unlink()
        model.add(210, 10)
        journal.flush(timeout=30)
        assert_replays(path, model.entries)
    assert_replays(path, model.entries)
    assert Journal.replay(path).records == 220
