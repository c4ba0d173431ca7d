"""benchmarks/before_after.py: how a side is run and how the two sides are put together."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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


def _scheduler_run(value: float) -> dict:
    return {"rows": [{"operation": "lookup", "size_label": "1k", "tieredkv_median_us": value}]}


def test_two_rounds_measure_each_rows_noise_from_its_two_runs_per_side() -> None:
    runs = {"before": [_scheduler_run(10.0), _scheduler_run(11.0)],
            "after": [_scheduler_run(10.0), _scheduler_run(10.2)]}
    measured = before_after.noise(runs, before_after.scheduler_rows, before_after.no_samples)
    assert measured == {"lookup @ 1k": (11.0 - 10.0) / 10.5}  # the noisier side


def test_one_round_takes_the_noise_from_each_rows_own_samples() -> None:
    def run(samples: list[float]) -> dict:
        return {"rows": {"host": {"median_s": sorted(samples)[len(samples) // 2], "samples_s": samples}},
                "verdicts": [{"target": "host hit", "worse_ratio": 1.1}]}
    runs = {"before": [run([1.0, 1.0, 1.1, 1.2, 1.2])], "after": [run([1.0, 1.0, 1.0, 1.0, 1.0])]}
    measured = before_after.noise(runs, before_after.e2e_rows, before_after.e2e_samples)
    assert set(measured) == {"TTFT host (median s)"}  # the ratio row has no samples
    assert measured["TTFT host (median s)"] > 0.1


def test_the_verdict_weighs_the_mean_ratio_against_the_noise_and_names_slower_rows() -> None:
    table = {"before": {"a": 10.0, "b": 10.0, "c": 10.0}, "after": {"a": 9.0, "b": 10.0, "c": 12.0},
             "noise": {"a": 0.05, "b": 0.05, "c": 0.05}}
    judged = before_after.verdict(table)
    assert judged["slower_rows"] == ["c"]  # 1.2 > 1.05
    assert judged["geomean"] == pytest.approx((0.9 * 1.0 * 1.2) ** (1 / 3))
    assert judged["no_slower"] is True  # 1.026 <= 1.05
    table["after"]["b"] = 11.5
    assert before_after.verdict(table)["no_slower"] is False
    text = before_after.render("aaa", "bbb", {"scheduler_bench": {"rounds": 2, **table}})
    assert "**Verdict: SLOWER.**" in text and "Rows slower beyond their own noise: b, c." in text


def test_rows_are_matched_by_exact_size_and_the_after_side_can_be_given_the_before_sizes() -> None:
    before = {"rows": [
        {"operation": "get_num_new_matched_tokens hit", "size": 1024, "size_label": "1k tokens", "unit": "tokens",
         "tieredkv_median_us": 10.0},
        {"operation": "build_connector_meta (decode)", "size": 4, "size_label": "4 requests", "unit": "requests",
         "tieredkv_median_us": 5.0},
        {"operation": "get_num_new_matched_tokens miss", "size": 2348, "size_label": "2348 tokens", "unit": "tokens",
         "tieredkv_median_us": 9.0},
    ]}
    after = {"rows": [{"operation": "get_num_new_matched_tokens hit", "size": 1024, "size_label": "1,024 tokens",
                       "unit": "tokens", "tieredkv_median_us": 9.0}]}
    assert before_after.same_sizes(before) == ["--sizes", "1024,2348"]
    assert set(before_after.scheduler_rows(after)) <= set(before_after.scheduler_rows(before))


def test_the_scheduler_bench_runs_the_sizes_it_is_given() -> None:
    from benchmarks import scheduler_bench

    result = scheduler_bench.run("smoke", write=False, make_plot=False, show_progress=False, sizes=[700, 1500])
    lookups = {r["size"] for r in result.rows if r["operation"].startswith("get_num_new_matched_tokens")}
    assert lookups == {700, 1500}


def test_a_harness_dir_pairs_one_trees_package_with_anothers_benchmarks(tmp_path: Path) -> None:
    for tree in ("old", "new"):
        for package in ("tieredkv", "benchmarks"):
            (tmp_path / tree / package).mkdir(parents=True)
            (tmp_path / tree / package / "__init__.py").write_text(f"TREE = {tree!r}\n")
    run_dir = before_after.harness_dir(tmp_path / "old", tmp_path / "new", tmp_path)
    assert before_after.harness_dir(tmp_path / "old", tmp_path / "new", tmp_path) == run_dir  # reused
    found = subprocess.run(
        [sys.executable, "-c", "import tieredkv, benchmarks; print(tieredkv.TREE, benchmarks.TREE)"],
        cwd=run_dir, capture_output=True, text=True, check=True).stdout.split()
    assert found == ["old", "new"]
