"""The SPMD runtime: every schedule as one ``jax.jit(jax.shard_map(...))`` program.

Two subpackages and the seam between them and the rest of jaxpipe:

- :mod:`.lowering` (numpy) -- a schedule to typed static tables, liveness-sized buffers
  and the sync model of the program's time;
- :mod:`.program` (JAX) -- where values live, what a step runs, the tick loop and its
  ``shard_map``, the optimizer update after it;
- :mod:`.runtime` -- :class:`SpmdRuntime`, the runtime seam, over its options
  (:mod:`.options`); :mod:`.executor` -- :class:`SpmdExecutor`, the program it builds.

The lowering never imports the program; the program reads the lowering's data types.
"""

from jaxpipe.runtime.spmd.executor import SpmdExecutor
from jaxpipe.runtime.spmd.runtime import SpmdRuntime

__all__ = ["SpmdExecutor", "SpmdRuntime"]
