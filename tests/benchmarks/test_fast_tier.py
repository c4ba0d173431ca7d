"""benchmarks/fast_tier.py: the kept figure for the README's fast tier comes from a real run."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import fast_tier


def test_a_run_keeps_its_wall_time_summary_and_stamp(tmp_path: Path) -> None:
    status = fast_tier.main(["--out-dir", str(tmp_path), "tests/test_layers.py"])
    data = json.loads((tmp_path / "fast_tier.json").read_text())
    assert status == 0 == data["exit_status"]
    assert "passed" in data["summary"] and data["wall_s"] > 0
    assert data["marker"] == "not vllm and not redis" and data["commit"]
    assert f"{data['wall_s']:.0f} s" in (tmp_path / "fast_tier.md").read_text()


def test_a_failing_tier_is_kept_with_its_status(tmp_path: Path) -> None:
    (tmp_path / "test_fails.py").write_text("def test_no():\n    assert False\n")
    status = fast_tier.main(["--out-dir", str(tmp_path / "out"), str(tmp_path / "test_fails.py")])
    data = json.loads((tmp_path / "out" / "fast_tier.json").read_text())
    assert status == 1 == data["exit_status"] and "1 failed" in data["summary"]


def test_the_summary_is_pytests_own_line_in_quiet_mode_too(tmp_path: Path) -> None:
    (tmp_path / "test_two.py").write_text("def test_a():\n    pass\n\n\ndef test_b():\n    pass\n")
    fast_tier.main(["--out-dir", str(tmp_path / "out"), str(tmp_path / "test_two.py")])
    data = json.loads((tmp_path / "out" / "fast_tier.json").read_text())
    assert data["summary"] == "2 passed"
