"""The two verdicts and ``gpu_check.md``.

Correctness (bytes and ordering: the CUDA tests, the integration test, the copy check under
the sanitizer) and speed (the overlap timeline, the transfer benchmark's targets) are judged
apart: a missed speed target never turns a correct run into a failure, and only a
correctness failure makes the exit status non-zero. A run the budget cut short, or a machine
that could not run the checks, is ``incomplete``: nothing wrong was found, not everything was
proven. The sanitizer is supplementary (the copy check it repeats proved the bytes): cut short,
it is recorded as ``warn``, which leaves the verdict to the other steps.
"""

from __future__ import annotations

from typing import Any

RUN_STATUSES = ("pass", "fail", "timeout")


def verdicts(steps: list[dict[str, Any]]) -> dict[str, str]:
    """{"correctness": pass | fail | incomplete, "speed": met | missed | incomplete | not judged}."""
    proof = [s for s in steps if s["kind"] == "correctness"]
    setup_failed = any(s["kind"] == "setup" and s["status"] in ("fail", "timeout") for s in steps)
    if any(s["status"] == "fail" for s in proof):
        correctness = "fail"
    elif setup_failed or not any(s["status"] == "pass" for s in proof) or any(
            s["status"] == "timeout" for s in proof):
        correctness = "incomplete"
    else:
        correctness = "pass"
    judged = [s for s in steps if s["kind"] == "speed" and s["status"] in RUN_STATUSES]
    if not judged:
        speed = "not judged"
    elif any(s["status"] == "fail" for s in judged):
        speed = "missed"
    elif any(s["status"] == "timeout" for s in judged):
        speed = "incomplete"
    else:
        speed = "met"
    return {"correctness": correctness, "speed": speed}


def exit_status(steps: list[dict[str, Any]]) -> int:
    return 1 if verdicts(steps)["correctness"] == "fail" else 0


def _mib(n: int) -> str:
    return f"{n / 2**20:g} MiB" if n >= 2**20 else f"{n // 1024} KiB"


def _machine_rows(data: dict[str, Any]) -> list[str]:
    m = data["machine"]
    rows = [f"| device | `{data['device']}`: {m.get('device_name', '?')}"
            + (f", compute capability {m['capability']}, {m.get('gpu_memory_gib')} GiB" if m.get("capability") else "")
            + " |"]
    if data["device"] == "cuda":
        rows += [
            f"| driver | {m.get('driver', '?')} (CUDA driver API {m.get('cuda_driver_api', '?')}) |",
            f"| torch | {m.get('torch', '?')} (CUDA {m.get('torch_cuda', '?')}) |",
            f"| CuPy | {m.get('cupy', 'not installed: ' + str(m.get('cupy_error', '')))} "
            f"(CUDA runtime {m.get('cupy_cuda_runtime', '?')}) |",
        ]
    else:
        rows.append(f"| torch | {m.get('torch', '?')} |")
    commit = data.get("commit")
    commit_text = (f"{commit} (from {data.get('commit_from')})" if commit
                   else "unknown: no .git here; set GPU_CHECK_COMMIT")
    rows += [
        f"| numpy / Python | {m.get('numpy', '?')} / {m.get('python', '?')} |",
        f"| CPU | {m.get('cpu', '?')} ({m.get('cpu_count', '?')} CPUs) |",
        f"| vLLM | {m.get('vllm') or ('hidden (--without-vllm)' if data.get('vllm_hidden') else 'not installed')} |",
        f"| commit | {commit_text} |",
        f"| source digest | `{data.get('source_digest')}` (`python scripts/gpu_check.py --source-digest` on a tree prints its own) |",
        f"| folder to commit | `{data['suggested_dir']}/` |",
    ]
    return rows


def _bench_lines(bench: dict[str, Any]) -> list[str]:
    backends = list(bench["targets_met_by_backend"])
    lines = [
        "", f"## Transfer benchmark ({bench['profile']} profile): {bench.get('device')}", "",
        f"Targets (ratio to one contiguous uint8 copy of the same bytes): {bench.get('targets')}. "
        f"`copy_backend: auto` picks **{bench.get('auto_backend')}** here. Targets met: "
        + ", ".join(f"{b} {v['passed']}/{v['judged']}" for b, v in bench["targets_met_by_backend"].items())
        + ". Full table: `logs/bench.log` in the archive.",
        "",
        "| dir | chunk | batch | contig GB/s | "
        + " | ".join(f"{b} GB/s (ratio)" for b in [*backends, "vllm"]) + " | target | "
        + " | ".join(backends) + " |",
        "|---|---|---|---|" + "---|" * (len(backends) + 1) + "---|" + "---|" * len(backends),
    ]
    for row in bench["rows"]:
        g, r = row["gbps"], row["ratio_to_contig"]
        cells = " | ".join(f"{g[b]:.2f} ({r[b]:.2f})" for b in [*backends, "vllm"] if b in g)
        verdicts_ = " | ".join(row.get("result_by_backend", {}).get(b, "?") for b in backends)
        lines.append(f"| {row['direction']} | {_mib(row['chunk_bytes'])} | {row['batch']} | "
                     f"{g['contig']:.2f} | {cells} | {row.get('target_text') or '-'} | {verdicts_} |")
    return lines


def markdown(data: dict[str, Any]) -> str:
    m = data["machine"]
    lines = [
        f"# tieredkv GPU check: {m.get('device_name', '?')} ({data['date'][:10]})",
        "",
        f"**Correctness: {data['verdict'].upper()}** · speed: {data['speed']} "
        f"(`python scripts/gpu_check.py {' '.join(data['arguments'])}`, {data['seconds']:.0f} s of a "
        f"{data['budget_s']:.0f} s budget)",
        "",
        "| | |",
        "|---|---|",
        *_machine_rows(data),
        "",
        "## Steps",
        "",
        "| step | kind | result | time | detail |",
        "|---|---|---|---|---|",
    ]
    for step in data["steps"]:
        log = f" (`{step['log']}`)" if step.get("log") else ""
        detail = step["detail"].replace("|", "\\|")
        lines.append(f"| {step['name']} | {step['kind']} | **{step['status'].upper()}** | "
                     f"{step['seconds']:.0f} s | {detail}{log} |")
    for name, counts in data["tests"].items():
        if counts["failures"]:
            lines += ["", f"### {name}: failures", ""]
            lines += [f"- `{f}`" for f in counts["failures"][:50]]
        if counts["skip_reasons"]:
            lines += ["", f"### {name}: skipped", ""]
            lines += [f"- {n} x {reason or '(no reason)'}" for reason, n in counts["skip_reasons"].items()]
    timeline = data.get("overlap_timeline")
    if timeline:
        lines += ["", "## d2h / h2d / compute overlap (integration test, CUDA events)", "",
                  "Milliseconds after forward N ended; both copies were queued behind it and ran "
                  "beside forward N+1.", "",
                  "| backend | MiB each way | d2h | h2d | forward N+1 |", "|---|---|---|---|---|"]
        for name, t in timeline.items():
            span = " | ".join(f"{t[k][0]:.2f}-{t[k][1]:.2f}" for k in ("d2h_ms", "h2d_ms", "forward_ms"))
            lines.append(f"| {name} | {t['bytes_each_way'] / 2**20:g} | {span} |")
    if data.get("bench"):
        lines += _bench_lines(data["bench"])
    lines += ["", "Logs, JUnit files, the timeline and the benchmark's JSON: `gpu_check.tar.gz`.", ""]
    return "\n".join(lines)
