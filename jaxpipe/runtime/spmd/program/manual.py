"""The one ``jax.shard_map`` wrapper: manual over the program's manual axes, placed outside.

Every ``shard_map`` of the SPMD runtime (the tick program, and the moves of parameters
into and out of the stage layout) goes through :func:`manual_shard_map`. Its specs are
the arrays' specs *outside* the map, over every mesh axis: inputs and outputs are placed
on them, and the map itself gets their manual part, so the axes the program leaves to
JAX (FSDP, tensor) keep their sharding across the boundary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpipe.sharding.mesh_axes import MeshAxes, constrain_to, manual_spec

__all__ = ["manual_shard_map", "place", "place_tree"]


def place(x: Any, mesh: Mesh, spec: P) -> Any:
    """Constrain ``x`` (inside jit) to ``spec`` on ``mesh``, for Auto, Explicit and mixed
    meshes (:func:`jaxpipe.sharding.mesh_axes.constrain_to`)."""
    return constrain_to(x, mesh, spec)


def place_tree(tree: Any, mesh: Mesh, specs: Any) -> Any:
    """:func:`place` every leaf of ``tree`` on its spec (``specs``: a prefix tree)."""
    return jax.tree.map(lambda s, x: jax.tree.map(lambda y: place(y, mesh, s), x), specs, tree,
                        is_leaf=lambda x: isinstance(x, P))


def manual_shard_map(fn: Callable, mesh: Mesh, axes: MeshAxes, in_specs: Any,
                     out_specs: Any) -> Callable:
    """``fn`` mapped manual over ``axes.manual_axes`` of ``mesh``.

    ``in_specs`` / ``out_specs``: prefix trees of the inputs' and outputs' specs outside
    the map. The returned function places its arguments on ``in_specs``, runs the map on
    their manual part, and places the results on ``out_specs`` (a fully manual map's
    out_specs already are the outputs' shardings).
    """
    manual = set(axes.manual_axes)

    def inner(specs: Any) -> Any:
        return jax.tree.map(lambda s: manual_spec(s, manual), specs,
                            is_leaf=lambda x: isinstance(x, P))

    mapped = jax.shard_map(fn, mesh=mesh, in_specs=inner(in_specs),
                           out_specs=inner(out_specs), check_vma=False,
                           **axes.shard_map_kwargs(mesh))

    def run(*args: Any) -> Any:
        out = mapped(*place_tree(args, mesh, in_specs))
        if manual == set(mesh.axis_names):
            return out
        return place_tree(out, mesh, out_specs)

    return run
