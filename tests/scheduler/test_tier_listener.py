"""The indexes' ``TierListener`` (what KV events are built from): told when an entry becomes
READY, when a READY entry stops being served, and once when a tier is cleared."""

from __future__ import annotations

from test_fill import Rig

from tieredkv.protocol import JobResult, Move, Tier
from tieredkv.scheduler.tier_index import TierIndex


class Heard:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def entry_ready(self, tier: str, key: bytes, aliases: tuple[bytes, ...]) -> None:
        self.calls.append(("ready", tier, key, aliases))

    def entry_gone(self, tier: str, key: bytes) -> None:
        self.calls.append(("gone", tier, key))

    def tier_cleared(self, tier: str) -> None:
        self.calls.append(("cleared", tier))


def listened(slots: int = 2) -> tuple[TierIndex, Heard]:
    index = TierIndex(Tier.HOST, slots)
    index.listener = heard = Heard()
    return index, heard


def test_ready_eviction_and_removal_are_heard_writes_that_never_finished_are_not():
    index, heard = listened()
    a, b, c, d = (bytes([i]) * 32 for i in range(4))
    index.allocate(a, aliases=(b"x" * 32,))
    assert heard.calls == []  # being written: nothing to announce
    index.mark_ready(a)
    index.allocate(b)
    index.abort(b)  # a failed write: never announced, nothing removed
    index.allocate(c)
    index.mark_ready(c)
    index.allocate(d)  # full: the least recently used READY entry (a) is evicted
    assert heard.calls == [("ready", Tier.HOST, a, (b"x" * 32,)), ("ready", Tier.HOST, c, ()),
                           ("gone", Tier.HOST, a)]
    heard.calls.clear()
    index.remove(d)  # still being written
    index.pin(c)
    index.remove(c)  # pinned: doomed, gone from lookups now
    assert heard.calls == [("gone", Tier.HOST, c)]
    index.unpin(c)
    assert heard.calls == [("gone", Tier.HOST, c)]


def test_a_write_doomed_before_it_finished_is_not_announced():
    index, heard = listened()
    index.allocate(b"a" * 32)
    index.remove(b"a" * 32)
    assert index.mark_ready(b"a" * 32) is False
    assert heard.calls == []


def test_a_clear_is_heard_once_not_per_entry():
    index, heard = listened(4)
    for i in range(3):
        index.allocate(bytes([i]) * 32)
        index.mark_ready(bytes([i]) * 32)
    heard.calls.clear()
    index.clear()
    assert heard.calls == [("cleared", Tier.HOST)]
    assert index.listener is heard  # still listening after the clear


def test_a_failed_fill_tells_that_its_tier_does_not_serve_the_chunk():
    r = Rig()
    r.host.listener = r.disk.listener = heard = Heard()
    c0, c1, c2 = r.chunk[:3]
    r.fill_run("a", [c0, c1, c2], [c1], [c2], 2)
    plan = r.ledger.take_plan()
    r.ledger.apply([JobResult.fail(plan.of(Move.PROMOTE)[0].job_id, "checksum"),
                    JobResult.fail(plan.of(Move.REMOTE_READ)[0].job_id, "missing")])
    gone = [call for call in heard.calls if call[0] == "gone"]
    assert ("gone", Tier.DISK, c1) in gone  # the disk entry is dropped (corrupt)
    assert ("gone", Tier.REMOTE, c2) in gone  # the shared tier's value is not there
    assert not [call for call in heard.calls if call[0] == "ready"]
