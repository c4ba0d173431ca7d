"""What tieredkv exports to Prometheus: one table of metric definitions and the counter routes.

Every ``vllm:tieredkv_*`` metric is defined once, in :data:`METRIC_SPECS` (name, type, help
text, label and every label value), and every scheduler counter is declared once, as a
:class:`Count` routed to one of them by :data:`COUNT_ROUTES`; :class:`Counts` refuses any
other key, so nothing can be counted that is not exported. Both ways the metrics reach Prometheus build from this table (vLLM's
stat logger through :class:`tieredkv.vllm.prometheus.TieredKVPromMetrics`, the standalone
exporter through :mod:`tieredkv.metrics.exporter`), and the Grafana dashboard's tests check
its queries against it. Plain data: imports neither vLLM nor prometheus_client.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from tieredkv.protocol import FAILURE_CAUSES, FailureCause, Move, Tier

__all__ = [
    "CHUNK_OPS",
    "Count",
    "CountRoute",
    "Counts",
    "COUNTER",
    "COUNT_ROUTES",
    "DECLINE_REASONS",
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

TIERS = tuple(t.value for t in Tier)
DIRECTIONS = tuple(move.direction for move in Move)  # the byte counters' label per move
JOB_KINDS = tuple(move.value for move in Move)
QUEUES = ("spill_queue", "d2h_queue", "h2d_queue", "jobs_in_flight", "host_slots_in_flight",
          "remote_write_queue")
CHUNK_OPS = ("stored", "spilled", "promoted", "superseded", "remote_written", "remote_read")
SKIP_REASONS = ("store_host_full", "spill_disk_full", "promote_no_host_slot")
# Why a lower tier's hit was not taken (scheduler/policies.py).
DECLINE_REASONS = ("slower_than_recompute", "probe_wait_over_saving")
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
    """One metric: its name, type, help text and (at most two) labels with their known values.

    ``name`` is the family name; a counter is exposed as ``name + "_total"``, a histogram as
    ``_bucket``/``_sum``/``_count`` series. Every value in ``values`` (times every one in
    ``values2``, for a second label ``label2``) exists from the start at 0.
    """

    name: str
    kind: str
    help: str
    label: str | None = None
    values: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None
    label2: str | None = None
    values2: tuple[str, ...] = ()

    @property
    def exposed_names(self) -> tuple[str, ...]:
        if self.kind == COUNTER:
            return (self.name + "_total",)
        if self.kind == HISTOGRAM:
            return tuple(self.name + s for s in ("_bucket", "_sum", "_count"))
        return (self.name,)


def _spec(name: str, kind: str, help: str, label: str | None = None,
          values: Iterable[str] = (), buckets: tuple[float, ...] | None = None,
          label2: str | None = None, values2: Iterable[str] = ()) -> MetricSpec:
    return MetricSpec("vllm:tieredkv_" + name, kind, help, label, tuple(values), buckets,
                      label2, tuple(values2))


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
    "hits_declined": _spec(
        "hits_declined", COUNTER,
        "Lower-tier hits not taken, once per request and tier: slower_than_recompute (its "
        "read was predicted slower than recomputing its tokens: the request computes them), "
        "probe_wait_over_saving (the remote probe took longer than the hit could save; "
        "counted when the request ends, once the probe's answer shows Redis held more).",
        "tier", TIERS, label2="reason", values2=DECLINE_REASONS),
    "partial_hits": _spec(
        "partial_hits", COUNTER,
        "Hits that ended inside a chunk: a prompt's tail (fewer blocks than a chunk) loaded."),
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
    "partial_stores": _spec(
        "partial_stores", COUNTER,
        "Stores issued for a prompt's tail (its blocks past the last whole chunk); each that "
        "completes on every rank also counts in chunks{op=\"stored\"}."),
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
    "chunks_dropped_by_failed_loads": _spec(
        "chunks_dropped_by_failed_loads", COUNTER,
        "Host entries dropped because a load from them failed (vLLM recomputes their blocks; "
        "later lookups miss them)."),
    "load_blocks_unserved": _spec(
        "load_blocks_unserved", COUNTER,
        "Device blocks a hybrid model's load could not fill (vLLM kept more of a sliding "
        "window than was stored): the load fails without a copy and vLLM recomputes."),
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
    "remote_probed_chunks": _spec(
        "remote_probed_chunks", COUNTER,
        "Chunks remote probes asked about (one Redis key per chunk and rank)."),
    "remote_known_chunks": _spec(
        "remote_known_chunks", COUNTER,
        "Chunks a remote probe did not ask about because an earlier probe or our own write "
        "showed them present on every rank (a hint: reads still verify)."),
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


class Count(StrEnum):
    """Every counter the scheduler keeps; the value is its name in the stats snapshot.

    A counter named here ``by tier`` or ``by cause`` is keyed ``(count, label)`` (a
    :class:`~tieredkv.protocol.Tier`, a :class:`~tieredkv.protocol.FailureCause`); every other
    one by itself. :data:`COUNT_ROUTES` gives each the metric it feeds."""

    LOOKUPS = "lookups"
    LOOKUP_TOKENS = "lookup_tokens"
    HIT_TOKENS = "hit_tokens"  # by tier
    PARTIAL_HITS = "partial_hits"
    HITS_DECLINED_SLOWER = "hits_declined_slower_than_recompute"  # by tier
    HITS_DECLINED_PROBE_WAIT = "hits_declined_probe_wait_over_saving"  # by tier
    EVICTIONS = "evictions"  # by tier
    SUPERSEDED = "superseded"  # by tier
    DISK_ADMISSION_REJECTED = "disk_admission_rejected"
    REMOTE_ADMISSION_REJECTED = "remote_admission_rejected"
    STORE_SKIPPED_HOST_FULL = "store_skipped_host_full"
    SPILL_SKIPPED_DISK_FULL = "spill_skipped_disk_full"
    PROMOTE_NO_HOST_SLOT = "promote_no_host_slot"
    STORED_CHUNKS = "stored_chunks"
    STORED_PARTIAL_CHUNKS = "stored_partial_chunks"
    SPILLED_CHUNKS = "spilled_chunks"
    PROMOTED_CHUNKS = "promoted_chunks"
    REMOTE_WRITTEN_CHUNKS = "remote_written_chunks"
    REMOTE_READ_CHUNKS = "remote_read_chunks"
    PREEMPTIONS = "preemptions"
    RESETS = "resets"
    DROPPED_AT_RECOVERY = "dropped_at_recovery"
    JOURNAL_RECORDS_DROPPED = "journal_records_dropped"
    LOAD_FAILED = "load_failed"  # by cause
    CHUNKS_DROPPED_BY_FAILED_LOADS = "chunks_dropped_by_failed_loads"
    LOAD_ROWS_UNSERVED = "load_rows_unserved"
    DISK_READ_FAILED = "disk_read_failed"  # by cause
    STORE_FAILED = "store_failed"  # by cause
    SPILL_FAILED = "spill_failed"  # by cause
    REMOTE_READ_FAILED = "remote_read_failed"  # by cause
    REMOTE_PROBES = "remote_probes"
    REMOTE_PROBE_KEYS = "remote_probe_keys"
    REMOTE_PROBE_KNOWN_HITS = "remote_probe_known_hits"
    REMOTE_PROBE_FAILED = "remote_probe_failed"  # by cause
    REMOTE_WRITES_DROPPED = "remote_writes_dropped"
    REMOTE_WRITE_FAILED = "remote_write_failed"


@dataclass(frozen=True)
class CountRoute:
    """Where a :class:`Count` goes: metric ``spec`` (a key of :data:`METRIC_SPECS`), with label
    value ``value``. ``by``: the count is keyed ``(count, label)``; with ``value`` None the
    label is the metric's label value, otherwise a breakdown summed into ``value``.
    ``value2``: the second label's value, for a metric with two (``label2``)."""

    spec: str
    value: str | None = None
    by: bool = False
    value2: str | None = None


COUNT_ROUTES: dict[Count, CountRoute] = {
    Count.LOOKUPS: CountRoute("lookups"),
    Count.LOOKUP_TOKENS: CountRoute("lookup_tokens"),
    Count.HIT_TOKENS: CountRoute("hit_tokens", by=True),
    Count.PARTIAL_HITS: CountRoute("partial_hits"),
    Count.HITS_DECLINED_SLOWER: CountRoute("hits_declined", by=True,
                                           value2="slower_than_recompute"),
    Count.HITS_DECLINED_PROBE_WAIT: CountRoute("hits_declined", by=True,
                                               value2="probe_wait_over_saving"),
    Count.EVICTIONS: CountRoute("evictions", by=True),
    Count.SUPERSEDED: CountRoute("chunks", "superseded", by=True),
    Count.DISK_ADMISSION_REJECTED: CountRoute("disk_admission_rejected"),
    Count.REMOTE_ADMISSION_REJECTED: CountRoute("remote_admission_rejected"),
    Count.STORE_SKIPPED_HOST_FULL: CountRoute("skipped", "store_host_full"),
    Count.SPILL_SKIPPED_DISK_FULL: CountRoute("skipped", "spill_disk_full"),
    Count.PROMOTE_NO_HOST_SLOT: CountRoute("skipped", "promote_no_host_slot"),
    Count.STORED_CHUNKS: CountRoute("chunks", "stored"),
    Count.STORED_PARTIAL_CHUNKS: CountRoute("partial_stores"),
    Count.SPILLED_CHUNKS: CountRoute("chunks", "spilled"),
    Count.PROMOTED_CHUNKS: CountRoute("chunks", "promoted"),
    Count.REMOTE_WRITTEN_CHUNKS: CountRoute("chunks", "remote_written"),
    Count.REMOTE_READ_CHUNKS: CountRoute("chunks", "remote_read"),
    Count.PREEMPTIONS: CountRoute("preemptions"),
    Count.RESETS: CountRoute("resets"),
    Count.DROPPED_AT_RECOVERY: CountRoute("recovery_dropped"),
    Count.JOURNAL_RECORDS_DROPPED: CountRoute("journal_records_dropped"),
    Count.LOAD_FAILED: CountRoute("load_failures", by=True),
    Count.CHUNKS_DROPPED_BY_FAILED_LOADS: CountRoute("chunks_dropped_by_failed_loads"),
    Count.LOAD_ROWS_UNSERVED: CountRoute("load_blocks_unserved"),
    Count.DISK_READ_FAILED: CountRoute("load_failures", by=True),
    Count.STORE_FAILED: CountRoute("store_failures", by=True),
    Count.SPILL_FAILED: CountRoute("spill_failures", by=True),
    Count.REMOTE_READ_FAILED: CountRoute("remote_read_failures", by=True),
    Count.REMOTE_PROBES: CountRoute("remote_probes"),
    Count.REMOTE_PROBE_KEYS: CountRoute("remote_probed_chunks"),
    Count.REMOTE_PROBE_KNOWN_HITS: CountRoute("remote_known_chunks"),
    Count.REMOTE_PROBE_FAILED: CountRoute("remote_probe_failures", by=True),
    Count.REMOTE_WRITES_DROPPED: CountRoute("remote_writes_dropped"),
    Count.REMOTE_WRITE_FAILED: CountRoute("remote_write_failures"),
}
# Checked once at import: a Count without a route, or a route to no metric, cannot ship.
for _count in Count:
    _route = COUNT_ROUTES[_count]
    _spec_of = METRIC_SPECS[_route.spec]
    if _spec_of.kind != COUNTER or (_spec_of.label is None) != (_route.value is None
                                                                  and not _route.by) or (
            (_spec_of.label2 is None) != (_route.value2 not in _spec_of.values2)):
        raise AssertionError(f"tieredkv: counter {_count} routes to {_route.spec} wrongly")

# Where code that serves any tier below host counts a tier's own counter.
READ_FAILED: dict[Tier, Count] = {Tier.DISK: Count.DISK_READ_FAILED,
                                  Tier.REMOTE: Count.REMOTE_READ_FAILED}
ADMISSION_REJECTED: dict[Tier, Count] = {Tier.DISK: Count.DISK_ADMISSION_REJECTED,
                                         Tier.REMOTE: Count.REMOTE_ADMISSION_REJECTED}

CountKey = Count | tuple[Count, str]


def _declared(key: object, by_value: bool = False) -> bool:
    """Whether ``key`` is a declared counter in its shape; ``by_value``: a plain str naming
    a :class:`Count` counts as that Count (reads may use names; counting must use Counts)."""
    count, label = (key if len(key) == 2 else (None, None)) if isinstance(key, tuple) else (key, None)
    if by_value and isinstance(count, str) and not isinstance(count, Count):
        count = next((c for c in Count if c.value == count), None)
    if not isinstance(count, Count):
        return False
    if isinstance(key, tuple):
        return isinstance(label, str) and COUNT_ROUTES[count].by
    return not COUNT_ROUTES[count].by


# The counters counted by themselves, and those counted ``(count, label)``.
_UNLABELLED = frozenset(c for c in Count if not COUNT_ROUTES[c].by)
_LABELLED = frozenset(c for c in Count if COUNT_ROUTES[c].by)


def _undeclared(key: object) -> KeyError:
    return KeyError(f"tieredkv: {key!r} is not a declared counter (metrics/specs.py Count)")


class Counts(Counter):
    """The scheduler's counters: keyed by a :class:`Count`, or ``(count, label)`` for one
    counted by tier or cause. Any other key raises, counted or read (a misspelled counter
    read as 0 would make an assertion on it unable to fail), so every counter has a metric."""

    def __setitem__(self, key: CountKey, value: int) -> None:
        # Checked on every count, so the common shapes first (a lookup counts several times).
        if key.__class__ is Count:
            if key not in _UNLABELLED:
                raise _undeclared(key)
        elif not (key.__class__ is tuple and len(key) == 2 and key[0].__class__ is Count
                  and key[0] in _LABELLED and isinstance(key[1], str)):
            raise _undeclared(key)
        dict.__setitem__(self, key, value)

    def __missing__(self, key: object) -> int:
        """0 for a declared counter never counted; any other key raises."""
        if not _declared(key, by_value=True):
            raise _undeclared(key)
        return 0

    def update(self, other: Mapping[CountKey, int] | None = None, /,  # type: ignore[override]
               **kwargs: int) -> None:
        """Add counts (Counter's own skips ``__setitem__`` when empty: every key is checked)."""
        for key, n in {**dict(other or {}), **kwargs}.items():
            self[key] += n

    def snapshot(self) -> dict[str, Any]:
        """The counts as the stats snapshot carries them: ``{count: n}`` or
        ``{count: {label: n}}`` (plain strs, msgpack-safe); zeros left out."""
        out: dict[str, Any] = {}
        for key, n in self.items():
            if not n:
                continue
            if isinstance(key, tuple):
                count, label = key
                out.setdefault(count.value, {})[str(label)] = n
            else:
                out[key.value] = n
        return out


def route_counter(name: str, label: str | None = None
                  ) -> tuple[str, str | tuple[str, str] | None] | None:
    """The (spec id, label value) a scheduler counter of the snapshot feeds (a metric with two
    labels: the pair of values); None for a name no :class:`Count` declares (a newer peer's)
    or a shape that does not match it."""
    try:
        route = COUNT_ROUTES[Count(name)]
    except ValueError:
        return None
    if route.by != (label is not None):
        return None
    value = label if route.value is None else route.value
    if route.value2 is not None and value is not None:
        return route.spec, (value, route.value2)
    return route.spec, value
