"""The on-disk files contract: file names and slot geometry, spelled out literally once here.

Every other test, the connector halves, the ``tieredkv`` command and the benchmarks build names
and offsets through :mod:`tieredkv.disk.format`; these literals are what a disk tier written by
an earlier build holds, so changing one breaks restarts on existing tiers.
"""

from __future__ import annotations

from pathlib import Path

from tieredkv.disk import format as disk_format


def test_file_names() -> None:
    disk = Path("/srv/tier")
    assert disk_format.slab_name(0) == "rank0.slab" and disk_format.slab_name(12) == "rank12.slab"
    assert disk_format.slab_path(disk, 3) == disk / "rank3.slab"
    assert disk_format.slab_path(str(disk), 3) == disk / "rank3.slab"
    assert disk_format.rank_lock_name(1) == "rank1.lock"
    assert disk_format.lock_path(disk) == disk / "lock"
    assert disk_format.manifest_path(disk) == disk / "manifest.json"
    assert disk_format.journal_path(disk) == disk / "journal.bin"
    assert (disk_format.LOCK_NAME, disk_format.MANIFEST_NAME, disk_format.JOURNAL_NAME) == (
        "lock", "manifest.json", "journal.bin"
    )


def test_slab_rank_parses_only_slab_names() -> None:
    assert disk_format.slab_rank("rank0.slab") == 0
    assert disk_format.slab_rank("rank17.slab") == 17
    for name in ("rank.slab", "rankX.slab", "rank1.lock", "rank1.slab.tmp", "xrank1.slab", "lock"):
        assert disk_format.slab_rank(name) is None, name


def test_slab_files_sorted_by_rank(tmp_path: Path) -> None:
    for name in ("rank10.slab", "rank2.slab", "rankX.slab", "rank0.slab", "rank1.lock", "journal.bin"):
        (tmp_path / name).touch()
    assert [p.name for p in disk_format.slab_files(tmp_path)] == [
        "rank0.slab", "rank2.slab", "rank10.slab", "rankX.slab"
    ]
    assert disk_format.slab_files(tmp_path / "missing") == []


def test_slot_geometry() -> None:
    assert disk_format.PAGE_BYTES == 4096 and disk_format.HEADER_BYTES == 4096
    assert disk_format.align_up(1) == 4096 and disk_format.align_up(4096) == 4096
    assert disk_format.align_up(4097) == 8192 and disk_format.align_up(0) == 0
    assert disk_format.slot_stride(512 * 1024) == 4096 + 512 * 1024
    assert disk_format.slot_stride(1000) == 8192
    stride = disk_format.slot_stride(20000)
    assert stride == 4096 + 20480
    assert disk_format.slot_offset(3, stride) == 3 * stride
    assert disk_format.payload_offset(3, stride) == 3 * stride + 4096

