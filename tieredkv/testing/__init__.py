"""Fault injection and launchers for tests, soak runs and benchmarks; never imported in production."""
