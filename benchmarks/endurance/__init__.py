"""The parts of ``python -m benchmarks.soak`` (the command line and the docstring are in
:mod:`benchmarks.soak`): ``workload`` (the prompt pool, the Zipf choice of prompts),
``probes`` (what is read off the running server and its disk tier, and the payload bytes the
fault injector flips), ``runner`` (the reference outputs, then the clients, the sampler and
the injector under load), ``judging`` (the leak rules, the checks) and ``report``.
"""
