"""The parts of ``python -m benchmarks.multi_replica`` (the command line and the docstring are
in :mod:`benchmarks.multi_replica`): ``workload`` (serve_bench's chat with varied user turns,
routed turn by turn to alternating replicas; the tiers' sizes), ``runner`` (each configuration's
two servers alone, round by round, and one shared Redis), ``breakdown`` (where a request's
time goes, from the replicas' histograms and the client's timings), ``judging`` (hits summed
over both replicas, pooled figures, shared against separate, the checks and targets) and
``report``.
"""
