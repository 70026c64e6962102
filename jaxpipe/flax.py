"""Flax integration: ``@jp.layer`` on Module classes, and pipelines over nnx / linen models.

Decorating a Module class
-------------------------
``@jp.layer`` on a flax ``nnx.Module`` or ``linen.Module`` subclass returns a
*subclass* (same ``__name__``, ``__qualname__``, ``__module__``, fields and
methods) whose ``__call__`` passes its outputs through :func:`jaxpipe.boundary`.
Every call of the module is then one cuttable unit for the pipeline cutter::

    @jp.layer
    class Block(nnx.Module):
        def __init__(self, d, *, rngs):
            self.linear = nnx.Linear(d, d, rngs=rngs)

        def __call__(self, x):
            return x + nnx.relu(self.linear(x))

Without a pipeline the boundary is the identity, so outputs, parameter trees
(names included) and serialization are exactly those of the undecorated class.
A subclass rather than in-place patching is used so that ``jp.layer(nnx.Linear)``
gives a cuttable ``Linear`` without changing flax's own ``Linear`` everywhere.
The wrapping needs nothing from flax: it is :func:`jaxpipe.markers.layer_class`
(re-exported here as ``jaxpipe.flax.layer_class``).

Pipelining a model
------------------
:func:`pipeline` (nnx) and :func:`pipeline_linen` (linen) are thin adapters over
:func:`jaxpipe.pipeline`: they pull the trainable parameters out of the model as a
pure ``dict`` pytree, pipeline a loss over that dict (rebuilding the model inside
the traced loss), and hand back an object with the whole ``jp.Pipeline`` API plus a
way to write trained parameters back into the model or variables.

State that is not a trained parameter
-------------------------------------
- *Randomness (dropout).* Build with ``rng=True`` and pass a PRNG key to every call
  (``pipe.value_and_grad(model, batch, key)``, ``pipe.train_step(state, batch, key)``).
  Microbatch ``i`` gets ``jax.random.fold_in(key, i)`` (see :func:`jaxpipe.pipeline`);
  for nnx, every RNG stream of the model is reseeded from it before ``loss_fn`` runs
  (:func:`reseed`), so the streams' keys and counters flow through the stages and each
  dropout layer of each microbatch draws its own bits. For linen, ``loss_fn`` receives
  the key as its last argument (``module.apply(..., rngs={"dropout": key})``). A loss
  that draws from the model's streams without ``rng=True`` is refused: every
  microbatch and step would reuse the same bits.
- *Other non-parameter state* (batch statistics in eval mode, constants) is read as a
  constant. A loss that *updates* it (``nnx.BatchNorm`` in training mode, or assigning
  to a parameter) is refused: the pipeline returns only the loss and gradients, so the
  update would be lost. Passing a model whose non-parameter state or static attributes
  changed since the pipeline was built is refused the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jaxpipe.errors import PipelineError, PipelineTypeError
from jaxpipe.flax_state import (
    check_same_model,
    check_updates,
    reseed,  # re-exported: what rng=True does per microbatch
    same_tree,
    stream_tags,
    value,
    variables_of,
)
from jaxpipe.markers import layer_class  # re-exported: the class form of @jp.layer

__all__ = [
    "layer_class",
    "pipeline",
    "pipeline_linen",
    "reseed",
    "NnxPipeline",
    "LinenPipeline",
]

# --------------------------------------------------------------------------- helpers


def _pipeline_fn() -> Callable[..., Any]:
    # Imported late: jaxpipe.frontend pulls in the tracer/cutter/runtime, which the
    # markers (and models merely decorated with them) never need.
    from jaxpipe.frontend import pipeline as jp_pipeline

    return jp_pipeline


class _Delegating:
    """Forward every attribute not defined here to the wrapped ``jp.Pipeline``."""

    pipe: Any

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not found normally; guard against recursion while
        # ``pipe`` itself is not set yet (e.g. during unpickling).
        if name == "pipe":
            raise AttributeError(name)
        return getattr(self.pipe, name)

    @property
    def plan(self) -> Any:
        """The wrapped pipeline's plan (stages, layers, bytes, bubble); printable."""
        return self.pipe.plan

    def shard(self, params: Any) -> Any:
        """Move parameters into the per-device stage layout (see ``Pipeline.shard``)."""
        return self.pipe.shard(self._as_params(params))

    def unshard(self, staged: Any) -> Any:
        """Inverse of :meth:`shard`: the parameters as the pure-dict pytree."""
        return self.pipe.unshard(staged)

    def value_and_grad(self, params: Any, batch: Any, key: Any = None
                       ) -> tuple[jax.Array, Any]:
        """Pipelined mean loss over microbatches and its gradient (a pure dict);
        ``key`` with ``rng=True``."""
        return self.pipe.value_and_grad(self._as_params(params), batch, key)

    def loss(self, params: Any, batch: Any, key: Any = None) -> Any:
        """The pipelined loss, forward only (``Pipeline.loss``): parameters as for
        :meth:`value_and_grad`, or a :meth:`init` / :meth:`train_step` state (evaluated in
        the stage layout). ``(loss, aux)`` with ``has_aux=True``."""
        from jaxpipe.train import TrainState

        if isinstance(params, TrainState):
            return self.pipe.loss(params, batch, key)
        return self.pipe.loss(self._as_params(params), batch, key)

    def init(self, params: Any, optimizer: Any, *, skip_nonfinite: bool = False,
             clip_global_norm: float | None = None) -> Any:
        """Training state for :meth:`train_step` (parameters + optax state, staged);
        options as for ``Pipeline.init``."""
        return self.pipe.init(self._as_params(params), optimizer,
                              skip_nonfinite=skip_nonfinite, clip_global_norm=clip_global_norm)

    def train_step(self, state: Any, batch: Any, key: Any = None
                   ) -> tuple[Any, dict[str, Any]]:
        """One jitted optimizer step; ``state`` is donated. Returns ``(state, metrics)``;
        ``key`` with ``rng=True``."""
        return self.pipe.train_step(state, batch, key)

    def params(self, state: Any) -> Any:
        """The parameters (pure-dict pytree) held in a :meth:`init`/:meth:`train_step` state."""
        return self.pipe.params(state)

    def _as_params(self, params: Any) -> Any:  # pragma: no cover - overridden
        return params


# --------------------------------------------------------------------------- nnx


def _nnx_pure(x: Any, wrt: Any) -> Any:
    """Pure-dict parameters from an nnx Module, an nnx State, or a pure dict."""
    from flax import nnx

    if isinstance(x, nnx.Module):
        x = nnx.state(x, wrt)
    if isinstance(x, nnx.State):
        return nnx.to_pure_dict(x)
    return x


class NnxPipeline(_Delegating):
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
        self._modes: dict[Any, NnxPipeline] = {}

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
                rng = self.pipe.rng and key is not None
                if (graphdef, rng) not in self._modes:
                    self._modes[(graphdef, rng)] = self._rebuild(params, rng)
                return self._modes[(graphdef, rng)].loss(params, batch, key)
        return super().loss(params, batch, key)

    def _as_params(self, params: Any) -> Any:
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
        self.pipe.check_params(pure, "update_model(model, params)")
        nnx.update(model, _state_from_pure(self.template, pure))
        return model


def _state_from_pure(template: Any, pure: Any) -> Any:
    """A fresh ``nnx.State`` shaped like ``template`` holding the arrays of ``pure``."""
    from flax import nnx

    state = jax.tree.map(lambda v: v, template)  # new Variable objects, same metadata
    nnx.replace_by_pure_dict(state, pure)
    return state



def _placed_on(params: Any, mesh: Any) -> bool:
    """Some leaf of ``params`` carries a ``NamedSharding`` over ``mesh``'s axes."""
    return any(isinstance(getattr(x, "sharding", None), NamedSharding)
               and tuple(x.sharding.mesh.axis_names) == tuple(mesh.axis_names)
               for x in jax.tree.leaves(params))


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

    def run(p: Any, microbatch: Any, key: Any) -> jax.Array:
        # Fresh Variables belong to this trace, so the model may update them here (RNG
        # counters); what it updates is checked below.
        fresh = jax.tree.map(lambda v: v, rest)
        before = {path: value(v) for path, v in variables_of(fresh)}
        param_state = _state_from_pure(template, p)
        before_p = {path: value(v) for path, v in variables_of(param_state)}
        m = nnx.merge(graphdef, param_state, fresh)
        if key is not None:
            reseed(m, key)
        out = loss_fn(m, microbatch)
        _, p_after, r_after = nnx.split(m, wrt, ...)
        check_updates(before, before_p, r_after, p_after, rng=key is not None)
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
    elif kwargs.get("param_specs") is None and not _placed_on(params, mesh):
        # Variables made outside a mesh keep their sharding only as metadata: follow it.
        declared = nnx.to_pure_dict(nnx.get_partition_spec(template))
        if any(isinstance(s, PartitionSpec) and any(s) for s in jax.tree.leaves(
                declared, is_leaf=lambda x: isinstance(x, PartitionSpec))):
            kwargs["param_specs"] = declared
    pipe = _pipeline_fn()(pure_loss, params, batch, mesh=mesh, schedule=schedule, cut=cut,
                          axis=axis, rng=rng, **kwargs)

    def rebuild(other: Any, other_rng: bool) -> NnxPipeline:
        return pipeline(other, loss_fn, batch, mesh=mesh, schedule=schedule, cut=cut,
                        axis=axis, wrt=wrt, rng=other_rng, **kwargs)

    return NnxPipeline(pipe, graphdef, template, rest, wrt, rebuild)


# --------------------------------------------------------------------------- linen


class LinenPipeline(_Delegating):
    """A ``jp.Pipeline`` over a linen module's ``variables["params"]``; see :func:`pipeline_linen`.

    Methods accepting parameters take either the ``params`` collection or the full
    ``variables`` dict (its ``"params"`` entry is used). All other ``jp.Pipeline``
    attributes are forwarded.
    """

    def __init__(self, pipe: Any, module: Any, variables: Mapping[str, Any]):
        self.pipe = pipe
        self.module = module
        self.variables = variables

    def _as_params(self, params: Any) -> Any:
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
        self.pipe.check_params(params, "update_variables(variables, params)")
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

    if kwargs.get("param_specs") is None and not _placed_on(variables["params"], mesh):
        declared = _linen_specs(variables["params"])
        if declared is not None:
            kwargs["param_specs"] = declared
    pipe = _pipeline_fn()(params_loss, variables["params"], batch, mesh=mesh,
                          schedule=schedule, cut=cut, axis=axis, rng=rng, **kwargs)
    return LinenPipeline(pipe, module, variables)


def _linen_specs(params: Any) -> Any:
    """The specs linen's partitioning boxes declare (``nn.with_partitioning``: mesh axes;
    ``nn.with_logical_partitioning``: logical names through the active
    ``nn.logical_axis_rules``, as ``nn.logical_to_mesh`` maps them), or ``None`` when no
    parameter is boxed."""
    from flax import linen as nn
    from flax.core import meta

    def is_box(x: Any) -> bool:
        return isinstance(x, meta.AxisMetadata)

    if not any(map(is_box, jax.tree.leaves(params, is_leaf=is_box))):
        return None

    def spec(x: Any) -> Any:  # in the box, so the specs have the structure of params
        if isinstance(x, nn.LogicallyPartitioned):
            return x.replace_boxed(nn.logical_to_mesh_axes(x.names, x.rules))
        if isinstance(x, meta.Partitioned):
            return x.replace_boxed(PartitionSpec(*x.names))
        return None

    return jax.tree.map(spec, params, is_leaf=is_box)
