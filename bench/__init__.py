"""Benchmarks: `python bench/run.py` (TTFT table and plot), `python bench/hotpath.py` (overhead)."""
