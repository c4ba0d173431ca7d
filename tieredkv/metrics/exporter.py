"""The standalone exporter: tieredkv's metrics without vLLM, in a ``prometheus_client`` registry.

The same metrics reach Prometheus two ways:

* inside vLLM, through :class:`tieredkv.vllm.prometheus.TieredKVPromMetrics`: vLLM's stat logger
  builds it with its own metric classes and ``model_name``/``engine`` labels, and feeds it the
  :class:`~tieredkv.vllm.stats.TieredKVStats` payload of every engine step;
* outside vLLM (benchmarks, the store on its own, the scheduler half's ``metrics_port``),
  through :func:`build_exporter_metrics` and :func:`start_exporter` here: plain
  ``prometheus_client`` metrics in a registry of the caller's choosing, with a ``model_name``
  label.

Both paths build their metrics from :data:`~tieredkv.metrics.specs.METRIC_SPECS` and feed them
with :class:`~tieredkv.metrics.recorder.TieredKVMetrics`, so names, help texts, label values and
the way a stats payload (:mod:`tieredkv.metrics.snapshot`) turns into samples cannot drift
apart. This module does not import vLLM (importing it takes tens of seconds and the store does
not need it).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from tieredkv.metrics.recorder import MetricFactory, TieredKVMetrics
from tieredkv.metrics.specs import COUNTER, GAUGE, HISTOGRAM


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

    Always the text format, as vLLM's own ``/metrics`` serves: prometheus_client (0.22 on)
    answers a Prometheus that asks for OpenMetrics with names escaped, ``vllm:`` becoming
    ``vllm_``, and the dashboard's ``vllm:tieredkv_*`` queries would then find nothing.
    """
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                self.send_error(404)
                return
            body = generate_latest(registry)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet scrapes
            pass

    server = ThreadingHTTPServer((addr, port), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="tieredkv-metrics", daemon=True)
    thread.start()
    return server, thread
