"""How a stats payload becomes Prometheus samples: :class:`TieredKVMetrics`.

The recorder builds the metrics of :data:`~tieredkv.metrics.specs.METRIC_SPECS` with whatever
metric classes it is given and folds every stats payload (see :mod:`tieredkv.metrics.snapshot`)
into them: counters increase by the deltas, gauges are set, histograms observe every latency
sample. Inside vLLM the classes are vLLM's (or Ray's wrappers) and the labels vLLM's
``model_name``/``engine`` (:class:`tieredkv.vllm.prometheus.TieredKVPromMetrics`); outside,
plain ``prometheus_client`` classes bound to a registry (:mod:`tieredkv.metrics.exporter`).
Imports neither vLLM nor prometheus_client.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tieredkv.metrics.specs import (
    GAUGE,
    HISTOGRAM,
    LATENCY_BUCKETS,
    METRIC_SPECS,
    TIERS,
    MetricSpec,
    route_counter,
)
from tieredkv.protocol import FAILURE_CAUSES, Tier

logger = logging.getLogger("tieredkv")

MetricFactory = Callable[..., Any]
# A child's own label values: none, one, or (a metric with two labels) a pair.
LabelValue = str | tuple[str, str] | None


def _label_values(spec: MetricSpec) -> list[LabelValue]:
    """Every label value (pair) of ``spec`` that exists from the start at 0."""
    if not spec.label:
        return [None]
    if not spec.label2:
        return list(spec.values)
    return [(v, v2) for v in spec.values for v2 in spec.values2]


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
        self._children: dict[tuple[Any, str, LabelValue], Any] = {}
        self._queue_depths: dict[Any, dict[str, dict[str, float]]] = {}
        self._lock = threading.Lock()
        for engine, values in per_engine_labelvalues.items():
            self.add_engine(engine, values)

    def _create(self, spec: MetricSpec, classes: Mapping[str, MetricFactory]) -> Any:
        labelnames = self._labelnames + [n for n in (spec.label, spec.label2) if n]
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
                for value in _label_values(spec):
                    self._child(engine, key, value)

    def _child(self, engine: Any, key: str, value: LabelValue) -> Any:
        child = self._children.get((engine, key, value))
        if child is None:
            own = [] if value is None else [value] if isinstance(value, str) else list(value)
            values = self._labelvalues[engine] + own
            child = self._children[(engine, key, value)] = self._families[key].labels(*values)
        return child

    def child(self, engine: Any, key: str, value: LabelValue = None) -> Any:
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

    def _inc(self, engine: Any, key: str, value: LabelValue, delta: float) -> None:
        if delta > 0:
            self._child(engine, key, value).inc(delta)
        elif delta < 0:
            logger.debug("tieredkv: negative delta %s for %s ignored", delta, key)

    def _observe_scheduler(self, sched: Mapping[str, Any], engine: Any) -> None:
        for name, counted in (sched.get("counters") or {}).items():
            by_label = counted if isinstance(counted, Mapping) else {None: counted}
            for label, delta in by_label.items():
                route = route_counter(name, label)
                if route is not None:
                    self._inc(engine, route[0], route[1], delta)
        probe_latency = (sched.get("latency_s") or {}).get("remote_probe") or ()
        if probe_latency:
            histogram = self._child(engine, "remote_probe_latency", None)
            for seconds in probe_latency:
                histogram.observe(seconds)
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
        for tier_field, key in (("remote_capacity_bytes", "capacity_bytes"),
                                ("remote_used_bytes", "used_bytes")):
            if tier_field in gauges:  # Redis's own figures (INFO memory), not slots
                self._child(engine, key, Tier.REMOTE.value).set(gauges[tier_field])
        if "remote_up" in gauges:
            self._child(engine, "remote_up", None).set(gauges["remote_up"])
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
            self._inc(engine, "remote_write_failures", None, snap.get("remote_writes_failed") or 0)
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
