"""DiskLock: one engine per disk_path, across real processes, released even on SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tieredkv.config import ConfigError
from tieredkv.disk.lock import DiskLock

HOLD = """
import sys, time
from pathlib import Path
from tieredkv.disk.lock import DiskLock
lock = DiskLock(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(60)
"""


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
        assert (tmp_path / "lock").read_text().strip() == str(os.getpid())
        assert (tmp_path / "lock").stat().st_mode & 0o777 == 0o600
    assert not lock.held
    assert (tmp_path / "lock").read_text() == ""
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
