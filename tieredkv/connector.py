"""The import path users put in ``kv_connector_module_path``; the adapter lives in ``tieredkv.vllm``."""

from tieredkv.vllm.connector import TieredKVConnector

__all__ = ["TieredKVConnector"]
