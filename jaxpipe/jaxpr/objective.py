"""What a pipeline's ``loss_fn`` returns per microbatch, and how the pipeline reduces it.

A leaf module: the trace, the stages and every runtime read an :class:`Objective`, and
it imports nothing of jaxpipe.

- ``reduction="mean"`` (default): ``loss_fn`` returns the microbatch's loss; the
  pipeline's loss is their mean over microbatches (for a mean loss over equal
  microbatches, the full batch's loss).
- ``"sum"``: their sum. (With both, over batch axes a runtime splits by hand each
  shard's value counts as a mean over its rows: the shards' values are averaged.)
- ``"weighted"``: ``loss_fn`` returns ``(loss_sum, weight)`` (e.g. the summed loss of a
  microbatch's real tokens and their count); the pipeline's loss is ``sum(loss_sum) /
  sum(weight)`` over every microbatch and data shard, and its gradient that quotient's.
  Where the weight comes from the batch alone (``jaxpipe.jaxpr.weight.batch_weight``), a
  runtime totals it first and seeds each ``loss_sum`` with ``1 / total``; else each
  microbatch's gradient is of its ``loss_sum`` and the total is divided by the total
  weight once, after the last microbatch (exact for backward rules linear in the
  cotangent, JAX's own; not for a ``custom_vjp`` clipping its cotangent). A weight
  with a gradient in the parameters is refused at build
  (:func:`jaxpipe.jaxpr.weight.weight_has_gradient`).
- ``has_aux=True``: ``loss_fn`` returns ``(loss, aux)`` (with ``"weighted"``:
  ``((loss_sum, weight), aux)``), ``aux`` any pytree of arrays. Aux values never enter
  the gradient; the pipeline returns each leaf stacked over microbatches.

The traced loss outputs ``[loss, weight?, *aux leaves]``; the last stage outputs the
same, and only the loss is differentiated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp

__all__ = ["MEAN", "REDUCTIONS", "Objective", "sum_dtype"]

#: The reductions a pipeline's loss may use.
REDUCTIONS = ("mean", "sum", "weighted")


@dataclass(frozen=True)
class Objective:
    """What ``loss_fn`` returns and how the pipeline reduces it (see the module docstring).

    Attributes:
      reduction: ``"mean"``, ``"sum"`` or ``"weighted"``.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      aux_avals: one microbatch's aux leaves (abstract values; set by the trace).
      aux_treedef: the aux pytree's structure (set by the trace; ``None`` without aux).
    """

    reduction: str = "mean"
    has_aux: bool = False
    aux_avals: tuple[Any, ...] = ()
    aux_treedef: Any = None

    def __post_init__(self) -> None:
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {', '.join(map(repr, REDUCTIONS))}, "
                             f"got {self.reduction!r}")

    @property
    def weighted(self) -> bool:
        return self.reduction == "weighted"


    def seed(self, num_microbatches: int) -> float:
        """The cotangent each microbatch's loss output gets: ``1/m`` for a mean, else 1
        (a weighted loss divides the total gradient by the total weight at the end)."""
        return 1.0 / num_microbatches if self.reduction == "mean" else 1.0


#: The default objective: one scalar loss, averaged over microbatches.
MEAN = Objective()


def sum_dtype(dtype: Any) -> Any:
    """What a runtime sums losses and weights in: float32, or the loss's dtype where it is
    wider (float64 under x64); a bfloat16 or float16 loss is summed (and returned) in
    float32."""
    return jnp.promote_types(dtype, jnp.float32)
