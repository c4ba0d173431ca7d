"""The launcher's start/stop helpers, on plain child processes (no vLLM needed)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tieredkv.tools.ports import free_port
from tieredkv.tools.vllm_server import stop_process_group, wait_until_healthy


def test_wait_until_healthy_returns_once_the_url_answers_and_stop_ends_the_session(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                            cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_until_healthy(proc, f"http://127.0.0.1:{port}/", 60, "http.server", tmp_path / "log")
        assert proc.poll() is None
    finally:
        stop_process_group(proc, 10)
    assert proc.poll() is not None
    stop_process_group(proc, 10)  # stopping a stopped process is a no-op


def test_a_process_that_exits_during_start_up_fails_at_once(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], start_new_session=True)
    with pytest.raises(RuntimeError, match="exited during start-up; see .*log"):
        wait_until_healthy(proc, f"http://127.0.0.1:{free_port()}/health", 60, "x", tmp_path / "log")


def test_a_process_that_never_answers_times_out(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        with pytest.raises(TimeoutError, match="did not start within 1s"):
            wait_until_healthy(proc, f"http://127.0.0.1:{free_port()}/health", 1, "sleeper", tmp_path / "log")
    finally:
        stop_process_group(proc, 5)
    assert proc.poll() is not None


def test_a_servers_own_environment_reaches_its_process_over_this_ones(tmp_path, monkeypatch):
    """Each replica of a run gets its own CPU binding this way (benchmarks/multi_replica.py)."""
    from tieredkv.tools.vllm_server import Server

    dump = tmp_path / "env.txt"
    fake_python = tmp_path / "python"
    fake_python.write_text(f"#!/bin/sh\nenv > {dump}\nexit 3\n")
    fake_python.chmod(0o755)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    monkeypatch.setenv("TIEREDKV_LAUNCHER_TEST", "inherited")
    server = Server(tmp_path / "model", None, tmp_path / "log", python=fake_python,
                    env={"VLLM_CPU_OMP_THREADS_BIND": "1"})
    with pytest.raises(RuntimeError, match="exited during start-up"):
        server.start(timeout_s=60)
    seen = dict(line.split("=", 1) for line in dump.read_text().splitlines() if "=" in line)
    assert seen["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert seen["TIEREDKV_LAUNCHER_TEST"] == "inherited"
