"""The parts of ``python -m benchmarks.scheduler_bench`` (the command line, :func:`run` and the
docstring are in :mod:`benchmarks.scheduler_bench`): ``workload`` (prompt sizes, profiles),
``sides`` (the two scheduler halves built as vLLM builds them, requests and steps), ``measure``
(the timed calls, alternating between the sides) and ``report`` (rows, verdicts, table, plot).
"""
