"""The types the stages are traced with where the mesh's parameter axes are Explicit.

Where some parameter axis is Explicit (sharding in types), the stages are traced with the
parameters' sharded types (:func:`typed_shardings`) and, under FSDP, the microbatch's
(:func:`typed_batch_sharding`), inside the mesh's abstract mesh (:func:`trace_context`);
the program's buffers then take their values' types. Elsewhere all three are ``None`` /
no context, and the stages are traced untyped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding

from jaxpipe.sharding.mesh_axes import Dims, MeshAxes, to_spec

__all__ = ["explicit_param_axes", "trace_context", "typed_batch_sharding", "typed_shardings"]


def explicit_param_axes(mesh: Mesh, mesh_axes: MeshAxes) -> tuple[str, ...]:
    """The parameter axes of type Explicit (sharding in types)."""
    return tuple(a for a in mesh_axes.param_axes
                 if mesh.axis_types[mesh.axis_names.index(a)] == AxisType.Explicit)


def typed_shardings(mesh: Mesh, mesh_axes: MeshAxes, dims: Sequence[Dims]) -> list | None:
    """Per parameter, the ``NamedSharding`` its traced type carries when some parameter
    axis is Explicit (sharding in types: the stages are traced with it); else ``None``."""
    if not explicit_param_axes(mesh, mesh_axes):
        return None
    return [NamedSharding(mesh, to_spec(d)) for d in dims]


def typed_batch_sharding(mesh: Mesh, mesh_axes: MeshAxes) -> NamedSharding | None:
    """The ``NamedSharding`` a microbatch leaf's traced type carries: its rows split over
    the automatic batch axes (a parameter axis the batch is split over too: FSDP) when
    types carry the mesh's Explicit axes; else ``None``. Inside the program the stages
    see the microbatch so split (``build_step`` reshards it), and what they compute from
    it (a residual, a message) has that type: its buffers must be traced with it."""
    axes = tuple(a for a in mesh_axes.auto_batch_axes
                 if mesh.axis_types[mesh.axis_names.index(a)] == AxisType.Explicit)
    if not explicit_param_axes(mesh, mesh_axes) or not axes:
        return None
    return NamedSharding(mesh, to_spec((axes,)))


def trace_context(mesh: Mesh, mesh_axes: MeshAxes) -> Any:
    """What tracing the stages runs under: the mesh, when types carry its Explicit axes."""
    if not explicit_param_axes(mesh, mesh_axes):
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh.abstract_mesh)
