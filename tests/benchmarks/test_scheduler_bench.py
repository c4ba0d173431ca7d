"""Smoke test of benchmarks.scheduler_bench: its smallest profile, in-process.

Builds both scheduler halves (tieredkv and vLLM's OffloadingConnector) from real vLLM
configs, runs every measurement once or a few times, and checks that the rows are sane
and the results files are written. Timings themselves are not judged here.
"""

from __future__ import annotations

import importlib
import json
import math

import pytest

from benchmarks.scheduler import report, workload


@pytest.fixture(scope="module")
def bench():
    # Imported here, not at collection: the module sets VLLM_LOGGING_LEVEL when imported.
    return importlib.import_module("benchmarks.scheduler_bench")


def test_smoke_profile_gives_sane_rows(bench, tmp_path):
    # No plot: importing matplotlib alone would cost seconds of the smoke test's budget.
    result = bench.run("smoke", out_dir=tmp_path, make_plot=False, show_progress=False)
    profile = bench.PROFILES["smoke"]
    rows = result.rows

    lookups = [r for r in rows if r["group"] == "lookup"]
    assert len(lookups) == 2 * 2 * len(profile.sizes)  # hit/miss x cold/repeat x sizes
    assert {(r["state"], r["phase"], r["size"]) for r in lookups} == {
        (s, p, n) for s in ("hit", "miss") for p in ("cold", "repeat") for n in profile.sizes
    }
    metas = [r for r in rows if r["group"] == "meta"]
    assert {(r["variant"], r["size"]) for r in metas} == {
        (v, c) for v in ("decode", "prefill") for c in profile.running
    }
    assert {r["operation"] for r in rows if r["group"] == "keying"} == {
        "keying alone: chunk keys from block hashes (256 keys)",
        "index lookups alone: 256 keys, all present",
    }
    for row in rows:
        for side in ("tieredkv", "vllm"):
            median, p90 = row[f"{side}_median_us"], row[f"{side}_p90_us"]
            assert math.isfinite(median) and 0 < median < 1e6, row
            assert median <= p90 + 1e-9, row
        assert row["ratio"] == pytest.approx(row["tieredkv_median_us"] / row["vllm_median_us"])
        assert row["verdict"] in ("PASS", "PASS (within noise)", "FAIL"), row
        assert row["samples"] >= 1

    # The hit rows really hit: everything but the block of the last prompt token.
    hit_tokens = result.payload["hit_tokens"]
    for n in profile.sizes:
        assert hit_tokens["tieredkv"][n] == (n - 1) // workload.BLOCK_SIZE * workload.BLOCK_SIZE
        assert n - workload.CHUNK_TOKENS <= hit_tokens["vllm"][n] <= n

    # The smoke profile stops at 4k tokens: the 128k target row is reported as not measured.
    assert result.payload["targets"]["lookup_128k_under_2ms"] == "not measured"
    assert result.payload["machine"]["name"]

    data = json.loads((tmp_path / "scheduler_bench.json").read_text())
    assert data["profile"] == "smoke" and len(data["rows"]) == len(rows)
    markdown = (tmp_path / "scheduler_bench.md").read_text()
    assert "| operation | size | tieredkv µs median (p90) |" in markdown
    assert "Keying a 128k-token prompt" in markdown
    assert not (tmp_path / "scheduler_bench.png").exists()


def test_kv_events_side_is_measured_and_its_ratio_printed(bench, tmp_path, capsys):
    """Issue 26: --kv-events adds tieredkv with vLLM's KV events on as a third, interleaved
    side; each measured row shows events on / events off, and the results go to their own
    files so the kept default ones are not overwritten."""
    argv = ["--profile", "smoke", "--kv-events", "--out-dir", str(tmp_path), "--quiet",
            "--no-plot"]
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    assert "| ratio events on/off |" in printed
    assert "The events-off figures are the plain tieredkv side" in printed
    assert not (tmp_path / "scheduler_bench.json").exists()
    data = json.loads((tmp_path / "scheduler_bench_events.json").read_text())
    assert "ratio events on/off" in (tmp_path / "scheduler_bench_events.md").read_text()
    profile = bench.PROFILES["smoke"]
    measured = [r for r in data["rows"] if r["group"] in ("lookup", "meta")]
    assert len(measured) == 2 * 2 * len(profile.sizes) + 2 * len(profile.running)
    for row in measured:
        on, off = row["tieredkv_events_median_us"], row["tieredkv_median_us"]
        assert math.isfinite(on) and 0 < on < 1e6, row
        assert row["events_ratio"] == pytest.approx(on / off)
        assert f"| {row['events_ratio']:.2f} |" in printed
    # The events side hit what plain tieredkv hit (JSON keys are strings).
    assert data["hit_tokens"]["tieredkv_events"] == data["hit_tokens"]["tieredkv"]


def test_percentiles_and_table(bench):
    common = bench.common
    assert common.percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 90) == pytest.approx(9.1)
    assert common.summarize([3.0, 1.0, 2.0])["median"] == 2.0
    table = common.markdown_table([{"a": 1.5, "b": "x|y"}], [("a", "A"), ("b", "B")])
    assert table.splitlines() == ["| A | B |", "|---|---|", "| 1.5 | x\\|y |"]


def test_verdicts_use_the_noise_band(bench):
    assert report.verdict(0.8) == "PASS"
    assert report.verdict(1.0) == "PASS"
    assert report.verdict(1.05) == "PASS (within noise)"
    assert report.verdict(1.1) == "PASS (within noise)"
    assert report.verdict(1.11) == "FAIL"
    assert report.verdict(float("nan")) == "n/a"


def test_prompt_sizes_are_unaligned_but_one_labelled_row():
    """Issue 27: six of seven sizes were chunk multiples. Every profile's sizes are random
    lengths that are no multiple of the block, but for one chunk-aligned 4k row, labelled."""
    for profile in workload.PROFILES.values():
        aligned = [n for n in profile.sizes if workload.is_aligned(n)]
        assert aligned == [workload.ALIGNED_SIZE]
        assert all(n % workload.BLOCK_SIZE for n in profile.sizes if n not in aligned)
        assert len(profile.sizes) >= 3
    assert workload.PROMPT_SIZES == workload.prompt_sizes((1024, 2048, 16384, 32768, 65536, 131072))
    assert len(workload.PROMPT_SIZES) == 7
    # The lookup target's row is at least 128k tokens, not rounded down to a kinder size.
    assert max(workload.PROMPT_SIZES) > workload.KEYING_TOKENS
    samples = report.Samples()
    for side in ("tieredkv", "vllm"):
        for n in (4096, 4097):
            samples.add((side, "lookup", "hit", "cold", str(n)), 1.0)
    labels = {n: report._row(samples, "x", ("lookup", "hit", "cold", str(n)), n, "tokens",
                             group="lookup")["size_label"] for n in (4096, 4097)}
    assert labels == {4096: "4k tokens (chunk-aligned)", 4097: "4,097 tokens"}
