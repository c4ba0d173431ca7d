"""DiskCatalog: locked start-up, manifest checks, journal recovery verified on every rank."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tieredkv.config import ConfigError
from tieredkv.disk.catalog import DiskCatalog, load_manifest
from tieredkv.disk.errors import SlabError
from tieredkv.disk.format import (
    JOURNAL_NAME,
    LOCK_NAME,
    MANIFEST_NAME,
    manifest_path,
    payload_offset,
    slab_path,
    slot_stride,
)
from tieredkv.disk.journal import Journal
from tieredkv.disk.journal_file import FILE_HEADER_BYTES, RECORD_BYTES
from tieredkv.disk.slab import SlabFile
from tieredkv.protocol import FailureCause

PAYLOAD = 32 * 1024
SLOTS = 16
def populate(
    disk: Path, fp: bytes, key: Callable[[int], bytes], payload: Callable[[bytes, int, int], bytes],
    count: int = 8, world: int = 2,
) -> dict[bytes, int]:
    """One engine run: write ``count`` keys on every rank, journal them, shut down cleanly."""
    written = {}
    with DiskCatalog.open(disk, fp, PAYLOAD, SLOTS, world) as catalog:
        slabs = [SlabFile.open(catalog.slab_path(r), SLOTS, PAYLOAD, fp) for r in range(world)]
        for i in range(count):
            for rank, slab in enumerate(slabs):
                slab.write_slot(i, key(i), payload(key(i), rank, PAYLOAD))
            catalog.record_written(key(i), i)  # after every rank confirmed
            written[key(i)] = i
        for slab in slabs:
            slab.close()
    return written


def test_fresh_tier_layout_and_permissions(tmp_path: Path, fp: bytes) -> None:
    disk = tmp_path / "tier"
    disk.mkdir(mode=0o755)
    os.chmod(disk, 0o755)
    with DiskCatalog.open(disk, fp, PAYLOAD, SLOTS, 2) as catalog:
        assert catalog.recovered == {} and catalog.reset_reason == "new disk tier"
        assert catalog.slab_path(1) == slab_path(disk, 1)
        with pytest.raises(IndexError):
            catalog.slab_path(2)
        assert disk.stat().st_mode & 0o777 == 0o700
        for name in (MANIFEST_NAME, JOURNAL_NAME, LOCK_NAME):
            assert (disk / name).stat().st_mode & 0o777 == 0o600, name
        manifest = load_manifest(disk)
        assert manifest is not None
        assert (manifest.fingerprint, manifest.world_size, manifest.num_slots) == (fp.hex(), 2, SLOTS)
        assert manifest.slot_stride == slot_stride(PAYLOAD)


def test_restart_recovers_verified_entries(tmp_path: Path, fp: bytes, key, payload) -> None:
    disk = tmp_path / "tier"
    written = populate(disk, fp, key, payload)
    created = load_manifest(disk).created  # type: ignore[union-attr]
    with DiskCatalog.open(disk, fp, PAYLOAD, SLOTS, 2) as catalog:
        assert catalog.recovered == written
        assert catalog.dropped_at_recovery == {} and catalog.reset_reason is None
        assert load_manifest(disk).created == created  # type: ignore[union-attr]
        for rank in range(2):
            with SlabFile.open(catalog.slab_path(rank), SLOTS, PAYLOAD, fp) as slab:
                out = bytearray(PAYLOAD)
                for k, slot in catalog.recovered.items():
                    slab.read_slot_into(slot, k, out)
                    assert out == payload(k, rank, PAYLOAD)


def test_second_engine_is_refused(tmp_path: Path, fp: bytes) -> None:
    with DiskCatalog.open(tmp_path, fp, PAYLOAD, SLOTS, 1):
        with pytest.raises(ConfigError) as err:
            DiskCatalog.open(tmp_path, fp, PAYLOAD, SLOTS, 1)
        assert "already in use by another engine" in str(err.value)
    DiskCatalog.open(tmp_path, fp, PAYLOAD, SLOTS, 1).close()


def test_removed_and_cleared_entries_stay_gone(tmp_path: Path, fp: bytes, key, payload) -> None:
    disk = tmp_path / "tier"
    populate(disk, fp, key, payload)
    with DiskCatalog.open(disk, fp, PAYLOAD, SLOTS, 2) as catalog:
        catalog.record_removed(key(3))
    with DiskCatalog.open(disk, fp, PAYLOAD, SLOTS, 2) as catalog:
        assert key(3) not in catalog.recovered and len(catalog.recovered) == 7
        catalog.record_cleared()
        catalog.flush()
    with DiskCatalog.open(disk, fp, PAYLOAD, SLOTS, 2) as catalog:
        assert catalog.recovered == {}


@pytest.mark.parametrize(
    "change, reason",
    [
        (dict(fingerprint="other"), "fingerprint"),
        (dict(payload_bytes=PAYLOAD * 2), "payload_bytes"),
        (dict(world_size=1), "world size"),
    ],
)
def test_manifest_mismatch_starts_empty(
    tmp_path: Path, fp: bytes, other_fp: bytes, key, payload, change: dict, reason: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    disk = tmp_path / "tier"
    populate(disk, fp, key, payload)
    args = dict(fingerprint=fp, payload_bytes=PAYLOAD, num_slots=SLOTS, world_size=2)
    args.update({k: (other_fp if v == "other" else v) for k, v in change.items()})
    with caplog.at_level(logging.INFO, logger="tieredkv.disk.catalog"):
        with DiskCatalog.open(disk, **args) as catalog:  # type: ignore[arg-type]
            assert catalog.recovered == {}
            assert reason in (catalog.reset_reason or "")
    lines = [r for r in caplog.records if "starting empty" in r.getMessage()]
    assert len(lines) == 1 and reason in lines[0].getMessage()
    assert Journal.replay(disk / JOURNAL_NAME).entries == {}
    if change.get("world_size") == 1:
        assert not slab_path(disk, 1).exists()  # a rank that no longer exists
    # Going back to the original engine finds nothing either: the reset was recorded.
    with DiskCatalog.open(disk, fp, PAYLOAD, SLOTS, 2) as catalog:
        assert catalog.recovered == {}


def test_corrupted_manifest_starts_empty(tmp_path: Path, fp: bytes, key, payload) -> None:
    disk = tmp_path / "tier"
    populate(disk, fp, key, payload)
    manifest_path(disk).write_text('{"format_version": 1, "fingerprint": ')
    with DiskCatalog.open(disk, fp, PAYLOAD, SLOTS, 2) as catalog:
        assert catalog.recovered == {} and catalog.reset_reason == "unreadable manifest"
    assert load_manifest(disk) is not None  # rewritten


def test_fewer_slots_drops_entries_beyond(tmp_path: Path, fp: bytes, key, payload) -> None:
    disk = tmp_path / "tier"
    populate(disk, fp, key, payload)
    with DiskCatalog.open(disk, fp, PAYLOAD, 5, 2) as catalog:
        assert sorted(catalog.recovered.values()) == [0, 1, 2, 3, 4]
        assert catalog.dropped_at_recovery == {FailureCause.MISSING: 3}
        assert load_manifest(disk).num_slots == 5  # type: ignore[union-attr]


def test_recovery_drops_bad_slots_by_kind(tmp_path: Path, fp: bytes, other_fp: bytes, key, payload) -> None:
    disk = tmp_path / "tier"
    written = populate(disk, fp, key, payload)
    stride = slot_stride(PAYLOAD)
    rank0, rank1 = slab_path(disk, 0), slab_path(disk, 1)
    # slot 0: header bit flip on rank 1 only (one bad rank is enough to drop the entry)
    with open(rank1, "r+b") as f:
        f.seek(0 * stride + 50)
        byte = f.read(1)
        f.seek(0 * stride + 50)
        f.write(bytes([byte[0] ^ 0x01]))
    # slot 1: another key written over it on rank 0 (its journal REMOVE/ADD were lost)
    with SlabFile.open(rank0, SLOTS, PAYLOAD, fp) as slab:
        slab.write_slot(1, key(100), payload(key(100), 0, PAYLOAD))
        slab.invalidate_slot(2)  # slot 2: invalidated -> missing
    # slot 3: another namespace's slot on rank 1
    with SlabFile.open(rank1, SLOTS, PAYLOAD, other_fp) as slab:
        slab.write_slot(3, key(3), payload(key(3), 1, PAYLOAD))
    # slots 6, 7: beyond the end of a truncated rank-0 file
    os.truncate(rank0, 6 * stride + 100)
    with DiskCatalog.open(disk, fp, PAYLOAD, SLOTS, 2) as catalog:
        assert catalog.recovered == {key(i): i for i in (4, 5)}
        assert catalog.dropped_at_recovery == {
            FailureCause.CHECKSUM: 1, FailureCause.WRONG_KEY: 1, FailureCause.MISSING: 1,
            FailureCause.WRONG_NAMESPACE: 1, FailureCause.SHORT_READ: 2,
        }
    # The compacted journal no longer mentions the dropped entries.
    assert Journal.replay(disk / JOURNAL_NAME).entries == {key(i): i for i in (4, 5)}
    assert len(written) == 8


def test_deleted_slab_file_drops_everything(tmp_path: Path, fp: bytes, key, payload) -> None:
    disk = tmp_path / "tier"
    populate(disk, fp, key, payload)
    slab_path(disk, 1).unlink()
    with DiskCatalog.open(disk, fp, PAYLOAD, SLOTS, 2) as catalog:
        assert catalog.recovered == {}
        assert catalog.dropped_at_recovery == {FailureCause.MISSING: 8}


def test_corrupted_journal_tail_keeps_the_good_prefix(tmp_path: Path, fp: bytes, key, payload) -> None:
    disk = tmp_path / "tier"
    populate(disk, fp, key, payload)
    journal = disk / JOURNAL_NAME
    data = bytearray(journal.read_bytes())
    data[FILE_HEADER_BYTES + 5 * RECORD_BYTES + 40] ^= 0x80  # record 5 of 8
    journal.write_bytes(bytes(data) + b"\x01\x02\x03")
    with DiskCatalog.open(disk, fp, PAYLOAD, SLOTS, 2) as catalog:
        assert catalog.recovered == {key(i): i for i in range(5)}
        assert catalog.journal_tail_bytes == 3 * RECORD_BYTES + 3
    assert Journal.replay(journal).bad_tail_bytes == 0  # compacted at start-up


def test_every_recovered_entry_still_verifies_on_read(tmp_path: Path, fp: bytes, key, payload) -> None:
    """A payload flip passes header verification at start-up but never passes a read."""
    disk = tmp_path / "tier"
    populate(disk, fp, key, payload)
    with open(slab_path(disk, 0), "r+b") as f:
        f.seek(payload_offset(2, slot_stride(PAYLOAD)) + 1234)
        f.write(b"\x00" if payload(key(2), 0, PAYLOAD)[1234] else b"\x01")
    with DiskCatalog.open(disk, fp, PAYLOAD, SLOTS, 2) as catalog:
        assert key(2) in catalog.recovered
        with SlabFile.open(catalog.slab_path(0), SLOTS, PAYLOAD, fp) as slab:
            with pytest.raises(SlabError) as err:
                slab.read_slot_into(2, key(2), bytearray(PAYLOAD))
            assert err.value.kind is FailureCause.CHECKSUM
