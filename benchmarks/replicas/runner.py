"""multi_replica's runner: one level's users played across the two replicas (turn ``t`` of
user ``u`` on replica ``(u + t) % 2``), and the sweep: round by round, each configuration's
two servers started alone, every level played, both stopped."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.replicas.breakdown import per_request
from benchmarks.replicas.judging import aggregate_hits
from benchmarks.replicas.workload import CONFIGS, replica_for, sessions
from benchmarks.serve.client import run_level
from benchmarks.serve.judging import level_summary
from benchmarks.serve.servers import start_servers
from benchmarks.serve.workload import (
    ChatWorkload,
    Conversation,
)
from tieredkv.tools.vllm_server import Server


def run_level_rr(
    urls: Sequence[str],
    spec: ChatWorkload,
    conversations: Sequence[Conversation],
    *,
    timeout_s: float,
    request_timeout_s: float,
    on_done: Any = None,
) -> tuple[list[dict[str, Any]], float]:
    """Play one level's conversations concurrently (one thread per user) against the replicas,
    turn ``t`` of user ``u`` on ``urls[replica_for(u, t)]``; (records, wall s)."""
    return run_level(urls, spec, len(conversations), timeout_s=timeout_s,
                     request_timeout_s=request_timeout_s, on_done=on_done,
                     conversations=conversations, route=replica_for)


def _replies(records: Sequence[Mapping[str, Any]]) -> dict[str, list[int]]:
    return {f"{r['user']}:{r['turn']}": list(r.get("output") or []) for r in records if r.get("ok")}


@dataclass
class Sweep:
    """What the rounds measured, per configuration and (level, round): ``runs`` the summaries,
    ``full`` the requests (greedy replies included), ``replies`` by conversation; ``slots``
    when each run ran and the machine's load then; ``errors`` everything that went wrong."""

    runs: dict[str, dict[tuple[int, int], dict[str, Any]]]
    full: dict[str, dict[tuple[int, int], list[dict[str, Any]]]]
    replies: dict[str, dict[tuple[int, int], dict[str, list[int]]]]
    slots: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def sweep(servers: Mapping[str, Sequence[Server]], spec: ChatWorkload,
          conversations: Mapping[tuple[int, int], Sequence[Conversation]], levels: Sequence[int],
          rounds: int, *, progress: Any, budget_s: float, started_wall: float,
          prof: Mapping[str, Any], reset: Callable[[str], None] | None = None) -> Sweep:
    """Play :func:`sessions`: for each (round, configuration) ``reset(config)`` (a cold
    shared tier), start that configuration's two servers, play every level, stop them. Only
    the two servers under test run during a measurement. A configuration whose servers fail
    to start is not tried again."""
    out = Sweep({c: {} for c in CONFIGS}, {c: {} for c in CONFIGS}, {c: {} for c in CONFIGS})
    runs, full, replies, slots, errors = out.runs, out.full, out.replies, out.slots, out.errors
    broken: set[str] = set()

    def run(config: str, level: int, round_: int) -> None:
        left = budget_s - (time.monotonic() - started_wall)
        if left < 15:
            errors.append(f"{config} {level} users round {round_}: skipped, time budget "
                          f"({budget_s:.0f}s) spent")
            progress.advance(level * spec.turns)
            return
        progress.set_label(f"{config}: {level} users, round {round_}")
        pair = servers[config]
        before = [s.metrics() for s in pair]
        slot = {"config": config, "users": level, "round": round_, "servers_up": len(pair),
                "t_start_s": time.monotonic() - started_wall, "load_1m_start": os.getloadavg()[0]}

        def done(_record: dict[str, Any]) -> None:
            progress.advance(1, f"{config}: {level} users, round {round_}")

        records, wall = run_level_rr(
            [s.url for s in pair], spec, conversations[(level, round_)],
            timeout_s=min(prof["level_timeout_s"], left),
            request_timeout_s=prof["request_timeout_s"], on_done=done,
        )
        progress.advance(level * spec.turns - len(records))
        time.sleep(1.0)  # let the last step's stats reach /metrics
        try:
            after = [s.metrics() for s in pair]
        except OSError as exc:
            after = before
            errors.append(f"{config} {level} users: /metrics failed: {exc}")
        slot.update(wall_s=wall, load_1m_end=os.getloadavg()[0])
        slots.append(slot)
        for r in records:
            r["round"] = round_
        summary = level_summary(records, wall)
        summary["hits"] = aggregate_hits(before, after, summary["prompt_tokens"])
        summary["breakdown"] = per_request(before, after, records)
        runs[config][(level, round_)] = summary
        full[config][(level, round_)] = records
        replies[config][(level, round_)] = _replies(records)
        for r in records:
            if not r.get("ok"):
                errors.append(f"{config} {level} users round {round_}, user {r['user']} turn "
                              f"{r['turn']}: {r['error']}")

    try:
        for round_, config in sessions(rounds):
            per_session = sum(levels) * spec.turns
            if config in broken or budget_s - (time.monotonic() - started_wall) < 60:
                if config not in broken:
                    errors.append(f"{config} round {round_}: skipped, time budget ({budget_s:.0f}s) spent")
                progress.advance(per_session)
                continue
            if reset is not None:
                reset(config)
            pair = servers[config]
            progress.set_label(f"{config}: starting its 2 servers (round {round_})")
            errs = start_servers(pair, True, progress)
            try:
                failed = [(s, e) for s, e in zip(pair, errs, strict=True) if e is not None]
                if failed:
                    errors += [f"{config}: server did not start ({e}); log {s.log_path}" for s, e in failed]
                    broken.add(config)
                    progress.advance(per_session)
                    continue
                for level in levels:
                    run(config, level, round_)
            finally:
                for server in pair:
                    server.stop()
    finally:
        for pair in servers.values():
            for server in pair:
                server.stop()
    return out
