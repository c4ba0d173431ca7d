"""The parts of ``python -m benchmarks.multi_replica`` (the command line and the docstring are
in :mod:`benchmarks.multi_replica`): ``workload`` (serve_bench's chat with varied user turns,
routed turn by turn to alternating replicas; the tiers' sizes), ``runner`` (each configuration's
two servers and one shared Redis, the rounds), ``judging`` (hits summed over both replicas,
pooled figures, shared against separate, the checks) and ``report``.
"""
