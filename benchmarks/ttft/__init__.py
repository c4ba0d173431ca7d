"""The parts of ``python -m benchmarks.e2e_ttft`` (the command line and its docstring are in
:mod:`benchmarks.e2e_ttft`), one job each: ``workload`` (geometry, prompts, the hit each row
must show, the rows' names), ``specs`` (each configuration's engine settings and phases),
``child`` (one engine in its own process, driven over stdin/stdout), ``runner`` (the parent:
the raw disk read, the children, Redis and the LMCache peer's server), ``judging`` (the proof
that each hit hit, the targets), ``report`` (Markdown, results files) and ``plot``.

Nothing here imports tieredkv or vLLM at import time: the LMCache row's child runs in a
virtualenv where neither tieredkv nor this repository's egg-info is installed.
"""
