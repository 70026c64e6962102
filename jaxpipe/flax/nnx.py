"""``jp.flax.pipeline``: pipeline an nnx model's loss over its pure parameter dict."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxpipe.errors import PipelineError, PipelineTypeError
from jaxpipe.flax.delegating import Delegating, pipeline_fn, placed_on
from jaxpipe.flax.state import (
    check_same_model,
    check_updates,
    reseed,
    stream_tags,
    value,
    variables_of,
)
from jaxpipe.jaxpr.interpret import forwarded_outputs

__all__ = ["NnxPipeline", "pipeline"]



def _nnx_pure(x: Any, wrt: Any) -> Any:
    """Pure-dict parameters from an nnx Module, an nnx State, or a pure dict."""
    from flax import nnx

    if isinstance(x, nnx.Module):
        x = nnx.state(x, wrt)
    if isinstance(x, nnx.State):
        return nnx.to_pure_dict(x)
    return x


class NnxPipeline(Delegating):
    """A ``jp.Pipeline`` over an nnx model's parameters; made by :func:`pipeline`.

    Every method accepting parameters takes the model itself, an ``nnx.State`` of its
    parameters, or the pure ``dict`` (``nnx.to_pure_dict(state)``) the pipeline works on
    internally; gradients and :meth:`params` come back as that pure dict. All other
    ``jp.Pipeline`` attributes are forwarded.

    Attributes:
      pipe: the underlying ``jp.Pipeline`` (loss over the pure parameter dict).
      graphdef: the model's static structure.
      template: an ``nnx.State`` of the parameters, used to rebuild the model.
      rest: the model's non-parameter state, held constant inside the pipeline.
    """

    def __init__(self, pipe: Any, graphdef: Any, template: Any, rest: Any, wrt: Any,
                 rebuild: Callable[..., NnxPipeline] | None = None):
        self.pipe = pipe
        self.graphdef = graphdef
        self.template = template
        self.rest = rest
        # The values traced into the pipeline (the model's Variables may change later).
        self._rest_values = {path: value(v) for path, v in variables_of(rest)}
        self.wrt = wrt
        # ``rebuild(model, rng)``: this pipeline's arguments over another model (the same
        # model in another mode, for evaluation); one pipeline per mode, built once
        self._rebuild = rebuild
        # (graphdef, rng, pipeline): a list searched by ==, since a graphdef holding an
        # unhashable static attribute (a config dict on the model) cannot be a dict key
        self._modes: list[tuple[Any, bool, NnxPipeline]] = []

    def loss(self, params: Any, batch: Any, key: Any = None) -> Any:
        """The pipelined loss, forward only (``Pipeline.loss``).

        ``params``: the model, its parameters (``nnx.State`` or pure dict), or a training
        state. A model switched to another mode since the pipeline was built
        (``model.eval()``: dropout off) is evaluated in that mode: its pipeline is traced
        once, on first use, and kept (without a ``key`` it is built with ``rng=False``,
        for a model that draws nothing in that mode)."""
        from flax import nnx

        if isinstance(params, nnx.Module) and self._rebuild is not None:
            graphdef = nnx.split(params, self.wrt, ...)[0]
            if graphdef != self.graphdef:
                rng = self.pipe.inspect.rng and key is not None
                mode = next((p for g, r, p in self._modes if r == rng and g == graphdef),
                            None)
                if mode is None:
                    mode = self._rebuild(params, rng)
                    self._modes.append((graphdef, rng, mode))
                return mode.loss(params, batch, key)
        return super().loss(params, batch, key)

    def as_params(self, params: Any) -> Any:
        from flax import nnx

        if isinstance(params, nnx.Module):
            self._check_same_model(params)
        return _nnx_pure(params, self.wrt)

    def _check_same_model(self, model: Any) -> None:
        check_same_model(model, self.graphdef, self._rest_values, self.wrt)

    def update_model(self, model: Any, params: Any) -> Any:
        """Write ``params`` (pure dict, ``nnx.State``, or a :meth:`init` state) into ``model``.

        The model is updated in place (nnx semantics) and also returned, so
        ``pipe.update_model(model, pipe.params(state))`` after training leaves ``model``
        holding the trained weights.
        """
        from flax import nnx

        if not isinstance(model, nnx.Module):
            raise PipelineTypeError(
                f"update_model(model, params): model must be the nnx.Module to write into, "
                f"got {type(model).__name__}.")
        if not isinstance(params, nnx.State | Mapping):
            params = self.pipe.params(params)  # a training state from init/train_step
        pure = _nnx_pure(params, self.wrt)
        self.pipe.inspect.check_params(pure, "update_model(model, params)")
        nnx.update(model, _state_from_pure(self.template, pure))
        return model


def _state_from_pure(template: Any, pure: Any) -> Any:
    """A fresh ``nnx.State`` shaped like ``template`` holding the arrays of ``pure``."""
    from flax import nnx

    state = jax.tree.map(lambda v: v, template)  # new Variable objects, same metadata
    nnx.replace_by_pure_dict(state, pure)
    return state





def _passed_through(call: Callable, param_state: Any, rest: Any, microbatch: Any,
                    key: Any) -> set[str]:
    """The paths of the variables whose values ``call`` (the model's loss) returns as
    they came in, through any calls (:func:`jaxpipe.jaxpr.interpret.forwarded_outputs`):
    traced once more, from the variables' shapes."""
    def values_after(p_leaves: list, r_leaves: list, mb: Any, k: Any) -> list:
        _, p_after, r_after = call(jax.tree.unflatten(p_def, p_leaves),
                                   jax.tree.unflatten(r_def, r_leaves), mb, k)
        return jax.tree.leaves(p_after) + jax.tree.leaves(r_after)

    p_leaves, p_def = jax.tree.flatten(param_state)
    r_leaves, r_def = jax.tree.flatten(rest)
    shape = lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))  # noqa: E731
    closed = jax.make_jaxpr(values_after)(*jax.tree.map(shape, (p_leaves, r_leaves,
                                                                 microbatch, key)))
    paths = [p for p, _ in variables_of(param_state)] + [p for p, _ in variables_of(rest)]
    return {path for i, (path, src) in enumerate(zip(paths, forwarded_outputs(closed),
                                                     strict=True)) if src == i}


def pipeline(
    model: Any,
    loss_fn: Callable[[Any, Any], jax.Array],
    batch: Any,
    *,
    mesh: jax.sharding.Mesh,
    schedule: Any,
    cut: Any = "auto",
    axis: str = "pipe",
    wrt: Any = None,
    rng: bool = False,
    **kwargs: Any,
) -> NnxPipeline:
    """Pipeline an nnx model: ``loss_fn(model, microbatch) -> scalar`` over ``model``'s params.

    The model is split into ``graphdef``, its parameters (filter ``wrt``, default
    ``nnx.Param``) and the rest. The pipeline runs over the parameters as a pure
    ``dict``; inside the traced loss the model is merged back, so ``loss_fn`` is
    written exactly as for unpipelined code::

        model = GPT(cfg, rngs=nnx.Rngs(0))
        def loss_fn(model, mb):
            logits = model(mb["x"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, mb["y"]).mean()

        pipe = jp.flax.pipeline(model, loss_fn, batch, mesh=mesh, schedule=jp.OneFOneB(4, 8))
        state = pipe.init(model, optax.adamw(3e-4))
        state, metrics = pipe.train_step(state, batch)
        pipe.update_model(model, pipe.params(state))   # trained weights back in model

    Mark cut points with ``@jp.layer`` on the block class (or ``jp.boundary`` calls).
    Non-parameter state (batch statistics in eval mode) is read as a constant inside
    the pipeline; a ``loss_fn`` that updates it is refused (see the module doc). For
    dropout build with ``rng=True`` and pass a key per call: each microbatch's key
    reseeds the model's RNG streams (:func:`reseed`).

    Args:
      model: the nnx Module (not modified).
      loss_fn: per-microbatch loss ``loss_fn(model, microbatch) -> scalar``; the
        pipeline's loss is the mean over microbatches.
      batch: an example batch (pytree, leading axis split into microbatches).
      mesh, schedule, cut, axis: as for :func:`jaxpipe.pipeline`.
      wrt: nnx filter selecting the trained parameters (default ``nnx.Param``).
      rng: the model draws random numbers (dropout): every call then takes a PRNG key.
      **kwargs: passed on to :func:`jaxpipe.pipeline` (e.g. ``runtime="reference"``,
        ``has_aux=True``, ``reduction="weighted"``).
        By default the parameters keep the shardings flax placed them with (a model
        built under ``jax.set_mesh(mesh)`` with ``nnx.with_partitioning`` /
        ``kernel_metadata``); a model whose variables are on no mesh is sharded as
        their partitioning metadata declares (``nnx.get_partition_spec``), which
        ``param_specs="flax"`` asks for always.

    Returns:
      an :class:`NnxPipeline` (the ``jp.Pipeline`` API plus :meth:`NnxPipeline.update_model`).
    """
    from flax import nnx

    wrt = nnx.Param if wrt is None else wrt
    if not isinstance(model, nnx.Module):
        raise PipelineTypeError(
            f"jp.flax.pipeline expects an nnx.Module, got {type(model).__name__}; "
            "for linen use jp.flax.pipeline_linen(module, variables, loss_fn, batch, ...)"
        )
    if not callable(loss_fn):
        raise PipelineTypeError(
            f"jp.flax.pipeline(model, loss_fn, batch, ...): loss_fn must be a function "
            f"loss_fn(model, microbatch) -> scalar, got {type(loss_fn).__name__}.")
    graphdef, template, rest = nnx.split(model, wrt, ...)
    params = nnx.to_pure_dict(template)
    streams = stream_tags(rest)

    def call(param_state: Any, rest_state: Any, microbatch: Any, key: Any) -> tuple:
        m = nnx.merge(graphdef, param_state, rest_state)
        if key is not None:
            reseed(m, key)
        out = loss_fn(m, microbatch)
        _, p_after, r_after = nnx.split(m, wrt, ...)
        return out, p_after, r_after

    def run(p: Any, microbatch: Any, key: Any) -> jax.Array:
        # Fresh Variables belong to this trace, so the model may update them here (RNG
        # counters); what it updates is checked below.
        fresh = jax.tree.map(lambda v: v, rest)
        before = {path: value(v) for path, v in variables_of(fresh)}
        param_state = _state_from_pure(template, p)
        before_p = {path: value(v) for path, v in variables_of(param_state)}
        out, p_after, r_after = call(param_state, fresh, microbatch, key)
        check_updates(before, before_p, r_after, p_after, key is not None,
                      lambda: _passed_through(call, param_state, fresh, microbatch, key))
        return out

    if rng:
        def pure_loss(p: Any, microbatch: Any, key: Any) -> jax.Array:
            return run(p, microbatch, key)
    else:
        def pure_loss(p: Any, microbatch: Any) -> jax.Array:
            return run(p, microbatch, None)

    if rng and not streams:
        raise PipelineError(
            "jp.flax.pipeline(..., rng=True) but the model holds no RNG streams to seed "
            "(no nnx.Rngs stored in it, e.g. nnx.Dropout(rate, rngs=rngs)); give its "
            "random layers rngs=... or build without rng=True.")
    if isinstance(kwargs.get("param_specs"), str) and kwargs["param_specs"] == "flax":
        kwargs["param_specs"] = nnx.to_pure_dict(nnx.get_partition_spec(template))
    elif kwargs.get("param_specs") is None and not placed_on(params, mesh):
        # Variables made outside a mesh keep their sharding only as metadata: follow it.
        declared = nnx.to_pure_dict(nnx.get_partition_spec(template))
        if any(isinstance(s, PartitionSpec) and any(s) for s in jax.tree.leaves(
                declared, is_leaf=lambda x: isinstance(x, PartitionSpec))):
            kwargs["param_specs"] = declared
    pipe = pipeline_fn()(pure_loss, params, batch, mesh=mesh, schedule=schedule, cut=cut,
                          axis=axis, rng=rng, **kwargs)

    def rebuild(other: Any, other_rng: bool) -> NnxPipeline:
        return pipeline(other, loss_fn, batch, mesh=mesh, schedule=schedule, cut=cut,
                        axis=axis, wrt=wrt, rng=other_rng, **kwargs)

    return NnxPipeline(pipe, graphdef, template, rest, wrt, rebuild)
