"""tieredkv's benchmarks, one module each; run them from the repository root as modules::

    python -m benchmarks.serve_bench --help

Shared helpers (machine facts, KV geometry, results files, progress, plots) are in
:mod:`benchmarks.common`; servers are started with :class:`tieredkv.tools.vllm_server.Server`.
"""
