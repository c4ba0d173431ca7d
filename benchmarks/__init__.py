"""tieredkv's benchmarks, one script each; run them from the repository root as modules::

    python -m benchmarks.serve_bench --help

A script holds its command line; its parts (workload, runner, judging, report) live in a
subpackage: ``ttft`` (e2e_ttft), ``serve`` (serve_bench, whose chat client multi_replica and
soak use too), ``scheduler``, ``remote``, ``replicas`` (multi_replica), ``endurance`` (soak).
Shared helpers (machine facts, KV geometry, results files, progress, plots) are in
:mod:`benchmarks.common`; servers are started with :class:`tieredkv.tools.vllm_server.Server`.
"""
