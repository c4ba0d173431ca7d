"""multi_replica's per-request breakdown: where a request's time to first token goes (probe
wait, remote read, load, compute, waiting), from the client's timings and the replicas'
``/metrics`` (vLLM's request histograms and tieredkv's), and the sentence that says where
the shared tier loses when it does."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.serve.judging import metric_sum

#: (metric, labels, how the per-request figure is derived). Every figure is the growth of a
#: histogram's ``_sum`` between the scrapes before and after a run, summed over both
#: replicas, divided by the run's completed requests: a mean per request, in seconds.
PARTS: dict[str, tuple[str, dict[str, str] | None, str]] = {
    "server_ttft": ("vllm:time_to_first_token_seconds_sum", None,
                    "vLLM's TTFT histogram: the request's arrival at the engine to its first token"),
    "waiting": ("vllm:request_queue_time_seconds_sum", None,
                "vLLM's queue-time histogram: arrival to first scheduled; a request whose KV is "
                "being probed, read or loaded by tieredkv is not scheduled yet, so this holds "
                "that wait as well as the wait for other requests' steps"),
    "compute": ("vllm:request_prefill_time_seconds_sum", None,
                "vLLM's prefill-time histogram: first scheduled to first token (the forward "
                "passes that compute what was not hit, batched with other requests' steps)"),
    "probe": ("vllm:tieredkv_remote_probe_latency_seconds_sum", None,
              "tieredkv's remote probe latency histogram: the round trip of each existence probe "
              "to Redis (one per prompt and lookup)"),
    "read": ("vllm:tieredkv_transfer_latency_seconds_sum", {"kind": "remote_read"},
             "tieredkv's transfer latency histogram, remote_read jobs: Redis -> host slot, per "
             "chunk and rank (jobs overlap, so this is work, not wall time)"),
    "load": ("vllm:tieredkv_load_latency_seconds_sum", None,
             "tieredkv's load latency histogram: host slots -> device blocks of a request's hit, "
             "per rank"),
}
CLIENT = ("client_ttft", "the client's mean TTFT (request sent to first streamed token)")
OVERHEAD = ("http", "client_ttft - server_ttft: HTTP, the API server and detokenisation")
ORDER = ("client_ttft", "server_ttft", "waiting", "probe", "read", "load", "compute", "http")


def derivations() -> dict[str, str]:
    """How each figure of :func:`per_request` is derived (printed with the table)."""
    out = {CLIENT[0]: CLIENT[1], OVERHEAD[0]: OVERHEAD[1]}
    out.update({key: f"{how} (`{metric}{_labels(labels)}` growth over the run, both replicas, "
                     "/ completed requests)" for key, (metric, labels, how) in PARTS.items()})
    return {key: out[key] for key in ORDER}


def _labels(labels: Mapping[str, str] | None) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""


def per_request(befores: Sequence[str], afters: Sequence[str],
                records: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Mean seconds per completed request of each part (see :data:`PARTS`), from one run's
    scrapes of every replica before and after it and its client records."""
    ok = [r for r in records if r.get("ok")]
    n = len(ok)
    out: dict[str, float] = {"requests": float(n)}
    out[CLIENT[0]] = sum(r["ttft_s"] for r in ok) / n if n else math.nan
    for key, (metric, labels, _how) in PARTS.items():
        grown = sum(metric_sum(a, metric, labels) - metric_sum(b, metric, labels)
                    for b, a in zip(befores, afters, strict=True))
        out[key] = grown / n if n else math.nan
    out[OVERHEAD[0]] = out[CLIENT[0]] - out["server_ttft"]
    return out


def pool(parts: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Several runs' :func:`per_request` figures as one mean per request (weighted by requests)."""
    total = sum(p.get("requests", 0.0) for p in parts)
    out: dict[str, float] = {"requests": total}
    for key in ORDER:
        out[key] = (sum(p[key] * p["requests"] for p in parts if p.get("requests") and p[key] == p[key]) / total
                    if total else math.nan)
    return out


def where_time_goes(shared: Mapping[str, float], separate: Mapping[str, float]) -> str:
    """One sentence: per part, shared minus separate in ms per request, the largest growth
    named first (what to look at when the shared tier loses)."""
    deltas = {k: shared[k] - separate[k] for k in ORDER[2:] if shared.get(k) == shared.get(k)
              and separate.get(k) == separate.get(k)}
    if not deltas:
        return "no breakdown measured"
    worst = max(deltas, key=lambda k: deltas[k])
    listed = ", ".join(f"{k} {1e3 * v:+.1f}" for k, v in sorted(deltas.items(), key=lambda kv: -kv[1]))
    return (f"shared - separate per request (ms): {listed}; the most added time: {worst} "
            f"({1e3 * deltas[worst]:+.1f} ms)")
