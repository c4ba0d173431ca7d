"""What tieredkv exports to Prometheus: one table of metric definitions and the counter routes.

Every ``vllm:tieredkv_*`` metric is defined once, in :data:`METRIC_SPECS` (name, type, help
text, label and every label value), and every scheduler counter is routed to one of them by
:func:`route_counter`. Both ways the metrics reach Prometheus build from this table (vLLM's
stat logger through :class:`tieredkv.vllm.prometheus.TieredKVPromMetrics`, the standalone
exporter through :mod:`tieredkv.metrics.exporter`), and the Grafana dashboard's tests check
its queries against it. Plain data: imports neither vLLM nor prometheus_client.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tieredkv.protocol import FAILURE_CAUSES, FailureCause

__all__ = [
    "CHUNK_OPS",
    "COUNTER",
    "DIRECTIONS",
    "GAUGE",
    "HISTOGRAM",
    "JOB_KINDS",
    "LATENCY_BUCKETS",
    "METRIC_SPECS",
    "QUEUES",
    "REMOTE_CAUSES",
    "SKIP_REASONS",
    "TIERS",
    "MetricSpec",
    "route_counter",
]

TIERS = ("host", "disk", "remote")
DIRECTIONS = ("d2h", "h2d", "spill", "restore", "remote_read", "remote_write")
JOB_KINDS = ("store", "spill", "promote", "load", "remote_read", "remote_write")
QUEUES = ("spill_queue", "d2h_queue", "h2d_queue", "jobs_in_flight", "host_slots_in_flight",
          "remote_write_queue")
CHUNK_OPS = ("stored", "spilled", "promoted", "superseded", "remote_written", "remote_read")
SKIP_REASONS = ("store_host_full", "spill_disk_full", "promote_no_host_slot")
# The remote tier's failures add one cause: the store is known to be down, so no call was made.
REMOTE_CAUSES = (*FAILURE_CAUSES, FailureCause.UNAVAILABLE.value)

# One chunk moves in well under a millisecond on a GPU and in tens of ms on a busy CPU; a
# stuck disk shows up in the top buckets (the load timeout defaults to 30 s).
LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"


@dataclass(frozen=True)
class MetricSpec:
    """One metric: its name, type, help text and (at most one) label with its known values.

    ``name`` is the family name; a counter is exposed as ``name + "_total"``, a histogram as
    ``_bucket``/``_sum``/``_count`` series. Every value in ``values`` exists from the start at 0.
    """

    name: str
    kind: str
    help: str
    label: str | None = None
    values: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None

    @property
    def exposed_names(self) -> tuple[str, ...]:
        if self.kind == COUNTER:
            return (self.name + "_total",)
        if self.kind == HISTOGRAM:
            return tuple(self.name + s for s in ("_bucket", "_sum", "_count"))
        return (self.name,)


def _spec(name: str, kind: str, help: str, label: str | None = None,
          values: Iterable[str] = (), buckets: tuple[float, ...] | None = None) -> MetricSpec:
    return MetricSpec("vllm:tieredkv_" + name, kind, help, label, tuple(values), buckets)


# Keyed by a short id the recorder uses; every name is vllm:tieredkv_* (never vllm:kv_offload_*).
METRIC_SPECS: dict[str, MetricSpec] = {
    # -- is it helping?
    "lookups": _spec(
        "lookups", COUNTER,
        "Requests tieredkv answered a prefix lookup for (counted once per request)."),
    "lookup_tokens": _spec(
        "lookup_tokens", COUNTER,
        "Prompt tokens tieredkv was asked about (beyond vLLM's own prefix-cache hit), once per "
        "request; missed tokens = lookup_tokens - hit_tokens."),
    "hit_tokens": _spec(
        "hit_tokens", COUNTER,
        "Prompt tokens loaded from tieredkv instead of recomputed, by the tier that held them "
        "when the request was admitted.", "tier", TIERS),
    "load_latency": _spec(
        "load_latency_seconds", HISTOGRAM,
        "Time to load one request's hit from host slots into device blocks (h2d), per rank.",
        buckets=LATENCY_BUCKETS),
    "requests_waiting_on_load": _spec(
        "requests_waiting_on_load", GAUGE,
        "Requests waiting for tieredkv to promote (disk -> host) or load (host -> device) "
        "their KV."),
    # -- is it healthy?
    "bytes": _spec(
        "bytes", COUNTER,
        "KV bytes moved, summed over ranks: d2h device->host store, h2d host->device load, "
        "spill host->disk, restore disk->host.", "direction", DIRECTIONS),
    "operations": _spec(
        "operations", COUNTER,
        "Chunk transfers completed, summed over ranks (one per chunk and rank).",
        "direction", DIRECTIONS),
    "transfer_latency": _spec(
        "transfer_latency_seconds", HISTOGRAM,
        "Duration of one transfer job on one rank, by job kind (store, spill, promote, load).",
        "kind", JOB_KINDS, LATENCY_BUCKETS),
    "queue_depth": _spec(
        "queue_depth", GAUGE,
        "Work queued in the transfer engines, summed over ranks (latest value per rank).",
        "queue", QUEUES),
    "capacity_bytes": _spec(
        "capacity_bytes", GAUGE,
        "KV payload bytes a tier can hold, all ranks (slots x chunk bytes x world size); "
        "remote: Redis's maxmemory (0: no limit set).",
        "tier", TIERS),
    "used_bytes": _spec(
        "used_bytes", GAUGE,
        "KV payload bytes in a tier's occupied slots (ready or being written), all ranks; "
        "remote: Redis's used_memory (the whole server).",
        "tier", TIERS),
    "evictions": _spec(
        "evictions", COUNTER,
        "Chunks evicted to make room, by tier; remote: keys Redis itself evicted (INFO "
        "evicted_keys, the whole server, one key per chunk and rank).", "tier", TIERS),
    "disk_admission_rejected": _spec(
        "disk_admission_rejected", COUNTER,
        "Stored chunks not spilled to disk because they were not seen often enough "
        "(disk_admission)."),
    "spills_dropped": _spec(
        "spills_dropped", COUNTER,
        "Spills dropped because the bounded spill queue was full (the disk did not keep up)."),
    "skipped": _spec(
        "skipped", COUNTER,
        "Placements skipped for lack of room: a store with every host slot busy, a spill with "
        "the disk full, a promotion without a free host slot.", "reason", SKIP_REASONS),
    "pinned_host_slots": _spec(
        "pinned_host_slots", GAUGE,
        "Host slots pinned by promised hits, loads in flight or spills in flight."),
    "chunks": _spec(
        "chunks", COUNTER,
        "Chunks that completed a placement on every rank: stored in host, spilled to disk, "
        "promoted from disk; superseded: a prompt's tail (part of a chunk) dropped from a "
        "tier because a longer entry of the same prefix now holds its blocks there.",
        "op", CHUNK_OPS),
    "preemptions": _spec(
        "preemptions", COUNTER, "Request preemptions the connector fenced."),
    "resets": _spec(
        "resets", COUNTER,
        "Cache resets that emptied both tiers (/reset_prefix_cache?reset_external=true, "
        "sleep mode, weight updates)."),
    # -- is it failing?
    "load_failures": _spec(
        "load_failures", COUNTER,
        "Failed reads by cause: host->device loads and disk->host promotions (disk reads); "
        "the chunk is dropped and vLLM recomputes.", "cause", FAILURE_CAUSES),
    "store_failures": _spec(
        "store_failures", COUNTER, "Failed device->host stores by cause.", "cause",
        FAILURE_CAUSES),
    "spill_failures": _spec(
        "spill_failures", COUNTER, "Failed host->disk spills by cause.", "cause", FAILURE_CAUSES),
    "disk_reads_retried": _spec(
        "disk_reads_retried", COUNTER,
        "Disk reads read a second time after a transient failure (timeout, I/O error, short "
        "read), by the first failure's cause; a retry that fails again is also a load failure.",
        "cause", FAILURE_CAUSES),
    "disk_reads_recovered": _spec(
        "disk_reads_recovered", COUNTER,
        "Disk reads whose second read succeeded after a transient failure."),
    # -- the shared remote tier (Redis/Valkey)
    "remote_up": _spec(
        "remote_up", GAUGE,
        "1 while the scheduler's connection to the remote tier is up, 0 while it is down "
        "(lookups then skip the remote tier; it reconnects with backoff)."),
    "remote_probe_latency": _spec(
        "remote_probe_latency_seconds", HISTOGRAM,
        "Round trip of one remote existence probe (one pipelined call for a whole prompt's "
        "chunks, every rank), as the store measured it.", buckets=LATENCY_BUCKETS),
    "remote_probes": _spec(
        "remote_probes", COUNTER, "Remote existence probes sent (one per prompt and lookup)."),
    "remote_probe_failures": _spec(
        "remote_probe_failures", COUNTER,
        "Remote probes that failed or passed their deadline (remote_timeout_s), by cause; the "
        "lookup then serves what host and disk hold.", "cause", REMOTE_CAUSES),
    "remote_read_failures": _spec(
        "remote_read_failures", COUNTER,
        "Chunks read from the remote tier that were not used, by cause: gone (missing, e.g. "
        "evicted by Redis), corrupted (checksum), written by another model or setting "
        "(wrong_namespace), a timeout or a network error; vLLM recomputes them.",
        "cause", REMOTE_CAUSES),
    "remote_writes_dropped": _spec(
        "remote_writes_dropped", COUNTER,
        "Chunk writes to the remote tier dropped because its bounded write queue was full or "
        "the store was down (the remote tier fell behind; serving never waits for it)."),
    "remote_write_failures": _spec(
        "remote_write_failures", COUNTER,
        "Queued chunk writes that Redis did not take (errors, timeouts, maxmemory), per rank "
        "and chunk."),
    "remote_admission_rejected": _spec(
        "remote_admission_rejected", COUNTER,
        "Stored chunks not written to the remote tier because they were not seen often "
        "enough (remote_admission)."),
    "recovery_dropped": _spec(
        "recovery_dropped", COUNTER,
        "Disk entries dropped while recovering the index at start-up (bad or missing slot "
        "headers)."),
    "journal_records_dropped": _spec(
        "journal_records_dropped", COUNTER,
        "Disk journal records dropped because its bounded backlog filled while writes failed "
        "(a full disk); the journal is rebuilt from the live index once writes succeed."),
}

# Scheduler counters (tieredkv/scheduler/planner.py Planner.counters) -> (spec id, label value).
_COUNTER_ROUTES: dict[str, tuple[str, str | None]] = {
    "lookups": ("lookups", None),
    "lookup_tokens": ("lookup_tokens", None),
    "hit_tokens_host": ("hit_tokens", "host"),
    "hit_tokens_disk": ("hit_tokens", "disk"),
    "evictions_host": ("evictions", "host"),
    "evictions_disk": ("evictions", "disk"),
    "disk_admission_rejected": ("disk_admission_rejected", None),
    "store_skipped_host_full": ("skipped", "store_host_full"),
    "spill_skipped_disk_full": ("skipped", "spill_disk_full"),
    "promote_no_host_slot": ("skipped", "promote_no_host_slot"),
    "stored_chunks": ("chunks", "stored"),
    "spilled_chunks": ("chunks", "spilled"),
    "promoted_chunks": ("chunks", "promoted"),
    "superseded_host": ("chunks", "superseded"),
    "superseded_disk": ("chunks", "superseded"),
    "preemptions": ("preemptions", None),
    "resets": ("resets", None),
    "dropped_at_recovery": ("recovery_dropped", None),
    "journal_records_dropped": ("journal_records_dropped", None),
    "hit_tokens_remote": ("hit_tokens", "remote"),
    "evictions_remote": ("evictions", "remote"),
    "remote_written_chunks": ("chunks", "remote_written"),
    "remote_read_chunks": ("chunks", "remote_read"),
    "remote_probes": ("remote_probes", None),
    "remote_writes_dropped": ("remote_writes_dropped", None),
    "remote_admission_rejected": ("remote_admission_rejected", None),
    "remote_write_failed": ("remote_write_failures", None),
}
# Failure counters are named <prefix><cause>.
_FAILURE_ROUTES: tuple[tuple[str, str], ...] = (
    ("load_failed_", "load_failures"),
    ("disk_read_failed_", "load_failures"),
    ("store_failed_", "store_failures"),
    ("spill_failed_", "spill_failures"),
    ("remote_read_failed_", "remote_read_failures"),
    ("remote_probe_failed_", "remote_probe_failures"),
)


def route_counter(name: str) -> tuple[str, str | None] | None:
    """The (spec id, label value) a scheduler counter feeds; None for one not exported."""
    route = _COUNTER_ROUTES.get(name)
    if route is not None:
        return route
    for prefix, key in _FAILURE_ROUTES:
        if name.startswith(prefix):
            return key, name[len(prefix):]
    return None
