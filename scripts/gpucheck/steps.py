"""The check's steps, in order: set-up, correctness (bytes and ordering), speed, and last the
sanitizer run (slow, at most SANITIZER_CAP_S).

Each step records one outcome (pass, fail, timeout, skip, warn or info) with its kind; a
failed or cut-short step never stops the next one. Correctness comes first so that a short
budget spends itself on proof, not on figures; the sanitizer comes last so that a slow one
cuts only itself short.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path

from gpucheck import probe
from gpucheck.common import (
    EXTRA_WHEELS,
    INTEGRATION,
    OVERLAP,
    OWN_KERNELS,
    PER_TEST_TIMEOUT_S,
    ROOT,
    SANITIZER_CAP_S,
    WHEEL_FILL,
    cuda_test_files,
    find_sanitizer,
    parse_junit,
    provenance,
    slug,
)
from gpucheck.runner import Ran, Runner

# Each cap bounds one step that hangs, so that the steps after it still run; the budget
# (default 360 s) bounds the sum. A normal H100 run needs well under each cap; the sanitizer,
# last and slowest, is what a tight budget cuts short (a warning: it is a supplementary check).
CAPS_S = {"environment": 60.0, "wheels": 30.0, "build": 120.0, "cuda-tests": 150.0,
          "integration": 150.0, "copy-check": 60.0, "overlap": 60.0, "bench": 90.0,
          "sanitizer": SANITIZER_CAP_S}


def environment(r: Runner) -> bool:
    """What the machine has; False when nothing can be checked here."""
    start = time.monotonic()
    info = probe.probe(r.python, r.run_env(), r.budget.clip(CAPS_S["environment"]))
    smi, smi_text = probe.nvidia_smi(min(30.0, r.budget.left())) if r.device == "cuda" else ({}, "")
    if smi:
        info["driver"], info["nvidia_smi"] = smi.get("driver"), smi
    if smi_text:
        (r.work / "logs").mkdir(parents=True, exist_ok=True)
        (r.work / "logs" / "nvidia-smi.txt").write_text(smi_text)
    name = (info.get("gpu") or smi.get("name") or "unknown-gpu") if r.device == "cuda" else \
        f"cpu-{info.get('cpu') or probe.cpu_model()}"
    info["device_name"] = name
    r.machine = info
    r.provenance = provenance(r.args.commit)
    r.suggested = f"benchmarks/results/gpu/{slug(name)}-{r.date.strftime('%Y-%m-%d')}"
    if r.out is None:
        r.out = Path(r.env["OUT"]).resolve() if r.env.get("OUT") else ROOT / r.suggested
    found = probe.problems(info, r.device)
    seconds = time.monotonic() - start
    if found:
        status = "timeout" if info.get("probe_timeout") else "fail"
        r.record("environment", "setup", status, "; ".join(found), seconds=seconds)
        return False
    what = (f"{name}, driver {info.get('driver', '?')}, torch {info['torch']} (CUDA "
            f"{info.get('torch_cuda')}), cupy {info.get('cupy', 'not installed')}, numpy "
            f"{info.get('numpy', '?')}, Python {info['python']}" if r.device == "cuda" else
            f"{name}, torch {info['torch']}, numpy {info.get('numpy', '?')}, Python {info['python']}")
    if info.get("vllm"):
        what += f"; vLLM {info['vllm']} importable"
    r.record("environment", "setup", "pass", what, seconds=seconds)
    return True


def wheels(r: Runner) -> None:
    """pytest-timeout from the wheel folder, into a temporary target folder put on PYTHONPATH:
    the machine's own environment is left as it was."""
    missing = [m for m in EXTRA_WHEELS if not r.machine.get(m)]
    if not missing:
        r.record("wheels", "setup", "pass", f"{', '.join(EXTRA_WHEELS.values())} already installed")
        return
    names = [EXTRA_WHEELS[m] for m in missing]
    folder: Path = r.args.wheels
    have = sorted(p.name for p in folder.glob("*.whl")) if folder.is_dir() else []
    if not have:
        r.record("wheels", "setup", "warn",
                 f"{', '.join(names)} missing and no wheels in {folder} (the tests do not need "
                 f"it; without pytest-timeout only each step's time limit bounds a hung "
                 f"test). Fill the folder with: {WHEEL_FILL}")
        return
    target = r.work / "_site"
    cmd = [r.python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input",
           "--no-index", "--no-deps", "--target", str(target), "--find-links", str(folder), *names]
    ran = r.run("wheels", cmd, CAPS_S["wheels"])
    if ran.rc == 0:
        r.pythonpath.append(str(target))  # after the tree: a wheel never shadows tieredkv
        for module in missing:
            r.machine[module] = True
        r.record("wheels", "setup", "pass", f"{', '.join(names)} from {folder} (into a temporary "
                 "folder on PYTHONPATH; nothing installed)", ran)
    else:
        r.record("wheels", "setup", "timeout" if ran.timed_out else "warn",
                 f"could not take {', '.join(names)} from {folder} (exit {ran.rc}); the tests run "
                 f"without them. Fill it with: {WHEEL_FILL}", ran)


def build(r: Runner) -> None:
    """The optional C extension (the CPU copy path), built in place where it is missing."""
    if r.device == "cuda":
        r.record("build", "setup", "skip", "the C extension is the CPU copy path (native backend); "
                 "not used on CUDA, not built")
        return
    if r.machine.get("rowcopy_extension"):
        r.record("build", "setup", "pass", "C extension importable from the tree")
        return
    cmd = [r.python, "setup.py", "-q", "build_ext", "--inplace", "--build-temp", str(r.work / "_build")]
    ran = r.run("build", cmd, CAPS_S["build"])
    ok = ran.rc == 0 and probe.probe(r.python, r.run_env(), r.budget.clip(60.0)).get("rowcopy_extension")
    r.record("build", "setup", "pass" if ok else "timeout" if ran.timed_out else "warn",
             "C extension built in place" if ok else
             f"C extension not built (exit {ran.rc}): the native backend is not checked", ran)


def pytest_step(r: Runner, name: str, kind: str, paths: list[str], marker: str | None,
                keyword: str | None, extra_env: dict[str, str] | None = None) -> None:
    junit = r.work / f"junit-{name}.xml"
    timeout = [f"--timeout={PER_TEST_TIMEOUT_S}"] if r.machine.get("pytest_timeout") else []
    cmd = [r.python, "-m", "pytest", "-v", "-rfEs", "-p", "no:cacheprovider", *timeout,
           *r.pytest_extra, f"--junitxml={junit}", *(["-m", marker] if marker else []),
           *(["-k", keyword] if keyword else []), *paths]
    ran = r.run(name, cmd, CAPS_S[name], extra_env)
    counts = parse_junit(junit) if junit.exists() or not ran.timed_out else _counts_from_log(ran.text(r.work))
    r.tests[name] = counts
    summary = (f"{counts['passed']} passed, {counts['failed']} failed, {counts['errors']} errors, "
               f"{counts['skipped']} skipped")
    if counts["failed"] or counts["errors"]:
        status = "fail"  # found wrong before any cut: a failure, not a timeout
        if ran.timed_out:
            summary += f"; then cut short after {ran.timeout_s:.0f} s"
    elif ran.timed_out:
        status, summary = "timeout", f"cut short after {ran.timeout_s:.0f} s (budget); {summary} so far"
    elif ran.rc == 5 or counts["passed"] == 0:
        status, summary = "fail", f"no test passed (exit {ran.rc}); {summary}"
    else:
        status = "pass" if ran.rc == 0 else "fail"
    r.record(name, kind, status, summary, ran)


def _counts_from_log(text: str) -> dict:
    """Outcomes pytest -v printed before it was stopped (no JUnit file then)."""
    counts: dict = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "skip_reasons": {},
                    "failures": []}
    for test, outcome in re.findall(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)", text, re.M):
        key = {"PASSED": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped"}[outcome]
        counts[key] += 1
        if key in ("failed", "errors"):
            counts["failures"].append(test)
    return counts


def cuda_tests(r: Runner) -> None:
    if r.device != "cuda":
        r.record("cuda-tests", "correctness", "skip", "--device cpu: no CUDA tests")
        return
    files = cuda_test_files()
    if not files:
        r.record("cuda-tests", "correctness", "fail", "no test file marks tests cuda")
        return
    pytest_step(r, "cuda-tests", "correctness", files, "cuda", None)


def integration(r: Runner) -> None:
    """Bytes and ordering on vLLM's layouts; on CUDA the cuda-marked half only."""
    marker = "cuda" if r.device == "cuda" else "not cuda"
    pytest_step(r, "integration", "correctness", [INTEGRATION], marker, f"not {OVERLAP}")


def overlap(r: Runner) -> None:
    """How far d2h, h2d and the next forward overlap on the GPU timeline: a speed check (on
    CPU the same test only checks that both directions complete with the right bytes)."""
    cuda = r.device == "cuda"
    timeline = r.work / "overlap_timeline.json"
    pytest_step(r, "overlap", "speed" if cuda else "correctness", [INTEGRATION],
                "cuda" if cuda else "not cuda", OVERLAP, {"GPU_CHECK_TIMELINE": str(timeline)})
    if timeline.exists():
        try:
            r.timeline = json.loads(timeline.read_text())
        except (OSError, json.JSONDecodeError):
            r.timeline = None
        r.write()


def copy_check(r: Runner) -> None:
    """Every backend's bytes on small caches in vLLM's layouts, directly and through the
    engine's lanes (the run the sanitizer step repeats under memcheck)."""
    ran = r.run("copy-check", _copy_command(r), CAPS_S["copy-check"])
    _judge_copy(r, "copy-check", ran, ran.text(r.work), "plain run")


def sanitizer(r: Runner) -> None:
    """The copy check under compute-sanitizer memcheck, restricted to tieredkv's own kernels,
    with torch's caching allocator off (exact allocations: an overrun is not hidden in a cached
    block) and API-error reports off (torch and CuPy probe the driver and expect errors).
    Last, so a slow sanitizer only cuts itself short."""
    if r.device != "cuda":
        r.record("sanitizer", "correctness", "skip", "--device cpu: no CUDA kernels to check")
        return
    if r.args.no_sanitizer:
        r.record("sanitizer", "correctness", "skip", "--no-sanitizer")
        return
    found = find_sanitizer()
    if not found:
        r.record("sanitizer", "correctness", "skip", "no compute-sanitizer on PATH or in "
                 "/usr/local/cuda/bin (it comes with the CUDA toolkit, not with torch's wheels)")
        return
    cmd = [found, "--tool", "memcheck", "--kernel-name", f"kns={OWN_KERNELS}",
           "--report-api-errors", "no", "--error-exitcode", "99", "--print-limit", "50",
           "--target-processes", "all", *_copy_command(r)]
    ran = r.run("sanitizer", cmd, CAPS_S["sanitizer"], {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"})
    text = ran.text(r.work)
    if _copy_line(text) is None and ran.rc not in (0, 99) and not ran.timed_out:
        r.record("sanitizer", "correctness", "warn", f"compute-sanitizer did not run the copy "
                 f"check (exit {ran.rc}; its options or version? see the log)", ran)
        return
    _judge_copy(r, "sanitizer", ran, text, f"memcheck on {OWN_KERNELS}* kernels")


def _copy_command(r: Runner) -> list[str]:
    return [r.python, "scripts/gpu_check.py", "--copy-check", "--device", r.device]


def _copy_line(text: str) -> str | None:
    last = [line for line in text.splitlines() if line.startswith("copy-check:")]
    return last[-1][len("copy-check:"):].strip() if last else None


def _judge_copy(r: Runner, name: str, ran: Ran, text: str, how: str) -> None:
    errors = re.findall(r"ERROR SUMMARY: (\d+) error", text)
    line = _copy_line(text)
    detail = how + (f", {errors[-1]} memcheck errors" if errors else "") + (f"; {line}" if line else "")
    if (line or "").startswith("FAILED") or ran.rc == 99 or (errors and errors[-1] != "0"):
        status = "fail"
    elif ran.timed_out:
        cut = ("not started: the budget is spent" if ran.timeout_s < 1.0
               else f"cut short after {ran.timeout_s:.0f} s (budget)")
        status, detail = "timeout", f"{detail}: {cut}"
        if name == "sanitizer":  # the copy-check step proved the bytes; memcheck adds to it
            status = "warn"
            detail += ("; the sanitizer is a supplementary check, so this is a warning and "
                       "leaves the correctness verdict to the other steps")
    else:
        status = "pass" if ran.rc == 0 and line is not None else "fail"
        detail += "" if status == "pass" else f" (exit {ran.rc})"
    r.record(name, "correctness", status, detail, ran)


def bench(r: Runner) -> None:
    """The transfer benchmark; every backend that ran is judged against the targets."""
    profile = r.args.bench
    if profile == "none":
        r.record("bench", "speed", "skip", "--bench none")
        return
    json_path = r.work / "transfer_bench.json"
    cmd = [r.python, "-m", "benchmarks.transfer_bench", "--device", r.device, "--json", str(json_path),
           *({"quick": [], "smoke": ["--smoke"], "full": ["--full"]}[profile])]
    ran = r.run("bench", cmd, CAPS_S["bench"])
    try:
        data = json.loads(json_path.read_text())
    except (OSError, json.JSONDecodeError):
        data = None
    if data is None:
        r.record("bench", "speed", "timeout" if ran.timed_out else "fail",
                 f"transfer_bench {'was cut short' if ran.timed_out else f'exited {ran.rc}'} "
                 "without figures", ran)
        return
    by_backend = data.get("targets_met_by_backend", {})
    r.bench = {"profile": profile, "device": data.get("device"), "auto_backend": data.get("auto_backend"),
               "targets": data.get("targets"), "targets_met_by_backend": by_backend,
               "rows": data.get("rows", [])}
    met = ", ".join(f"{b}{' (auto)' if b == data.get('auto_backend') else ''} {v['passed']}/{v['judged']}"
                    for b, v in by_backend.items())
    if r.device != "cuda":
        r.record("bench", "speed", "info", f"{profile} profile; targets met: {met} (CPU figures "
                 "are not judged here: a shared small machine measures mostly its neighbours)", ran)
        return
    r.record("bench", "speed", "pass" if every_backend_met(by_backend) else "fail",
             f"{profile} profile, every backend judged against {data.get('targets')}: {met}", ran)


def every_backend_met(by_backend: dict[str, dict[str, int]]) -> bool:
    """Every backend that was judged met every target (not only the one ``auto`` picks: a
    user may name any of them)."""
    judged = [v for v in by_backend.values() if v["judged"]]
    return bool(judged) and all(v["passed"] == v["judged"] for v in judged)


STEPS: list[tuple[str, Callable[[Runner], None]]] = [
    ("wheels", wheels), ("build", build), ("cuda-tests", cuda_tests), ("integration", integration),
    ("copy-check", copy_check), ("overlap", overlap), ("bench", bench), ("sanitizer", sanitizer),
]
KINDS = {"wheels": "setup", "build": "setup", "cuda-tests": "correctness", "integration": "correctness",
         "copy-check": "correctness", "overlap": "speed", "bench": "speed", "sanitizer": "correctness"}
