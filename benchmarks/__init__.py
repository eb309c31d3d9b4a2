"""Benchmarks (not installed); run from the repository root, e.g. `python -m benchmarks.bench_ops`."""
