"""tieredkv: tiered KV-cache offload for vLLM (pinned host memory, then NVMe)."""

__version__ = "0.1.0"
