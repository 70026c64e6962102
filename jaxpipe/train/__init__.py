"""Training: optax per stage, the train state, and the step's options.

Owns :class:`~jaxpipe.train.state.TrainState` (what ``Pipeline.init`` returns), the
per-stage optimizer the runtimes run (:class:`~jaxpipe.train.state.StageOptimizer`), the
checks that refuse optimizers a per-stage update would change
(:mod:`~jaxpipe.train.optimizer_checks`) and the step's options (clipping, non-finite
skips). Imports the jaxpr layer and the foundation only; the runtimes build on it, so
it names what it needs of them as protocols (:mod:`~jaxpipe.train.seams`).
"""

from jaxpipe.train.state import StageOptimizer, Trainer, TrainState

__all__ = ["StageOptimizer", "TrainState", "Trainer"]
