"""Benchmarks: `python -m bench.engine` (see docs/benchmarks.md)."""
