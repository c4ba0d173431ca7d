"""Everything that imports vLLM, and nothing else does: the connector and its two halves."""
