"""Remote-tier throughput: tieredkv's Redis path against raw redis-py and redis-benchmark.

Issue #25's targets (point 3): tieredkv's GETs of chunk values move >= 0.9 of what raw
redis-py moves with the same concurrency and sizes, its EXISTS probes run at >= 0.8 of a raw
pipelined EXISTS (SET keeps issue #14's 0.8), on one node *and* on a Cluster: the verdict
uses the worse of the two. The benchmark starts its own redis-server, then a 3-master Redis
Cluster (``tieredkv.testing.redis_procs``), and for three value sizes users get (one TP
rank's shard of one chunk, see ``SHARDS``) measures, per deployment:

* **tieredkv**: one batch = the shards of one 4,096-token prompt for one rank, ``clients``
  batches in flight. Values are ``codec.encode`` output (the 100-byte header included, built
  before timing). A GET is the worker's real read path (``benchmarks.remote.worker_read``):
  each prompt is one ``RemoteDriver.submit_reads`` of ``Job.remote_read`` jobs, RemoteJobs
  (the engine's default 128 MiB read budget, batches of half, answers landed on its own
  thread through ``on_answer``) reads them bounded to the value's length on a store of its
  own, straight into a slot of a real ``HostPool`` (a whole chunk's value), and verifies each
  with ``codec.decode`` (key, rank, namespace, length, checksum); a failed read fails the pass. SET and EXISTS
  are the store's ``batch_set`` / ``batch_exists`` (EXISTS is the call the scheduler's
  probe sends; SET is not the engine's queued write path, see ``passes``).
* **redis-py**: ``redis.asyncio`` pipelines (``transaction=False``) of ``batch`` plain
  commands on an event-loop thread of their own, ``clients`` in flight (the same
  concurrency), same keys and values; replies only length-checked.
* **redis-benchmark** (the reference; no target): ``-t set,get -d <value bytes> -P <batch>
  -n <items> -c <clients> -r <keyspace>`` and ``EXISTS`` the same way: random keys over the
  same key count (every one written first, so every GET and EXISTS hits).

The three sides take turns within every round (the order flips each round: ABC CBA) on one
shared server, so load from other tenants lands on all of them alike; each figure is the
median of the rounds, with the min-max spread. Ratio = tieredkv median / baseline median
(MB/s for SET and GET, ops/s for EXISTS). MB = 10^6 bytes of values.

    python -m benchmarks.remote_throughput            # quick profile, one node then a Cluster
    python -m benchmarks.remote_throughput --full     # more bytes and rounds, 1 and 4 clients
    python -m benchmarks.remote_throughput --only cluster   # one deployment (diagnosis only)
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis
from redis.cluster import ClusterNode, RedisCluster

from benchmarks import common
from benchmarks.remote.passes import codec_rates, measure
from benchmarks.remote.raw_async import AsyncRedisPy
from benchmarks.remote.rbench import RedisBenchmark
from benchmarks.remote.report import build_rows, headline, table, verdict_table, verdicts
from benchmarks.remote.worker_read import WorkerReads
from benchmarks.remote.workload import (
    CALL_TIMEOUT_S,
    CLUSTER_MIN_RUN_S,
    DEPLOYMENTS,
    NAME,
    PROFILES,
    PROMPT_TOKENS,
    TARGET_BASELINE,
    TARGETS,
    BenchError,
    Case,
    Profile,
)
from tieredkv.remote.codec import HEADER_BYTES
from tieredkv.remote.threaded import ThreadedRemoteStore
from tieredkv.remote_url import parse_remote_url
from tieredkv.testing.redis_procs import RedisClusterProcs, RedisServer


@dataclass
class Result:
    rows: list[dict[str, Any]]
    payload: dict[str, Any]
    markdown: str
    paths: dict[str, str] = field(default_factory=dict)


def _redis_benchmark_version(binary: str) -> str:
    try:
        return subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10,
                              check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _connected(store: ThreadedRemoteStore, timeout_s: float) -> bool:
    """Wait for the store's first connection before measuring (the engine itself never waits)."""
    deadline = time.monotonic() + timeout_s
    while not store.up and time.monotonic() < deadline:
        time.sleep(0.01)
    return store.up


def _deployment(profile: Profile, deployment: str, binary: str, progress: common.Progress,
                codec: dict[str, dict[str, float]]) -> tuple[list[dict[str, Any]], str]:
    """Start one deployment, run the profile's cases on it, stop it: rows and server version."""
    cluster = deployment == "cluster"
    tmp = Path(tempfile.mkdtemp(prefix="tkv-remote-bench-"))
    procs: RedisServer | RedisClusterProcs = RedisClusterProcs(tmp) if cluster else RedisServer(tmp)
    rows: list[dict[str, Any]] = []
    try:
        progress.set_label(f"starting {deployment} redis")
        procs.start()
        servers = procs.servers if isinstance(procs, RedisClusterProcs) else [procs]
        version = servers[0].cli("info", "server").split("redis_version:")[1].split()[0]
        ports = [s.port for s in servers]
        store = ThreadedRemoteStore(parse_remote_url(procs.url), timeout_s=CALL_TIMEOUT_S,
                                    connect_timeout_s=10.0, socket_timeout_s=CALL_TIMEOUT_S,
                                    write_timeout_s=CALL_TIMEOUT_S)
        client: redis.Redis | RedisCluster = (
            RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", p) for p in ports])
            if cluster else redis.Redis(port=ports[0]))
        raw = AsyncRedisPy(ports, cluster)
        try:
            if not _connected(store, 30.0):
                raise BenchError(f"the tieredkv store did not connect: {store.stats()}")
            bench = RedisBenchmark(binary, ports[0], client)
            for shard in profile.shards:
                for clients in profile.clients:
                    batches = max(clients, round(profile.bytes_per_op / (shard.value_bytes * shard.batch)))
                    exists = max(profile.exists_items, clients * shard.batch)
                    case = Case(shard, batches * shard.batch, exists)
                    codec[shard.name] = codec_rates(case)
                    reader = WorkerReads(parse_remote_url(procs.url), case, clients)
                    try:
                        if not reader.wait_connected(30.0):
                            raise BenchError(f"the reader's store did not connect: {reader.store.stats()}")
                        samples = measure(case, clients, profile.rounds, store, reader, raw, bench,
                                          progress)
                    finally:
                        reader.close()
                    rows += build_rows(case, clients, samples, deployment)
                    del case, reader
                    client.flushall()
        finally:
            store.close(5.0)
            raw.close()
            client.close()
    finally:
        procs.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return rows, version


def run(profile_name: str = "quick", *, deployments: Sequence[str] = DEPLOYMENTS,
        out_dir: Path | str | None = None, write: bool = True, show_progress: bool = True) -> Result:
    """Run one profile on each deployment in turn; returns (and writes) the results."""
    profile = PROFILES[profile_name]
    binary = shutil.which("redis-benchmark")
    if binary is None:
        raise BenchError("redis-benchmark is not installed (Debian's redis-tools package)")
    started = time.time()
    load_before = common.machine_info().get("load_average")
    rows: list[dict[str, Any]] = []
    codec: dict[str, dict[str, float]] = {}
    progress = common.Progress(
        len(deployments) * len(profile.shards) * len(profile.clients) * profile.rounds,
        "starting redis-server", enabled=show_progress)
    server_version = ""
    try:
        for deployment in deployments:
            more, server_version = _deployment(profile, deployment, binary, progress, codec)
            rows += more
    finally:
        progress.close()
    judged = verdicts(rows)

    clients_note = ", ".join(map(str, profile.clients))
    named = {"single": "single redis-server", "cluster": "3-master Redis Cluster"}
    payload: dict[str, Any] = {
        "benchmark": NAME,
        "profile": profile.name,
        "deployment": " and ".join(named[d] for d in deployments),
        "deployments": list(deployments),
        "machine": {**common.machine_info(), "load_average_at_start": load_before},
        "tieredkv_revision": common.git_revision(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "wall_seconds": round(time.time() - started, 1),
        "targets": TARGETS,
        "target_baseline": TARGET_BASELINE,
        "verdict": "PASS" if all(v["verdict"] == "PASS" for v in judged) else "MISS",
        "headline": headline(judged),
        "verdicts": judged,
        "versions": {
            "redis_server": server_version,
            "redis_benchmark": _redis_benchmark_version(binary),
            "redis_py": redis.__version__,
            "hiredis_parser": _hiredis(),
        },
        "settings": {
            "rounds": profile.rounds, "bytes_per_op_per_round": profile.bytes_per_op,
            "exists_items_per_round": profile.exists_items, "clients": list(profile.clients),
            "prompt_tokens_per_batch": PROMPT_TOKENS, "header_bytes": HEADER_BYTES,
            "tieredkv_call_timeout_s": CALL_TIMEOUT_S,
            "shards": [{**asdict(s), "payload_bytes": s.payload_bytes, "value_bytes": s.value_bytes,
                        "batch": s.batch} for s in profile.shards],
        },
        "sides": {
            "tieredkv": "GET: the worker's read path, RemoteDriver.submit_reads of one prompt's "
                        "Job.remote_read jobs per batch, `clients` prompts outstanding, RemoteJobs "
                        "with the engine's default read budget (128 MiB, batches of half, answers "
                        "landed on its own thread via on_answer) on a ThreadedRemoteStore of its "
                        "own: each value read bounded to its length, received into a HostPool "
                        "slot, verified by codec.decode, every read required to land; SET / EXISTS: "
                        "ThreadedRemoteStore.batch_set / batch_exists (redis.asyncio client on the "
                        "store's own event-loop thread), one pipeline per batch, `clients` "
                        "batches in flight",
            "redis-py": "redis.asyncio Redis/RedisCluster pipelines (transaction=False) of <batch> "
                        "plain SET/GET/EXISTS on an event-loop thread of their own, <clients> in "
                        "flight, same keys and values as tieredkv and its socket read size; "
                        "replies length-checked, not decoded",
            "redis-benchmark": "-t set,get -d <value bytes> -P <batch> -n <items> -c <clients> "
                               "-r <keyspace>, then EXISTS the same way: random keys over the "
                               "same key count, all written first (every GET and EXISTS hits); "
                               "in a Cluster --cluster with one client per master (at least 3), "
                               "each master's client on its own hash tag and keyspace / 3, and "
                               "its runs lengthened to >= "
                               f"{CLUSTER_MIN_RUN_S} s each (it times them in 250 ms ticks)",
        },
        "codec_single_thread_mb_s": codec,
        "rows": rows,
    }
    machine = payload["machine"]
    load = machine.get("load_average")
    targets = ", ".join(f"{op.upper()} >= {t}" for op, t in TARGETS.items())
    notes = (
        f"Machine: {machine['name']}"
        + (f" (1-min load average {load_before[0]:.1f} at start, {load[0]:.1f} at end)"
           if load and load_before else "")
        + f". tieredkv {payload['tieredkv_revision']}, profile `{profile.name}`, {payload['date']}, "
        f"{payload['wall_seconds']} s. Servers: {payload['deployment']}, redis-server "
        f"{server_version} on loopback, no persistence; redis-py {redis.__version__} "
        f"({'hiredis' if _hiredis() else 'pure-Python'} parser).\n\n"
        f"Targets (issue #25 point 3; SET: issue #14): tieredkv / raw {TARGET_BASELINE} "
        f"{targets}, judged on the worse of the deployments; redis-benchmark is the reference "
        "(the C client), shown without a target. Ratio = tieredkv median / baseline median "
        "(MB/s for SET and GET, ops/s for EXISTS); per-round range = the ratio within each "
        f"round. {profile.rounds} rounds per deployment; in each, tieredkv, redis-benchmark and "
        "redis-py take turns (the order flips every round), each running SET, GET and EXISTS; "
        "GETs read the keys in one random order, the same for both Python sides. "
        f"MB = 10^6 bytes of values (header included). Clients: {clients_note}.\n\n"
        "What each side used: "
        + "; ".join(f"**{side}**: {text}" for side, text in payload["sides"].items()) + ".\n\n"
        "Value sizes: one TP rank's shard of one chunk, tokens x 2 (K, V) x layers x KV heads x "
        "head dim x 2 bytes / TP, plus the 100-byte tieredkv header; one batch = the chunks of one "
        f"{PROMPT_TOKENS}-token prompt: "
        + "; ".join(f"{s.label}: {s.model}, value {s.value_bytes:,} B, batch {s.batch}"
                    for s in profile.shards) + "."
    )
    codec_line = "Codec alone, one thread, one batch (information): " + "; ".join(
        f"{name}: encode {rates['encode_mb_s']:,.0f} MB/s, decode+verify+copy "
        f"{rates['decode_verify_mb_s']:,.0f} MB/s" for name, rates in codec.items()) + "."
    markdown = "\n\n".join([payload["headline"], verdict_table(judged), notes, table(rows), codec_line])
    result = Result(rows, payload, markdown)
    if write:
        out = common.results_dir(out_dir)
        name = NAME if tuple(deployments) == DEPLOYMENTS else f"{NAME}_{'_'.join(deployments)}"
        result.paths["json"] = str(common.write_json(out / f"{name}.json", payload))
        result.paths["md"] = str(common.write_markdown(
            out / f"{name}.md",
            "Remote-tier throughput: tieredkv vs raw redis-py and redis-benchmark -r", [markdown]))
    return result


def _hiredis() -> bool:
    try:
        from redis.utils import HIREDIS_AVAILABLE
    except ImportError:
        return False
    return bool(HIREDIS_AVAILABLE)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--full", action="store_true", help="more bytes and rounds, 1 and 4 clients")
    group.add_argument("--profile", choices=sorted(PROFILES), help="quick (default), full, smoke")
    parser.add_argument("--only", choices=DEPLOYMENTS, default=None,
                        help="one deployment (the verdict needs both; written under its own name)")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help=f"results directory (default {common.RESULTS_DIR})")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    profile = "full" if args.full else (args.profile or "quick")
    deployments = (args.only,) if args.only else DEPLOYMENTS
    result = run(profile, deployments=deployments, out_dir=args.out_dir, write=not args.no_write,
                 show_progress=not args.quiet)
    return common.print_written(result.markdown, result.paths)


if __name__ == "__main__":
    sys.exit(main())
