"""What the soak reads off the running server and its disk tier (memory of the process tree,
disk usage, the journal, the manifest, /health, /metrics, the idle state, the root cause of
a crash in the log) and the payload bytes its fault injector flips in journaled slots."""

from __future__ import annotations

import json
import math
import os
import random
import re
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.endurance.workload import VOCAB
from benchmarks.serve.client import stream_completion
from benchmarks.serve.judging import metric_sum
from tieredkv.disk.format import journal_path, manifest_path, payload_offset


def process_role(proc: Any, is_root: bool) -> str:
    """Which of a vLLM server's processes this is: ``api_server`` (the root), else the title
    vLLM gives its children (``VLLM::EngineCore``, ``VLLM::Worker``...), else the process name."""
    if is_root:
        return "api_server"
    try:
        argv0 = (proc.cmdline() or [""])[0]
    except Exception:  # noqa: BLE001 - psutil errors and odd cmdlines alike: fall back to the name
        argv0 = ""
    return argv0.split()[0] if argv0.startswith("VLLM::") else proc.name()


def tree_usage(pid: int) -> dict[str, Any]:
    """RSS, open fds and threads of a process and all its children (psutil), and the RSS of
    each kind of process (summed by :func:`process_role`), so growth can be placed."""
    import psutil

    rss = fds = threads = 0
    by_process: dict[str, int] = {}
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return {"rss_bytes": math.nan, "open_fds": math.nan, "threads": math.nan, "processes": 0,
                "rss_by_process": {}}
    alive = 0
    for proc in procs:
        try:
            with proc.oneshot():
                proc_rss = proc.memory_info().rss
                fds += proc.num_fds()
                threads += proc.num_threads()
            role = process_role(proc, proc.pid == pid)
        except psutil.Error:
            continue
        rss += proc_rss
        by_process[role] = by_process.get(role, 0) + proc_rss
        alive += 1
    return {"rss_bytes": rss, "open_fds": fds, "threads": threads, "processes": alive,
            "rss_by_process": by_process}


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

    return Journal.replay(journal_path(disk_path)).entries


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
