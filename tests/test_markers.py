"""The ``redis`` and ``vllm`` markers (tests/conftest.py): applied by fixture use and folder, so
the fast unit tier ``-m "not vllm and not redis"`` starts neither, and a test that starts
redis-server without the marker fails instead of slipping into that tier."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tieredkv.testing.redis_procs import RedisServer

ROOT = Path(__file__).resolve().parents[1]


def test_a_test_starting_redis_server_without_the_marker_fails_naming_itself(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    assert request.node.get_closest_marker("redis") is None
    server = RedisServer(tmp_path)
    with pytest.raises(pytest.fail.Exception, match=r"test_markers\.py::.* is not marked 'redis'"):
        server.start()
    assert server.proc is None  # refused before anything was started


def collected(*args: str) -> set[str]:
    files = ["tests/remote/test_remote_bounded_reads.py", "tests/transfer/test_remote_jobs.py",
             "tests/e2e/test_e2e_namespace.py", "tests/scheduler/test_ledger.py"]
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         *args, *files],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return {line for line in out.stdout.splitlines() if "::" in line}


def test_the_fast_tier_leaves_out_every_test_using_redis_server_or_vllm() -> None:
    everything, fast = collected(), collected("-m", "not vllm and not redis")
    left_out = everything - fast
    assert fast and left_out
    assert not any(node.startswith("tests/e2e/") for node in fast)
    # By fixture: directly, through a fixture of the test file, or named by a parameter.
    assert "tests/remote/test_remote_bounded_reads.py::test_a_bound_below_one_byte_is_refused" in left_out
    assert any(n.startswith("tests/remote/test_remote_bounded_reads.py::test_a_planted") for n in left_out)
    assert any("[redis_cluster]" in n or "[redis_server]" in n for n in left_out)
    assert any(n.startswith("tests/scheduler/test_ledger.py::") for n in fast)
