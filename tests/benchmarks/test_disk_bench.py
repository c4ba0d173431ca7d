"""disk_bench compares each queue depth with the same depth on the raw side (issue 27)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from benchmarks import disk_bench
from benchmarks.render_results import disk_rows


def test_raw_baseline_reaches_the_queue_depth_it_is_given(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """At depth 4 the raw side has 4 I/Os in flight at once (it used to do one at a time)."""
    case = disk_bench.DiskCase(tmp_path, 64 * 1024, 1 << 20, inflight=4, io_threads=2, direct=False)
    active, peak, lock = 0, 0, threading.Lock()
    real = os.pwritev

    def counting(fd: int, views: list[memoryview], offset: int) -> int:
        nonlocal active, peak
        with lock:
            active += 1
            peak = max(peak, active)
        time.sleep(0.01)  # hold the slot so overlapping calls can be seen
        try:
            return real(fd, views, offset)
        finally:
            with lock:
                active -= 1

    try:
        monkeypatch.setattr(disk_bench.os, "pwritev", counting)
        case.raw(True, 0, 1, depth=1)
        assert peak == 1
        case.raw(True, 0, case.count, depth=4)
        assert peak == 4
        with pytest.raises(ValueError, match="above --inflight"):
            case.raw(True, 0, 4, depth=5)
    finally:
        monkeypatch.undo()
        case.close()


def test_smoke_run_reports_both_depths_on_both_sides(tmp_path: Path) -> None:
    out = tmp_path / "disk.json"
    disk_bench.main(["--dir", str(tmp_path / "d"), "--total-bytes", "1MiB", "--block-bytes", "256KiB",
                     "--chunk-sizes", "64KiB", "--repeats", "1", "--direct", "off", "--json", str(out)])
    data = json.loads(out.read_text())
    assert data["depths"] == [1, 4]
    disk = [r for r in data["rows"] if r["what"] != "host slot copy"]
    assert sorted((r["what"], r["depth"]) for r in disk) == [
        ("restore (read_slot_into)", 1), ("restore (read_slot_into)", 4),
        ("spill (write_slot)", 1), ("spill (write_slot)", 4)]
    for r in disk:  # each depth has samples on both sides, and its ratio is theirs
        assert r["samples_tieredkv"] and r["samples_raw"]
        assert r["ratio"] == pytest.approx(r["tieredkv_gbs"] / r["raw_gbs"])
    rows, notes = disk_rows(data)
    assert any("4 in flight both sides" in row["what"] for row in rows)
    assert "queue depths [1, 4] on both sides" in notes[0]


def test_depths_are_one_and_inflight() -> None:
    assert disk_bench.depths(4) == [1, 4]
    assert disk_bench.depths(1) == [1]
