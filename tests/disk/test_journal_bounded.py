"""A long-running journal stays bounded: it compacts itself without the caller waiting, and a
full disk costs neither unbounded memory nor a busy core, nor anything reported durable.

While writes fail (ENOSPC, injected one system call at a time by the journal's own
``FaultyJournalFiles``, or real on a full tmpfs) the backlog stays under its cap, what it drops
is counted, retries follow the backoff schedule, and once writes succeed the journal is
rebuilt from the live index, so a restart finds every live entry again (issue #23, point 3).
"""

from __future__ import annotations

import asyncio
import contextvars
import errno
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from tests.disk.test_disk_journal_faults import (
    ONE_ATTEMPT_PER_FLUSH,
    FaultyJournalFiles,
    _fill,
    assert_replays,
)
from tests.helpers import HANG_S
from tests.helpers import wide_key as k
from tieredkv.disk import journal as journal_mod
from tieredkv.disk import journal_file
from tieredkv.disk.catalog import DiskCatalog
from tieredkv.disk.errors import SlabError
from tieredkv.disk.format import journal_path
from tieredkv.disk.journal import Journal
from tieredkv.disk.journal_file import FILE_HEADER_BYTES, RECORD_BYTES, RetryBackoff
from tieredkv.disk.slab import SlabFile
from tieredkv.metrics.exporter import build_exporter_metrics
from tieredkv.protocol import FailureCause

FOREVER = 10**9  # an armed fault that never runs out: the disk stays full until clear()
CAP = 64
PAYLOAD = 32 * 1024
SLOTS = 16


def _backlog(journal: Journal) -> int:
    """Records queued or being written, neither durable nor dropped yet."""
    with journal._cond:
        return journal._backlog.records


def test_journal_compacts_itself_and_keeps_the_index(tmp_path, monkeypatch):
    monkeypatch.setattr(journal_mod, "COMPACT_MIN_RECORDS", 64)
    path = tmp_path / "journal"
    j = Journal(path)
    live: dict[bytes, int] = {}
    for i in range(3000):  # a server spilling and evicting for a long time
        key = (i % 40).to_bytes(2, "little") * 16
        if i % 3 == 2:
            j.record_remove(key)
            live.pop(key, None)
        else:
            slot = i % 40
            j.record_add(key, slot)
            live[key] = slot
    j.flush()
    j.close()
    assert j.runtime_compactions > 10
    records = (path.stat().st_size) // 56
    assert records < 64 + 4 * 40 + 64, records  # bounded, not 3000 records
    assert Journal.replay(path).entries == live


class Slots:
    """What the disk tier journals: a key spilled into a slot (the slot's old key journaled
    removed first, as ``DiskTier.allocate`` does), with the index the records describe."""

    def __init__(self, journal: Journal | DiskCatalog, num_slots: int) -> None:
        self.journal = journal
        self.num_slots = num_slots
        self.entries: dict[bytes, int] = {}
        self._owner: dict[int, bytes] = {}
        self.records = 0  # records journaled


    def spill(self, key: bytes, slot: int) -> None:
        old = self._owner.get(slot)
        if old is not None:
            self.remove(old)
        if isinstance(self.journal, DiskCatalog):
            self.journal.record_written(key, slot)
        else:
            self.journal.record_add(key, slot)
        self.records += 1
        self.entries[key] = slot
        self._owner[slot] = key

    def remove(self, key: bytes) -> None:
        if isinstance(self.journal, DiskCatalog):
            self.journal.record_removed(key)
        else:
            self.journal.record_remove(key)
        self.records += 1
        self._owner.pop(self.entries.pop(key), None)


def test_backoff_doubles_to_its_cap_and_resets_on_success() -> None:
    backoff = RetryBackoff()  # the journal's default: 50 ms doubling to 5 s
    assert backoff.delay == 0
    delays = [backoff.failed() for _ in range(10)]
    assert delays == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0, 5.0]
    backoff.succeeded()
    assert backoff.delay == 0 and backoff.failed() == 0.05
    with pytest.raises(ValueError):
        RetryBackoff(first_s=1.0, max_s=0.5)


@contextmanager
def _journal_fills_up_after(path: Path) -> Iterator[tuple[Journal, Slots, FaultyJournalFiles]]:
    """A journal (one attempt per flush: no interval passes in a test) whose first 10 records
    a flush reported durable; from then on every write fails with ENOSPC, until
    ``files.clear()``."""
    files = FaultyJournalFiles()
    with Journal(path, flush_interval_s=ONE_ATTEMPT_PER_FLUSH, files=files, max_backlog=CAP) as journal:
        tier = Slots(journal, 40)
        for i in range(10):
            tier.spill(k(i), i)
        journal.flush()
        files.fail("write", errno.ENOSPC, times=FOREVER)
        yield journal, tier, files


def test_a_full_disk_keeps_the_backlog_under_its_cap_and_counts_what_it_drops(tmp_path: Path) -> None:
    path = journal_path(tmp_path)
    with _journal_fills_up_after(path) as (journal, tier, files):
        written, writes = journal.records_written, files.calls["write"]
        first = tier.records
        peak = 0
        for i in range(10, 10 + 50 * CAP):  # a server spilling and evicting on a full disk
            tier.spill(k(i), i % 40)
            peak = max(peak, _backlog(journal))
        records = tier.records - first
        assert peak == CAP  # filled up to the cap, never past it
        # Nothing was written (no attempt even: the flusher waits for its interval), and every
        # record is either still queued or dropped and counted, the backlog dropped with them.
        assert journal.records_written == written and files.calls["write"] == writes
        assert journal.overflowing
        assert _backlog(journal) == 0 and journal.records_dropped == records
        # A flush does not report the dropped records durable while the disk is full.
        with pytest.raises(SlabError) as err:
            journal.flush(timeout=30)
        assert err.value.kind is FailureCause.NO_SPACE
        assert journal.overflowing and journal.records_dropped == records
        files.clear()
        journal.flush(timeout=30)  # the rebuild from the live index
        assert not journal.overflowing and journal.rebuilds == 1
        assert_replays(path, tier.entries)
        # One record per live entry, not the 3,200 that were dropped.
        assert path.stat().st_size == FILE_HEADER_BYTES + len(tier.entries) * RECORD_BYTES
        tier.spill(k(100_000), 3)  # and journaling goes on as before
        journal.flush()
        assert_replays(path, tier.entries)
    assert_replays(path, tier.entries)


class ManualClockLoop(asyncio.SelectorEventLoop):
    """The journal flusher's event loop on a clock that moves only when the test moves it, so
    when each of the flusher's waits ends, and so which attempts happen by then, is decided by
    the code and not by how busy the machine is."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self._timers: list[asyncio.TimerHandle] = []  # every wait the flusher began, in order
        self._armed = threading.Condition()

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[..., object], *args: object,
                context: contextvars.Context | None = None) -> asyncio.TimerHandle:
        timer = super().call_at(when, callback, *args, context=context)
        with self._armed:  # only the flusher's waits arm timers on this loop
            self._timers.append(timer)
            self._armed.notify_all()
        return timer

    def move_to(self, now: float) -> None:
        """Set the clock, then make the loop look at its timers again (any thread)."""
        self.now = now
        self.call_soon_threadsafe(lambda: None)

    def parked(self) -> asyncio.TimerHandle:
        """The timer ending the flusher's current wait, once it waits on one not yet due (not
        while it is awake: woken by a timer or a caller, writing). The bound only turns a
        hang into a failure."""

        def waiting() -> bool:
            timer = self._timers[-1] if self._timers else None
            return timer is not None and not timer.cancelled() and timer.when() > self.now

        with self._armed:
            assert self._armed.wait_for(waiting, HANG_S), "the journal flusher never waited again"
            return self._timers[-1]


def test_a_failing_disk_is_retried_on_the_backoff_schedule_not_every_interval(tmp_path: Path) -> None:
    # Without backoff the flusher retried at every interval (1 ms here): hundreds of attempts,
    # each encoding the whole backlog again. On a clock the test moves one flush interval at a
    # time, a record arriving at each, the flusher retries exactly when the backoff's delay
    # since its last failure has passed (doubling, then capped), never at an interval between.
    interval = 0.001
    delays = (0.01, 0.02, 0.04, 0.04)
    files = FaultyJournalFiles()
    path = journal_path(tmp_path)
    loop = ManualClockLoop()
    with Journal(
        path, flush_interval_s=interval, files=files, max_backlog=CAP,
        backoff=RetryBackoff(first_s=0.01, max_s=0.04), new_loop=lambda: loop,
    ) as journal:
        tier = Slots(journal, 40)
        arrived = iter(range(1, 10**6))

        def arrive() -> None:
            i = next(arrived)
            tier.spill(k(i), i % 40)

        arrive()
        journal.flush()
        writes = files.calls["write"]
        files.fail("write", errno.ENOSPC, times=FOREVER)
        for _ in range(2 * CAP):  # past the cap: the next write is a rebuild
            arrive()
        wait = loop.parked()
        assert journal.write_errors == 0 and files.calls["write"] == writes  # not before its turn
        loop.move_to(wait.when())  # the interval passes: the first attempt, which fails
        for attempts, delay in enumerate(delays, start=1):
            failed_at = loop.now
            wait = loop.parked()
            # Each attempt (a rebuild here) is one write, and each failed.
            assert journal.write_errors == attempts == files.calls["write"] - writes
            assert wait.when() == pytest.approx(failed_at + delay)
            for step in range(1, round(delay / interval)):
                arrive()
                loop.move_to(failed_at + step * interval)
                assert loop.parked() is wait  # still the same wait: no attempt at this interval
            loop.move_to(wait.when())
        loop.parked()
        assert journal.write_errors == len(delays) + 1 == files.calls["write"] - writes
        assert journal.records_dropped > 0
        # A caller waiting on the journal does not wait out the backoff: flush wakes it at once
        # (the clock is not moved again), and the rebuild covers every dropped record.
        files.clear()
        journal.flush(timeout=30)
        assert journal.rebuilds == 1 and not journal.overflowing
        assert_replays(path, tier.entries)
    assert_replays(path, tier.entries)


@pytest.mark.parametrize("rebuild_fails", [False, True], ids=["rebuild succeeds", "rebuild fails"])
@pytest.mark.parametrize("arriving", [3, 3 * CAP], ids=["a few records", "past the cap again"])
def test_records_made_while_the_rebuild_is_written_are_not_lost(
    tmp_path: Path, rebuild_fails: bool, arriving: int,
) -> None:
    path = journal_path(tmp_path)
    with _journal_fills_up_after(path) as (journal, tier, files):
        for i in range(10, 10 + 2 * CAP):
            tier.spill(k(i), i % 40)
        assert journal.overflowing
        files.clear()
        if rebuild_fails:
            files.fail("create_temp", errno.ENOSPC)
        held, release = files.gate("create_temp")
        errors: list[BaseException] = []

        def flush() -> None:
            try:
                journal.flush(timeout=60)
            except SlabError as exc:
                errors.append(exc)

        flusher = threading.Thread(target=flush)
        flusher.start()
        try:
            assert held.wait(30)  # the rebuild took its snapshot and is writing it
            for i in range(1000, 1000 + arriving):
                tier.spill(k(i), i % 40)
            tier.remove(k(1000 + arriving - 1))
        finally:
            release.set()
            flusher.join(60)
        assert len(errors) == rebuild_fails
        journal.flush(timeout=30)  # a second rebuild where the first failed or overflowed
        assert not journal.overflowing
        # Records past the cap during a rebuild that succeeds need a rebuild of their own;
        # after a failed one, the next covers them all.
        assert journal.rebuilds == 1 + (arriving > CAP and not rebuild_fails)
        assert_replays(path, tier.entries)
    assert_replays(path, tier.entries)


class SpillingTier(Slots):
    """:class:`Slots` over a real catalog: each spill writes its slot on every rank first."""

    def __init__(self, catalog: DiskCatalog, fp: bytes, world: int, payload: Callable) -> None:
        super().__init__(catalog, catalog.num_slots)
        self.payload = payload
        self.slabs = [SlabFile.open(catalog.slab_path(r), SLOTS, PAYLOAD, fp) for r in range(world)]

    def spill(self, key: bytes, slot: int) -> None:
        for rank, slab in enumerate(self.slabs):
            slab.write_slot(slot, key, self.payload(key, rank, PAYLOAD))
        super().spill(key, slot)  # journaled once every rank confirmed its write

    def close(self) -> None:
        for slab in self.slabs:
            slab.close()


def assert_reads_back(catalog: DiskCatalog, fp: bytes, world: int, payload: Callable) -> None:
    """Every recovered entry reads back, verified, exactly its own bytes on every rank."""
    out = bytearray(PAYLOAD)
    for rank in range(world):
        with SlabFile.open(catalog.slab_path(rank), SLOTS, PAYLOAD, fp) as slab:
            for key, slot in catalog.recovered.items():
                slab.read_slot_into(slot, key, memoryview(out))
                assert out == payload(key, rank, PAYLOAD)


@contextmanager
def _disk_fills_up_after(
    disk: Path, fp: bytes, key: Callable[[int], bytes], payload: Callable, durable: int,
) -> Iterator[tuple[DiskCatalog, SpillingTier, FaultyJournalFiles]]:
    """A two-rank catalog whose first ``durable`` keys (slots 0 on) a flush reported durable;
    from then on every journal write fails with ENOSPC, until ``files.clear()``."""
    files = FaultyJournalFiles()
    with DiskCatalog.open(disk, fp, PAYLOAD, SLOTS, 2, journal_files=files) as catalog:
        tier = SpillingTier(catalog, fp, 2, payload)
        for i in range(durable):
            tier.spill(key(i), i)
        catalog.flush()
        files.fail("write", errno.ENOSPC, times=FOREVER)
        yield catalog, tier, files


def test_after_the_disk_frees_up_a_restart_finds_every_live_entry(
    tmp_path: Path, fp: bytes, key, payload, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(journal_file, "BACKLOG_MAX_RECORDS", 8)
    disk = tmp_path / "tier"
    with _disk_fills_up_after(disk, fp, key, payload, durable=6) as (catalog, tier, files):
        first_dropped = None
        for i in range(6, 60):  # slots reused round-robin: evictions and spills
            tier.spill(key(i), i % SLOTS)
            if first_dropped is None and catalog.journal.records_dropped:
                first_dropped = i
            assert _backlog(catalog.journal) <= 8
        journal = catalog.journal
        assert journal.overflowing and first_dropped is not None
        dropped = journal.records_dropped
        deltas = catalog.take_counter_deltas()  # as the scheduler's stats snapshot carries them
        assert deltas == {"journal_records_dropped": dropped}
        assert catalog.take_counter_deltas() == {}  # deltas: each drop reported once
        registry = CollectorRegistry()
        build_exporter_metrics(registry, {"scheduler": {"counters": deltas}})
        assert registry.get_sample_value(
            "vllm:tieredkv_journal_records_dropped_total", {"model_name": "tieredkv"}
        ) == dropped
        # Every live entry was spilled after records started being dropped.
        assert all(i >= first_dropped for i in range(60) if key(i) in tier.entries)
        files.clear()
        catalog.flush()
        assert journal.rebuilds == 1 and not journal.overflowing
        assert catalog.take_counter_deltas() == {}
        tier.close()
    with DiskCatalog.open(disk, fp, PAYLOAD, SLOTS, 2) as catalog:
        assert catalog.recovered == tier.entries and len(tier.entries) == SLOTS
        assert catalog.dropped_at_recovery == {}
        assert_reads_back(catalog, fp, 2, payload)


def test_an_engine_that_dies_while_records_are_dropped_never_serves_a_reused_slot(
    tmp_path: Path, fp: bytes, key, payload, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The journal on disk is the one from before the disk filled up; since then slots 0-3
    # were evicted and reused by new keys whose records were dropped. A restart must find the
    # entries made durable before (4-7), and for 0-3 a miss, never the new keys' bytes.
    monkeypatch.setattr(journal_file, "BACKLOG_MAX_RECORDS", 8)
    disk = tmp_path / "tier"
    with _disk_fills_up_after(disk, fp, key, payload, durable=8) as (catalog, tier, _):
        durable = dict(tier.entries)  # reported durable
        before = journal_path(disk).read_bytes()
        for i in range(4):
            tier.spill(key(100 + i), i)  # evicts key(i): REMOVE + ADD, into the same slot
        for i in range(8, SLOTS):
            tier.spill(key(100 + i), i)
        assert catalog.journal.overflowing
        with pytest.raises(SlabError):
            catalog.flush()  # nothing more is reported durable
        tier.close()
    # The engine went down with the disk still full: its journal file is exactly as a crash
    # at any moment since the disk filled up would have left it.
    assert journal_path(disk).read_bytes() == before
    with DiskCatalog.open(disk, fp, PAYLOAD, SLOTS, 2) as catalog:
        assert catalog.recovered == {k_: s for k_, s in durable.items() if s >= 4}
        assert catalog.dropped_at_recovery == {FailureCause.WRONG_KEY: 4}
        assert_reads_back(catalog, fp, 2, payload)
        with SlabFile.open(catalog.slab_path(0), SLOTS, PAYLOAD, fp) as slab:
            with pytest.raises(SlabError) as err:
                slab.read_slot_into(0, key(0), memoryview(bytearray(PAYLOAD)))
            assert err.value.kind is FailureCause.WRONG_KEY


def test_real_enospc_on_a_full_tmpfs_is_survived_by_a_rebuild(
    small_tmpfs: Path, fp: bytes, key, payload, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The slab file is preallocated, so spills go on succeeding on a full filesystem while
    # every journal append fails with a real ENOSPC.
    monkeypatch.setattr(journal_file, "BACKLOG_MAX_RECORDS", 8)
    disk = small_tmpfs / "tier"
    with DiskCatalog.open(disk, fp, PAYLOAD, SLOTS, 1) as catalog:
        tier = SpillingTier(catalog, fp, 1, payload)
        tier.spill(key(0), 0)
        catalog.flush()
        filler = _fill(small_tmpfs)
        for i in range(1, 80):
            tier.spill(key(i), i % SLOTS)
        with pytest.raises(SlabError) as err:
            catalog.flush()
        assert err.value.kind is FailureCause.NO_SPACE
        assert catalog.journal.overflowing and _backlog(catalog.journal) == 0
        filler.unlink()
        catalog.flush()
        assert catalog.journal.rebuilds == 1
        tier.close()
    with DiskCatalog.open(disk, fp, PAYLOAD, SLOTS, 1) as catalog:
        assert catalog.recovered == tier.entries
        assert_reads_back(catalog, fp, 1, payload)
