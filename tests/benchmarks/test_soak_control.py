"""The soak's RSS baseline (#27): a control server without tieredkv under the same load, the
RSS rule judged on the tieredkv server's RSS minus the control's, growth placed per process,
the KV bytes per token stated, and a kept run re-rendered from its JSON."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import soak
from benchmarks.endurance import judging, probes, report, runner
from benchmarks.endurance.runner import Run
from benchmarks.endurance.workload import PROFILES, MiB

REPO = Path(__file__).resolve().parents[2]
P = PROFILES["full"]


def _run(server_mib_per_h: float, control_mib_per_h: float | None, *, control_fails: bool = False,
         control_served: int = 50) -> Run:
    """An hour and six minutes of samples every 10 s: every series flat except the servers' RSS,
    which climbs by the given MiB per hour (the growth all in the worker process); tieredkv
    served 50 requests, the control ``control_served``."""
    run = Run(load_start=0.0, load_end=P["duration_s"], with_control=control_mib_per_h is not None)
    for i in range(400):
        t = i * 10.0
        worker = 1500 * MiB + server_mib_per_h * MiB * t / 3600
        sample = {"t": t, "rss_bytes": 500 * MiB + worker, "open_fds": 90, "threads": 60,
                  "host_slots_used": 20, "pinned_host_slots": 1, "disk_slots_used": 60,
                  "journal_entries": 60, "disk_usage_bytes": 20 * MiB, "journal_bytes": 40_000,
                  "rss_by_process": {"api_server": 500 * MiB, "VLLM::Worker": worker}}
        if control_mib_per_h is not None:
            c_worker = 1400 * MiB + control_mib_per_h * MiB * t / 3600
            sample.update(control_rss_bytes=500 * MiB + c_worker,
                          control_rss_by_process={"api_server": 500 * MiB, "VLLM::Worker": c_worker})
            sample["rss_excess_bytes"] = sample["rss_bytes"] - sample["control_rss_bytes"]
        run.samples.append(sample)
    run.records = [{"t": 1.0, "prompt": 0, "client": 0, "ok": True, "ttft_s": 0.1, "mismatch": False}] * 50
    if control_mib_per_h is not None:
        run.control_records = [{"t": 1.0, "prompt": 0, "client": 0, "ok": True, "ttft_s": 0.1,
                                "mismatch": False, "lag_s": 0.25}] * control_served
        if control_fails:
            run.control_records.append({"t": 9.0, "prompt": 0, "client": 0, "ok": False, "error": "timeout"})
            run.failures.append("control server stopped answering: request for prompt 0 at t=9s failed: timeout")
            run.control_lost = True
    run.idle = {"pinned_host_slots": 0, "jobs_in_flight": 0, "host_slots_in_flight": 0,
                "requests_waiting_on_load": 0}
    return run


def _prompts() -> list[list[int]]:
    return [[1] * 600, [2] * 900]


def test_growth_the_control_shows_too_is_not_tieredkvs_leak():
    """Both servers' workers grow (37 and 35 MiB/h): the excess is flat, PASS; the server's own
    RSS is judged under the looser cap (64 MiB/h), which 37 MiB/h passes."""
    run = _run(37, 35)
    judged = judging.judge(run, P, _prompts())
    excess = judged["leaks"]["rss_excess_bytes"]
    assert excess["verdict"] == "PASS" and excess["slope_per_h"] == pytest.approx(2 * MiB)
    own = judged["leaks"]["rss_bytes"]
    assert own["verdict"] == "PASS" and own["limit"] == 64 * MiB
    assert judged["leaks_info"]["control_rss_bytes"]["slope_per_h"] == pytest.approx(35 * MiB)
    assert judged["verdict"] == "PASS", judged["checks"]
    leak = next(c for c in judged["checks"] if c["check"].startswith("every sampled series"))
    assert "RSS above the control's: slope < 16 MiB/h, own RSS slope < 64 MiB/h" in leak["check"]


def test_growth_past_the_cap_fails_even_when_the_control_grows_as_fast():
    """Both grow 80 and 78 MiB/h: the excess is flat, but an operator still pays for 80 MiB/h."""
    run = _run(80, 78)
    judged = judging.judge(run, P, _prompts())
    assert judged["leaks"]["rss_excess_bytes"]["verdict"] == "PASS"
    assert judged["leaks"]["rss_bytes"]["verdict"] == "FAIL"
    assert judged["verdict"] == "FAIL"
    assert any(f.startswith("series rss_bytes: FAIL: slope") for f in run.failures)
    control = next(c for c in judged["checks"] if c["check"].startswith("control server"))
    assert control["verdict"] == "PASS"
    assert "50 of tieredkv's 50 requests, 0 errors; lag behind tieredkv's clients mean 0.25 s" in control["measured"]


def test_growth_beyond_the_controls_fails_the_rss_rule():
    run = _run(40, 5)
    judged = judging.judge(run, P, _prompts())
    excess = judged["leaks"]["rss_excess_bytes"]
    assert excess["verdict"] == "FAIL" and excess["slope_per_h"] == pytest.approx(35 * MiB)
    assert judged["verdict"] == "FAIL"
    assert any(f.startswith("series rss_excess_bytes: FAIL: slope") for f in run.failures)


def test_without_a_control_the_servers_own_rss_is_judged():
    run = _run(37, None)
    judged = judging.judge(run, P, _prompts())
    assert judged["leaks"]["rss_bytes"]["verdict"] == "FAIL"
    assert "rss_excess_bytes" not in judged["leaks"] and judged["leaks_info"] == {}
    assert not any(c["check"].startswith("control server") for c in judged["checks"])
    assert judged["verdict"] == "FAIL"


def test_a_control_that_stops_answering_fails_the_run():
    run = _run(37, 35, control_fails=True)
    judged = judging.judge(run, P, _prompts())
    control = next(c for c in judged["checks"] if c["check"].startswith("control server"))
    assert control["verdict"] == "FAIL" and "1 error;" in control["measured"]
    assert judged["verdict"] == "FAIL"


def test_a_control_that_carried_less_of_the_load_fails_its_check():
    """40 of 50: the baseline saw a fifth less load, so vLLM's growth would be understated."""
    judged = judging.judge(_run(37, 35, control_served=40), P, _prompts())
    control = next(c for c in judged["checks"] if c["check"].startswith("control server"))
    assert control["verdict"] == "FAIL" and "40 of tieredkv's 50 requests" in control["measured"]
    assert judged["verdict"] == "FAIL"
    ok = judging.judge(_run(37, 35, control_served=48), P, _prompts())  # 96 %: in flight at the end
    assert next(c for c in ok["checks"] if c["check"].startswith("control server"))["verdict"] == "PASS"


def test_a_control_without_samples_leaves_the_rss_rule_undecided():
    """A control that was started but never sampled: RSS is not judged without it (n/a, which
    is no pass), and the report does not say no control ran."""
    run = _run(37, 35)
    for sample in run.samples:
        for key in ("control_rss_bytes", "control_rss_by_process", "rss_excess_bytes"):
            sample.pop(key)
    judged = judging.judge(run, P, _prompts())
    assert judged["leaks"]["rss_excess_bytes"]["verdict"] == "n/a"
    assert judged["leaks"]["rss_bytes"]["limit"] == 64 * MiB  # the cap still applies
    assert judged["verdict"] == "FAIL"


def test_per_process_slopes_place_the_growth_in_the_worker():
    run = _run(37, 35)
    slopes = judging.judge(run, P, _prompts())["rss_slopes_by_process"]
    assert slopes["tieredkv"]["VLLM::Worker"] == pytest.approx(37 * MiB)
    assert slopes["tieredkv"]["api_server"] == pytest.approx(0.0, abs=1.0)
    assert slopes["control"]["VLLM::Worker"] == pytest.approx(35 * MiB)


def test_tree_usage_sums_rss_per_kind_of_process():
    """A real process tree: the root counted as the API server, a child titled like vLLM's
    worker under its title, another child under its name."""
    script = ("import subprocess, time\n"
              "subprocess.Popen(['bash', '-c', 'exec -a VLLM::Worker sleep 30'])\n"
              "subprocess.Popen(['sleep', '30'])\n"
              "time.sleep(30)\n")
    root = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    expected = {"api_server", "VLLM::Worker", "sleep"}
    try:
        deadline = time.monotonic() + 10
        while True:  # until bash has exec'd under its new title (a loaded box can be slow)
            usage = probes.tree_usage(root.pid)
            if set(usage["rss_by_process"]) == expected or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        os.killpg(root.pid, signal.SIGKILL)
        root.wait()
    by = usage["rss_by_process"]
    assert set(by) == expected and usage["processes"] == 3, usage
    assert sum(by.values()) == usage["rss_bytes"] and all(v > 0 for v in by.values())


def _payload(judged: dict, run: Run, *, with_control: bool) -> dict:
    return {
        "benchmark": "soak", "profile": "full", "started": "now", "git": "abc",
        "machine": {"name": "test box"}, "allocator": "tcmalloc",
        "params": {**P, "seed": 0, "faults": True}, "model": soak.MODEL, "working_set_chunks": 70,
        "chunk_bytes": 1 << 20, "disk_slots": 64, "warmup_end_s": 600.0,
        "control_flags": ["--dtype", "float32", "--enable-prefix-caching"] if with_control else None,
        "control_requests": len(run.control_records),
        "control_pacing": "one slot per client" if with_control else None,
        "own_rss_cap": {"per_hour": 64 * MiB, "rise": 128 * MiB} if with_control else None,
        "summary": judged["summary"], "checks": judged["checks"], "verdict": judged["verdict"],
        "failures": run.failures, "leaks": judged["leaks"], "leaks_info": judged["leaks_info"],
        "rss_slopes_by_process": judged["rss_slopes_by_process"],
        "tieredkv_counters": judged["counters"], "samples": run.samples,
    }


def test_report_states_the_kv_size_and_the_control(tmp_path, monkeypatch):
    monkeypatch.setattr(report.common, "plot_panels", lambda path, *a, **k: path)
    run = _run(37, 35)
    _, md, _ = report.write_outputs(_payload(judging.judge(run, P, _prompts()), run, with_control=True),
                                    tmp_path, "soak-full")
    text = md.read_text()
    assert "**4,096 bytes (4 KiB) of KV per token**" in text
    assert "**Control.**" in text and "`--dtype float32 --enable-prefix-caching`" in text
    assert "`VLLM::Worker` +37.0" in text and "`VLLM::Worker` +35.0" in text
    assert "| RSS above the control's (MiB) |" in text and "info (FAIL on its own)" in text
    assert "slope 35/h > 16/h" in text  # the control's, in MiB as the table is, not raw bytes
    assert "waiting before its next request while its pair still held the last" in text
    assert "under a looser cap (64 MiB/h; a 128 MiB climb on a short run)" in text
    run = _run(37, None)
    _, md, _ = report.write_outputs(_payload(judging.judge(run, P, _prompts()), run, with_control=False),
                                    tmp_path, "soak-x")
    assert "No control server ran" in md.read_text()


@pytest.mark.parametrize("name", ["soak.json", "soak-full.json"])
def test_a_kept_run_is_rendered_again_from_its_json(tmp_path, monkeypatch, name):
    """``--from-json`` writes the Markdown again under the file's own name, nothing run; a file
    from before the control existed renders and now states its KV bytes per token."""
    monkeypatch.setattr(report.common, "plot_panels", lambda path, *a, **k: None)  # no figure here
    src = tmp_path / "in" / name
    src.parent.mkdir()
    shutil.copy(REPO / "benchmarks" / "results" / name, src)
    out = tmp_path / "out"
    assert soak.main(["--from-json", str(src), "--out", str(out)]) == 0
    md = (out / name.replace(".json", ".md")).read_text()
    assert "**4,096 bytes (4 KiB) of KV per token**" in md
    kept = json.loads(src.read_text())
    assert kept["verdict"] in md
    if "control_pacing" not in kept and kept.get("leaks_info"):  # kept before f4a59b9: as it ran
        assert "through an unbounded queue per client" in md and "predates the own-RSS cap" in md
    # The stamp still names the run the figures came from, and says the text is new.
    stamp_line = next(x for x in md.splitlines() if x.startswith("> Stamped by"))
    assert f"commit `{kept['stamp']['commit'][:10]}`" in stamp_line
    assert "Text re-rendered from the run's JSON (`--from-json`) at commit" in stamp_line


class _FakeServer:
    """Stands for a vLLM server process: a URL, a live pid, a stop()."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.proc = SimpleNamespace(pid=os.getpid(), poll=lambda: None, returncode=None)
        self.log_path = Path("/dev/null")
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True


def _fake_run(monkeypatch, tmp_path, *, control_fails_after: int | None = None, duration_s: float = 2.0,
              request_s: tuple[float, float] = (0.02, 0.005),
              control_error: Exception | None = None) -> tuple[Run, dict]:
    """run_soak with every server, request and probe replaced by fakes (the pairing, the
    sampler's excess and the shutdown are what is under test, not vLLM)."""
    calls: dict[str, list] = {"tkv": [], "ctl": [], "ref": []}
    lock = threading.Lock()

    def stream(url, prompt, max_tokens, timeout):
        with lock:
            calls[url].append(prompt[0])
            n_ctl = len(calls["ctl"])
        if url == "ctl" and control_fails_after is not None and n_ctl > control_fails_after:
            raise control_error or OSError("connection refused")
        time.sleep(request_s[1] if url == "ctl" else request_s[0])  # (tieredkv, control) seconds
        return 0.001, [prompt[0], prompt[0]]

    def usage(pid):
        return {"rss_bytes": 2000 * MiB, "open_fds": 10, "threads": 5, "processes": 3,
                "rss_by_process": {"api_server": 500 * MiB, "VLLM::Worker": 1500 * MiB}}

    monkeypatch.setattr(runner, "start_servers", lambda servers, parallel, progress, envs=None: [None] * len(servers))
    monkeypatch.setattr(runner, "stream_completion", stream)
    monkeypatch.setattr(runner, "tree_usage", usage)
    monkeypatch.setattr(runner, "scrape", lambda url: "")
    monkeypatch.setattr(runner, "health", lambda url: True)
    monkeypatch.setattr(runner, "read_manifest", lambda path: {})
    monkeypatch.setattr(runner, "idle_state", lambda url, chunk, timeout: {"pinned_host_slots": 0})
    p = {**P, "duration_s": duration_s, "clients": 2, "sample_every_s": 0.1, "fault_every_s": 999.0,
         "request_timeout_s": 5.0}
    prompts = [[i] * 8 for i in range(6)]
    servers = {"ref": _FakeServer("ref"), "tkv": _FakeServer("tkv"), "ctl": _FakeServer("ctl")}
    progress = SimpleNamespace(advance=lambda *a, **k: None, close=lambda: None)
    t0 = time.monotonic()
    run = runner.run_soak(servers["ref"], servers["tkv"], prompts, p, seed=0, faults_on=False,
                          disk_path=tmp_path, chunk_bytes=1 << 20, progress=progress, control=servers["ctl"])
    return run, {"wall_s": time.monotonic() - t0, "servers": servers, "calls": calls}


def test_the_control_is_sent_each_clients_prompts_in_order_and_everything_stops(monkeypatch, tmp_path):
    run, seen = _fake_run(monkeypatch, tmp_path)
    assert seen["wall_s"] < 2.0 + 6.0, "the load did not end near its deadline"
    assert all(s.stopped for s in seen["servers"].values())
    assert run.with_control and not run.control_lost and not run.failures
    assert len(run.records) > 20
    for client in (0, 1):
        sent = [r["prompt"] for r in run.records if r["client"] == client]
        served = [r["prompt"] for r in run.control_records if r["client"] == client]
        assert served == sent[:len(served)] and len(served) >= len(sent) - 2  # same order, none extra
    assert all(r["lag_s"] >= 0 for r in run.control_records)
    assert run.samples and all(s["rss_excess_bytes"] == 0 for s in run.samples)
    assert all("control_rss_by_process" in s for s in run.samples)


def test_a_slower_control_holds_tieredkvs_clients_back(monkeypatch, tmp_path):
    """The control takes six times as long per request: each tieredkv client waits for its
    control pair, so it never runs more than two requests ahead (one queued, one in flight)."""
    run, _ = _fake_run(monkeypatch, tmp_path, request_s=(0.005, 0.03))
    for client in (0, 1):
        sent = len([r for r in run.records if r["client"] == client])
        served = len([r for r in run.control_records if r["client"] == client])
        assert 10 < sent <= served + 2, (sent, served)
    assert not run.failures


@pytest.mark.parametrize("error", [OSError("connection refused"), KeyError("choices")],
                         ids=["refused", "malformed-answer"])
def test_a_lost_control_ends_the_run_and_says_so(monkeypatch, tmp_path, error):
    """Any failure of the control's request, not only a network error, ends the run: a pair
    thread that died silently would hold its tieredkv client back until the deadline."""
    run, seen = _fake_run(monkeypatch, tmp_path, control_fails_after=5, duration_s=30.0, control_error=error)
    assert run.control_lost and seen["wall_s"] < 15.0, "the run went on without its baseline"
    assert any(f.startswith("control server stopped answering") for f in run.failures)
    judged = judging.judge(run, {**P, "duration_s": 30.0}, [[i] * 8 for i in range(6)])
    assert judged["verdict"] == "FAIL"
    control = next(c for c in judged["checks"] if c["check"].startswith("control server"))
    assert control["verdict"] == "FAIL"
