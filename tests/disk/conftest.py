"""Shared helpers for the disk-tier tests: deterministic keys and payloads, real files."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers import make_key
from tieredkv.testing.faulty_fileio import FaultyFileIO

REPO = Path(__file__).resolve().parents[2]
FINGERPRINT = hashlib.sha256(b"tieredkv tests/disk namespace").digest()
OTHER_FINGERPRINT = hashlib.sha256(b"another namespace").digest()


def payload_for(key: bytes, rank: int, size: int) -> bytes:
    """Bytes a slot for ``key`` on ``rank`` must hold: derivable anywhere, so checks are exact."""
    seed = hashlib.blake2b(key + rank.to_bytes(4, "little"), digest_size=64).digest()
    return (seed * (size // len(seed) + 1))[:size]


@pytest.fixture
def fp() -> bytes:
    return FINGERPRINT


@pytest.fixture
def other_fp() -> bytes:
    return OTHER_FINGERPRINT


@pytest.fixture
def faulty() -> FaultyFileIO:
    """A fresh fault-injecting FileIO (no rules until a test adds them)."""
    return FaultyFileIO()


@pytest.fixture
def key() -> Callable[[int], bytes]:
    return make_key


@pytest.fixture
def payload() -> Callable[[bytes, int, int], bytes]:
    return payload_for


@pytest.fixture
def run_py() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run ``python -c code`` (or a module) with the package importable, capturing output."""

    def run(*args: str, timeout: float = 30.0, check: bool = False) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        return subprocess.run(
            [sys.executable, *args], capture_output=True, text=True, timeout=timeout,
            env=env, cwd=REPO, check=check,
        )

    return run


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs mounted under tmp_path, for real ENOSPC; skipped where mounting is not allowed."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    try:
        result = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mount)],
            capture_output=True, text=True, timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {result.stderr.strip() or result.returncode}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
