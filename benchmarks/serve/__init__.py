"""The parts of ``python -m benchmarks.serve_bench`` (the command line and its docstring are in
:mod:`benchmarks.serve_bench`), one job each: ``workload`` (the seeded multi-turn chat and the
device, tier and model-length sizes drawn from it), ``configs`` (the server configurations, a
registry other modules can add to), ``servers`` (their command lines, environment and
start-up), ``client`` (the streamed chat client that plays one level's users), ``runner`` (the
sweep: repeat by repeat, level by level), ``judging`` (summaries, hit rates from ``/metrics``,
spreads, targets) and ``report`` (Markdown, PNG, results files).

``benchmarks.multi_replica`` and ``benchmarks.soak`` play the same chat with the same client.
"""
