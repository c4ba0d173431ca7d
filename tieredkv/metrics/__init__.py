"""Counters and their export, vLLM-free (vLLM's stats/Prometheus interfaces are in tieredkv.vllm).

:mod:`~tieredkv.metrics.snapshot` the stats payload both halves report and how it merges;
:mod:`~tieredkv.metrics.specs` every metric's definition; :mod:`~tieredkv.metrics.recorder`
how a payload becomes Prometheus samples; :mod:`~tieredkv.metrics.exporter` the standalone
``prometheus_client`` exporter.
"""
