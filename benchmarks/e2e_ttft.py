"""End-to-end TTFT on real vLLM (CPU build): tieredkv hits against recompute, vLLM's own
prefix cache and vLLM's ExampleConnector, on the same model and the same long prompts.

TTFT is the wall time of ``LLM.generate([prompt], SamplingParams(max_tokens=1))``. Two
prompts of lengths that are no multiple of the chunk (quick: 4,000 tokens, and a random length
that is no multiple of the block either) alternate in every row, so each hit ends inside a chunk: tieredkv's hit must
be as long as vLLM's own prefix-cache hit, every block but the one holding the last token
(checked per run; the targets compare rows at equal hit tokens). Rows:

1. ``recompute``: no connector, no prefix caching (the ceiling);
2. ``vllm_prefix``: vLLM's in-memory prefix-cache hit, same prompt twice (the floor);
3. ``example_connector``: vLLM's ExampleConnector hit (safetensors files in a temp dir),
   vLLM's prefix cache reset before every measured run (a row for scale, no target: it is
   vLLM's debug connector);
4. ``tieredkv_host``: a TieredKVConnector hit from the host tier (prefix cache reset before
   every measured run);
5. ``tieredkv_disk``: a hit from the disk tier: the host tier holds exactly one prompt, two
   prompts A and B alternate, so each measured prompt was evicted from host by the other and
   is promoted (read + checksum) from the slab file before it is promised;
6. ``tieredkv_disk_restart``: a fresh engine on the same ``disk_path`` (index recovered from
   the journal), the same alternation;
7. ``tieredkv_slow_disk`` (row 5c; ``--no-slow-disk`` leaves it out): row 5a's tiers with
   every slab read delayed (``TIEREDKV_FAULTS`` ``disk_read_delay_s``, per shape or
   ``--slow-disk-delay``), far slower than recomputing; after a few unmeasured disk hits
   teach the cost model (on, the default), each measured hit must be declined (counted; an
   exploration reads its chunk aside, never on the request's path), so its TTFT is a recompute's
   (before each measured hit a fresh filler prompt of its length takes the host slots: its cold
   run is the hit's same-engine recompute);
8. ``tieredkv_remote`` (row 6 in the table): a hit from the shared remote tier (a real
   redis-server on loopback), the multi-replica case: one engine (replica A: small host
   tier, no disk, ``remote_url``) computes both prompts, which writes their chunks and tails
   to Redis, and exits; a fresh engine (replica B, same Redis, host tier holding one prompt)
   measures, A and B alternating as in the disk rows, so each measured prompt is read from
   Redis. Its hit is as long as the floor's (checked, and ``hit_tokens_remote``);
9. ``tieredkv_slow_remote`` (row 6c; with row 6 only, ``--no-slow-remote`` leaves it out):
   a fresh engine as replica B on replica A's Redis, reached through a throttling loopback
   proxy started by this script (``tieredkv.testing.throttled_proxy``: every 16 KiB block of
   a value it sends back waits, per shape or ``--slow-remote-delay``; probes and writes pass),
   far slower than recomputing; ``remote_timeout_s`` 30 s, so reads are slow, not failed.
   As row 5c: after a few unmeasured remote hits teach the cost model, each measured hit
   (a fresh filler prompt took the host slots first) must be declined (counted, at the probe
   or once it answered), so its TTFT is a recompute's;
10. hybrid rows (``--no-hybrid`` leaves them out), on a Gemma-2-style variant of the same
   model (same hidden size, heads and layers; layers alternate sliding-window attention,
   window ``HYBRID_WINDOW`` = 256 tokens, and full attention), which keeps vLLM's hybrid
   KV-cache manager on: ``hybrid_vllm_prefix`` (vLLM's prefix cache on that model: the
   hybrid floor), ``hybrid_tieredkv_host`` and ``hybrid_tieredkv_disk`` (as rows 4 and 5a:
   the disk row's host tier holds the entries one prompt's hit reads, A and B alternate).
   A hybrid hit is as long as the floor's (a stored prompt's tail keeps the window before
   its end; a prompt ending on a block boundary, as A does in both profiles, also stores the entry one block shorter, where
   its repeat hits), so each tieredkv hit is checked against it (:func:`hybrid_hit`) and
   the tier's hit counter. The window is smaller than the chunk (512
   tokens) so that a sliding layer stores only its last ``ceil((W-1)/block)`` = 8 of a
   chunk's 16 blocks: with a window of a chunk or more, the sliding layers would copy as
   much as full attention and the row would show nothing hybrid-specific;
11. ``lmcache`` (row 7 in the table; ``--no-lmcache`` leaves it out): a real peer, LMCache
   (``benchmarks/peers/lmcache.py``), present when ``.venv-lmcache`` is built
   (``bash benchmarks/peers/lmcache_env.sh``; else the row is skipped with a line saying so).
   Its engine runs with that venv's python (nothing of tieredkv imported or installed there),
   LMCache's documented MP-mode settings: an ``lmcache server`` started by this script with
   the host tier's memory budget of row 4 as its L1 size and LMCache's default chunk of
   ``256`` tokens (LRU, engine-driven transfer over POSIX shared memory, as on vLLM's CPU
   build), and ``LMCacheMPConnector`` in vLLM with the hybrid KV-cache manager off. vLLM's
   prefix cache is on and reset before every measured hit, as in row 4 (LMCache's docs turn
   it off; its connector supports it). LMCache stores whole 256-token chunks only, so its
   hit is chunk-aligned, shorter than the floor's (:func:`lmcache_hit`): it is checked
   against that length (and against the tokens the server logged as retrieved). Beside it,
   ``lmcache_vllm_prefix`` (row 7f): LMCache's own floor, vLLM's prefix-cache hit measured
   in LMCache's environment (its venv, its engine settings, no connector); LMCache's row is
   shown over each floor, its own and tieredkv's.

The targets (:mod:`benchmarks.ttft.targets`), each judged on the worse of its cross-engine
figure (row median over the floor row's median) and its same-engine one (each hit over the
prefix-cache hit of the same prompt in the same engine right after), printed beside its limit:
host hit <= 1.3 x floor; disk hits (5a, 5b) <= 1.3 x (floor + KV / raw disk bandwidth);
remote hit <= 1.5 x floor; slow disk (5c) <= 1.1 x recompute; slow Redis (6c) <= 1.1 x
recompute (for these two: the row median over recompute's, and each hit over the filler of
its length computed cold right before it in the same engine); host hit as a multiple of its
floor <= LMCache's hit as a multiple of LMCache's own floor (the better of LMCache's two
figures; not judged when the LMCache rows are missing); hybrid host hit <= 1.3 x the hybrid
floor. The hybrid disk hit <= 1.3 x (hybrid floor + hybrid KV / raw disk BW) is a reference
line. ``--model-shape 8b-kv`` runs all of it on a model with an 8B-class model's KV bytes per
token (128 KiB: 32 layers x 8 KV heads x 128 head dim, bf16; hidden 256), shorter prompts.

Every configuration runs in its own subprocess (vLLM's worker-side connector is a process
global); the parent orchestrates, measures the raw O_DIRECT read bandwidth of the disk tier's
filesystem, checks the targets and writes ``benchmarks/results/e2e_ttft.{json,md,png}``.
Every hit row is checked through ``RequestOutput.num_cached_tokens`` (and tieredkv's own hit
counters): a hit that did not happen is a FAIL, not a number.

These are CPU-build figures: the "device" KV cache and the host tier are the same RAM, so a
host-tier load is a memcpy, not a PCIe transfer.

    python -m benchmarks.e2e_ttft            # quick profile (4,000 tokens and a random ~4k)
    python -m benchmarks.e2e_ttft --full     # 8,000 tokens and a random ~8k, more repeats
    python -m benchmarks.e2e_ttft --trace    # also a per-step timeline of tieredkv hits
    python -m benchmarks.e2e_ttft --no-remote   # without the remote-tier row (no redis-server needed)
    python -m benchmarks.e2e_ttft --no-hybrid   # without the hybrid-model rows
    python -m benchmarks.e2e_ttft --no-lmcache  # without the LMCache peer rows
    python -m benchmarks.e2e_ttft --no-slow-remote  # without the slow-Redis row (6c)
    python -m benchmarks.e2e_ttft --model-shape 8b-kv  # 128 KiB of KV per token (1,500-token prompts)

The exit status is 1 when a target (its worse-of verdict) fails, or when the remote or a hybrid
row's hits did not happen. The hybrid disk line is a reference only; a target not judged and
the LMCache peer's own hits never set it (a peer's hits that did not happen are printed as such).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import kv_bytes_per_token
from benchmarks.ttft import runner
from benchmarks.ttft.judging import (
    exit_status,
    judge_rows,
    remote_ratios,
    remote_ratios_by_prompt,
)
from benchmarks.ttft.report import print_outcome, print_partial, table_markdown, write_outputs
from benchmarks.ttft.specs import build_specs
from benchmarks.ttft.targets import (
    hybrid_verdicts,
    lmcache_floor_ratios,
    print_lines,
    slow_verdicts,
    verdicts,
)
from benchmarks.ttft.workload import (
    BLOCK_SIZE,
    CHUNK_BLOCKS,
    CHUNK_TOKENS,
    DISK_TARGET,
    DTYPE_BYTES,
    HERE,
    HYBRID_LABELS,
    HYBRID_WINDOW,
    LABELS,
    LMCACHE_BUILD,
    LMCACHE_CONFIG,
    LMCACHE_FLOOR_CONFIG,
    MODEL_SHAPES,
    NAME,
    PROFILES,
    PROMPT_SEED,
    SLOW_DISK_CONFIG,
    SLOW_DISK_LEARNING_HITS,
    SLOW_REMOTE_CONFIG,
    SLOW_REMOTE_TIMEOUT_S,
    TOUCH_TOKENS,
    hybrid_hit,
    hybrid_host_slots,
    hybrid_kv_bytes,
    hybrid_layer_types,
    prefix_hit,
    random_b_length,
    remote_hit,
)

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def parent_main(args) -> int:
    prof = PROFILES[args.profile]
    shape = MODEL_SHAPES[args.model_shape]
    model = shape["model"]
    prompt_tokens = args.prompt_tokens or shape["prompt_tokens"][args.profile]
    args.slow_disk_delay = args.slow_disk_delay or shape["slow_disk_read_delay_s"]
    args.slow_remote_delay = args.slow_remote_delay or shape["slow_remote_delay_s"]
    # Lengths that are no multiple of the chunk: vLLM's prefix cache and
    # ExampleConnector hit every block but the one holding the last token, and so must
    # tieredkv (a whole-chunk hit would stop up to a chunk earlier).
    lengths = {"A": prompt_tokens,
               "B": args.prompt_b_tokens or random_b_length(prompt_tokens, args.prompt_seed)}
    for name, n in lengths.items():
        if n % CHUNK_TOKENS == 0 or n < 2 * CHUNK_TOKENS:
            print(f"prompt {name}: {n} tokens; use a length of at least {2 * CHUNK_TOKENS} "
                  f"that is no multiple of {CHUNK_TOKENS}", file=sys.stderr)
            return 2
    expected_hit = {name: prefix_hit(n) for name, n in lengths.items()}
    expected_remote = {name: remote_hit(n) for name, n in lengths.items()}
    kv_per_token = kv_bytes_per_token(model, DTYPE_BYTES)
    kv_bytes = sum(expected_hit.values()) // len(expected_hit) * kv_per_token
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="tieredkv_e2e_ttft_", dir=args.tmp_root))
    work.mkdir(parents=True, exist_ok=True)
    # One directory per shape: each is reused while its geometry matches.
    model_dir = Path(args.model_dir + ("" if args.model_shape == "tiny" else f"_{args.model_shape}"))
    from tieredkv.tools.tiny_model import make_tiny_llama

    make_tiny_llama(model_dir, **model)
    layer_types = hybrid_layer_types(model["num_layers"])
    expected_hybrid = {name: hybrid_hit(n) for name, n in lengths.items()}
    hybrid_kv = sum(hybrid_kv_bytes(h, model=model)
                    for h in expected_hybrid.values()) // len(expected_hybrid)
    hybrid_info: dict[str, Any] = {
        "window": HYBRID_WINDOW, "layer_types": layer_types,
        "sliding_blocks": min(CHUNK_BLOCKS, -(-(HYBRID_WINDOW - 1) // BLOCK_SIZE)),
        "disk_host_slots": hybrid_host_slots(lengths),
    }
    hybrid_dir = None
    if args.no_hybrid:
        hybrid_info = {"skipped": "--no-hybrid"}
    elif not args.rerender:
        hybrid_dir = Path(f"{model_dir}_hybrid_w{HYBRID_WINDOW}")
        make_tiny_llama(hybrid_dir, **model, sliding_window=HYBRID_WINDOW, layer_types=layer_types)
    only = set(args.only.split(",")) if args.only else None
    if only and {"tieredkv_remote", SLOW_REMOTE_CONFIG} & only:
        only.add("tieredkv_remote_writer")  # replica B and row 6c read what replica A wrote
    if only and LMCACHE_CONFIG in only:
        only.add(LMCACHE_FLOOR_CONFIG)  # LMCache's row is read against its own floor
    remote_info: dict[str, Any] = {}
    redis = None
    if not args.no_remote and not args.rerender and (
            only is None or {"tieredkv_remote", SLOW_REMOTE_CONFIG} & only):
        redis = runner.start_redis(work, remote_info)
    elif args.no_remote:
        remote_info["skipped"] = "--no-remote"
    # Row 7, the LMCache peer: its server (not started yet) and the settings its engine needs.
    lmcache_info: dict[str, Any] = {}
    lmcache_server = None
    if args.no_lmcache:
        lmcache_info["skipped"] = "--no-lmcache"
    elif not args.rerender and (only is None or LMCACHE_CONFIG in only):
        lmcache_server = runner.lmcache_server_for(work, lengths, lmcache_info, model)
    # Row 6c: the same Redis behind a throttling proxy (none with --no-slow-remote).
    slow_proxy = None
    if redis is not None and not args.no_slow_remote and (only is None or SLOW_REMOTE_CONFIG in only):
        slow_proxy = runner.start_slow_proxy(redis, work, args.slow_remote_delay)
    specs = build_specs(args, model_dir, work, lengths, redis.url if redis is not None else None,
                        hybrid_dir, lmcache_info if lmcache_server is not None else None, model,
                        slow_proxy.url if slow_proxy is not None else None)
    if args.no_slow_disk:
        specs.pop(SLOW_DISK_CONFIG, None)
    if only:
        specs = {c: s for c, s in specs.items() if c in only}
    if lmcache_server is not None and LMCACHE_CONFIG in specs:
        lmcache_server = runner.start_lmcache(lmcache_server, specs, lmcache_info)
    if redis is not None:
        remote_info.update(runner.remote_facts(redis, lengths))
    reps = args.repeats or prof["hit_repeats"]
    common.preload_tcmalloc()  # as vLLM's CPU docs ask; every row alike
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONHASHSEED": "0"}
    # Each engine's KV cache is its spec's kv_cache_memory_bytes (4 prompts' KV, at least
    # 256 MiB); vLLM's CPU build lets this legacy variable override it (1 GiB per engine at
    # least), which with a dozen engines alive took nearly all of a 23 GiB machine's RAM.
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    late = [c for c in ("tieredkv_disk_restart", "tieredkv_remote", SLOW_REMOTE_CONFIG) if c in specs]
    progress = common.Progress(runner.progress_steps(specs, reps, late), "raw disk read bandwidth")
    t_start = time.monotonic()
    wall_s = load_end = git = None
    if args.rerender:  # tables and plot again from a kept run's raw results (no engine runs)
        raw = json.loads(Path(args.rerender).read_text())
        disk, results = raw["raw_disk_read"], raw["results"]
        wall_s, load_end = raw.get("wall_s"), raw.get("load_average_end")
        git = raw.get("git")
        remote_info = raw.get("remote") or {"skipped": "not in the kept raw results"}
        lmcache_info = raw.get("lmcache") or {"skipped": "not in the kept raw results"}
        progress.close()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    else:
        try:
            disk, results = runner.measure(
                specs, env, progress, reps=reps, timeout=prof["timeout"], late=late, work=work,
                kv_bytes=kv_bytes, kv_per_token=kv_per_token, redis=redis, remote_info=remote_info,
                lmcache_server=lmcache_server, lmcache_info=lmcache_info, t_start=t_start)
        finally:
            if slow_proxy is not None:
                slow_proxy.close()
            if redis is not None:
                redis.stop()
            if lmcache_server is not None:
                lmcache_server.stop()
            progress.close()
            if not args.keep:
                shutil.rmtree(work, ignore_errors=True)
    results = {c: results[c] for c in {**LABELS, **HYBRID_LABELS} if c in results}
    rows = judge_rows(results, expected_hit, expected_remote, expected_hybrid, lmcache_info)
    if args.only:
        print_partial(rows, expected_hit, remote_info, lmcache_info)
        if "recompute" in rows:  # the slow rows' targets need recompute only
            print("\n".join(print_lines(slow_verdicts(rows))))
        for config in (c for c in results if args.trace and c.startswith("tieredkv")):
            for record in (r for r in results[config]["records"] if r.get("trace")):
                print(f"\n{config} {record['label']}:", *record["trace"], sep="\n  ")
        return 0
    floor = rows["vllm_prefix"]["median_s"]
    import vllm

    payload: dict[str, Any] = {
        "benchmark": NAME,
        "machine": common.machine_info(),
        "vllm": f"vllm-cpu {vllm.__version__}",
        "git": git if args.rerender else common.git_revision(HERE),
        "params": {
            "allocator": os.environ.get("LD_PRELOAD", "glibc malloc"),
            "profile": args.profile, "model_shape": args.model_shape, "model": model,
            "block_size": BLOCK_SIZE,
            "chunk_blocks": CHUNK_BLOCKS, "prompt_lengths": lengths,
            "prompt_seed": args.prompt_seed,
            "expected_hit_tokens": expected_hit, "kv_bytes_per_token": kv_per_token,
            "expected_remote_hit_tokens": expected_remote,
            "expected_hybrid_hit_tokens": expected_hybrid, "hybrid_window": HYBRID_WINDOW,
            "hybrid_kv_bytes": hybrid_kv,
            "kv_bytes": kv_bytes,
            "slow_disk": ({"skipped": "--no-slow-disk"} if args.no_slow_disk else
                          {"disk_read_delay_s": args.slow_disk_delay,
                           "learning_hits": SLOW_DISK_LEARNING_HITS}),
            "slow_remote": ({"skipped": "--no-slow-remote"} if args.no_slow_remote else
                            {"skipped": "needs row 6 (" + remote_info.get("skipped", "not selected") + ")"}
                            if SLOW_REMOTE_CONFIG not in rows else
                            {"proxy_delay_s": args.slow_remote_delay, "block_bytes": 16384,
                             "remote_timeout_s": SLOW_REMOTE_TIMEOUT_S,
                             "learning_hits": SLOW_DISK_LEARNING_HITS}),
            "switch_interval_s": args.switch_interval or sys.getswitchinterval(),
            # Each round began with the touch prompt (specs.round_phases); None: a kept run
            # from before it.
            "touch_tokens": TOUCH_TOKENS if any(
                str(r.get("label", "")).startswith("touch")
                for res in results.values() if isinstance(res, dict)
                for r in res.get("records") or ()) else None,
            "disk_limit_s": DISK_TARGET * (floor + kv_bytes / (disk["gb_per_s"] * 1e9)),
            "wall_s": wall_s if args.rerender else time.monotonic() - t_start,
        },
        "raw_disk_read": disk,
        "load_average_end": load_end if args.rerender else list(os.getloadavg()),
        "rows": rows,
        "remote": remote_info,
        "lmcache": lmcache_info,
        "hybrid": hybrid_info,
    }
    payload["verdicts"] = verdicts(rows, kv_bytes, disk["gb_per_s"] * 1e9)
    if LMCACHE_CONFIG in rows:  # its ratio to its own floor and to tieredkv's
        lmcache_info["floor_ratios"] = lmcache_floor_ratios(rows)
    payload["hybrid_verdicts"] = hybrid_verdicts(rows, hybrid_kv / (disk["gb_per_s"] * 1e9))
    if "tieredkv_remote" in rows:  # no target: the figures, and whether the hit happened
        remote_info["ratios"] = remote_ratios(rows["tieredkv_remote"], rows["vllm_prefix"],
                                              rows["recompute"])
        remote_info["ratios_by_prompt"] = remote_ratios_by_prompt(
            rows["tieredkv_remote"], rows["vllm_prefix"], rows["recompute"])
        remote_info["hit_ok"] = rows["tieredkv_remote"]["hit_ok"]
    if args.trace:
        payload["traces"] = {
            c: {r["label"]: r.get("trace") for r in results[c]["records"] if r.get("trace")}
            for c in results if c.startswith("tieredkv")
        }
    payload["markdown"] = table_markdown(payload)
    print_outcome(payload, write_outputs(payload), args.trace)
    return exit_status(payload)


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        from benchmarks.ttft.child import child_main

        child_main(sys.argv[2])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_const", dest="profile", const="full", default="quick",
                        help="~8k-token prompts and more repeats (default: quick, ~4k tokens)")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="prompt A's length (default 4,000; 8,000 with --full; with "
                             "--model-shape 8b-kv 1,500 and 3,000)")
    parser.add_argument("--model-shape", choices=sorted(MODEL_SHAPES), default="tiny",
                        help="tiny (default: 8 KiB of KV per token) or 8b-kv (an 8B-class "
                             "model's 128 KiB per token: 32 layers x 8 KV heads x 128, hidden 256)")
    parser.add_argument("--prompt-b-tokens", type=int, default=None,
                        help="prompt B's length (default: random, see --prompt-seed)")
    parser.add_argument("--prompt-seed", type=int, default=PROMPT_SEED,
                        help="seed of prompt B's random length")
    parser.add_argument("--repeats", type=int, default=None, help="measured hits per configuration")
    parser.add_argument("--recompute-repeats", type=int, default=None)
    parser.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "tieredkv_e2e_ttft_model"),
                        help="where the random model is written (reused when its geometry matches)")
    parser.add_argument("--tmp-root", default=None, help="parent of the work dir (disk tier, ExampleConnector files)")
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs, slab files)")
    parser.add_argument("--trace", action="store_true", help="record a per-step timeline of tieredkv hits")
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="diagnostic: the children's sys.setswitchinterval (default: Python's 5 ms)")
    parser.add_argument("--rerender", default=None, metavar="RAW_JSON",
                        help="rebuild the outputs from a kept run's WORK_DIR/raw_results.json")
    parser.add_argument("--no-remote", action="store_true",
                        help="skip the remote-tier row (row 6; it needs redis-server)")
    parser.add_argument("--no-hybrid", action="store_true",
                        help="skip the hybrid-model rows (H1-H3)")
    parser.add_argument("--no-slow-disk", action="store_true",
                        help="skip the slow-disk row (5c)")
    parser.add_argument("--slow-disk-delay", type=float, default=None, metavar="S",
                        help="row 5c: seconds every slab read sleeps (default per shape: 0.5 "
                             "tiny, 2.0 8b-kv; several times a chunk's recompute)")
    parser.add_argument("--no-slow-remote", action="store_true",
                        help="skip the slow-Redis row (6c; it runs with row 6 only)")
    parser.add_argument("--slow-remote-delay", type=float, default=None, metavar="S",
                        help="row 6c: seconds the proxy holds each 16 KiB block of a value "
                             "(default per shape: 0.01 tiny, 0.0005 8b-kv; a prompt's read "
                             "several times its recompute)")
    parser.add_argument("--no-lmcache", action="store_true",
                        help="skip the LMCache peer row (row 7; it needs .venv-lmcache, built by "
                             f"`{LMCACHE_BUILD}`)")
    parser.add_argument("--only", default=None, help=argparse.SUPPRESS)  # debugging: some configs only
    args = parser.parse_args()
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
