"""Standalone probes: one question each, run as scripts (see benchmarks/README.md)."""
