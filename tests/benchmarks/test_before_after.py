"""benchmarks/before_after.py: how a side is run and how the two sides are put together."""

from __future__ import annotations

import sys
from pathlib import Path

from benchmarks import before_after


def test_old_trees_run_benchmarks_as_scripts_new_ones_as_modules(tmp_path: Path) -> None:
    (tmp_path / "benchmarks").mkdir()
    assert before_after._command(tmp_path, "e2e_ttft") == [sys.executable, str(tmp_path / "benchmarks" / "e2e_ttft.py")]
    (tmp_path / "benchmarks" / "__init__.py").touch()
    assert before_after._command(tmp_path, "e2e_ttft") == [sys.executable, "-m", "benchmarks.e2e_ttft"]


def test_rounds_merge_to_the_median_and_ratios_are_after_over_before() -> None:
    runs = [{"rows": [{"operation": "lookup", "size_label": "1k", "tieredkv_median_us": v}]} for v in (10.0, 30.0)]
    merged = before_after._merge(runs, before_after.scheduler_rows)
    assert merged == {"lookup @ 1k": 20.0}
    text = before_after.render("aaa", "bbb", {"scheduler_bench": {
        "rounds": 2, "before": merged, "after": {"lookup @ 1k": 25.0}}})
    assert "| lookup @ 1k | 20 | 25 | 1.25 |" in text
    assert "aaa vs bbb" in text


def test_e2e_rows_take_each_configs_median_and_each_verdicts_ratio() -> None:
    data = {"rows": {"recompute": {"median_s": 1.5}},
            "verdicts": [{"target": "host hit <= 1.3 x floor", "worse_ratio": 1.04}]}
    assert before_after.e2e_rows(data) == {
        "TTFT recompute (median s)": 1.5, "host hit <= 1.3 x floor (worse-of ratio)": 1.04}
