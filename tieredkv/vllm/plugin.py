"""vLLM general plugin: registers ``TieredKVConnector`` by name (safe to call repeatedly)."""

from __future__ import annotations


def register() -> None:
    """Let ``"kv_connector": "TieredKVConnector"`` work without ``kv_connector_module_path``."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if "TieredKVConnector" in KVConnectorFactory._registry:
        return
    KVConnectorFactory.register_connector(
        "TieredKVConnector", "tieredkv.vllm.connector", "TieredKVConnector"
    )
