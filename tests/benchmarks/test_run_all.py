"""benchmarks.run_all stamps what a benchmark wrote; benchmarks.render_results renders only what files say."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from benchmarks import render_results, run_all, stamps

REPO = Path(__file__).resolve().parents[2]


def _git(root: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True)


def _stamp(t_start: float, exit_status: int = 0) -> dict:
    return {
        "commit": "0123456789abcdef", "dirty": [], "profile": "quick", "command": "python -m benchmarks.x",
        "machine": {"name": "test CPU, 2 usable cores, no GPU"}, "load_before": [1.0, 1.0, 1.0],
        "load_after": [2.0, 1.5, 1.2], "date_start": "2026-11-25 05:00:00 UTC",
        "date_end": "2026-11-25 05:01:00 UTC", "wall_s": 60.0, "exit_status": exit_status, "t_start": t_start,
    }


def test_stamp_files_adds_the_stamp_once_and_reports_stale_or_missing_files(tmp_path):
    t_start = time.time() - 5
    (tmp_path / "x.json").write_text(json.dumps({"benchmark": "x", "value": 1}))
    (tmp_path / "x.md").write_text("# X\n\nbody\n")
    stale = tmp_path / "old.json"
    stale.write_text("{}")
    os.utime(stale, (t_start - 100, t_start - 100))
    problems = run_all.stamp_files([tmp_path / "x.json", tmp_path / "x.md", stale, tmp_path / "gone.json"],
                                   _stamp(t_start))
    assert problems == ["old.json is older than this run (not rewritten)", "gone.json was not written"]
    payload = json.loads((tmp_path / "x.json").read_text())
    assert payload["value"] == 1
    assert payload["stamp"]["commit"] == "0123456789abcdef" and "t_start" not in payload["stamp"]
    assert payload["stamp"]["load_before"] == [1.0, 1.0, 1.0]
    # Stamping again (a rerun) replaces the line instead of adding a second one.
    run_all.stamp_files([tmp_path / "x.md"], _stamp(t_start, exit_status=1))
    lines = (tmp_path / "x.md").read_text().splitlines()
    assert lines[0] == "# X"
    stamped = [x for x in lines if x.startswith(stamps.STAMP_PREFIX)]
    assert len(stamped) == 1 and "exit status 1" in stamped[0] and "`0123456789`" in stamped[0]
    assert "body" in lines


def test_tree_changes_ignores_results_files_only(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "code.py").write_text("a = 1\n")
    (tmp_path / "benchmarks" / "results" / "r.json").write_text("{}\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    assert run_all.tree_changes(tmp_path) == []
    (tmp_path / "benchmarks" / "results" / "r.json").write_text('{"new": 1}\n')
    assert run_all.tree_changes(tmp_path) == []
    # The page a run renders from the results: a second run_all right after a first must start.
    (tmp_path / "benchmarks" / "RESULTS.md").write_text("# re-rendered\n")
    assert run_all.tree_changes(tmp_path) == []
    (tmp_path / "code.py").write_text("a = 2\n")
    assert run_all.tree_changes(tmp_path) == ["code.py"]
    # An untracked module would run as well: it makes the tree dirty too.
    (tmp_path / "new_module.py").write_text("b = 1\n")
    assert run_all.tree_changes(tmp_path) == ["code.py", "new_module.py"]


def test_stamp_files_captions_a_png_figure(tmp_path):
    from PIL import Image

    t_start = time.time() - 5
    Image.new("RGB", (640, 200), "white").save(tmp_path / "x.png")
    assert run_all.stamp_files([tmp_path / "x.png"], _stamp(t_start)) == []
    with Image.open(tmp_path / "x.png") as figure:
        assert figure.size == (640, 224)  # the caption strip under the figure
        text = figure.text["tieredkv-stamp"]
        dark = sum(figure.crop((0, 200, 640, 224)).convert("L").histogram()[:128])
    assert text.startswith(stamps.STAMP_PREFIX) and "`0123456789`" in text and "exit status 0" in text
    assert dark > 50, "the caption is drawn, not only stored"


def test_run_all_refuses_a_tree_whose_c_copier_is_not_built(tmp_path):
    # A clone without the built extension would run (and stamp) the numpy fallback.
    package = tmp_path / "tieredkv" / "transfer" / "backends"
    package.mkdir(parents=True)
    for folder in (tmp_path / "tieredkv", tmp_path / "tieredkv" / "transfer", package):
        (folder / "__init__.py").write_text("")
    problem = run_all.c_copier_problem(tmp_path)
    assert problem is not None and "build_ext --inplace" in problem and str(tmp_path) in problem
    assert run_all.c_copier_problem(REPO) is None  # the project's own tree has it built


def test_run_one_runs_a_real_benchmark_and_stamps_its_files(tmp_path):
    bench = run_all.Bench("transfer_bench", ("--device", "cpu", "--smoke", "--json", "{out}/t.json"), (),
                          ("t.json", "t.txt"), (), (1, 1), keeps_stdout=True)
    run = run_all.run_one(bench, False, tmp_path, tmp_path, "feedc0de" * 5, [])
    assert run["problems"] == [] and run["status"] in ("ok", "target missed")
    payload = json.loads((tmp_path / "t.json").read_text())
    assert payload["rows"], "the benchmark's own figures are kept"
    stamp = payload["stamp"]
    assert stamp["commit"] == "feedc0de" * 5 and stamp["profile"] == "quick"
    assert stamp["command"].startswith("python -m benchmarks.transfer_bench --device cpu --smoke")
    assert len(stamp["load_before"]) == 3 and len(stamp["load_after"]) == 3
    assert stamp["machine"]["usable_cpus"] >= 1 and stamp["exit_status"] == run["exit_status"]
    assert "targets met" in (tmp_path / "t.txt").read_text()  # its printed table is kept


def test_run_all_refuses_unknown_benchmarks():
    try:
        run_all.main(["--only", "nope", "--list"])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("an unknown benchmark name must be refused")


def _write_soak(results: Path, rss_verdict: str) -> None:
    payload = {
        "benchmark": "soak", "checks": [{"check": "every response equals its float32 reference",
                                         "measured": "10/10 equal", "verdict": "PASS"}],
        "leaks": {"rss_bytes": {"verdict": rss_verdict, "mode": "hourly", "slope_per_h": 20 * 2**20,
                                "climb": 20 * 2**20, "limit": 16 * 2**20}},
        "summary": {"requests": 10, "load_s": 3600, "faults": 2}, "params": {"warmup_s": 600},
        "stamp": {k: v for k, v in _stamp(0).items() if k != "t_start"},
    }
    (results / "soak-full.json").write_text(json.dumps(payload))


def test_render_puts_a_missed_target_in_the_headline(tmp_path):
    _write_soak(tmp_path, "FAIL")
    page = render_results.render(render_results.load_sections(tmp_path))
    headline = next(line for line in page.splitlines() if line.startswith("| Soak (full"))
    assert "1 of 2" in headline and "**MISS**: leak rule: rss_bytes (hourly)" in headline
    assert "slope +20.00 MiB/h" in page and "<= 16.00" in page
    _write_soak(tmp_path, "PASS")
    page = render_results.render(render_results.load_sections(tmp_path))
    headline = next(line for line in page.splitlines() if line.startswith("| Soak (full"))
    assert "2 of 2" in headline and "MISS" not in headline


def test_check_flags_a_page_that_differs_from_the_files(tmp_path):
    _write_soak(tmp_path, "PASS")
    out = tmp_path / "RESULTS.md"
    assert render_results.main(["--results", str(tmp_path), "--output", str(out)]) == 0
    assert render_results.main(["--results", str(tmp_path), "--output", str(out), "--check"]) == 0
    out.write_text(out.read_text().replace("2 of 2", "3 of 3"))
    assert render_results.main(["--results", str(tmp_path), "--output", str(out), "--check"]) == 1


def test_every_kept_results_file_renders():
    """Each JSON under benchmarks/results/ that the page lists is read without error, with verdicts."""
    sections = render_results.load_sections(REPO / "benchmarks" / "results")
    assert sections, "no kept results files found"
    for s in sections:
        assert s.rows, f"{s.file}: nothing rendered"
        assert {r["verdict"] for r in s.rows} <= {"PASS", "MISS", "info", render_results.REF_PASS,
                                                  render_results.REF_MISS}


def _stamped_section(file: str, start: str, end: str) -> render_results.Section:
    stamp = {**{k: v for k, v in _stamp(0).items() if k != "t_start"}, "date_start": start, "date_end": end}
    return render_results.Section("soak", file, file, stamp, [render_results._row("x", "1", "", "PASS")])


def test_render_names_runs_that_overlapped():
    a = _stamped_section("a.json", "2026-11-25 05:00:00 UTC", "2026-11-25 05:10:00 UTC")
    b = _stamped_section("b.json", "2026-11-25 05:10:00 UTC", "2026-11-25 05:20:00 UTC")  # after a
    c = _stamped_section("c.json", "2026-11-25 05:05:00 UTC", "2026-11-25 05:06:00 UTC")  # inside a
    assert render_results.overlapping_runs([a, b]) == []
    assert render_results.overlapping_runs([a, b, c]) == [("a.json", "c.json")]
    assert "**Runs that overlapped**" in render_results.render([a, b, c])
    assert "No two of these runs overlapped" in render_results.render([a, b])


def test_e2e_info_lines_are_not_targets_and_reference_misses_reach_the_headline():
    payload = json.loads((REPO / "benchmarks" / "results" / "e2e_ttft.json").read_text())
    payload["verdicts"] = [
        {"target": "host hit <= 1.3 x floor", "pass": True, "worse_ratio": 1.0, "limit": "1.3 x floor"},
        {"target": "disk hit faster than X reading from disk (info)", "pass": False, "worse_ratio": 2.0,
         "limit": "< X"}]
    payload["hybrid_verdicts"] = [{"target": "hybrid host hit <= 1.3 x hybrid floor", "pass": False,
                                   "worse_ratio": 7.0, "limit": "1.3 x hybrid floor",
                                   "equal_compute": {"value_s": 0.1, "limit_s": 0.2, "pass": True}}]
    rows, _ = render_results.e2e_ttft_rows(payload)
    section = render_results.Section("e2e_ttft", "e2e_ttft.json", "TTFT", None, rows)
    assert [r["verdict"] for r in section.judged] == ["PASS"]  # the (info) line is not counted
    assert [r["what"].split(" (")[0] for r in section.reference_misses] == ["hybrid host hit <= 1.3 x hybrid floor"]
    headline = next(x for x in render_results.render([section]).splitlines() if x.startswith("| TTFT"))
    assert "1 of 1" in headline and "MISS**" not in headline
    assert "reference lines (not targets) missed: hybrid host hit <= 1.3 x hybrid floor" in headline


def test_multi_replica_pooled_row_has_no_empty_rounds():
    rows, _ = render_results.multi_replica_rows({"ratios": [
        {"users": 2, "ttft_p50_ratio": 0.9, "ttft_p99_ratio": 1.0, "ttft_p50_ratio_per_round": [0.8, 1.0]},
        {"users": "all", "ttft_p50_ratio": 1.1, "ttft_p99_ratio": 1.2}]})
    assert rows[0]["measured"] == "p50 0.90 (rounds 0.80, 1.00), p99 1.00"
    assert rows[1]["measured"] == "p50 1.10, p99 1.20"


def test_results_page_is_rendered_from_the_kept_files():
    """benchmarks/RESULTS.md says exactly what the kept files say (re-render after a new run)."""
    assert render_results.main(["--check"]) == 0, "run: python -m benchmarks.render_results"


def test_code_changed_since_sees_a_benchmarks_parts(tmp_path):
    """e2e_ttft's judging lives in benchmarks/ttft/, serve_bench's chat client (which
    multi_replica and soak play too) in benchmarks/serve/: a change there is a change to what
    those benchmarks measure, not only a change to their scripts."""
    _git(tmp_path, "init", "-q")
    for path in ("benchmarks/e2e_ttft.py", "benchmarks/soak.py", "benchmarks/ttft/judging.py",
                 "benchmarks/serve/client.py", "benchmarks/scheduler/sides.py", "tieredkv/__init__.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("a = 1\n")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    assert not render_results.code_changed_since("HEAD", "e2e_ttft", tmp_path)
    (tmp_path / "benchmarks" / "ttft" / "judging.py").write_text("a = 2\n")
    assert render_results.code_changed_since("HEAD", "e2e_ttft", tmp_path)
    assert not render_results.code_changed_since("HEAD", "soak", tmp_path)
    (tmp_path / "benchmarks" / "serve" / "client.py").write_text("a = 2\n")
    for script in ("serve_bench", "multi_replica", "soak"):
        assert render_results.code_changed_since("HEAD", script, tmp_path), script
    assert not render_results.code_changed_since("HEAD", "scheduler_bench", tmp_path)
    (tmp_path / "benchmarks" / "scheduler" / "sides.py").write_text("a = 2\n")
    assert render_results.code_changed_since("HEAD", "scheduler_bench", tmp_path)


def test_e2e_worse_of_verdicts_hybrid_host_is_a_target_unjudged_is_info():
    payload = json.loads((REPO / "benchmarks" / "results" / "e2e_ttft.json").read_text())
    payload["verdicts"] = [
        {"target": "host hit <= 1.3 x floor", "pass": True, "judged": True, "worse_ratio": 1.2,
         "cross_engine_ratio": 1.1, "same_engine_ratio": 1.2, "limit": "1.3 x floor", "note": ""},
        {"target": "host hit x floor <= LMCache hit x LMCache's own floor", "pass": False,
         "judged": False, "worse_ratio": 1.2, "limit": "LMCache's ratio",
         "note": "not judged: LMCache row not run"}]
    payload["hybrid_verdicts"] = [
        {"target": "hybrid host hit <= 1.3 x hybrid floor", "pass": False, "reference": False,
         "worse_ratio": 4.9, "cross_engine_ratio": 4.0, "same_engine_ratio": 4.9, "limit": "1.3", "note": ""},
        {"target": "hybrid disk hit <= 1.3 x (hybrid floor + 15 ms) (reference)", "pass": False,
         "reference": True, "worse_ratio": 4.8, "limit": "1.3", "note": ""}]
    rows, _ = render_results.e2e_ttft_rows(payload)
    verdicts = {r["what"]: r["verdict"] for r in rows if not r["what"].startswith("TTFT")}
    assert verdicts["host hit <= 1.3 x floor"] == "PASS"
    assert verdicts["host hit x floor <= LMCache hit x LMCache's own floor"] == "info"
    assert verdicts["hybrid host hit <= 1.3 x hybrid floor"] != "PASS"
    assert verdicts["hybrid host hit <= 1.3 x hybrid floor"] not in (render_results.REF_MISS, "info")
    assert verdicts["hybrid disk hit <= 1.3 x (hybrid floor + 15 ms) (reference)"] == render_results.REF_MISS
    measured = next(r["measured"] for r in rows if r["what"] == "host hit <= 1.3 x floor")
    assert measured == "1.20x (worse of cross/same engine); cross-engine 1.10, same-engine 1.20"


def test_every_benchmark_run_all_runs_is_a_script_with_its_own_output_names() -> None:
    # The 8B-class runs reuse e2e_ttft and serve_bench under another name: each entry must name
    # a real script, and no two entries may write the same file (one would overwrite the other).
    root = Path(run_all.__file__).resolve().parent
    for bench in run_all.BENCHES:
        assert (root / f"{bench.script}.py").is_file(), bench.name
    for full in (False, True):
        files = [f for b in run_all.BENCHES for f in b.files(full)]
        assert len(files) == len(set(files)), sorted(f for f in files if files.count(f) > 1)
    shaped = {b.name: b.args(False) for b in run_all.BENCHES if b.module}
    assert shaped and all("--model-shape" in args for args in shaped.values()), shaped
