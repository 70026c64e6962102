"""Trace the loss on a mesh, settling which batch axes stay manual by tracing it.

The mesh axes' roles come from the user (:func:`jaxpipe.sharding.mesh_axes.
resolve_mesh_axes`); two of them can only be settled by tracing the model:

- a model on Explicit axes that shards its own values over a manual batch axis fails
  to trace with it manual: that axis is left to JAX's sharding instead (the rows typed
  split over it; :func:`jaxpipe.sharding.constraints.explicit_batch_axes_automatic`);
- batch axes the model's own sharding constraints name stay under JAX's sharding, found
  in the traced jaxpr, and the loss is traced again without them manual: no batch axis
  where the user named none, an automatic one where the batch was split over it
  (:func:`jaxpipe.sharding.constraints.without_constrained_batch_axes`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh

from jaxpipe.api.inputs import check_microbatch_rows
from jaxpipe.errors import PipelineError
from jaxpipe.jaxpr.objective import Objective
from jaxpipe.jaxpr.trace import Traced, trace_shard
from jaxpipe.jaxpr.weight import weight_has_gradient
from jaxpipe.sharding.constraints import (
    explicit_batch_axes_automatic,
    without_constrained_batch_axes,
)
from jaxpipe.sharding.mesh_axes import Dims, MeshAxes
from jaxpipe.sharding.typed import trace_context, typed_batch_sharding, typed_shardings

__all__ = ["shards", "trace_on_mesh"]


def shards(mesh: Mesh, axes: Sequence[str]) -> int:
    """How many pieces ``axes`` of ``mesh`` split a value into."""
    return int(np.prod([mesh.shape[a] for a in axes])) if axes else 1


def trace_on_mesh(loss_fn: Callable, params: Any, mb: Any, *, mesh: Mesh, mesh_axes: MeshAxes,
                  param_dims: Sequence[Dims], num_microbatches: int,
                  mb_shapes: Sequence[tuple[int, ...]], key_dtype: Any, objective: Objective,
                  axes_free: bool) -> tuple[Traced, MeshAxes]:
    """Trace one microbatch's data shard of ``loss_fn`` with ``mesh_axes`` as the mesh's
    roles, or with the batch axes the model turns out to shard itself left automatic.

    Returns the traced loss and the roles it was traced with. ``key_dtype``: the rng key's
    dtype (``None``: no key); ``axes_free``: the user chose no batch axes (neither
    ``batch_axes=`` nor a placed batch), so the model's own constraints may take some.
    """

    def trace(axes: MeshAxes) -> Traced:
        check_microbatch_rows(mb_shapes, num_microbatches, shards(mesh, axes.batch_axes),
                              axes.batch_axes)
        with trace_context(mesh, axes):
            return trace_shard(loss_fn, params, mb, shards(mesh, axes.manual_batch_axes),
                               shards(mesh, axes.auto_batch_axes) if key_dtype is not None else 0,
                               key_dtype, objective, typed_shardings(mesh, axes, param_dims),
                               typed_batch_sharding(mesh, axes))

    try:
        traced = trace(mesh_axes)
    except PipelineError:
        raise
    except Exception as err:
        automatic = explicit_batch_axes_automatic(mesh, mesh_axes)
        if automatic is None:
            raise
        try:
            traced = trace(automatic)
        except Exception:
            raise err from None
        mesh_axes = automatic
    kept = without_constrained_batch_axes(mesh, mesh_axes, traced.jaxpr, axes_free)
    if kept is not None:
        traced, mesh_axes = trace(kept), kept
    if weight_has_gradient(traced):
        raise PipelineError(
            'reduction="weighted": the weight loss_fn returns has a gradient in the '
            "parameters, and the pipeline divides the summed loss gradients by the total "
            "weight as a constant (its gradient term, -(loss / weight) * d(weight), would "
            "be missing). Return a weight the parameters do not differentiate: one the "
            "batch gives (a token count), or wrap it in jax.lax.stop_gradient if a "
            "constant is what you mean.")
    return traced, mesh_axes
