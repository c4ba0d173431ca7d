"""A cache reset is durable when ``reset_cache`` returns, even on a full disk.

``reset_cache`` (a weight update) makes every stored block stale, but their slot headers still
verify (same namespace). If the journal's CLEAR were only queued, not yet flushed or dropped
past a full disk's backlog, an engine dying before the flush or rebuild would replay the old
journal at restart and serve KV computed under the old weights. The reset must therefore
leave nothing from before it recoverable before it returns: the journal is cut back to its
header (no free space needed), or, if even that fails, the manifest is removed so that a
restart starts empty. Faults are injected with the journal's own ``FaultyJournalFiles``.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.disk.test_disk_journal_faults import (
    ONE_ATTEMPT_PER_FLUSH,
    FaultyJournalFiles,
    assert_replays,
)
from tests.disk.test_journal_bounded import FOREVER, PAYLOAD, SLOTS, SpillingTier
from tests.helpers import HANG_S
from tests.helpers import wide_key as k
from tieredkv.disk import journal_file
from tieredkv.disk.catalog import DiskCatalog
from tieredkv.disk.errors import SlabError
from tieredkv.disk.format import journal_path, manifest_path
from tieredkv.disk.journal import Journal
from tieredkv.disk.journal_file import Cleared
from tieredkv.scheduler.lower_tier import DiskTier

CASES = ["disk has room", "disk full", "backlog overflowed", "the cut fails too"]


def recoverable(disk: Path) -> dict[bytes, int]:
    """What a new process would start recovering from (before checking slot headers): the
    journal's entries, if the manifest that makes them trusted is there."""
    if not os.path.lexists(manifest_path(disk)):
        return {}
    return dict(Journal.replay(journal_path(disk)).entries)


@pytest.mark.parametrize("case", CASES)
def test_a_reset_leaves_nothing_from_before_it_recoverable(
    tmp_path: Path, fp: bytes, key, payload, monkeypatch: pytest.MonkeyPatch, case: str,
) -> None:
    monkeypatch.setattr(journal_file, "BACKLOG_MAX_RECORDS", 8)
    disk = tmp_path / "tier"
    files = FaultyJournalFiles()
    with DiskCatalog.open(disk, fp, PAYLOAD, SLOTS, 1, journal_files=files) as catalog:
        spills = SpillingTier(catalog, fp, 1, payload)
        release = None
        try:
            for i in range(6):
                spills.spill(key(i), i)
            catalog.flush()
            assert recoverable(disk) == spills.entries  # stale after the reset, yet verified
            if case == "disk has room":
                _, release = files.gate("write")  # an appended CLEAR would not be durable yet
            else:
                files.fail("write", errno.ENOSPC, times=FOREVER)
            if case == "the cut fails too":
                files.fail("truncate", errno.EIO, times=FOREVER)
                files.fail("create_temp", errno.ENOSPC, times=FOREVER)
            if case != "disk has room":  # records wait, or are dropped past the backlog's cap
                for i in range(6, 6 + (20 if case == "backlog overflowed" else 3)):
                    spills.spill(key(i), i % SLOTS)
                assert catalog.journal.overflowing == (case == "backlog overflowed")
            tier = DiskTier(SLOTS, policy="lru", admission=1, seen_limit=64, catalog=catalog)
            tier.clear()  # what reset_cache does to the disk tier
            # The engine dies now: what a restart would replay holds nothing from before.
            assert recoverable(disk) == {}
            # Cut back, not given up on: the manifest stays unless even the cut failed.
            assert manifest_path(disk).exists() == (case != "the cut fails too")
            if release is not None:
                release.set()
            files.clear()  # room again: journaling goes on after the reset
            spills.entries.clear()
            spills._owner.clear()
            spills.spill(key(100), 0)
            catalog.flush()
            after = {} if case == "the cut fails too" else {key(100): 0}
            assert recoverable(disk) == after
        finally:
            if release is not None:
                release.set()
            files.clear()
            spills.close()
    with DiskCatalog.open(disk, fp, PAYLOAD, SLOTS, 1) as catalog:
        assert catalog.recovered == after


def test_a_reset_during_a_failing_write_goes_first_and_the_failed_records_go(tmp_path: Path) -> None:
    # The flusher is writing records from before the reset when it comes; the write fails
    # (ENOSPC, and every write after it). Those records must not be put back in front of the
    # reset, or it would wait behind appends that a full disk never lets through.
    path = journal_path(tmp_path)
    files = FaultyJournalFiles()
    journal = Journal(path, flush_interval_s=ONE_ATTEMPT_PER_FLUSH, files=files, max_backlog=64)
    try:
        for i in range(10):
            journal.record_add(k(i), i)
        journal.flush()
        files.fail("write", errno.ENOSPC, times=FOREVER)
        held, release = files.gate("write")
        journal.record_add(k(10), 10)
        failed: list[BaseException] = []
        errors: list[BaseException] = []

        def run(fn: Callable[[], None], into: list[BaseException]) -> None:
            try:
                fn()
            except SlabError as exc:
                into.append(exc)

        flusher = threading.Thread(target=run, args=(lambda: journal.flush(HANG_S), failed))
        flusher.start()
        assert held.wait(HANG_S)  # the write of k(10) has begun
        resetter = threading.Thread(target=run, args=(lambda: journal.clear(HANG_S), errors))
        resetter.start()
        deadline = time.monotonic() + HANG_S  # only turns a hang into a failure
        while not _pending_reset(journal):
            assert time.monotonic() < deadline, "the reset was never queued"
            time.sleep(0.001)
        release.set()
        flusher.join(HANG_S)
        resetter.join(HANG_S)
        assert not resetter.is_alive() and not errors  # durable on a full disk
        assert len(failed) == 1  # the write it waited for failed, and said so
        assert_replays(path, {})
        files.clear()
        journal.record_add(k(20), 2)
        journal.flush()
        assert_replays(path, {k(20): 2})
    finally:
        files.clear()
        journal.close()


def _pending_reset(journal: Journal) -> bool:
    with journal._cond:
        return any(isinstance(item, Cleared) for item in journal._backlog.items)
