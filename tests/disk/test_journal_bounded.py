"""A long-running journal stays bounded: it compacts itself without the caller waiting."""

from __future__ import annotations

from tieredkv.disk import journal as journal_mod
from tieredkv.disk.journal import Journal


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
    assert Journal.recover(path) == live
