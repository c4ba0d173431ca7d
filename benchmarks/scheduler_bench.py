"""Scheduler-half microbenchmark: TieredKVConnector against vLLM's own OffloadingConnector.

Both connectors are built as vLLM builds them in the engine-core process (role SCHEDULER)
from one real ``VllmConfig`` (a tiny Llama written to disk, block size 32) and one
``KVCacheConfig`` with a single FullAttentionSpec group. Both use 512-token offload chunks
(tieredkv ``chunk_blocks=16``; vLLM ``blocks_per_chunk=16``) and a CPU tier large enough
never to evict. Requests are real ``vllm.v1.request.Request`` objects whose ``block_hashes``
come from vLLM's own block hasher (sha256); scheduler steps are real ``SchedulerOutput``s.

Measured, tieredkv and vLLM alternating call by call (the first of the pair alternates too):

* ``get_num_new_matched_tokens`` for prompts of ~1k..~128k tokens, ``hit`` (every chunk is in
  the connector's CPU tier, stored through the connector's own store path and completed by
  a worker report) and ``miss`` (empty tier). The sizes are random lengths (seeded,
  ``SIZE_SEED``) no multiple of the block, as a chat's prompts are: tieredkv's hit ends
  inside its last chunk (the prompt's tail), vLLM's at the last chunk boundary. One row,
  4,096 tokens, is chunk-aligned and labelled so. ``cold`` is the first call for a fresh request
  (chunk keys derived from the block hashes inside the call); ``repeat`` is the same request
  asked again, as vLLM's scheduler does while a request waits (keys cached).
* ``build_connector_meta`` with 1..256 running requests: ``decode`` (every request scheduled
  one token, prefixes already stored, nothing to plan) and ``prefill`` (every request
  scheduled its second 512-token prefill chunk, so one store per request is planned).
* Keying alone for a 128k prompt: ``tieredkv.keys.chunk_keys`` and the host-index lookups of
  the resulting keys, next to vLLM's key packing and ``CPUOffloadingManager.lookup``.

Medians and p90 of ``time.perf_counter_ns`` samples; the garbage collector is paused inside
timed calls (collected between iterations) for both sides alike.

    python -m benchmarks.scheduler_bench            # quick profile (< 3 minutes)
    python -m benchmarks.scheduler_bench --full     # more iterations
    python -m benchmarks.scheduler_bench --kv-events  # + tieredkv with KV events on (issue 26)

``--kv-events`` adds a third side, interleaved with the other two: tieredkv built from a copy
of the config with vLLM's KV events on (``KVEventsConfig(enable_kv_cache_events=True,
publisher="null")``), ``take_events()`` called after each ``update_connector_output`` as
vLLM's scheduler does. Each row then shows events on / events off (ratio of medians; events
off is the plain tieredkv side). Results go to ``scheduler_bench_events.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.scheduler.measure import (
    Samples,
    bench_decode,
    bench_keying,
    bench_lookups,
    bench_prefill,
    cprofile_hot_paths,
)
from benchmarks.scheduler.report import (
    COLUMNS,
    EVENTS_COLUMNS,
    build_rows,
    events_summary,
    keying_summary,
    load_average,
    plot,
)
from benchmarks.scheduler.sides import Engine
from benchmarks.scheduler.workload import (
    DECODE_PROMPT_TOKENS,
    NAME,
    NOISE_BAND,
    PREFILL_PROMPT_TOKENS,
    PROFILES,
    SIZE_SEED,
    TIER_BYTES,
    is_aligned,
)

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


@dataclass
class Result:
    rows: list[dict[str, Any]]
    payload: dict[str, Any]
    markdown: str
    paths: dict[str, str] = field(default_factory=dict)


def run(
    profile_name: str = "quick",
    *,
    out_dir: Path | str | None = None,
    write: bool = True,
    make_plot: bool = True,
    show_progress: bool = True,
    model_dir: Path | None = None,
    kv_events: bool = False,
    sizes: Sequence[int] | None = None,
) -> Result:
    """Run one profile in-process; returns the rows and (optionally) writes the results.
    ``sizes`` replaces the profile's prompt sizes (before_after.py: an older commit's sizes)."""
    profile = PROFILES[profile_name]
    if sizes:
        profile = replace(profile, sizes=tuple(sorted(set(sizes))))
    started = time.time()
    load_before = load_average()
    engine = Engine(model_dir, kv_events=kv_events)
    gc.collect()
    gc.freeze()  # as vLLM's engine does after start-up: long-lived objects leave the GC's scans
    samples = Samples()
    total = (
        len(profile.sizes) * 2 * profile.lookup_iters
        + len(profile.running) * (profile.decode_iters + profile.prefill_iters)
        + profile.keying_iters
    )
    progress = common.Progress(total, "starting", enabled=show_progress)
    try:
        lookup_info = bench_lookups(engine, profile, samples, progress)
        bench_decode(engine, profile, samples, progress)
        bench_prefill(engine, profile, samples, progress)
        keying_info = bench_keying(engine, profile, samples, progress)
    finally:
        progress.close()
        gc.unfreeze()
    rows = build_rows(samples, profile, events=kv_events)
    machine = common.machine_name()
    judged = [r for r in rows if r["group"] != "target"]
    fails = [r for r in judged if r["verdict"] == "FAIL"]
    target_rows = [r for r in rows if r["group"] == "target"]
    import vllm

    payload = {
        "benchmark": NAME,
        "profile": profile.name,
        "machine": {**common.machine_info(), "load_average_at_start": load_before},
        "vllm_version": getattr(vllm, "__version__", "unknown"),
        "tieredkv_revision": common.git_revision(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "wall_seconds": round(time.time() - started, 1),
        "settings": {
            **engine.geometry,
            "tier_bytes": TIER_BYTES,
            "lookup_iters": profile.lookup_iters,
            "lookup_repeats": profile.lookup_repeats,
            "decode_iters": profile.decode_iters,
            "prefill_iters": profile.prefill_iters,
            "keying_iters": profile.keying_iters,
            "decode_prompt_tokens": DECODE_PROMPT_TOKENS,
            "prefill_prompt_tokens": PREFILL_PROMPT_TOKENS,
            "noise_band": NOISE_BAND,
            "prompt_sizes": list(profile.sizes),
            "size_seed": SIZE_SEED,
            "chunk_aligned_sizes": [n for n in profile.sizes if is_aligned(n)],
        },
        "targets": {
            "no_slower_than_vllm": "FAIL" if fails else "PASS",
            "failing_rows": [f"{r['operation']} @ {r['size_label']}" for r in fails],
            "lookup_128k_under_2ms": target_rows[0]["verdict"] if target_rows else "not measured",
        },
        "hit_tokens": lookup_info["hit_tokens"],
        "keying": {**keying_info, "summary": keying_summary(samples)},
        "rows": [{k: v for k, v in r.items() if not k.endswith("_text") and k not in
                  ("tieredkv_us", "vllm_us", "tieredkv_events_us")} for r in rows],
    }
    load = payload["machine"].get("load_average")
    notes = (
        f"Machine: {machine}"
        + (f" (1-min load average {load_before[0]:.1f} at start, {load[0]:.1f} at end)"
           if load and load_before else "")
        + f". vLLM {payload['vllm_version']}, tieredkv {payload['tieredkv_revision']}, "
        f"profile `{profile.name}`, {payload['date']}, {payload['wall_seconds']} s.\n\n"
        "Scheduler halves only (role SCHEDULER), built from one real VllmConfig (tiny Llama, "
        "block size 32, sha256 block hashes from vLLM's own hasher), 512-token offload chunks on "
        "both sides, CPU tier large enough never to evict. tieredkv and vLLM calls alternate; "
        "µs are medians (p90) of `perf_counter_ns` samples on a shared, noisy machine. Ratio = "
        f"tieredkv median / vLLM median: PASS <= 1.00, PASS (within noise) <= {NOISE_BAND:.2f}, "
        "FAIL beyond. *cold keys*: first call for a fresh request (chunk keys derived inside "
        "the call); *repeated*: the same request asked again (keys cached). Decode: prompts of "
        f"{DECODE_PROMPT_TOKENS} tokens already stored, 1 token scheduled each, nothing to plan. "
        "Prefill: each request's second 512-token chunk is scheduled, one store planned each."
    )
    table = common.markdown_table(rows, EVENTS_COLUMNS if kv_events else COLUMNS)
    summary = (
        f"**Target 'no slower than vLLM on any row': {payload['targets']['no_slower_than_vllm']}**"
        + (f" (FAIL rows: {', '.join(payload['targets']['failing_rows'])})" if fails else "")
        + f"  \n**Target '128k-token lookup under 2 ms': {payload['targets']['lookup_128k_under_2ms']}**"
    )
    parts = [notes, summary, table, keying_summary(samples)]
    if kv_events:
        payload["kv_events"] = {"summary": events_summary(rows)}
        parts.insert(2, payload["kv_events"]["summary"])
    markdown = "\n\n".join(parts)
    result = Result(rows, payload, markdown)
    if write:
        out = common.results_dir(out_dir)
        name = f"{NAME}_events" if kv_events else NAME  # the kept default files stay as they are
        title = "Scheduler-half benchmark: tieredkv vs vLLM OffloadingConnector"
        result.paths["json"] = str(common.write_json(out / f"{name}.json", payload))
        result.paths["md"] = str(common.write_markdown(
            out / f"{name}.md", title + (", KV events on/off" if kv_events else ""), [markdown]))
        if make_plot:
            result.paths["png"] = str(plot(rows, out / f"{name}.png", machine, profile))
    return result


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token counts like 1024,2348, not {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError("every size is at least one token")
    return sizes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--full", action="store_true", help="more iterations (several minutes)")
    group.add_argument("--profile", choices=sorted(PROFILES), help="quick (default), full, smoke")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help=f"results directory (default {common.RESULTS_DIR})")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="where the tiny model is written (default: a temp directory)")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--kv-events", action="store_true",
                        help="also tieredkv with vLLM's KV events on, interleaved; per row the "
                        "events on/off ratio (writes scheduler_bench_events.*)")
    parser.add_argument("--cprofile", action="store_true",
                        help="only print cProfile reports of the hot paths, no timing run")
    parser.add_argument("--sizes", type=_sizes, default=None,
                        help="prompt sizes in tokens, comma-separated, instead of the profile's "
                        "(to compare with a run that used other sizes)")
    args = parser.parse_args(argv)
    logging.getLogger("tieredkv").setLevel(logging.ERROR)  # the CLI's output is the table
    if args.cprofile:
        print(cprofile_hot_paths(Engine(args.model_dir)))
        return 0
    profile = "full" if args.full else (args.profile or "quick")
    result = run(
        profile,
        out_dir=args.out_dir,
        write=not args.no_write,
        make_plot=not args.no_plot,
        show_progress=not args.quiet,
        model_dir=args.model_dir,
        kv_events=args.kv_events,
        sizes=args.sizes,
    )
    return common.print_written(result.markdown, result.paths)


if __name__ == "__main__":
    sys.exit(main())
