"""Runtimes: ``spmd`` (one jit(shard_map) program) and ``reference`` (sequential, for tests)."""
