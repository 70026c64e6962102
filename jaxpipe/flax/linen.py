"""``jp.flax.pipeline_linen``: pipeline a linen module's loss over ``variables["params"]``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import PartitionSpec

from jaxpipe.errors import PipelineError, PipelineTypeError
from jaxpipe.flax.delegating import Delegating, pipeline_fn, placed_on
from jaxpipe.flax.state import same_tree

__all__ = ["LinenPipeline", "pipeline_linen"]



class LinenPipeline(Delegating):
    """A ``jp.Pipeline`` over a linen module's ``variables["params"]``; see :func:`pipeline_linen`.

    Methods accepting parameters take either the ``params`` collection or the full
    ``variables`` dict (its ``"params"`` entry is used). All other ``jp.Pipeline``
    attributes are forwarded.
    """

    def __init__(self, pipe: Any, module: Any, variables: Mapping[str, Any]):
        self.pipe = pipe
        self.module = module
        self.variables = variables

    def as_params(self, params: Any) -> Any:
        if isinstance(params, Mapping) and set(params) == set(self.variables):
            # The full variables dict: its other collections must be the ones the
            # pipeline reads as constants, or they would be silently ignored.
            for name in params:
                if name != "params" and not same_tree(params[name], self.variables[name]):
                    raise PipelineError(
                        f"variables[{name!r}] differs from the one the pipeline was built "
                        "with; the pipeline reads collections other than 'params' as "
                        "constants. Rebuild it with jp.flax.pipeline_linen(module, "
                        "variables, ...) to use the new values.")
            return params["params"]
        _check_boxing(params, self.variables["params"])
        return params

    def update_variables(self, variables: Mapping[str, Any], params: Any) -> dict[str, Any]:
        """Return ``variables`` with its ``"params"`` replaced by ``params``.

        ``params`` is a params pytree or a training state from :meth:`init` /
        :meth:`train_step`. Linen variables are immutable, so a new dict is returned.
        """
        if not isinstance(params, Mapping):
            params = self.pipe.params(params)
        if not isinstance(variables, Mapping):
            raise PipelineTypeError(
                "update_variables(variables, params): variables must be the dict from "
                f"module.init, got {type(variables).__name__}.")
        self.pipe.inspect.check_params(params, "update_variables(variables, params)")
        return {**variables, "params": params}


def pipeline_linen(
    module: Any,
    variables: Mapping[str, Any],
    loss_fn: Callable[[Any, Any, Any], jax.Array],
    batch: Any,
    *,
    mesh: jax.sharding.Mesh,
    schedule: Any,
    cut: Any = "auto",
    axis: str = "pipe",
    rng: bool = False,
    **kwargs: Any,
) -> LinenPipeline:
    """Pipeline a linen module: ``loss_fn(module, variables, microbatch) -> scalar``.

    ``loss_fn`` is written as for unpipelined linen code, calling
    ``module.apply(variables, ...)``. The pipeline trains ``variables["params"]``;
    other collections (e.g. ``batch_stats``) are passed through as constants::

        model = MLP(features=(256, 256, 10))
        variables = model.init(jax.random.key(0), x)
        def loss_fn(module, variables, mb):
            return jnp.mean((module.apply(variables, mb["x"]) - mb["y"]) ** 2)

        pipe = jp.flax.pipeline_linen(model, variables, loss_fn, batch,
                                      mesh=mesh, schedule=jp.GPipe(2, 4))
        loss, grads = pipe.value_and_grad(variables["params"], batch)

    Args:
      module: the linen Module (unbound).
      variables: the result of ``module.init``; must contain ``"params"``.
      loss_fn: per-microbatch loss; the pipeline's loss is the mean over microbatches.
      batch, mesh, schedule, cut, axis: as for :func:`jaxpipe.pipeline`.
      rng: ``loss_fn(module, variables, microbatch, key)`` gets microbatch ``i``'s key
        (``jax.random.fold_in(key, i)`` of the key passed to each call), e.g. for
        ``module.apply(variables, x, rngs={"dropout": key})``.
      **kwargs: passed on to :func:`jaxpipe.pipeline` (e.g. ``runtime="reference"``).
        By default the parameters keep the shardings they are placed with; parameters
        on no mesh are sharded as their partitioning boxes declare
        (``nn.with_partitioning``, or ``nn.with_logical_partitioning`` mapped by the
        ``nn.logical_axis_rules`` active when the pipeline is built).

    Returns:
      a :class:`LinenPipeline` (the ``jp.Pipeline`` API plus
      :meth:`LinenPipeline.update_variables`).
    """
    if not callable(loss_fn):
        raise PipelineTypeError(
            "jp.flax.pipeline_linen(module, variables, loss_fn, batch, ...): loss_fn must be "
            f"a function loss_fn(module, variables, microbatch) -> scalar, got "
            f"{type(loss_fn).__name__}.")
    if not isinstance(variables, Mapping) or "params" not in variables:
        raise PipelineTypeError(
            "jp.flax.pipeline_linen expects the variables dict returned by module.init "
            f"(with a 'params' collection); got {type(variables).__name__}"
        )
    # Unfreeze once so the rebuilt variables are plain dicts like the params pytree.
    variables = {k: v for k, v in variables.items()}
    others = {k: v for k, v in variables.items() if k != "params"}

    if rng:
        def params_loss(params: Any, microbatch: Any, key: Any) -> jax.Array:
            return loss_fn(module, {**others, "params": params}, microbatch, key)
    else:
        def params_loss(params: Any, microbatch: Any) -> jax.Array:
            return loss_fn(module, {**others, "params": params}, microbatch)

    if kwargs.get("param_specs") is None and not placed_on(variables["params"], mesh):
        declared = _linen_specs(variables["params"], mesh, axis)
        if declared is not None:
            kwargs["param_specs"] = declared
    pipe = pipeline_fn()(params_loss, variables["params"], batch, mesh=mesh,
                          schedule=schedule, cut=cut, axis=axis, rng=rng, **kwargs)
    return LinenPipeline(pipe, module, variables)


def _is_box(x: Any) -> bool:
    """A linen partitioning box (``nn.with_partitioning`` and the like)."""
    from flax.core import meta

    return isinstance(x, meta.AxisMetadata)


def _boxed(tree: Any) -> bool:
    return any(map(_is_box, jax.tree.leaves(tree, is_leaf=_is_box)))


def _check_boxing(params: Any, built: Any) -> None:
    """Refuse unboxed params for a pipeline built from boxed ones (or the other way):
    the structures differ by the boxes alone, which the generic mismatch does not say."""
    from flax.core import meta

    if _boxed(params) == _boxed(built):
        return
    if jax.tree.structure(meta.unbox(params)) != jax.tree.structure(meta.unbox(built)):
        return  # another structure altogether: the pipeline's own check says so
    if _boxed(built):
        raise PipelineError(
            "the pipeline was built from boxed linen params (nn.with_partitioning / "
            "nn.with_logical_partitioning boxes, as module.init returns them) and takes "
            "params in those boxes; these are unboxed (nn.meta.unbox). Pass the boxed "
            "params, or build the pipeline from the unboxed variables "
            "(nn.meta.unbox(variables): placed with their shardings, they keep them).")
    raise PipelineError(
        "the pipeline was built from unboxed linen params and takes them unboxed; these "
        "are in partitioning boxes (as module.init returns them): pass "
        "nn.meta.unbox(params), or build the pipeline from the boxed variables.")


def _linen_specs(params: Any, mesh: Any, axis: str) -> Any:
    """The specs linen's partitioning boxes declare (``nn.with_partitioning``: mesh axes;
    ``nn.with_logical_partitioning``: logical names through the active
    ``nn.logical_axis_rules``, as ``nn.logical_to_mesh`` maps them), or ``None`` when no
    parameter is boxed."""
    from flax import linen as nn
    from flax.core import meta

    if not _boxed(params):
        return None

    named = [x for x in jax.tree.leaves(params, is_leaf=_is_box)
             if isinstance(x, nn.LogicallyPartitioned) and any(n is not None for n in x.names)]
    other_axes = [a for a, n in mesh.shape.items() if a != axis and n > 1]
    if named and other_axes and not named[0].rules and not nn.get_logical_axis_rules():
        # with no rules every logical name maps to no mesh axis: all replicated, silently
        raise PipelineError(
            f"the parameters name logical axes (nn.with_logical_partitioning, e.g. "
            f"{tuple(named[0].names)}) but no nn.logical_axis_rules are active while the "
            f"pipeline is built, so none would map to a mesh axis and every parameter would "
            f"be replicated over {other_axes}. Build it inside "
            "`with nn.logical_axis_rules(rules):`, or pass param_specs=..., or parameters "
            "placed with their shardings.")

    def spec(x: Any) -> Any:  # in the box, so the specs have the structure of params
        if isinstance(x, nn.LogicallyPartitioned):
            return x.replace_boxed(nn.logical_to_mesh_axes(x.names, x.rules))
        if isinstance(x, meta.Partitioned):
            return x.replace_boxed(PartitionSpec(*x.names))
        return None

    return jax.tree.map(spec, params, is_leaf=_is_box)
