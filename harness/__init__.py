"""What students run but never edit: data, rank pools, checks, profiling, analysis, benchmark.

Tools run as modules from the repository root, e.g. `uv run python -m harness.benchmark`.
Importing the package imports nothing else: each module pulls in only what it needs.
"""
