"""What a training step does besides the optimizer: global-norm clipping, non-finite skips.

:class:`TrainOptions` is what ``Pipeline.init(params, tx, clip_global_norm=...,
skip_nonfinite=...)`` records; every runtime's ``make_train_step`` receives it and applies
it with :func:`global_norm_scale` over the squared norm of *all* stages' gradients
(:func:`sq_norm` per stage, summed across the pipe), which an optimizer run per stage
could not compute.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxpipe.errors import PipelineError

__all__ = ["TrainOptions", "global_norm_scale", "sq_norm"]


@dataclass(frozen=True)
class TrainOptions:
    """Options of a training step that are not the optimizer's own.

    Attributes:
      skip_nonfinite: if the loss or the gradient norm is NaN/inf, leave the state
        unchanged for that step (``metrics["skipped"] == 1``).
      clip_global_norm: clip gradients by their true global norm (over all stages)
        before the optimizer; ``None`` for no clipping.
    """

    skip_nonfinite: bool = False
    clip_global_norm: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.skip_nonfinite, bool):
            raise PipelineError(
                f"skip_nonfinite must be True or False, got {self.skip_nonfinite!r}.")
        c = self.clip_global_norm
        # a numpy or JAX scalar counts as the number it holds
        number = (not isinstance(c, bool | np.bool_) and np.ndim(c) == 0
                  and np.issubdtype(np.asarray(c).dtype, np.number)) if c is not None else False
        if c is not None and (not number or not math.isfinite(float(c)) or float(c) <= 0):
            raise PipelineError(
                f"clip_global_norm must be a positive finite number (or None for no "
                f"clipping), got {c!r}.")
        if c is not None:
            object.__setattr__(self, "clip_global_norm", float(c))



def global_norm_scale(sq_norm: jax.Array, options: TrainOptions) -> tuple[jax.Array, jax.Array]:
    """``(gradient norm, scale to apply)`` from the global squared norm."""
    gnorm = jnp.sqrt(sq_norm)
    scale = jnp.ones((), sq_norm.dtype)
    if options.clip_global_norm is not None:
        scale = jnp.minimum(1.0, options.clip_global_norm / jnp.maximum(gnorm, 1e-12))
    return gnorm, scale


def sq_norm(leaves: Sequence[jax.Array]) -> jax.Array:
    """Sum of squares of the differentiable leaves, in float32 (float64 where a leaf is)."""
    inexact = [x for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]
    dtype = jnp.result_type(jnp.float32, *(x.dtype for x in inexact))
    total = jnp.zeros((), dtype)
    for x in inexact:
        total = total + jnp.sum(jnp.square(x.astype(dtype)))
    return total


