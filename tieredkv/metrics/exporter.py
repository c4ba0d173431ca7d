"""tieredkv's Prometheus metrics: one table of definitions, one recorder, a standalone exporter.

The same metrics reach Prometheus two ways:

* inside vLLM, through :class:`tieredkv.vllm.prometheus.TieredKVPromMetrics`: vLLM's stat logger
  builds it with its own metric classes and ``model_name``/``engine`` labels, and feeds it the
  :class:`~tieredkv.vllm.stats.TieredKVStats` payload of every engine step;
* outside vLLM (benchmarks, the store on its own), through :func:`build_exporter_metrics` and
  :func:`start_exporter` here: plain ``prometheus_client`` metrics in a registry of the
  caller's choosing, with a ``model_name`` label.

Both paths build their metrics from :data:`METRIC_SPECS` and feed them with
:class:`TieredKVMetrics`, so names, help texts, label values and the way a stats payload turns
into samples cannot drift apart. This module does not import vLLM (importing it takes tens of
seconds and the store does not need it).

The payload (see ``tieredkv/vllm/stats.py``) carries counter *deltas* and latest gauge values::

    {"scheduler": {"counters": {name: delta}, "gauges": {name: value},
                   "chunk_bytes": int, "chunk_tokens": int, "world_size": int},
     "workers": {"<rank>": {"bytes": {dir: n}, "ops": {dir: n}, "spills_dropped": n,
                             "reads_retried": {cause: n}, "reads_recovered": n,
                             "failures": {kind: n}, "latency_s": {job_kind: [s, ...]},
                             "queue_depths": {name: n}}}}

Counters increase by the deltas, gauges are set, histograms observe every latency sample.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from tieredkv.protocol import FAILURE_CAUSES

logger = logging.getLogger("tieredkv")

TIERS = ("host", "disk")
DIRECTIONS = ("d2h", "h2d", "spill", "restore")
JOB_KINDS = ("store", "spill", "promote", "load")
QUEUES = ("spill_queue", "d2h_queue", "h2d_queue", "jobs_in_flight", "host_slots_in_flight")
CHUNK_OPS = ("stored", "spilled", "promoted", "superseded")
SKIP_REASONS = ("store_host_full", "spill_disk_full", "promote_no_host_slot")

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
        "job", JOB_KINDS, LATENCY_BUCKETS),
    "queue_depth": _spec(
        "queue_depth", GAUGE,
        "Work queued in the transfer engines, summed over ranks (latest value per rank).",
        "queue", QUEUES),
    "capacity_bytes": _spec(
        "capacity_bytes", GAUGE,
        "KV payload bytes a tier can hold, all ranks (slots x chunk bytes x world size).",
        "tier", TIERS),
    "used_bytes": _spec(
        "used_bytes", GAUGE,
        "KV payload bytes in a tier's occupied slots (ready or being written), all ranks.",
        "tier", TIERS),
    "evictions": _spec(
        "evictions", COUNTER, "Chunks evicted to make room, by tier.", "tier", TIERS),
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
    "recovery_dropped": _spec(
        "recovery_dropped", COUNTER,
        "Disk entries dropped while recovering the index at start-up (bad or missing slot "
        "headers)."),
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
}
# Failure counters are named <prefix><cause>.
_FAILURE_ROUTES: tuple[tuple[str, str], ...] = (
    ("load_failed_", "load_failures"),
    ("disk_read_failed_", "load_failures"),
    ("store_failed_", "store_failures"),
    ("spill_failed_", "spill_failures"),
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


MetricFactory = Callable[..., Any]


class TieredKVMetrics:
    """The metrics of :data:`METRIC_SPECS`, built with the given classes, fed stats payloads.

    ``classes`` maps ``"counter"``/``"gauge"``/``"histogram"`` to constructors with
    ``prometheus_client``'s signature (vLLM passes its own, or Ray wrappers). Each engine key of
    ``per_engine_labelvalues`` gets its children for every known label value at construction,
    so every cause, tier and direction is exported at 0 before anything happens.
    """

    def __init__(
        self,
        classes: Mapping[str, MetricFactory],
        labelnames: Iterable[str],
        per_engine_labelvalues: Mapping[Any, Iterable[object]],
    ) -> None:
        self._labelnames = list(labelnames)
        self._families = {key: self._create(spec, classes) for key, spec in METRIC_SPECS.items()}
        self._labelvalues: dict[Any, list[str]] = {}
        self._children: dict[tuple[Any, str, str | None], Any] = {}
        self._queue_depths: dict[Any, dict[str, dict[str, float]]] = {}
        self._lock = threading.Lock()
        for engine, values in per_engine_labelvalues.items():
            self.add_engine(engine, values)

    def _create(self, spec: MetricSpec, classes: Mapping[str, MetricFactory]) -> Any:
        labelnames = self._labelnames + ([spec.label] if spec.label else [])
        kwargs: dict[str, Any] = {
            "name": spec.name, "documentation": spec.help, "labelnames": labelnames,
        }
        if spec.kind == GAUGE:
            # vLLM's API server may run several processes (PROMETHEUS_MULTIPROC_DIR).
            kwargs["multiprocess_mode"] = "mostrecent"
        elif spec.kind == HISTOGRAM:
            kwargs["buckets"] = list(spec.buckets or LATENCY_BUCKETS)
        return classes[spec.kind](**kwargs)

    def add_engine(self, engine: Any, labelvalues: Iterable[object]) -> None:
        """Create every child of one engine (one set of base label values) at 0."""
        with self._lock:
            self._labelvalues[engine] = [str(v) for v in labelvalues]
            for key, spec in METRIC_SPECS.items():
                for value in spec.values if spec.label else (None,):
                    self._child(engine, key, value)

    def _child(self, engine: Any, key: str, value: str | None) -> Any:
        child = self._children.get((engine, key, value))
        if child is None:
            values = self._labelvalues[engine] + ([value] if value is not None else [])
            child = self._children[(engine, key, value)] = self._families[key].labels(*values)
        return child

    def child(self, engine: Any, key: str, value: str | None = None) -> Any:
        """The labelled metric of one engine (for tests and callers that record directly)."""
        with self._lock:
            return self._child(engine, key, value)

    def observe(self, data: Mapping[str, Any], engine: Any = None) -> None:
        """Fold one stats payload in: counters += deltas, gauges = values, histograms observe.

        ``engine`` is a key of ``per_engine_labelvalues`` (vLLM's engine index); None means
        the first one.
        """
        if not data:
            return
        with self._lock:
            if engine is None:
                engine = next(iter(self._labelvalues), None)
            if engine not in self._labelvalues:
                logger.warning("tieredkv: metrics for unknown engine %r ignored", engine)
                return
            self._observe_scheduler(data.get("scheduler") or {}, engine)
            self._observe_workers(data.get("workers") or {}, engine)

    def _inc(self, engine: Any, key: str, value: str | None, delta: float) -> None:
        if delta > 0:
            self._child(engine, key, value).inc(delta)
        elif delta < 0:
            logger.debug("tieredkv: negative delta %s for %s ignored", delta, key)

    def _observe_scheduler(self, sched: Mapping[str, Any], engine: Any) -> None:
        for name, delta in (sched.get("counters") or {}).items():
            route = route_counter(name)
            if route is None:
                continue
            self._inc(engine, route[0], route[1], delta)
        gauges = sched.get("gauges") or {}
        if not gauges:
            return
        chunk_bytes = sched.get("chunk_bytes")
        world_size = sched.get("world_size") or 1
        if chunk_bytes is not None:
            for tier in TIERS:
                for field, key in (("capacity", "capacity_bytes"), ("used", "used_bytes")):
                    slots = gauges.get(f"{tier}_slots_{field}")
                    if slots is not None:
                        self._child(engine, key, tier).set(slots * chunk_bytes * world_size)
        if "host_slots_pinned" in gauges:
            self._child(engine, "pinned_host_slots", None).set(gauges["host_slots_pinned"])
        if "requests_waiting_on_load" in gauges:
            self._child(engine, "requests_waiting_on_load", None).set(
                gauges["requests_waiting_on_load"]
            )

    def _observe_workers(self, workers: Mapping[str, Any], engine: Any) -> None:
        depths = self._queue_depths.setdefault(engine, {})
        changed_queues: set[str] = set()
        for rank, snap in workers.items():
            for direction, nbytes in (snap.get("bytes") or {}).items():
                self._inc(engine, "bytes", direction, nbytes)
            for direction, ops in (snap.get("ops") or {}).items():
                self._inc(engine, "operations", direction, ops)
            self._inc(engine, "spills_dropped", None, snap.get("spills_dropped") or 0)
            for cause, count in (snap.get("reads_retried") or {}).items():
                if cause in FAILURE_CAUSES:
                    self._inc(engine, "disk_reads_retried", cause, count)
            self._inc(engine, "disk_reads_recovered", None, snap.get("reads_recovered") or 0)
            for job, samples in (snap.get("latency_s") or {}).items():
                if not samples:
                    continue
                histogram = self._child(engine, "transfer_latency", job)
                for seconds in samples:
                    histogram.observe(seconds)
                if job == "load":
                    load = self._child(engine, "load_latency", None)
                    for seconds in samples:
                        load.observe(seconds)
            queue_depths = snap.get("queue_depths")
            if queue_depths is not None:
                depths[str(rank)] = dict(queue_depths)
                changed_queues.update(queue_depths)
        # A gauge over ranks: the sum of each rank's latest report.
        for queue in changed_queues:
            total = sum(d.get(queue, 0) for d in depths.values())
            self._child(engine, "queue_depth", queue).set(total)


# ---------------------------------------------------------------------------- standalone


def registry_classes(registry: CollectorRegistry) -> dict[str, MetricFactory]:
    """``prometheus_client`` metric classes that register into ``registry``."""

    def bind(cls: type) -> type:
        class Bound(cls):  # type: ignore[valid-type, misc]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                kwargs.setdefault("registry", registry)
                super().__init__(*args, **kwargs)

        Bound.__name__ = Bound.__qualname__ = cls.__name__
        return Bound

    return {COUNTER: bind(Counter), GAUGE: bind(Gauge), HISTOGRAM: bind(Histogram)}


def build_exporter_metrics(
    registry: CollectorRegistry,
    data: Mapping[str, Any] | None = None,
    model_name: str = "tieredkv",
) -> TieredKVMetrics:
    """Create the tieredkv metrics in ``registry``, labelled ``model_name``, and record ``data``.

    Same names, help texts and label values as inside vLLM; the only base label is
    ``model_name``. Keep the returned object and call ``observe(payload)`` with every later
    payload (counter deltas, latest gauges); building twice in one registry raises ValueError
    (duplicated time series), as prometheus_client does.
    """
    metrics = TieredKVMetrics(registry_classes(registry), ["model_name"], {model_name: [model_name]})
    if data:
        metrics.observe(data)
    return metrics


def start_exporter(port: int, registry: CollectorRegistry, addr: str = "127.0.0.1"):
    """Serve ``registry`` at ``http://addr:port/metrics`` from a daemon thread.

    Loopback by default. Returns ``(server, thread)``; ``server.server_port`` is the port bound
    (pass ``port=0`` for a free one) and ``server.shutdown()`` stops it.
    """
    return start_http_server(port, addr=addr, registry=registry)
