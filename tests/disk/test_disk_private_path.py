"""Nothing planted under disk_path can redirect a write, and an unsafe disk_path is refused.

Each test plants what an attacker with write access to the directory *before* the engine
starts could plant: a symlink (or hard link) at the name of a file tieredkv opens, pointing
at a victim file outside disk_path. The real open path must refuse it with a message naming
the file (or, for temporary files, replace the link without following it), and the victim
must keep its content, mode and size. A directory that is group/other-writable, owned by
another user, or itself a symlink is refused with a message naming disk_path.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from tieredkv.disk.catalog import DiskCatalog, Manifest, load_manifest, write_manifest
from tieredkv.disk.format import (
    JOURNAL_NAME,
    LOCK_NAME,
    MANIFEST_NAME,
    lock_path,
    rank_lock_name,
    slab_name,
    slab_path,
    slot_stride,
)
from tieredkv.disk.journal import Journal
from tieredkv.disk.private_files import DiskLock, UntrustedPathError
from tieredkv.disk.slab import SlabFile

PAYLOAD = 10_000
SLOTS = 4
VICTIM_BYTES = b"precious bytes outside disk_path\n" * 300


@pytest.fixture
def disk(tmp_path: Path) -> Path:
    path = tmp_path / "disk"
    path.mkdir(mode=0o700)
    return path


@pytest.fixture
def victim(tmp_path: Path):
    """A file outside disk_path, and a check that it is exactly as it was."""
    outside = tmp_path / "outside"
    outside.mkdir()
    file = outside / "victim.conf"
    file.write_bytes(VICTIM_BYTES)
    os.chmod(file, 0o644)
    before = os.stat(file)

    def unchanged() -> None:
        after = os.stat(file)
        assert file.read_bytes() == VICTIM_BYTES, "victim content changed"
        assert stat.S_IMODE(after.st_mode) == 0o644, "victim mode changed"
        assert after.st_size == before.st_size == len(VICTIM_BYTES), "victim size changed"
        assert after.st_mtime_ns == before.st_mtime_ns, "victim was written"

    return SimpleNamespace(path=file, unchanged=unchanged)


def plant(link: Path, target: Path) -> None:
    link.symlink_to(target)
    assert link.is_symlink()


def refused(exc: pytest.ExceptionInfo[BaseException], name: str) -> None:
    assert isinstance(exc.value, UntrustedPathError)
    assert name in str(exc.value), str(exc.value)


def new_manifest(fp: bytes) -> Manifest:
    return Manifest.new(fp, PAYLOAD, slot_stride(PAYLOAD), SLOTS, 1)


# -- slab files -------------------------------------------------------------------------


@pytest.mark.parametrize("direct", [None, False], ids=["probed", "buffered"])
def test_symlinked_slab_is_refused(disk: Path, victim, fp: bytes, direct: bool | None) -> None:
    plant(slab_path(disk, 0), victim.path)
    with pytest.raises(UntrustedPathError) as err:
        SlabFile.open(slab_path(disk, 0), SLOTS, PAYLOAD, fp, direct=direct)
    refused(err, slab_name(0))
    assert "symlink" in str(err.value)
    victim.unchanged()


@pytest.mark.parametrize("readonly", [True, False], ids=["readonly", "readwrite"])
def test_symlinked_slab_is_refused_by_readers(
    disk: Path, victim, fp: bytes, readonly: bool
) -> None:
    """The catalog's header check and ``tieredkv verify [--drop]`` open existing slabs."""
    plant(slab_path(disk, 0), victim.path)
    with pytest.raises(UntrustedPathError) as err:
        SlabFile.open(
            slab_path(disk, 0), SLOTS, PAYLOAD, fp, direct=False, create=False, readonly=readonly
        )
    refused(err, slab_name(0))
    victim.unchanged()


def test_dangling_slab_symlink_is_refused_not_missing(disk: Path, tmp_path: Path, fp: bytes) -> None:
    target = tmp_path / "outside-new-file"
    plant(slab_path(disk, 0), target)
    for create in (True, False):
        with pytest.raises(UntrustedPathError) as err:
            SlabFile.open(slab_path(disk, 0), SLOTS, PAYLOAD, fp, direct=False, create=create)
        refused(err, slab_name(0))
    assert not target.exists(), "nothing was created through the link"


def test_hard_linked_slab_is_refused(disk: Path, victim, fp: bytes) -> None:
    os.link(victim.path, slab_path(disk, 0))
    with pytest.raises(UntrustedPathError) as err:
        SlabFile.open(slab_path(disk, 0), SLOTS, PAYLOAD, fp, direct=False)
    refused(err, slab_name(0))
    assert "hard links" in str(err.value)
    victim.unchanged()


def test_symlinked_o_direct_probe_file_is_not_followed(disk: Path, victim, fp: bytes) -> None:
    """The probe's name is predictable (pid and thread id): a link there is replaced."""
    probe = disk / f".odirect-probe-{os.getpid()}-{threading.get_ident()}"
    plant(probe, victim.path)
    with SlabFile.open(slab_path(disk, 0), SLOTS, PAYLOAD, fp) as slab:
        assert slab.num_slots == SLOTS
    victim.unchanged()
    assert not os.path.lexists(probe), "probe (and the planted link) removed"


# -- journal ------------------------------------------------------------------------------


def test_symlinked_journal_is_refused(disk: Path, victim) -> None:
    plant(disk / JOURNAL_NAME, victim.path)
    with pytest.raises(UntrustedPathError) as err:
        Journal(disk / JOURNAL_NAME)
    refused(err, JOURNAL_NAME)
    with pytest.raises(UntrustedPathError) as err:
        Journal.replay(disk / JOURNAL_NAME)
    refused(err, JOURNAL_NAME)
    victim.unchanged()


def test_symlinked_journal_temp_file_is_not_followed(disk: Path, victim, key) -> None:
    plant(disk / (JOURNAL_NAME + ".tmp"), victim.path)
    with Journal(disk / JOURNAL_NAME) as journal:
        journal.compact({key(1): 1})
    victim.unchanged()
    assert Journal.replay(disk / JOURNAL_NAME).entries == {key(1): 1}
    assert not os.path.lexists(disk / (JOURNAL_NAME + ".tmp"))


def test_catalog_refuses_symlinked_journal(disk: Path, victim, fp: bytes) -> None:
    DiskCatalog.open(disk, fp, PAYLOAD, SLOTS, 1).close()  # a matching manifest: journal replayed
    (disk / JOURNAL_NAME).unlink()
    plant(disk / JOURNAL_NAME, victim.path)
    with pytest.raises(UntrustedPathError) as err:
        DiskCatalog.open(disk, fp, PAYLOAD, SLOTS, 1)
    refused(err, JOURNAL_NAME)
    victim.unchanged()
    assert DiskLock.holder(disk) is None, "the lock was released after the refusal"


# -- manifest -----------------------------------------------------------------------------


def test_symlinked_manifest_is_refused(disk: Path, victim, fp: bytes) -> None:
    plant(disk / MANIFEST_NAME, victim.path)
    with pytest.raises(UntrustedPathError) as err:
        load_manifest(disk)
    refused(err, MANIFEST_NAME)
    with pytest.raises(UntrustedPathError) as err:
        DiskCatalog.open(disk, fp, PAYLOAD, SLOTS, 1)
    refused(err, MANIFEST_NAME)
    victim.unchanged()
    assert (disk / MANIFEST_NAME).is_symlink(), "refused, not silently replaced"


def test_dangling_manifest_symlink_is_refused(disk: Path, tmp_path: Path, fp: bytes) -> None:
    plant(disk / MANIFEST_NAME, tmp_path / "outside-new-file")
    with pytest.raises(UntrustedPathError) as err:
        DiskCatalog.open(disk, fp, PAYLOAD, SLOTS, 1)
    refused(err, MANIFEST_NAME)
    assert not (tmp_path / "outside-new-file").exists()


def test_symlinked_manifest_temp_file_is_not_followed(disk: Path, victim, fp: bytes) -> None:
    tmp = disk / (MANIFEST_NAME + ".tmp")
    plant(tmp, victim.path)
    manifest = new_manifest(fp)
    write_manifest(disk, manifest)
    victim.unchanged()
    assert not os.path.lexists(tmp)
    info = os.lstat(disk / MANIFEST_NAME)
    assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
    assert load_manifest(disk) == manifest
    plant(tmp, victim.path)  # and through the catalog, which writes it at every start
    DiskCatalog.open(disk, fp, PAYLOAD, SLOTS, 1).close()
    victim.unchanged()
    assert not os.path.lexists(tmp)


# -- lock ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [LOCK_NAME, rank_lock_name(0)])
def test_symlinked_lock_is_refused(disk: Path, victim, name: str) -> None:
    plant(disk / name, victim.path)
    with pytest.raises(UntrustedPathError) as err:
        DiskLock(disk, name=name)
    refused(err, name)
    victim.unchanged()


def test_lock_holder_query_refuses_symlinked_lock(disk: Path, victim) -> None:
    plant(lock_path(disk), victim.path)
    with pytest.raises(UntrustedPathError) as err:
        DiskLock.holder(disk)
    refused(err, LOCK_NAME)
    victim.unchanged()


def test_catalog_refuses_symlinked_lock(disk: Path, victim, fp: bytes) -> None:
    plant(lock_path(disk), victim.path)
    with pytest.raises(UntrustedPathError) as err:
        DiskCatalog.open(disk, fp, PAYLOAD, SLOTS, 1)
    refused(err, LOCK_NAME)
    victim.unchanged()


# -- the directory itself -----------------------------------------------------------------


def _every_opener(path: Path, fp: bytes):
    """Each way into a disk tier, as (name, call); each must refuse an unsafe directory."""
    return [
        ("catalog", lambda: DiskCatalog.open(path, fp, PAYLOAD, SLOTS, 1)),
        ("worker lock", lambda: DiskLock(path, name=rank_lock_name(0))),
        ("slab", lambda: SlabFile.open(slab_path(path, 0), SLOTS, PAYLOAD, fp)),
        ("journal", lambda: Journal(path / JOURNAL_NAME)),
    ]


def _assert_refuses_dir(path: Path, fp: bytes, why: str) -> None:
    for name, call in _every_opener(path, fp):
        with pytest.raises(UntrustedPathError) as err:
            call()
        message = str(err.value)
        assert "disk_path" in message and str(path) in message and why in message, (name, message)
    assert [p.name for p in path.iterdir()] == [], "nothing was created in the refused directory"


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_group_or_other_writable_directory_is_refused(tmp_path: Path, fp: bytes, mode: int) -> None:
    path = tmp_path / "shared"
    path.mkdir()
    os.chmod(path, mode)
    _assert_refuses_dir(path, fp, "writable by group or others")
    assert stat.S_IMODE(os.stat(path).st_mode) == mode, "refused, not silently chmodded"


def test_directory_owned_by_another_user_is_refused(tmp_path: Path, fp: bytes) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to chown a directory to another uid")
    path = tmp_path / "theirs"
    path.mkdir(mode=0o700)
    os.chown(path, 12345, 12345)
    _assert_refuses_dir(path, fp, "owned by")
    assert "12345" in str(pytest.raises(UntrustedPathError, DiskLock, path).value)


def test_symlinked_directory_is_refused(tmp_path: Path, fp: bytes) -> None:
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    for name, call in _every_opener(link, fp):
        with pytest.raises(UntrustedPathError) as err:
            call()
        assert "disk_path" in str(err.value) and "symlink" in str(err.value), name
    assert list(real.iterdir()) == []


def test_missing_directory_is_created_0700_and_files_0600(tmp_path: Path, fp: bytes) -> None:
    path = tmp_path / "a" / "b" / "disk"
    old_umask = os.umask(0)  # the modes must not depend on a friendly umask
    try:
        with DiskCatalog.open(path, fp, PAYLOAD, SLOTS, 1):
            with DiskLock(path, name=rank_lock_name(0)), SlabFile.open(
                slab_path(path, 0), SLOTS, PAYLOAD, fp
            ):
                pass
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    names = sorted(p.name for p in path.iterdir())
    assert names == sorted([MANIFEST_NAME, JOURNAL_NAME, LOCK_NAME, rank_lock_name(0), slab_name(0)])
    for name in names:
        info = os.lstat(path / name)
        assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600, name


def test_existing_files_of_ours_are_tightened_to_0600(disk: Path, fp: bytes) -> None:
    for name in (LOCK_NAME, rank_lock_name(0), slab_name(0)):
        (disk / name).write_bytes(b"")
        os.chmod(disk / name, 0o644)
    with DiskCatalog.open(disk, fp, PAYLOAD, SLOTS, 1):
        with DiskLock(disk, name=rank_lock_name(0)), SlabFile.open(slab_path(disk, 0), SLOTS, PAYLOAD, fp):
            for name in (LOCK_NAME, rank_lock_name(0), slab_name(0)):
                assert stat.S_IMODE(os.stat(disk / name).st_mode) == 0o600, name


def test_private_0755_directory_is_accepted_and_tightened(tmp_path: Path, fp: bytes) -> None:
    path = tmp_path / "readable"
    path.mkdir()
    os.chmod(path, 0o755)
    DiskCatalog.open(path, fp, PAYLOAD, SLOTS, 1).close()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700


# -- the worker, which vLLM starts before the scheduler half ------------------------------

LAYERS, BLOCKS, HEADS, BLOCK, CONTENT = 2, 16, 2, 16, 64


def _worker(disk_path: Path):
    torch = pytest.importorskip("torch")
    from tests.vllm.test_worker_side import fake_configs
    from tieredkv.config import TieredKVConfig
    from tieredkv.vllm.worker_side import WorkerHalf

    vllm_config, kv_cache_config = fake_configs(
        layers=LAYERS, blocks=BLOCKS, heads=HEADS, block=BLOCK, content=CONTENT
    )
    config = TieredKVConfig.from_dict(
        {"host_bytes": "1MiB", "disk_path": str(disk_path), "disk_bytes": "2MiB", "chunk_blocks": 2}
    )
    worker = WorkerHalf(vllm_config, kv_cache_config, config)
    worker.rank = 0
    caches = {
        f"l{i}": torch.zeros(BLOCKS, HEADS, BLOCK, CONTENT, dtype=torch.float32) for i in range(LAYERS)
    }
    return worker, caches


def _register(disk_path: Path):
    worker, caches = _worker(disk_path)
    try:
        worker.register_kv_caches(caches)
    finally:
        worker.shutdown()


def test_worker_refuses_a_world_writable_disk_path_before_any_open(tmp_path: Path) -> None:
    path = tmp_path / "shared"
    path.mkdir()
    os.chmod(path, 0o777)
    with pytest.raises(UntrustedPathError) as err:
        _register(path)
    assert "disk_path" in str(err.value) and str(path) in str(err.value)
    assert list(path.iterdir()) == []


def test_worker_refuses_a_symlinked_slab(disk: Path, victim) -> None:
    plant(slab_path(disk, 0), victim.path)
    with pytest.raises(UntrustedPathError) as err:
        _register(disk)
    refused(err, slab_name(0))
    victim.unchanged()
    assert DiskLock.holder(disk) is None


def test_worker_refuses_a_symlinked_rank_lock(disk: Path, victim) -> None:
    plant(disk / rank_lock_name(0), victim.path)
    with pytest.raises(UntrustedPathError) as err:
        _register(disk)
    refused(err, rank_lock_name(0))
    victim.unchanged()
