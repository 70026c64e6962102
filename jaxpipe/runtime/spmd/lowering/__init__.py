"""The lowering: a schedule to the static tables the SPMD program scans (numpy only).

Nothing here imports JAX's tracing machinery; the program (:mod:`..program`) reads what
this package returns. Modules, in the order the lowering runs them:

- :mod:`.types` -- the data types every step hands on (a leaf: imports nothing back);
- :mod:`.ticks` -- which actions run and in which tick; :mod:`.tick_rule` -- when an
  action may run given the others; :mod:`.fusion` -- which backwards share a step;
- :mod:`.messages` -- the values moved between actions, and when (the CPU program's lazy
  exchange);
- :mod:`.allocate` -- liveness-sized buffer slots;
- :mod:`.table` -- one row of integer fields per (step, device) (its types in
  :mod:`.tick_table`);
- :mod:`.sync` -- the sync model (how long the lowered program takes where devices run
  concurrently); :mod:`.refine` -- a local search over ticks under it;
- :mod:`.lower` -- :func:`lower`, which runs them all.
"""

from jaxpipe.runtime.spmd.lowering.allocate import allocate, first_fit
from jaxpipe.runtime.spmd.lowering.lower import lower, lower_accelerator
from jaxpipe.runtime.spmd.lowering.messages import list_messages, merge_exchanges
from jaxpipe.runtime.spmd.lowering.table import fill_table
from jaxpipe.runtime.spmd.lowering.tick_rule import resettle, settle, tick_constraints
from jaxpipe.runtime.spmd.lowering.tick_table import (
    IDLE,
    PROGRAM_KINDS,
    ActionFields,
    StepFields,
    TickTable,
    branch_id,
)
from jaxpipe.runtime.spmd.lowering.ticks import assign_ticks, expand, ticks_of
from jaxpipe.runtime.spmd.lowering.types import (
    ACCELERATOR_EXCHANGE,
    CONCURRENT_CPU_EXCHANGE,
    CPU_EXCHANGE,
    OVERLAPPED_EXCHANGE,
    Allocation,
    Exchange,
    Lowering,
    Message,
    Messages,
    Pool,
    Ticks,
    Timing,
)

__all__ = ["ACCELERATOR_EXCHANGE", "CONCURRENT_CPU_EXCHANGE", "CPU_EXCHANGE", "IDLE",
           "OVERLAPPED_EXCHANGE", "PROGRAM_KINDS", "ActionFields", "Allocation", "Exchange",
           "Lowering", "Message", "Messages", "Pool", "StepFields", "TickTable", "Ticks",
           "Timing", "allocate", "assign_ticks", "branch_id", "expand", "fill_table",
           "first_fit", "list_messages", "lower", "lower_accelerator", "merge_exchanges",
           "resettle", "settle", "tick_constraints", "ticks_of"]
