"""The tieredkv command, run as a real subprocess against disk tiers made here."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from tests.disk.test_disk_lock import SlowProbeFcntl
from tieredkv import cli
from tieredkv.disk import private_files as lock_module
from tieredkv.disk.catalog import DiskCatalog
from tieredkv.disk.format import (
    JOURNAL_NAME,
    LOCK_NAME,
    MANIFEST_NAME,
    payload_offset,
    rank_lock_name,
    slab_name,
    slab_path,
    slot_stride,
)
from tieredkv.disk.private_files import DiskLock
from tieredkv.disk.slab import SlabFile

PAYLOAD = 40_000
SLOTS = 12
WORLD = 2


@pytest.fixture
def tier(tmp_path: Path, fp: bytes, key, payload) -> Path:
    disk = tmp_path / "tier"
    with DiskCatalog.open(disk, fp, PAYLOAD, SLOTS, WORLD) as catalog:
        for rank in range(WORLD):
            with SlabFile.open(catalog.slab_path(rank), SLOTS, PAYLOAD, fp) as slab:
                for i in range(5):
                    slab.write_slot(i, key(i), payload(key(i), rank, PAYLOAD))
        for i in range(5):
            catalog.record_written(key(i), i)
    return disk


def tkv(run_py, *args: str):
    return run_py("-m", "tieredkv.cli", *args)


def test_inspect_text_and_json(tier: Path, fp: bytes, run_py) -> None:
    result = tkv(run_py, "inspect", str(tier))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert fp.hex() in out and "world size 2" in out and f"{SLOTS} slots per rank" in out
    assert "5 entries" in out and f"5 / {SLOTS}" in out and "lock        free" in out
    assert slab_name(0) in out and slab_name(1) in out
    result = tkv(run_py, "inspect", "--json", str(tier))
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["manifest"]["fingerprint"] == fp.hex()
    assert info["manifest"]["slot_stride"] == slot_stride(PAYLOAD)
    assert info["journal"] == {"entries": 5, "records": 5, "bad_tail_bytes": 0}
    assert info["slots_used"] == 5 and info["slots_capacity"] == SLOTS
    assert info["payload_bytes_used"] == 5 * PAYLOAD * WORLD
    assert info["lock_holder_pid"] is None
    assert [s["file"] for s in info["slab_files"]] == [slab_name(0), slab_name(1)]


def test_inspect_reports_the_lock_holder_without_taking_it(tier: Path, fp: bytes, run_py) -> None:
    with DiskCatalog.open(tier, fp, PAYLOAD, SLOTS, WORLD) as catalog:
        result = tkv(run_py, "inspect", "--json", str(tier))
        assert json.loads(result.stdout)["lock_holder_pid"] == os.getpid()
        result = tkv(run_py, "inspect", str(tier))
        assert f"held by pid {os.getpid()}" in result.stdout
        catalog.record_removed(next(iter(catalog.recovered)))  # still ours: lock not stolen


def test_verify_good_tier(tier: Path, run_py) -> None:
    result = tkv(run_py, "verify", str(tier))
    assert result.returncode == 0, result.stderr
    assert "5 good, 0 bad" in result.stdout


def test_verify_flipped_payload_byte_then_drop(tier: Path, fp: bytes, key, run_py) -> None:
    stride = slot_stride(PAYLOAD)
    with open(slab_path(tier, 1), "r+b") as f:
        f.seek(payload_offset(3, stride) + 999)
        old = f.read(1)[0]
        f.seek(payload_offset(3, stride) + 999)
        f.write(bytes([old ^ 0x01]))
    result = tkv(run_py, "verify", str(tier))
    assert result.returncode == 1, result.stderr
    assert "checksum: 1" in result.stdout and key(3).hex() in result.stdout
    report = json.loads(tkv(run_py, "verify", "--json", str(tier)).stdout)
    assert report["bad"] == {"checksum": 1} and report["good"] == 4
    assert report["bad_keys"][0]["slot"] == 3 and report["bad_keys"][0]["rank"] == 1

    with DiskCatalog.open(tier, fp, PAYLOAD, SLOTS, WORLD):  # an engine is running
        refused = tkv(run_py, "verify", "--drop", str(tier))
        assert refused.returncode == 2
        assert "already in use by another engine" in refused.stderr

    dropped = tkv(run_py, "verify", "--drop", str(tier))
    assert dropped.returncode == 1 and "dropped 1" in dropped.stdout
    again = tkv(run_py, "verify", str(tier))
    assert again.returncode == 0 and "4 good, 0 bad" in again.stdout
    with DiskCatalog.open(tier, fp, PAYLOAD, SLOTS, WORLD) as catalog:
        assert key(3) not in catalog.recovered and len(catalog.recovered) == 4
        assert catalog.dropped_at_recovery == {}
    with SlabFile.open(slab_path(tier, 0), SLOTS, PAYLOAD, fp, create=False) as slab:
        with pytest.raises(Exception) as err:
            slab.read_header(3)
        assert "missing" in str(err.value)  # invalidated on every rank, not only the bad one


def test_verify_missing_slab_file(tier: Path, run_py) -> None:
    slab_path(tier, 0).unlink()
    result = tkv(run_py, "verify", "--json", str(tier))
    assert result.returncode == 1
    assert json.loads(result.stdout)["bad"] == {"missing": 5}


def test_usage_errors(tmp_path: Path, run_py) -> None:
    missing = tkv(run_py, "inspect", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "no such directory" in missing.stderr
    empty = tkv(run_py, "inspect", str(tmp_path))
    assert empty.returncode == 2 and "not a tieredkv disk tier" in empty.stderr
    no_manifest = tkv(run_py, "verify", str(tmp_path))
    assert no_manifest.returncode == 2 and MANIFEST_NAME in no_manifest.stderr
    (tmp_path / "file").write_text("x")
    not_dir = tkv(run_py, "verify", str(tmp_path / "file"))
    assert not_dir.returncode == 2 and "not a directory" in not_dir.stderr
    assert tkv(run_py).returncode == 2
    assert tkv(run_py, "frobnicate").returncode == 2


def test_adding_a_subcommand_is_three_lines(capsys: pytest.CaptureFixture[str]) -> None:
    try:
        @cli.subcommand("hello", "say hello", configure=lambda p: p.add_argument("--name"))
        def _hello(args) -> int:
            print(f"hello {args.name}")
            return 0

        assert cli.main(["hello", "--name", "disk"]) == 0
        assert capsys.readouterr().out == "hello disk\n"
    finally:
        cli.SUBCOMMANDS.pop("hello", None)


def test_inspect_beside_an_engine_starting_never_makes_it_fail(
    tier: Path, fp: bytes, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 10 (6c): inspect used to hold a shared lock briefly, and an engine starting in
    that moment failed with "already in use (pid unknown)". Any lock a query takes is held
    50 ms here (a descheduled inspect), so the old probe collides every time."""
    monkeypatch.setattr(lock_module, "fcntl", SlowProbeFcntl())
    stop = threading.Event()
    runs: list[int] = []

    def inspect_loop() -> None:
        while not stop.is_set():
            runs.append(cli.main(["inspect", "--json", str(tier)]))

    thread = threading.Thread(target=inspect_loop)
    thread.start()
    try:
        for _ in range(40):
            DiskCatalog.open(tier, fp, PAYLOAD, SLOTS, WORLD).close()
            DiskLock(tier, name=rank_lock_name(0)).close()
    finally:
        stop.set()
        thread.join(30)
    capsys.readouterr()
    assert runs and set(runs) == {0}


@pytest.mark.parametrize("name", [JOURNAL_NAME, MANIFEST_NAME, LOCK_NAME])
def test_commands_refuse_a_symlinked_file_and_leave_its_target_alone(
    tier: Path, tmp_path: Path, run_py, name: str
) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("not yours\n")
    (tier / name).unlink()
    (tier / name).symlink_to(victim)
    for args in (["inspect", str(tier)], ["verify", str(tier)], ["verify", "--drop", str(tier)]):
        result = tkv(run_py, *args)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert "tieredkv: error:" in result.stderr and name in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
    assert victim.read_text() == "not yours\n"
    assert (tier / name).is_symlink()


def test_commands_refuse_a_shared_directory(tier: Path, run_py) -> None:
    os.chmod(tier, 0o777)
    for args in (["inspect", str(tier)], ["verify", str(tier)]):
        result = tkv(run_py, *args)
        assert result.returncode == 2
        assert f"disk_path '{tier}'" in result.stderr and "writable by group or others" in result.stderr
