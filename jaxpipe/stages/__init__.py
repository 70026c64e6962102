"""The stages layer: a traced loss cut into stage functions a runtime can run.

- :mod:`~jaxpipe.stages.stage_fn` — :class:`StageFn` (one stage as closed jaxprs:
  forward with residuals, backward, split I/W backward, and their bookkeeping) and
  :class:`StageParts`;
- :mod:`~jaxpipe.stages.fragments` — :class:`Fragments`, which builds the stage of any
  range of equations; :mod:`~jaxpipe.stages.backward_split` — a backward split into its
  input-gradient and weight-gradient halves (zero-bubble schedules);
- :mod:`~jaxpipe.stages.splitter` — :func:`split`: a traced loss cut after the given
  markers into ``StageFn`` s, each under its recomputation policy;
- :mod:`~jaxpipe.stages.shared_cores` — a first or last stage as a prologue, a core a
  middle stage shares and an epilogue, so a runtime compiles the blocks once;
- :mod:`~jaxpipe.stages.remat` — recomputation policies (what a stage stores for its
  backward); :mod:`~jaxpipe.stages.stacks` — scanned layer stacks cut between iterations.

Imports the jaxpr and sharding layers and the foundation; the cutter, which costs a
segment by splitting it, and the runtimes build on it.
"""

from jaxpipe.stages.fragments import Fragments
from jaxpipe.stages.splitter import split
from jaxpipe.stages.stage_fn import StageFn, StageParts, param_owners

__all__ = ["Fragments", "StageFn", "StageParts", "param_owners", "split"]
