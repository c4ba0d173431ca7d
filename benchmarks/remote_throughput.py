"""Remote-tier throughput: tieredkv's Redis path against redis-benchmark and a raw redis-py client.

Issue #14's target: the remote tier moves chunk shards at >= 0.8x the rate a plain client
moves the same value sizes on the same server. The benchmark starts its own redis-server
(``tieredkv.testing.redis_procs``; ``--cluster``: a 3-master Redis Cluster) and, for three
value sizes users get (one TP rank's shard of one chunk, see ``SHARDS``), measures:

* **tieredkv**: ``ThreadedRemoteStore.batch_set`` / ``batch_get`` / ``batch_exists``, one
  batch = the shards of one 4,096-token prompt for one rank, ``clients`` batches in flight.
  Values are ``codec.encode`` output (the 100-byte header included, built before timing);
  every value read is verified with ``codec.decode`` (key, rank, namespace, length,
  checksum) inside the timed loop, as the tier does before a value may reach a host slot.
* **redis-benchmark**: ``-t set,get -d <value bytes> -P <batch> -n <items> -c <clients>``
  and ``EXISTS`` the same way (the C client; one key, as redis-benchmark does without ``-r``).
* **redis-py**: ``redis.Redis`` pipelines of ``batch`` commands, ``clients`` threads, the
  same keys and values as tieredkv (replies only length-checked, not decoded).

The three sides take turns within every round (the order flips each round) on one shared
server, so load from other tenants lands on all of them alike; each figure is the median
of the rounds, with the min-max spread. Ratio = tieredkv median / baseline median (MB/s for
SET and GET, ops/s for EXISTS), judged against ``TARGET``. MB = 10^6 bytes of values.

    python -m benchmarks.remote_throughput            # quick profile (2-3 minutes)
    python -m benchmarks.remote_throughput --full     # more bytes and rounds, 1 and 4 clients
    python -m benchmarks.remote_throughput --cluster  # against a 3-master Redis Cluster
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
from benchmarks.remote.passes import RedisBenchmark, codec_rates, measure
from benchmarks.remote.report import build_rows, headline, table
from benchmarks.remote.workload import (
    CALL_TIMEOUT_S,
    CLUSTER_MIN_RUN_S,
    NAME,
    PROFILES,
    PROMPT_TOKENS,
    TARGET,
    BenchError,
    Case,
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


def run(profile_name: str = "quick", *, cluster: bool = False, out_dir: Path | str | None = None,
        write: bool = True, show_progress: bool = True) -> Result:
    """Start a server, run one profile, stop the server; returns (and writes) the results."""
    profile = PROFILES[profile_name]
    binary = shutil.which("redis-benchmark")
    if binary is None:
        raise BenchError("redis-benchmark is not installed (Debian's redis-tools package)")
    started = time.time()
    load_before = common.machine_info().get("load_average")
    tmp = Path(tempfile.mkdtemp(prefix="tkv-remote-bench-"))
    deployment: RedisServer | RedisClusterProcs = (
        RedisClusterProcs(tmp) if cluster else RedisServer(tmp))
    rows: list[dict[str, Any]] = []
    codec: dict[str, dict[str, float]] = {}
    progress = common.Progress(len(profile.shards) * len(profile.clients) * profile.rounds,
                               "starting redis-server", enabled=show_progress)
    try:
        deployment.start()
        first = deployment.servers[0] if isinstance(deployment, RedisClusterProcs) else deployment
        server_version = first.cli("info", "server").split("redis_version:")[1].split()[0]
        bench = RedisBenchmark(binary, first.port, cluster)
        store = ThreadedRemoteStore(parse_remote_url(deployment.url), timeout_s=CALL_TIMEOUT_S,
                                    connect_timeout_s=10.0, socket_timeout_s=CALL_TIMEOUT_S,
                                    write_timeout_s=CALL_TIMEOUT_S)
        client: redis.Redis | RedisCluster = (
            RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", s.port) for s in deployment.servers])
            if isinstance(deployment, RedisClusterProcs) else redis.Redis(port=first.port))
        try:
            if not _connected(store, 30.0):
                raise BenchError(f"the tieredkv store did not connect: {store.stats()}")
            for shard in profile.shards:
                for clients in profile.clients:
                    batches = max(clients, round(profile.bytes_per_op / (shard.value_bytes * shard.batch)))
                    exists = max(profile.exists_items, clients * shard.batch)
                    case = Case(shard, batches * shard.batch, exists)
                    codec[shard.name] = codec_rates(case)
                    samples = measure(case, clients, profile.rounds, store, client, bench, progress)
                    rows += build_rows(case, clients, samples)
                    del case
                    client.flushall()
        finally:
            store.close(5.0)
            client.close()
    finally:
        progress.close()
        deployment.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    clients_note = ", ".join(map(str, profile.clients))
    payload: dict[str, Any] = {
        "benchmark": NAME,
        "profile": profile.name,
        "deployment": "3-master Redis Cluster" if cluster else "single redis-server",
        "machine": {**common.machine_info(), "load_average_at_start": load_before},
        "tieredkv_revision": common.git_revision(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "wall_seconds": round(time.time() - started, 1),
        "target": TARGET,
        "verdict": "PASS" if all(r["verdict"] == "PASS" for r in rows) else "MISS",
        "headline": headline(rows),
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
            "tieredkv": "ThreadedRemoteStore (redis.asyncio client on the store's own event-loop "
                        "thread): batch_set/batch_get/batch_exists, one pipeline per batch, "
                        "`clients` batches in flight; codec.decode verifies every value read",
            "redis-benchmark": "-t set,get -d <value bytes> -P <batch> -n <items> -c <clients>"
                               + (" (at least 3: one per master) --cluster" if cluster else "")
                               + ", then EXISTS the same way; one key (no -r)"
                               + ("; in cluster mode it times a run in 250 ms ticks, so its runs "
                                  f"are lengthened to >= {CLUSTER_MIN_RUN_S} s each (more requests "
                                  "than the other sides; rates compare)" if cluster else ""),
            "redis-py": f"redis.{'RedisCluster' if cluster else 'Redis'} pipelines "
                        "(transaction=False) of <batch> commands from <clients> threads, same keys "
                        "and values as tieredkv; replies length-checked, not decoded",
        },
        "redis_benchmark_cluster_items": bench.items,
        "codec_single_thread_mb_s": codec,
        "rows": rows,
    }
    machine = payload["machine"]
    load = machine.get("load_average")
    notes = (
        f"Machine: {machine['name']}"
        + (f" (1-min load average {load_before[0]:.1f} at start, {load[0]:.1f} at end)"
           if load and load_before else "")
        + f". tieredkv {payload['tieredkv_revision']}, profile `{profile.name}`, {payload['date']}, "
        f"{payload['wall_seconds']} s. Server: {payload['deployment']}, redis-server "
        f"{server_version} on loopback, no persistence; redis-py {redis.__version__} "
        f"({'hiredis' if _hiredis() else 'pure-Python'} parser).\n\n"
        f"Target (issue #14): tieredkv's remote-tier throughput >= {TARGET} x a plain client "
        "moving the same value sizes on the same server. Ratio = tieredkv median / baseline "
        "median (MB/s for SET and GET, ops/s for EXISTS); per-round range = the ratio within "
        f"each round. {profile.rounds} rounds; in each, tieredkv, redis-benchmark and redis-py "
        "take turns (the order flips every round), each running SET, GET and EXISTS. MB = 10^6 "
        "bytes of values (header included). Clients: "
        f"{clients_note}.\n\n"
        "What each side used: "
        + "; ".join(f"**{side}**: {text}" for side, text in payload["sides"].items()) + ".\n\n"
        "Value sizes: one TP rank's shard of one chunk, tokens x 2 (K, V) x layers x KV heads x "
        "head dim x 2 bytes / TP, plus the 100-byte tieredkv header; one batch = the chunks of one "
        f"{PROMPT_TOKENS}-token prompt: "
        + "; ".join(f"{s.label}: {s.model}, value {s.value_bytes:,} B, batch {s.batch}"
                    for s in profile.shards) + "."
    )
    codec_line = "Codec alone, one thread, one batch (information): " + "; ".join(
        f"{name}: encode {rates['encode_mb_s']:,.0f} MB/s, decode+verify "
        f"{rates['decode_verify_mb_s']:,.0f} MB/s" for name, rates in codec.items()) + "."
    markdown = "\n\n".join([payload["headline"], notes, table(rows), codec_line])
    result = Result(rows, payload, markdown)
    if write:
        out = common.results_dir(out_dir)
        name = f"{NAME}_cluster" if cluster else NAME
        result.paths["json"] = str(common.write_json(out / f"{name}.json", payload))
        result.paths["md"] = str(common.write_markdown(
            out / f"{name}.md",
            "Remote-tier throughput: tieredkv vs redis-benchmark and raw redis-py", [markdown]))
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
    parser.add_argument("--cluster", action="store_true", help="a 3-master Redis Cluster")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help=f"results directory (default {common.RESULTS_DIR})")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    profile = "full" if args.full else (args.profile or "quick")
    result = run(profile, cluster=args.cluster, out_dir=args.out_dir, write=not args.no_write,
                 show_progress=not args.quiet)
    return common.print_written(result.markdown, result.paths)


if __name__ == "__main__":
    sys.exit(main())
