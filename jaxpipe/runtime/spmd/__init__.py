"""The SPMD runtime: lowering (schedule -> typed tick tables), layout, program, optimizer.

- :mod:`.lowering` — static tables and liveness-sized buffers from a schedule.
- :mod:`.layout` — parameter slots and flat layouts of stored values and messages.
- :mod:`.program` — the one ``jit(shard_map)`` program that scans over the tables.
- :mod:`.optimizer` — the per-stage optimizer update inside that program.
- :mod:`.executor` — :class:`SpmdRuntime` / :class:`SpmdExecutor`, the runtime seam.
"""

from jaxpipe.runtime.spmd.executor import SpmdExecutor, SpmdRuntime

__all__ = ["SpmdExecutor", "SpmdRuntime"]
