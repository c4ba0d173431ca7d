"""Smoke test of benchmarks.serve_bench and benchmarks.soak: imports and pure helpers.

No vLLM server is started; everything here runs in well under a second.
"""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

from benchmarks import common, soak
from benchmarks.endurance import judging as soak_judging
from benchmarks.endurance import probes as soak_probes
from benchmarks.endurance import report as soak_report
from benchmarks.endurance import workload as soak_workload
from benchmarks.serve import judging, workload
from tieredkv.disk.format import payload_offset, slab_path, slot_stride

# ---------------------------------------------------------------------------- serve_bench


def test_workload_is_deterministic_and_shaped():
    spec = workload.ChatWorkload(system_tokens=64, user_tokens=16, reply_tokens=4, turns=3, seed=7)
    a = workload.make_conversations(spec, 4)
    b = workload.make_conversations(spec, 4)
    assert a == b
    assert [c.user for c in a] == [0, 1, 2, 3]
    assert all(len(c.user_texts) == 3 and all(len(t) == 16 for t in c.user_texts) for c in a)
    assert len({c.user_texts for c in a}) == 4  # users differ
    assert workload.make_conversations(spec, 2)[0] != a[0]  # levels get fresh conversations
    random.seed(99)  # the global generator's state does not matter: the spec's seed does
    assert workload.system_prompt(spec) == workload.system_prompt(
        workload.ChatWorkload(system_tokens=64, user_tokens=16, reply_tokens=4, turns=3, seed=7))
    assert workload.system_prompt(spec) != workload.system_prompt(
        workload.ChatWorkload(system_tokens=64, user_tokens=16, reply_tokens=4, turns=3, seed=8))
    assert len(workload.system_prompt(spec)) == 64
    other = workload.ChatWorkload(system_tokens=64, user_tokens=16, reply_tokens=4, turns=3, seed=8)
    assert workload.make_conversations(other, 1) != workload.make_conversations(spec, 1)
    think = [t for c in a for t in c.think_s]
    assert all(0 <= t <= 3 * spec.think_mean_s for t in think)
    assert all(lo <= tok < hi for c in a for text in c.user_texts for tok in text
               for lo, hi in [workload.VOCAB])


def test_prompt_lengths_and_device_sizing():
    spec = workload.ChatWorkload(system_tokens=1024, user_tokens=192, reply_tokens=32, turns=4)
    assert spec.prompt_tokens(0) == 1024 + 192
    assert spec.prompt_tokens(3) == 1024 + 4 * 192 + 3 * 32
    assert spec.conversation_tokens() == spec.prompt_tokens(3) + 32
    blocks = workload.conversation_blocks(spec, 32)
    assert blocks == math.ceil(spec.conversation_tokens() / 32)
    # The system prompt's 32 full blocks are shared by every user.
    assert workload.working_set_blocks(spec, 1, 32) == blocks
    assert workload.working_set_blocks(spec, 3, 32) == 32 + 3 * (blocks - 32)
    n = workload.device_blocks(spec, 2, 32)
    assert not workload.exceeds_device(spec, 1, n, 32)
    assert not workload.exceeds_device(spec, 2, n, 32)
    assert workload.exceeds_device(spec, 3, n, 32)
    assert workload.exceeds_device(spec, 4, n, 32)
    assert workload.chunks_of(spec, 1, 256) == spec.prompt_tokens(3) // 256
    assert common.kv_bytes_per_token({"hidden_size": 256, "num_layers": 4, "num_heads": 4,
                                      "num_kv_heads": 2}, 4) == 4096
    assert common.kv_bytes_per_token(workload.MODEL, workload.DTYPE_BYTES) == 4096
    assert common.kv_bytes_per_token(soak_workload.MODEL, soak_workload.DTYPE_BYTES) == 4096


def test_percentile_math():
    p = judging.percentile
    assert math.isnan(p([], 50))
    assert p([5.0], 99) == 5.0
    assert p([1, 2, 3, 4], 50) == 2.5
    assert p(list(range(101)), 99) == pytest.approx(99.0)
    assert p([10, 0], 0) == 0 and p([10, 0], 100) == 10
    assert p([1, 2], 99) == pytest.approx(1.99)


def test_level_summary_and_hit_rates():
    recs = [
        {"ok": True, "turn": 0, "ttft_s": 0.2, "prompt_tokens": 100, "output": [1, 2]},
        {"ok": True, "turn": 1, "ttft_s": 0.4, "prompt_tokens": 200, "output": [1, 2]},
        {"ok": False, "turn": 2, "prompt_tokens": 300, "error": "x"},
    ]
    s = judging.level_summary(recs, 2.0)
    assert s["completed"] == 2 and s["errors"] == 1
    assert s["ttft_p50_s"] == pytest.approx(0.3)
    assert s["ttft_p50_warm_s"] == pytest.approx(0.4)
    assert s["requests_per_s"] == pytest.approx(1.0)
    assert s["output_tokens_per_s"] == pytest.approx(2.0)
    assert s["prompt_tokens_per_s"] == pytest.approx(150.0)
    before = "\n".join([
        "# HELP vllm:prefix_cache_hits_total x",
        'vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 10.0',
        'vllm:tieredkv_hit_tokens_total{engine="0",model_name="tiny",tier="host"} 0.0',
        'vllm:tieredkv_hit_tokens_total{engine="0",model_name="tiny",tier="disk"} 5.0',
    ])
    after = "\n".join([
        'vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 110.0',
        'vllm:tieredkv_hit_tokens_total{engine="0",model_name="tiny",tier="host"} 50.0',
        'vllm:tieredkv_hit_tokens_total{engine="0",model_name="tiny",tier="disk"} 30.0',
        'vllm:external_prefix_cache_hits_total{engine="0",model_name="tiny"} 75.0',
    ])
    h = judging.hit_rates(before, after, 300)
    assert h["device_rate"] == pytest.approx(100 / 300)
    assert h["tieredkv_host_rate"] == pytest.approx(50 / 300)
    assert h["tieredkv_disk_rate"] == pytest.approx(25 / 300)
    assert h["connector_rate"] == pytest.approx(75 / 300)
    assert judging.metric_sum(after, "vllm:tieredkv_hit_tokens_total") == 80.0
    assert judging.metric_sum(after, "vllm:tieredkv_hit_tokens") == 0.0  # no prefix matches


def test_judge_targets():
    def r(p50):  # three repeats, +-5 % apart
        return [{"ttft_p50_s": p50 * f} for f in (0.95, 1.0, 1.05)]

    results = {
        "no_cache": {1: r(1.0), 4: r(2.0)},
        "prefix_cache": {1: r(0.2), 4: r(0.9)},
        "tieredkv_host": {1: r(0.2), 4: r(0.5)},
        "tieredkv_disk": {1: r(0.2), 4: r(1.2)},
    }
    rows = judging.judge(results, [4])
    by = {(x["config"], x["target"].split()[4]): x["verdict"] for x in rows}
    assert len(rows) == 4
    assert by[("tieredkv_host", "better")] == "PASS"  # 4x
    assert by[("tieredkv_disk", "better")] == "FAIL"  # 1.67x
    assert [x["verdict"] for x in rows if "every" in x["target"]] == ["PASS", "FAIL"]
    missing = judging.judge({"no_cache": {}, "tieredkv_host": {4: r(0.5)}}, [4])
    assert {x["verdict"] for x in missing} == {"n/a"}


# ---------------------------------------------------------------------------- soak


def test_pool_and_zipf():
    pool = soak_workload.make_pool(0, 8, 2, 64, (32, 96))
    assert pool == soak_workload.make_pool(0, 8, 2, 64, (32, 96))
    assert len(pool) == 8 and all(96 <= len(x) <= 160 for x in pool)
    assert pool[0][:64] == pool[2][:64] and pool[0][:64] != pool[1][:64]
    w = soak_workload.zipf_weights(5, 1.0)
    assert sum(w) == pytest.approx(1.0) and w == sorted(w, reverse=True)
    choose = soak_workload.ZipfChooser(10, 1.1, "x")
    picks = [choose() for _ in range(5000)]
    assert set(picks) <= set(range(10))
    counts = sorted((picks.count(i) for i in range(10)), reverse=True)
    assert counts[0] > 3 * counts[-1]  # skewed
    assert picks.count(choose.order[0]) == counts[0]  # the hottest is rank 1
    again = soak_workload.ZipfChooser(10, 1.1, "x")
    assert [again() for _ in range(100)] == picks[:100]
    # Two prompts sharing a 64-token prefix with 32-token chunks: 2 shared chunks.
    a, b = [1] * 64 + [2] * 64, [1] * 64 + [3] * 64
    assert soak_workload.working_set_chunks([a, b], 32) == 2 + 2 + 2
    assert soak_workload.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert soak_workload.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert soak_workload.first_difference([1, 2, 3], [1, 2]) == 2


def _series(fn, n=60, period=5.0):
    ts = [i * period for i in range(n)]
    return ts, [fn(t) for t in ts]


def test_leak_check_flat_noisy_and_plateau_pass():
    rnd = random.Random(1)
    rule = soak_judging.LeakRule(per_hour=16, rise=32)
    ts, ys = _series(lambda t: 2000 + rnd.uniform(-5, 5), n=400, period=10.0)  # 66 min, noise only
    res = soak_judging.leak_check(ts, ys, rule, warmup_s=600)
    assert res["verdict"] == "PASS" and res["mode"] == "hourly"
    # Fast growth during the warm-up, then a plateau: not a leak.
    ts, ys = _series(lambda t: min(2000.0, 1000 + 2 * t), n=400, period=10.0)
    assert soak_judging.leak_check(ts, ys, rule, warmup_s=600)["verdict"] == "PASS"


def test_leak_check_hourly_rule_bites_on_slow_growth():
    """20 units/h over an hour: a 16/h limit fails it, though it climbs less than the rise."""
    rule = soak_judging.LeakRule(per_hour=16, rise=32)
    ts, ys = _series(lambda t: 2000 + 20 * t / 3600, n=400, period=10.0)
    res = soak_judging.leak_check(ts, ys, rule, warmup_s=600)
    assert res["verdict"] == "FAIL" and res["mode"] == "hourly"
    assert res["slope_per_h"] == pytest.approx(20.0)
    assert "/h" in res["reason"]
    ok = soak_judging.leak_check(*_series(lambda t: 2000 + 12 * t / 3600, n=400, period=10.0), rule, warmup_s=600)
    assert ok["verdict"] == "PASS" and ok["slope_per_h"] == pytest.approx(12.0)


def test_leak_check_short_run_judges_the_climb():
    rule = soak_judging.LeakRule(per_hour=16, rise=32)
    ts, ys = _series(lambda t: 2000 + 2.0 * t)  # +600 over 300 s
    res = soak_judging.leak_check(ts, ys, rule, warmup_s=60)
    assert res["verdict"] == "FAIL" and res["mode"] == "short run"
    assert res["slope_per_s"] == pytest.approx(2.0)
    assert res["climb"] == pytest.approx(2.0 * res["span_s"])
    assert "climbs" in res["reason"]
    # The same slope as the hourly failure above climbs too little to judge on a short run.
    slow = soak_judging.leak_check(*_series(lambda t: 2000 + 20 * t / 3600), rule, warmup_s=60)
    assert slow["verdict"] == "PASS" and slow["mode"] == "short run"


def test_leak_check_late_step_fails_on_ceiling():
    rule = soak_judging.LeakRule(per_hour=1, rise=2)
    ts, ys = _series(lambda t: 100 if t < 280 else 130)  # a jump in the last samples
    res = soak_judging.leak_check(ts, ys, rule, warmup_s=60)
    assert res["verdict"] == "FAIL" and "last-quarter" in res["reason"]


def test_leak_check_undecided_is_not_a_pass():
    rule = soak_judging.LeakRule(per_hour=1, rise=1)
    assert soak_judging.leak_check([0, 1, 2], [1, 1, 1], rule, warmup_s=0)["verdict"] == "n/a"
    assert soak_judging.leak_check([], [], rule, warmup_s=0)["verdict"] == "n/a"
    # Everything inside the warm-up: nothing to judge.
    assert soak_judging.leak_check(*_series(lambda t: 1.0), rule, warmup_s=1e6)["verdict"] == "n/a"
    assert soak_judging.lsq_slope([0, 1, 2, 3], [1, 3, 5, 7]) == pytest.approx(2.0)
    assert soak_judging.lsq_slope([1, 1], [0, 5]) == 0.0


def test_rss_rule_is_16_mib_per_hour():
    assert soak_judging.LEAK_RULES["rss_bytes"].per_hour == 16 * soak_workload.MiB
    assert all(p["warmup_s"] > 0 for p in soak_workload.PROFILES.values())
    assert soak_workload.PROFILES["full"]["duration_s"] - soak_workload.PROFILES["full"]["warmup_s"] >= \
        soak_judging.LEAK_RULES["rss_bytes"].judge_span_s


def test_flip_payload_bytes(tmp_path):
    payload = 8192
    stride = slot_stride(payload)
    slab = slab_path(tmp_path, 0)
    slab.write_bytes(bytes(3 * stride))
    offsets = soak_probes.flip_payload_bytes(slab, 1, stride, payload, 16, random.Random(0))
    data = slab.read_bytes()
    changed = [i for i, b in enumerate(data) if b]
    assert len(offsets) == 16 and len(changed) == 16
    base = payload_offset(1, stride)
    assert all(base <= i < base + payload for i in changed)  # payload of slot 1 only
    assert changed == [base + o for o in offsets]


def test_leak_rules_cover_every_plotted_series():
    """Every series in the report has a rule (the control's RSS is judged by the RSS rule)."""
    assert set(soak_judging.LEAK_RULES) == set(soak_report.SERIES_UNITS) - {"control_rss_bytes"}


def test_pool_without_shared_prefixes_and_idle_verdict():
    pool = soak_workload.make_pool(0, 4, 0, 64, (32, 40))
    assert all(32 <= len(x) <= 40 for x in pool)
    assert soak_judging.idle_verdict({})[0] == "FAIL"
    assert soak_judging.idle_verdict({"error": "x"}) == ("FAIL", "x")
    zero = {"pinned_host_slots": 0, "jobs_in_flight": 0, "host_slots_in_flight": 0,
            "requests_waiting_on_load": 0}
    assert soak_judging.idle_verdict(zero)[0] == "PASS"
    assert soak_judging.idle_verdict({**zero, "pinned_host_slots": 3})[0] == "FAIL"


def test_root_cause_finds_the_engine_error(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(
        "(APIServer pid=1) WARNING ValueError: Tokenizer not available when `skip_tokenizer_init=True`\n"
        "(EngineCore pid=2) ERROR [core.py:1512] KeyError: 'tieredkv: host tier: key ab is already present'\n"
        "(APIServer pid=1) ERROR vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n"
    )
    assert soak_probes.root_cause(log) == "KeyError: 'tieredkv: host tier: key ab is already present'"
    assert soak_probes.root_cause(tmp_path / "missing.log") is None


def test_soak_results_name():
    """The full profile is kept as soak-full.* (a run once wrote soak-spills_dropped.*: the
    name was taken from a variable a later loop reused)."""
    assert soak_report.results_name(None, False) == "soak"
    assert soak_report.results_name(None, True) == "soak-full"
    assert soak_report.results_name("single-client", False) == "soak-single-client"


@pytest.mark.parametrize(("args", "name"), [
    ([], "soak"), (["--full"], "soak-full"), (["--label", "single-client"], "soak-single-client"),
    (["--full", "--label", "x"], "soak-x"),
])
def test_soak_writes_its_results_under_the_profiles_name(tmp_path, monkeypatch, args, name):
    """The whole of soak.main after the servers' run, its leak table (series named like
    ``spills_dropped``) printed before the files are named; no server starts."""
    import tieredkv.tools.tiny_model as tiny_model

    written: list[str] = []

    def write_outputs(payload, out_dir, out_name):
        written.append(out_name)
        return out_dir / f"{out_name}.json", out_dir / f"{out_name}.md", None

    run = SimpleNamespace(failures=[], manifest={}, samples=[], records=[], idle={}, faults=[],
                          control_records=[])
    judged = {"leaks": {"spills_dropped": {"verdict": "PASS"}, "rss": {"verdict": "PASS"}},
              "leaks_info": {}, "rss_slopes_by_process": {},
              "counters": {}, "checks": [], "verdict": "PASS", "summary": {}, "mismatches": 0}
    monkeypatch.setattr(soak, "apply_server_env", lambda: {})
    monkeypatch.setattr(soak.common, "preload_tcmalloc", lambda: "tcmalloc")
    monkeypatch.setattr(tiny_model, "make_tiny_llama", lambda path, **kw: path)
    monkeypatch.setattr(soak, "Server", lambda *a, **kw: SimpleNamespace(log_path=tmp_path / "log",
                                                                           extra_args=kw.get("extra_args")))
    monkeypatch.setattr(soak, "run_soak", lambda *a, **kw: run)
    monkeypatch.setattr(soak, "judge", lambda *a: judged)
    monkeypatch.setattr(soak, "write_outputs", write_outputs)
    argv = [*args, "--out", str(tmp_path), "--workdir", str(tmp_path / "w"), "--no-progress"]
    assert soak.main(argv) == 0
    assert written == [name]
