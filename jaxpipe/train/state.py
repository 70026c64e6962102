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

Integer and boolean parameter leaves (and any other non-float leaf) are constants of
the loss: like ``jax.grad`` they get no gradient, and the optimizer never sees them
(they are ``None`` in its trees too), so they keep their values exactly.

Optimizers whose update of one leaf reads leaves that live on another stage (e.g.
``optax.clip_by_global_norm``, ``optax.apply_if_finite``, anything built on
``optax.global_norm``) would see only their stage's part. :mod:`jaxpipe.train.optimizer_checks`
finds them from the optimizer's own update function (which inputs each output depends
on), and ``Pipeline.init`` refuses them, pointing to ``clip_global_norm=`` and
``skip_nonfinite=``, which use the true global gradient norm. Transformations that
only keep per-leaf or scalar state (``optax.MultiSteps``, schedules, masks) are exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe.build_times import BuildTimes
from jaxpipe.compile_watch import CompileWatch
from jaxpipe.jaxpr.avals import is_differentiable
from jaxpipe.train.optimizer_checks import check_optimizer, check_rows_separable, check_separable
from jaxpipe.train.options import TrainOptions

if TYPE_CHECKING:
    from jaxpipe.train.seams import ParamLayout, StepBuilder

__all__ = ["StageOptimizer", "TrainState", "Trainer"]


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

    def __init__(self, optimizer: optax.GradientTransformation, spec: ParamLayout) -> None:
        self.optimizer = optimizer
        self.spec = spec
        self.treedef = spec.params_treedef
        #: per parameter leaf: does the optimizer update it (float leaves only)?
        self.trainable = tuple(is_differentiable(a) for a in spec.param_avals)
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
        """The user's parameter pytree as the optimizer sees it on ``stage``: that stage's
        trainable leaves, ``None`` for other stages' leaves and for non-float leaves.

        A scanned stack's stacked weight split over stages appears with this stage's rows
        only (an elementwise optimizer on those rows equals it on the whole leaf)."""
        full: list = [None] * self.treedef.num_leaves
        for pid, x in zip(self.spec.stages[stage].param_ids, leaves, strict=True):
            if self.trainable[pid]:
                full[self.spec.tree_leaf(pid)] = x
        return jax.tree.unflatten(self.treedef, full)

    def init(self, stage: int, param_leaves: Sequence[Any]) -> list:
        """Optimizer-state leaves of ``stage`` for its parameter leaves."""
        return jax.tree.leaves(self.optimizer.init(self.stage_tree(stage, param_leaves)))

    def update(self, stage: int, params: Sequence[Any], grads: Sequence[Any],
               state: Sequence[Any]) -> tuple[list, list]:
        """One optax step of ``stage``: ``(new param leaves, new state leaves)``.

        Non-float leaves come back unchanged. State leaves keep the dtype ``init`` gave
        them (optax may promote, e.g. an integer step count), so the state's layout is
        the same at every step.
        """
        p_tree = self.stage_tree(stage, params)
        g_tree = self.stage_tree(stage, grads)
        o_tree = jax.tree.unflatten(self.state_treedefs[stage], list(state))
        updates, o_tree = self.optimizer.update(g_tree, o_tree, p_tree)
        # stage param_ids are ascending, i.e. the tree's leaf order (one input per leaf)
        new = iter(jax.tree.leaves(optax.apply_updates(p_tree, updates)))
        ids = self.spec.stages[stage].param_ids
        out = [next(new) if self.trainable[pid] else x for pid, x in zip(ids, params,
                                                                         strict=True)]
        new_state = [jnp.asarray(x).astype(a.dtype) for x, a in zip(
            jax.tree.leaves(o_tree), self.state_avals[stage], strict=True)]
        return out, new_state


class Trainer:
    """An optimizer compiled for one pipeline: what a :class:`TrainState` trains with.

    Made by ``Pipeline.init``; holds the jitted, donated step
    ``step_fn(state, batch, key=None)`` (:meth:`step` calls it and warns once if it
    compiles again). ``microbatches(batch, key)`` turns a batch (and the step's PRNG key,
    for pipelines built with ``rng=True``) into the runtime's microbatch leaves. Equality
    is identity, so jax treats states of different trainers as different static
    structures.
    """

    def __init__(self, executor: StepBuilder, optimizer: optax.GradientTransformation,
                 options: TrainOptions, microbatches: Callable[[Any, Any], list],
                 times: BuildTimes | None = None) -> None:
        check_optimizer(optimizer)
        self.executor = executor
        self.optimizer = optimizer
        self.options = options
        check_separable(optimizer, executor.spec)
        check_rows_separable(optimizer, executor.spec)
        step, self._init_opt = executor.make_train_step(optimizer, options)

        def step_fn(state: TrainState, batch: Any, key: Any = None
                    ) -> tuple[TrainState, dict]:
            params, opt, metrics = step(state.params, state.opt_state,
                                        microbatches(batch, key))
            return TrainState(params, opt, state.step + 1, state.trainer), metrics

        from jaxpipe.xla_flags import compiler_options

        self._abstract_opt = executor.opt_state_abstract(self._init_opt)
        mesh = executor.spec.mesh
        self._abstract_state = TrainState(
            executor.staged_abstract(), self._abstract_opt,
            jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P())), self)
        # The step returns its state under the very shardings a state is placed at
        # (Pipeline.init's), not merely equivalent ones (P('pipe', None) for P('pipe')):
        # the next train_step takes it as it is, with no array rewrapped a leaf (~1 ms a
        # step of Python for 9 leaves, 2 devices)
        self._watch = CompileWatch(
            step_fn, "pipe.train_step", executor.compiled_check(), times,
            compiler_options=compiler_options(mesh.devices.flat[0].platform),
            donate_argnums=0, out_shardings=(_shardings(self._abstract_state), None))
        self.step_fn = self._watch.fn
        self._init_jit = jax.jit(self._init_opt,
                                 out_shardings=_shardings(self._abstract_opt))

    def step(self, state: TrainState, batch: Any, key: Any = None) -> tuple[TrainState, dict]:
        """One step of :attr:`step_fn` (inputs already checked and placed)."""
        return self._watch(state, batch, key)

    def init_opt_state(self, param_leaves: list) -> Any:
        """Optimizer state in the executor's layout for these parameter leaves."""
        return self._init_jit(param_leaves)

    def abstract_opt_state(self) -> Any:
        """Shape/dtype/sharding of the optimizer state (values not needed)."""
        return self._abstract_opt

    def abstract_state(self) -> TrainState:
        """A :class:`TrainState` of this trainer as ``jax.ShapeDtypeStruct``\\ s: the
        staged parameters' and the optimizer state's layouts, the step count replicated.
        Where a state is placed, what the step returns, what is lowered and restored."""
        return self._abstract_state

    def __repr__(self) -> str:
        return f"Trainer({self.optimizer!r}, {self.options})"


def _shardings(abstract: Any) -> Any:
    """The shardings of a tree of ``ShapeDtypeStruct``\\ s (``None``: unspecified)."""
    return jax.tree.map(lambda a: getattr(a, "sharding", None), abstract)

