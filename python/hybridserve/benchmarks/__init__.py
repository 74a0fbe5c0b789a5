"""Benchmarks behind `hybridserve bench` (serve: load generator; offline: engine throughput).

Importing this package loads neither torch nor matplotlib.
"""
