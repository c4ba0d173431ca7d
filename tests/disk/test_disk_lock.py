"""DiskLock: one engine per disk_path, across real processes, released even on SIGKILL."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tieredkv.config import ConfigError
from tieredkv.disk import private_files as lock_module
from tieredkv.disk.format import lock_path
from tieredkv.disk.private_files import DiskLock

HOLD = """
import sys, time
from pathlib import Path
from tieredkv.disk.private_files import DiskLock
lock = DiskLock(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(60)
"""


class RecordingTime:
    """``time`` for the lock module, recording every wait it makes (``sleep``)."""

    def __init__(self) -> None:
        self.sleeps: list[float] = []

    monotonic = staticmethod(time.monotonic)

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        time.sleep(seconds)


@pytest.fixture
def lock_waits(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The waits DiskLock makes for a holder that has not written its pid yet."""
    recorder = RecordingTime()
    monkeypatch.setattr(lock_module, "time", recorder)
    return recorder.sleeps


def _child_holding(path: Path) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "locked"
    return child


def test_lock_file_holds_pid_and_is_0600(tmp_path: Path) -> None:
    with DiskLock(tmp_path) as lock:
        assert lock.held
        assert lock_path(tmp_path).read_text().strip() == str(os.getpid())
        assert lock_path(tmp_path).stat().st_mode & 0o777 == 0o600
    assert not lock.held
    assert lock_path(tmp_path).read_text() == ""
    lock.close()  # idempotent


def test_second_lock_in_same_process_is_refused(tmp_path: Path) -> None:
    with DiskLock(tmp_path):
        with pytest.raises(ConfigError) as err:
            DiskLock(tmp_path)
        assert err.value.key == "disk_path"
        assert f"already in use by another engine (pid {os.getpid()})" in str(err.value)
    DiskLock(tmp_path).close()  # free again


def test_lock_across_processes_and_release_on_sigkill(tmp_path: Path) -> None:
    child = _child_holding(tmp_path)
    try:
        with pytest.raises(ConfigError) as err:
            DiskLock(tmp_path)
        assert f"pid {child.pid}" in str(err.value)
        assert DiskLock.holder(tmp_path) == child.pid
        assert DiskLock.holder(tmp_path) == child.pid  # probing did not take it away
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    # The kernel dropped the flock with the process: no stale lock.
    deadline = time.monotonic() + 5
    while DiskLock.holder(tmp_path) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    with DiskLock(tmp_path) as lock:
        assert lock.held


def test_holder_of_free_or_absent_lock(tmp_path: Path) -> None:
    assert DiskLock.holder(tmp_path) is None
    DiskLock(tmp_path).close()
    assert DiskLock.holder(tmp_path) is None


# -- tools looking at a tier never get in an engine's way (issue 10, 6c) ------------------


def test_a_probe_holding_a_shared_flock_does_not_block_an_engine(
    tmp_path: Path, lock_waits: list[float]
) -> None:
    """What ``tieredkv inspect`` used to do: hold a shared lock on the lock file for a moment.

    An engine starting in that moment failed with "already in use (pid unknown)". The lock is
    now one a probe neither takes nor conflicts with.
    """
    DiskLock(tmp_path).close()  # the lock file exists, as on any tier that was used before
    holding, done, released = threading.Event(), threading.Event(), threading.Event()

    def probe() -> None:
        fd = os.open(lock_path(tmp_path), os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            holding.set()
            done.wait(60)
        finally:
            os.close(fd)
            released.set()

    thread = threading.Thread(target=probe)
    thread.start()
    try:
        assert holding.wait(5)
        with DiskLock(tmp_path) as lock:
            assert lock.held
            assert DiskLock.holder(tmp_path) == os.getpid()
            # Taken while the probe still holds its lock, at the first try: never waited for it.
            assert not released.is_set()
        assert lock_waits == []
    finally:
        done.set()
        thread.join(10)


class SlowProbeFcntl:
    """``fcntl`` for the lock module, where any lock a query takes is held for 50 ms.

    A query that takes a lock (the old ``holder``: a shared ``flock``, dropped at once) can be
    descheduled while it holds it; this makes that moment long enough to hit every time. A
    query that takes no lock is not affected.
    """

    def __getattr__(self, name: str):
        return getattr(fcntl, name)

    def flock(self, fd: int, operation: int) -> None:
        fcntl.flock(fd, operation)
        if operation & fcntl.LOCK_SH:
            time.sleep(0.05)


def test_holder_queries_never_make_an_engine_start_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``holder`` in a loop beside engines taking and dropping the lock: every take wins."""
    monkeypatch.setattr(lock_module, "fcntl", SlowProbeFcntl())
    DiskLock(tmp_path).close()
    stop = threading.Event()
    seen: list[int | None] = []

    def query() -> None:
        while not stop.is_set():
            seen.append(DiskLock.holder(tmp_path))

    thread = threading.Thread(target=query)
    thread.start()
    try:
        for _ in range(50):
            DiskLock(tmp_path).close()
            time.sleep(0.002)
    finally:
        stop.set()
        thread.join(10)
    assert seen and set(seen) <= {None, os.getpid(), -1}


def test_a_real_second_engine_fails_at_once_naming_the_pid(
    tmp_path: Path, lock_waits: list[float]
) -> None:
    child = _child_holding(tmp_path)
    try:
        with pytest.raises(ConfigError) as err:
            DiskLock(tmp_path)
        assert lock_waits == [], "a holder with a pid is not waited for"
        assert f"already in use by another engine (pid {child.pid})" in str(err.value)
        assert str(tmp_path) in str(err.value)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)


def _hold_raw(path: Path, release_after: float | None) -> tuple[threading.Thread, threading.Event]:
    """Hold the lock the way an engine does between taking it and writing its pid."""
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, lock_module._flock_arg(fcntl.F_WRLCK))
            taken.set()
            release.wait(release_after if release_after is not None else 10)
        finally:
            os.close(fd)

    thread = threading.Thread(target=hold)
    thread.start()
    assert taken.wait(5)
    return thread, release


def test_a_holder_without_a_pid_yet_is_waited_for_briefly(
    tmp_path: Path, lock_waits: list[float], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A bound no loaded machine reaches: the holder lets go after 0.3 s, the lock is taken then.
    monkeypatch.setattr(lock_module, "_UNKNOWN_HOLDER_WAIT_S", 60.0)
    thread, _ = _hold_raw(lock_path(tmp_path), release_after=0.3)
    try:
        with DiskLock(tmp_path) as lock:  # taken once the pid-less holder let go
            assert lock.held
        assert lock_waits, "the pid-less holder was waited for"
    finally:
        thread.join(10)


def test_a_holder_without_a_pid_is_reported_after_the_bounded_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(lock_module, "_UNKNOWN_HOLDER_WAIT_S", 0.2)
    thread, release = _hold_raw(lock_path(tmp_path), release_after=None)
    try:
        with pytest.raises(ConfigError) as err:
            DiskLock(tmp_path)
        assert "pid unknown" in str(err.value)
        assert DiskLock.holder(tmp_path) == -1
    finally:
        release.set()
        thread.join(10)
