"""Optax training for a pipeline: a state that owns its optimizer, and per-stage updates.

``Pipeline.init(params, tx)`` returns a :class:`TrainState` that carries the compiled
:class:`Trainer` for ``tx`` (as static pytree metadata, like optax's returned state):
``Pipeline.train_step(state, batch)`` always trains a state with the optimizer it was
made with, however many other states were initialised on the same pipeline since.

The optimizer update runs per stage, on that stage's real parameter pytree (the user's
tree with the leaves other stages own set to ``None``), so masks given as callables,
weight decay by name and shape-aware optimizers behave as without a pipeline.
Parameters read by several stages (tied embeddings) get the sum of their gradients on
every copy, so the copies receive identical updates and never diverge. How the update
is placed on devices is the runtime's business; this module gives it the per-stage
pieces (:class:`StageOptimizer`).

Optimizers whose update needs the *global* gradient (e.g. ``clip_by_global_norm``) see
only their stage's gradients; use ``Pipeline.init(..., clip_global_norm=...)`` instead,
which clips by the true global norm before the optimizer runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax

from jaxpipe.errors import PipelineError

if TYPE_CHECKING:
    from jaxpipe.runtime.base import Executor, RuntimeSpec

__all__ = ["StageOptimizer", "TrainOptions", "TrainState", "Trainer"]


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
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float))
                              or not math.isfinite(c) or c <= 0):
            raise PipelineError(
                f"clip_global_norm must be a positive finite number (or None for no "
                f"clipping), got {c!r}.")


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TrainState:
    """Train state in the executor's staged layout, and the trainer it belongs to.

    ``params`` and ``opt_state`` live on the devices (use ``Pipeline.params(state)`` for
    the user pytree); ``step`` counts optimizer steps. ``trainer`` is static metadata:
    the optimizer (and its compiled step) this state trains with.
    """

    params: Any
    opt_state: Any
    step: jax.Array
    trainer: Trainer = field(metadata={"static": True})


class StageOptimizer:
    """The optimizer applied per stage: state shapes and the update of one stage.

    Args:
      optimizer: the optax ``GradientTransformation``.
      spec: the runtime spec (stages, parameter avals and treedef are read from it).
    """

    def __init__(self, optimizer: optax.GradientTransformation, spec: RuntimeSpec) -> None:
        self.optimizer = optimizer
        self.spec = spec
        self.treedef = spec.params_treedef
        # Each stage's optimizer-state leaves (abstract) and treedef, from eval_shape.
        self.state_avals: list[list[jax.ShapeDtypeStruct]] = []
        self.state_treedefs: list[Any] = []
        for st in spec.stages:
            sds = [jax.ShapeDtypeStruct(spec.param_avals[i].shape, spec.param_avals[i].dtype)
                   for i in st.param_ids]
            shape = jax.eval_shape(optimizer.init, self.stage_tree(st.index, sds))
            leaves, tdef = jax.tree.flatten(shape)
            self.state_avals.append(leaves)
            self.state_treedefs.append(tdef)

    def stage_tree(self, stage: int, leaves: Sequence[Any]) -> Any:
        """The user's parameter pytree restricted to ``stage`` (other leaves ``None``)."""
        full: list = [None] * len(self.spec.param_avals)
        for pid, x in zip(self.spec.stages[stage].param_ids, leaves, strict=True):
            full[pid] = x
        return jax.tree.unflatten(self.treedef, full)

    def init(self, stage: int, param_leaves: Sequence[Any]) -> list:
        """Optimizer-state leaves of ``stage`` for its parameter leaves."""
        return jax.tree.leaves(self.optimizer.init(self.stage_tree(stage, param_leaves)))

    def update(self, stage: int, params: Sequence[Any], grads: Sequence[Any],
               state: Sequence[Any]) -> tuple[list, list]:
        """One optax step of ``stage``: ``(new param leaves, new state leaves)``."""
        p_tree = self.stage_tree(stage, params)
        g_tree = self.stage_tree(stage, grads)
        o_tree = jax.tree.unflatten(self.state_treedefs[stage], list(state))
        updates, o_tree = self.optimizer.update(g_tree, o_tree, p_tree)
        # stage param_ids are ascending, i.e. the tree's leaf order
        return jax.tree.leaves(optax.apply_updates(p_tree, updates)), jax.tree.leaves(o_tree)


def global_norm_scale(sq_norm: jax.Array, options: TrainOptions) -> tuple[jax.Array, jax.Array]:
    """``(gradient norm, scale to apply)`` from the global squared norm."""
    gnorm = jnp.sqrt(sq_norm)
    scale = jnp.ones((), jnp.float32)
    if options.clip_global_norm is not None:
        scale = jnp.minimum(1.0, options.clip_global_norm / jnp.maximum(gnorm, 1e-12))
    return gnorm, scale


def sq_norm(leaves: Sequence[jax.Array]) -> jax.Array:
    """Sum of squares of the differentiable leaves, in float32."""
    total = jnp.zeros((), jnp.float32)
    for x in leaves:
        if jnp.issubdtype(x.dtype, jnp.inexact):
            total = total + jnp.sum(jnp.square(x.astype(jnp.float32)))
    return total


class Trainer:
    """An optimizer compiled for one pipeline: what a :class:`TrainState` trains with.

    Made by ``Pipeline.init``; holds the jitted, donated step. Equality is identity, so
    jax treats states of different trainers as different static structures.
    """

    def __init__(self, executor: Executor, optimizer: optax.GradientTransformation,
                 options: TrainOptions, microbatches: Callable[[Any], list]) -> None:
        self.executor = executor
        self.optimizer = optimizer
        self.options = options
        step, self._init_opt = executor.make_train_step(optimizer, options)

        def step_fn(state: TrainState, batch: Any) -> tuple[TrainState, dict]:
            params, opt, metrics = step(state.params, state.opt_state, microbatches(batch))
            return TrainState(params, opt, state.step + 1, state.trainer), metrics

        self.step_fn = jax.jit(step_fn, donate_argnums=0)
        shardings = jax.tree.map(lambda a: getattr(a, "sharding", None),
                                 self.abstract_opt_state())
        self._init_jit = jax.jit(self._init_opt, out_shardings=shardings)

    def init_opt_state(self, param_leaves: list) -> Any:
        """Optimizer state in the executor's layout for these parameter leaves."""
        return self._init_jit(param_leaves)

    def abstract_opt_state(self) -> Any:
        """Shape/dtype/sharding of the optimizer state (values not needed)."""
        return self.executor.opt_state_abstract(self._init_opt)

    def __repr__(self) -> str:
        return f"Trainer({self.optimizer!r}, {self.options})"

