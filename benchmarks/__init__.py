"""Reproducible measurements of the refit pipeline (``python -m benchmarks.refit --help``)."""
