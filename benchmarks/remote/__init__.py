"""The parts of ``python -m benchmarks.remote_throughput`` (the command line, :func:`run` and
the docstring are in :mod:`benchmarks.remote_throughput`): ``workload`` (shard sizes, profiles,
one case's keys and values), ``passes`` (tieredkv's store, redis-py and redis-benchmark moving
the same bytes, timed) and ``report`` (rows, verdicts, the table and headline).
"""
