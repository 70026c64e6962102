"""Baselines that jaxpipe is compared against in ``benchmarks/run.py``."""
