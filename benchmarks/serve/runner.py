"""serve_bench's sweep: repeat by repeat, each configuration's server started alone, warmed
up, its users played level by level and stopped (:func:`sweep`), within a time budget; what
each level measured is summarized as it ends."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.serve.client import run_level, warm_up
from benchmarks.serve.configs import BenchConfig
from benchmarks.serve.judging import hit_rates, level_summary
from benchmarks.serve.servers import start_servers
from benchmarks.serve.workload import Plan, sessions
from tieredkv.tools.vllm_server import Server


@dataclass
class Sweep:
    """What a sweep measured, per configuration: ``runs[config][level]`` the repeats'
    summaries, ``requests`` their records (replies left out), ``replies[config][repeat, level]``
    the replies by (user, turn); ``sent`` every completed prompt's length, ``order`` the run
    order with start times, ``errors`` everything that went wrong."""

    runs: dict[str, dict[int, list[dict[str, Any]]]]
    requests: dict[str, dict[int, list[list[dict[str, Any]]]]]
    replies: dict[str, dict[tuple[int, int], dict[tuple[int, int], list[int]]]]
    sent: list[int] = field(default_factory=list)
    order: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _replies(records: Sequence[Mapping[str, Any]]) -> dict[tuple[int, int], list[int]]:
    return {(r["user"], r["turn"]): list(r.get("output") or []) for r in records if r.get("ok")}


def _load_1m() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return math.nan


def _stop(server: Server, errors: list[str]) -> None:
    try:
        server.stop()
    except Exception as exc:  # noqa: BLE001 - the sweep goes on with the next configuration
        errors.append(f"{server.log_path.stem}: stop failed: {type(exc).__name__}: {exc}")


def sweep(plan: Plan, configs: Sequence[BenchConfig], servers: Sequence[Server],
          envs: Sequence[Mapping[str, str] | None], *, progress: Any, budget_s: float,
          started_wall: float, prof: Mapping[str, Any],
          reset: Callable[[BenchConfig], None] | None = None) -> Sweep:
    """Play :func:`sessions`: for each (repeat, configuration) start that configuration's
    server alone (``reset(config)`` first: a fresh tier state every repeat), warm it up, play
    every level, stop it. Only the server being measured runs, so the others' idle loops do
    not share its cores. A configuration whose server fails to start is not tried again."""
    spec, repeats, levels = plan.spec, plan.repeats, plan.levels
    per_session = sum(levels) * spec.turns
    out = Sweep({c.name: {} for c in configs}, {c.name: {} for c in configs}, {c.name: {} for c in configs})
    errors = out.errors
    by_name = {c.name: (c, server, env) for c, server, env in zip(configs, servers, envs, strict=True)}
    broken: set[str] = set()
    try:
        for repeat, name in sessions(repeats, [c.name for c in configs]):
            config, server, env = by_name[name]
            left = budget_s - (time.monotonic() - started_wall)
            if name in broken or left < 60:
                if name not in broken:
                    errors.append(f"{name} repeat {repeat}: skipped, time budget ({budget_s:.0f}s) spent")
                progress.advance(per_session + 1)
                continue
            if reset is not None:
                reset(config)
            progress.set_label(f"{name}: starting (repeat {repeat + 1}/{repeats})")
            (err,) = start_servers([server], False, progress, envs=[env])
            if err is not None:
                errors.append(f"{name}: server did not start ({err}); log {server.log_path}")
                broken.add(name)
                progress.advance(per_session + 1)
                continue
            try:
                try:
                    warm_up(server.url)
                except (OSError, RuntimeError, ValueError) as exc:
                    errors.append(f"{name} repeat {repeat}: warm-up request failed ({exc}); log {server.log_path}")
                    progress.advance(per_session + 1)
                    continue
                progress.advance(1)
                for level in levels:
                    _measure(plan, out, server, name, repeat, level, progress, budget_s, started_wall, prof)
            finally:
                _stop(server, errors)
    finally:
        for server in servers:  # a server left up by an interrupted session
            if server.proc is not None and server.proc.poll() is None:
                _stop(server, errors)
        progress.close()
    return out


def _measure(plan: Plan, out: Sweep, server: Server, name: str, repeat: int, level: int, progress: Any,
             budget_s: float, started_wall: float, prof: Mapping[str, Any]) -> None:
    """One level on the running server: its users played, its summary and records kept."""
    spec, errors = plan.spec, out.errors
    left = budget_s - (time.monotonic() - started_wall)
    if left < 15:
        errors.append(f"{name} {level} users repeat {repeat}: skipped, time budget ({budget_s:.0f}s) spent")
        progress.advance(level * spec.turns)
        return
    progress.set_label(f"{name}: {level} users, repeat {repeat + 1}/{plan.repeats}")
    before = server.metrics()

    def done(_record: dict[str, Any]) -> None:
        progress.advance(1)

    load_before = _load_1m()
    records, wall = run_level(
        server.url, spec, level, conversations=plan.conversations[level, repeat],
        timeout_s=min(prof["level_timeout_s"], left),
        request_timeout_s=prof["request_timeout_s"], on_done=done,
    )
    progress.advance(level * spec.turns - len(records))
    time.sleep(1.0)  # let the last step's stats reach /metrics
    try:
        after = server.metrics()
    except OSError as exc:
        after = before
        errors.append(f"{name} {level} users repeat {repeat}: /metrics failed: {exc}")
    summary = level_summary(records, wall)
    summary["repeat"] = repeat
    summary["hits"] = hit_rates(before, after, summary["prompt_tokens"])
    summary["ttfts_s"] = [r["ttft_s"] for r in records if r.get("ok")]
    summary["load_1m"] = [load_before, _load_1m()]
    out.runs[name].setdefault(level, []).append(summary)
    out.requests[name].setdefault(level, []).append(
        [{k: v for k, v in r.items() if k != "output"} for r in records])
    out.replies[name][repeat, level] = _replies(records)
    out.sent += [r["prompt_tokens"] for r in records if r.get("ok")]
    out.order.append({"repeat": repeat, "users": level, "config": name, "servers_up": 1,
                      "t_start_s": time.monotonic() - started_wall - wall, "wall_s": wall})
    for r in records:
        if not r.get("ok"):
            errors.append(f"{name} {level} users repeat {repeat}, user {r['user']} turn {r['turn']}: {r['error']}")


def consistency(replies: Mapping[str, Mapping[Any, Mapping[Any, list[int]]]]) -> tuple[str | None, int, int]:
    """(reference, equal, compared): every reply compared with the first configuration's
    (greedy, float32: they should match)."""
    ref = next(iter(replies), None)
    same = total = 0
    if ref is not None:
        for config, per_run in replies.items():
            if config == ref:
                continue
            for run_key, got in per_run.items():
                for key, tokens in got.items():
                    want = replies[ref].get(run_key, {}).get(key)
                    if want is None:
                        continue
                    total += 1
                    same += tokens == want
    return ref, same, total
