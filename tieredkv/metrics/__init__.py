"""Counters and their export (vLLM-free: vLLM's stats/Prometheus glue is in tieredkv.vllm)."""
