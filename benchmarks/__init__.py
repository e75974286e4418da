"""Benchmarks: run on the GPU machine with ``python -m benchmarks.run --preset h200``."""
