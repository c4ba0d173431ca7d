"""Two vLLM replicas behind a round-robin client: a shared remote tier against none.

Workload: serve_bench's multi-turn long-context chat (:class:`benchmarks.serve.workload.ChatWorkload`,
same seeded conversations, think times and streamed greedy completions), with random lengths:
the system prompt is no multiple of the block or the chunk and every user turn is trimmed to
a seeded random length, so prompt lengths are not chunk-aligned. The users of one level chat
at the same time; each level runs ``rounds`` (>= 3) times, with fresh conversations every
run (only the system prompt is shared). **Only the two servers under test run**: round by
round, each configuration's two servers are started (Redis flushed first for the shared one),
play every level and are stopped before the other configuration's start (:func:`sessions`).

Two replicas (``python -m vllm.entrypoints.openai.api_server``, loopback, started with
:class:`tieredkv.tools.vllm_server.Server`) serve every configuration, and the client sends
turn ``t`` of user ``u`` to replica ``(u + t) % 2`` (:func:`replica_for`): round-robin per
conversation, so consecutive turns of one conversation always land on different replicas,
and at any moment the users are split evenly over both. A replica therefore never served the
turn just before, only the one before that.

Configurations (same workload, same seed, same host tier per replica):

1. ``shared_remote``: both replicas with tieredkv's host tier and the same Redis
   (``remote_url``, a real redis-server on loopback): what one replica computed, the other
   can read;
2. ``separate``: both replicas with tieredkv's host tier only, each on its own.

A prompt's tail is in Redis too (a value of its own rows): a hit from the other replica is as
long as vLLM's prefix cache would give.

Figures per configuration and level (and pooled over levels): TTFT p50/p99 (client side, first
streamed token), throughput (requests/s, output and prompt tokens/s over the level's wall time,
think time included), hit rates = tokens / prompt tokens sent, summed over both replicas'
``/metrics``: vLLM's device prefix cache and ``vllm:tieredkv_hit_tokens{tier=host|remote}``;
the ratio shared/separate of TTFT p50 and p99, and a per-request breakdown (client TTFT, the
engine's TTFT, waiting, remote probe, remote read, load, compute, HTTP; each derived as
:mod:`benchmarks.replicas.breakdown` says). Targets, per level: shared TTFT p50 and p99 below
separate's and its hit rate above, each outside the spread of the rounds; where a TTFT target
is missed the report says which part of the breakdown the shared tier adds most to. A missed
target exits 1.
Greedy replies are compared between the configurations (float32: they must agree).

vLLM's CPU build: the "device" KV cache and the host tier share RAM. Not GPU figures.

    python -m benchmarks.multi_replica            # quick: 2, 4, 8 users, 6 turns, 3 rounds (<= 25 min)
    python -m benchmarks.multi_replica --full     # 2..16 users, 8 turns, 3 rounds
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from benchmarks import common, stamps
from benchmarks.replicas.breakdown import derivations
from benchmarks.replicas.judging import (
    checks,
    consistency,
    pool_results,
    shared_vs_separate,
    targets,
)
from benchmarks.replicas.report import load_payload, print_report, write_outputs
from benchmarks.replicas.runner import sweep
from benchmarks.replicas.workload import (
    CONFIG_LABELS,
    CONFIGS,
    FIT_USERS,
    KEY_PREFIX,
    NAME,
    PROFILES,
    REPLICAS,
    default_remote_timeout_s,
    host_bytes_per_replica,
    kv_config,
    level_conversations,
    prompt_lengths,
    replica_cpu_env,
)
from benchmarks.serve.servers import apply_server_env, server_args
from benchmarks.serve.workload import (
    CHUNK_TOKENS,
    DTYPE,
    MODEL,
    ChatWorkload,
    device_blocks,
)
from tieredkv.tools.vllm_server import BLOCK_SIZE, Server

HERE = Path(__file__).resolve().parent


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="the larger profile")
    parser.add_argument("--levels", default=None, help="comma-separated user counts (default: profile's)")
    parser.add_argument("--turns", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None,
                        help="times every level runs, fresh conversations each (default: profile's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--remote-timeout-s", type=float, default=None,
                        help="shared_remote's remote_timeout_s (default: tieredkv's)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop starting new levels after this many seconds (default: profile's)")
    parser.add_argument("--workdir", type=Path, default=None, help="model, logs, Redis (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="results directory")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="only rewrite the Markdown and PNG from an earlier run's JSON")
    args = parser.parse_args(argv)
    if args.from_json is not None:
        return stamps.rewrite_from_json(args.from_json, args.out, load_payload, write_outputs)

    from tieredkv.testing.redis_procs import RedisServer

    started_wall = time.monotonic()
    server_env = apply_server_env()
    profile_name = "full" if args.full else "quick"
    prof = dict(PROFILES[profile_name])
    levels = tuple(int(x) for x in args.levels.split(",")) if args.levels else tuple(prof["levels"])
    spec = ChatWorkload(
        system_tokens=prof["system_tokens"], user_tokens=prof["user_tokens"],
        reply_tokens=prof["reply_tokens"], turns=args.turns or prof["turns"],
        think_mean_s=prof["think_mean_s"], seed=args.seed,
    )
    user_min = prof["user_tokens_min"]
    budget_s = args.budget_s if args.budget_s is not None else prof["budget_s"]
    own_workdir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="tieredkv-multi-replica-")) if own_workdir else args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    num_blocks = device_blocks(spec, FIT_USERS)
    rounds = args.rounds or prof["rounds"]
    host_bytes = host_bytes_per_replica(spec, levels, rounds)
    conversations = {(lv, r): level_conversations(spec, lv, user_min, r) for lv in levels for r in range(rounds)}
    lengths = [n for convs in conversations.values() for c in convs
               for n in prompt_lengths(spec.system_tokens, c, spec.reply_tokens)]
    print(f"[{NAME}] machine: {common.machine_name()}", file=sys.stderr)
    print(f"[{NAME}] workdir {workdir}; device {num_blocks} blocks, host tier {host_bytes >> 20} MiB "
          f"per replica; levels {levels}", file=sys.stderr)

    from tieredkv.tools.tiny_model import make_tiny_llama

    model = make_tiny_llama(workdir / "model", **MODEL)
    redis = RedisServer(workdir / "redis").start()
    atexit.register(redis.stop)  # stopped below; this if the run never gets there
    redis_info = {
        "server": "redis-server " + redis.cli("INFO", "server").split("redis_version:")[1].split()[0],
        "timeout_s": args.remote_timeout_s or default_remote_timeout_s(), "key_prefix": KEY_PREFIX,
    }
    extra = server_args(spec, num_blocks, True)
    servers = {
        config: [Server(model, kv_config(host_bytes, redis.url if config == "shared_remote" else None,
                                         args.remote_timeout_s),
                        workdir / "logs" / f"{config}-{i}.log", extra_args=extra, env=replica_cpu_env(i))
                 for i in range(REPLICAS)]
        for config in CONFIGS
    }
    layout = LAYOUT
    total = len(CONFIGS) * rounds * sum(levels) * spec.turns

    def reset(config: str) -> None:
        """A cold shared tier for every shared_remote session, as the separate replicas'
        host tiers are cold after their restart."""
        if config == "shared_remote":
            redis.cli("FLUSHALL")
    progress = common.Progress(total + 1, "starting", enabled=not args.no_progress)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        done = sweep(servers, spec, conversations, levels, rounds, progress=progress, budget_s=budget_s,
                     started_wall=started_wall, prof=prof, reset=reset)
    finally:
        redis_info["keys_at_end"] = len(redis.cli("--scan", "--pattern", f"{KEY_PREFIX}:*").split())
        redis.stop()
        progress.close()
    errors = done.errors
    results = pool_results(done.full, done.runs, levels)
    agree = consistency(done.replies)
    ratios = shared_vs_separate(results)
    check_rows = checks(results)
    target_rows = targets(results)
    chunk_aligned = sum(1 for n in lengths if n % CHUNK_TOKENS == 0)
    payload = {
        "benchmark": NAME, "profile": profile_name, "started": started,
        "git": common.git_revision(HERE), "machine": common.machine_info(),
        "labels": "CPU-build vLLM: device KV cache and host tier share RAM; no GPU figures",
        "model": MODEL, "dtype": DTYPE, "block_size": BLOCK_SIZE, "chunk_tokens": CHUNK_TOKENS,
        "workload": asdict(spec), "user_tokens_min": user_min, "levels": list(levels),
        "prompt_tokens_range": [min(lengths), max(lengths)], "prompts_planned": len(lengths),
        "chunk_aligned_prompts": chunk_aligned,
        "replicas": REPLICAS, "assignment": "turn t of user u -> replica (u + t) % 2",
        "device_blocks": num_blocks, "host_bytes_per_replica": host_bytes,
        "configs": {c: {"label": CONFIG_LABELS[c], "kv_transfer_config": servers[c][0].kv_config}
                    for c in CONFIGS},
        "server_args": extra, "server_env": server_env, "layout": layout, "redis": redis_info,
        "replica_env": [replica_cpu_env(i) for i in range(REPLICAS)],
        "wall_s": time.monotonic() - started_wall,
        "rounds": rounds, "schedule": done.slots,
        "results": results, "ratios": ratios, "checks": check_rows, "targets": target_rows,
        "breakdown_derivation": derivations(),
        "requests": {c: {f"{lv}:{r}": recs for (lv, r), recs in done.full[c].items()} for c in CONFIGS},
        "consistency": {k: v for k, v in agree.items() if k != "note"},
        "consistency_note": agree["note"],
        "errors": errors,
    }
    json_path, md_path, png_path = write_outputs(payload, args.out)
    print_report(payload)
    print(f"wrote {json_path}, {md_path}" + (f", {png_path}" if png_path else ""), file=sys.stderr)
    if own_workdir and not errors:
        shutil.rmtree(workdir, ignore_errors=True)
    elif errors:
        print(f"logs kept in {workdir / 'logs'}", file=sys.stderr)
    if errors:
        return 2
    missed = any(c["verdict"] == "FAIL" for c in check_rows) or any(t["verdict"] != "PASS" for t in target_rows)
    return 1 if missed else 0


#: How the servers share the machine (recorded in the JSON, printed in the report).
LAYOUT = ("only the two servers under test run: round by round, each configuration's two "
          "servers are started, measured at every level and stopped before the other "
          "configuration's start (order reversed every other round); Redis is flushed before "
          "every shared_remote session, so both start cold")


if __name__ == "__main__":
    sys.exit(main())
