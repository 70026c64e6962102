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
``optax.global_norm``) would see only their stage's part. :func:`check_separable` finds
them from the optimizer's own update function (which inputs each output depends on),
and ``Pipeline.init`` refuses them, pointing to ``clip_global_norm=`` and
``skip_nonfinite=``, which use the true global gradient norm. Transformations that
only keep per-leaf or scalar state (``optax.MultiSteps``, schedules, masks) are exact.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpipe.avals import is_differentiable
from jaxpipe.errors import PipelineError, PipelineTypeError
from jaxpipe.inputs import CompileWatch

if TYPE_CHECKING:
    from jaxpipe.runtime.base import Executor, RuntimeSpec

__all__ = ["StageOptimizer", "TrainOptions", "TrainState", "Trainer", "check_rows_separable",
           "check_separable"]


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


def _output_inputs(closed: Any) -> list[list[int]]:
    """For every output of ``closed``, the inputs it reads (dead-code elimination per output)."""
    from jax._src.interpreters import partial_eval as pe  # no public per-output DCE

    jaxpr = closed.jaxpr
    n = len(jaxpr.outvars)
    out = []
    for j in range(n):
        _, used = pe.dce_jaxpr(jaxpr, [i == j for i in range(n)], instantiate=False)
        out.append([i for i, u in enumerate(used) if u])
    return out


def check_optimizer(optimizer: Any) -> None:
    """Refuse anything but an optax ``GradientTransformation`` (or a look-alike)."""
    if isinstance(optimizer, type) or not (callable(getattr(optimizer, "init", None))
                                           and callable(getattr(optimizer, "update", None))):
        what = (f"the function {optimizer.__name__} (call it to make one)"
                if callable(optimizer) and hasattr(optimizer, "__name__")
                else type(optimizer).__name__)
        raise PipelineTypeError(
            f"optimizer must be an optax.GradientTransformation, got {what}; e.g. "
            "optax.adamw(1e-3).")


def check_separable(optimizer: optax.GradientTransformation, spec: RuntimeSpec) -> None:
    """Raise :class:`PipelineError` if ``optimizer`` couples leaves held by different stages.

    The optimizer runs per stage (:class:`StageOptimizer`); that equals running it on the
    whole tree exactly when the update of every leaf reads only leaves its stage holds.
    This traces one ``optimizer.update`` on the whole trainable tree and asks, per output,
    which gradient / parameter / state inputs it reads; state carries those dependencies
    to the next step (iterated to a fixed point). A leaf whose update, now or through the
    state in a later step, reads a leaf of another stage is refused with its path and the
    stages involved.
    """
    avals, treedef = spec.param_avals, spec.params_treedef
    # One abstract leaf per tree leaf: the first input of each (a stacked weight split over
    # stages: its first stage's rows; which leaves an update reads does not depend on it).
    first: dict[int, int] = {}
    for pid, a in enumerate(avals):
        if is_differentiable(a):
            first.setdefault(spec.tree_leaf(pid), pid)
    trainable = sorted(first)  # tree leaves
    full: list = [None] * treedef.num_leaves
    for leaf, pid in first.items():
        full[leaf] = jax.ShapeDtypeStruct(avals[pid].shape, avals[pid].dtype)
    tree = jax.tree.unflatten(treedef, full)
    try:
        state = jax.eval_shape(optimizer.init, tree)
        closed = jax.make_jaxpr(lambda g, o, p: optimizer.update(g, o, p))(tree, state, tree)
    except Exception:  # the per-stage trace below reports the optimizer's own error
        return
    n_t, n_s = len(trainable), len(jax.tree.leaves(state))
    if len(closed.jaxpr.invars) != 2 * n_t + n_s or len(closed.jaxpr.outvars) != n_t + n_s:
        return  # an update with other outputs than (updates, state): nothing to compare
    reads = _output_inputs(closed)

    def leaves_read(j: int, state_deps: list[frozenset]) -> frozenset:
        deps: set[int] = set()
        for i in reads[j]:
            if i < n_t:
                deps.add(trainable[i])  # a gradient
            elif i < n_t + n_s:
                deps |= state_deps[i - n_t]  # state: what it was computed from
            else:
                deps.add(trainable[i - n_t - n_s])  # a parameter
        return frozenset(deps)

    state_deps = [frozenset()] * n_s
    while True:  # state read at step t+1 carries what it read at step t
        new = [leaves_read(n_t + k, state_deps) for k in range(n_s)]
        if new == state_deps:
            break
        state_deps = new
    owners = spec.param_owners
    inputs_of: dict[int, list[int]] = {}
    for pid in range(len(avals)):
        inputs_of.setdefault(spec.tree_leaf(pid), []).append(pid)
    for j, leaf in enumerate(trainable):
        deps = leaves_read(j, state_deps) | {leaf}
        # every stage that updates (rows of) this leaf must hold every leaf its update reads
        homes = [owners[pid][0] for pid in inputs_of[leaf]]
        held = [{spec.tree_leaf(q) for q in spec.stages[h].param_ids} for h in homes]
        bad = [(h, deps - home) for h, home in zip(homes, held, strict=True) if deps - home]
        if not bad:
            continue
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree.flatten_with_path(
            jax.tree.unflatten(treedef, list(range(treedef.num_leaves))))[0]]
        home, missing = bad[0]
        others = sorted(missing)
        stages = sorted({s for o in others for q in inputs_of[o] for s in owners[q]})
        raise PipelineError(
            f"the optimizer couples parameters across pipeline stages: the update of params"
            f"{paths[leaf]} (stage {home}) reads params{paths[others[0]]} "
            f"(stage(s) {stages}). The optimizer runs per stage and would see only its "
            "stage's part, so the step would differ from the same optimizer without a "
            "pipeline. Global-norm clipping (optax.clip_by_global_norm, anything using "
            "optax.global_norm) and non-finite skipping (optax.apply_if_finite) are "
            "built in: drop them from the chain and use pipe.init(params, tx, "
            "clip_global_norm=<max norm>, skip_nonfinite=True), which use the true "
            "global gradient norm over all stages."
        )


def check_rows_separable(optimizer: optax.GradientTransformation, spec: RuntimeSpec) -> None:
    """Raise :class:`PipelineError` if ``optimizer`` couples the layers of a split stack.

    A scanned stack's stacked weight split over stages is updated per stage, on that
    stage's rows. That equals updating the whole leaf when the update of a row reads only
    that row (Adam, SGD, weight decay: anything elementwise), not when it reads the whole
    leaf (a per-leaf norm: LARS / LAMB trust ratios, Adafactor's update clipping). The
    update reads no value that tells which, so this probes it: for every split leaf, one
    step on two random rows at once must equal one step on each row alone.
    """
    inputs_of: dict[int, list[int]] = {}
    for pid, a in enumerate(spec.param_avals):
        if is_differentiable(a):
            inputs_of.setdefault(spec.tree_leaf(pid), []).append(pid)
    split = sorted(leaf for leaf, pids in inputs_of.items() if len(pids) >= 2)
    if not split:
        return
    n = spec.params_treedef.num_leaves
    rng = np.random.default_rng(0)
    probes = []
    for leaf in split:
        a = spec.param_avals[inputs_of[leaf][0]]
        shape = (2, *a.shape[1:])
        probes.append((rng.standard_normal(shape).astype(a.dtype),
                       rng.standard_normal(shape).astype(a.dtype)))

    def step(p: jax.Array, g: jax.Array, leaf: int) -> jax.Array:
        """One update of ``leaf`` alone (the others ``None``)."""
        full: list = [None] * n

        def tree(x: Any) -> Any:
            full[leaf] = x
            return jax.tree.unflatten(spec.params_treedef, full)

        updates, _ = optimizer.update(tree(g), optimizer.init(tree(p)), tree(p))
        return jax.tree.leaves(updates)[0]

    @jax.jit  # one compile for every leaf (op by op, it compiled each operation per shape)
    def both(probes: list) -> list:
        return [(step(p, g, leaf),
                 jnp.concatenate([step(p[i:i + 1], g[i:i + 1], leaf) for i in range(2)]))
                for leaf, (p, g) in zip(split, probes, strict=True)]

    try:
        results = both(probes)
    except Exception:  # the optimizer's own error comes from the real step
        return
    for leaf, (whole, rows) in zip(split, results, strict=True):
        whole, rows = np.asarray(whole), np.asarray(rows)
        if np.allclose(whole, rows, rtol=1e-5, atol=1e-6 * (np.abs(whole).max() + 1e-12)):
            continue
        pids = inputs_of[leaf]
        path = jax.tree_util.keystr(jax.tree.flatten_with_path(
            jax.tree.unflatten(spec.params_treedef, list(range(n))))[0][leaf][0])
        stages = sorted({spec.param_owners[pid][0] for pid in pids})
        raise PipelineError(
            f"the optimizer couples the layers of the scanned stack params{path}: its "
            "update of one layer's rows reads the other layers' rows (e.g. a per-leaf norm: "
            "LARS / LAMB trust ratios, Adafactor's update clipping or factored moments over "
            f"the layer axis). Stages {stages} each hold and update only their own layers' "
            "rows, so the step would differ from the same optimizer without a pipeline. "
            "Use an optimizer whose update is per element (e.g. optax.adamw, optax.sgd), or "
            "give every layer its own parameter leaves (unroll the scan into a Python loop)."
        )


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

    Made by ``Pipeline.init``; holds the jitted, donated step
    ``step_fn(state, batch, key=None)`` (:meth:`step` calls it and warns once if it
    compiles again). ``microbatches(batch, key)`` turns a batch (and the step's PRNG key,
    for pipelines built with ``rng=True``) into the runtime's microbatch leaves. Equality
    is identity, so jax treats states of different trainers as different static
    structures.
    """

    def __init__(self, executor: Executor, optimizer: optax.GradientTransformation,
                 options: TrainOptions, microbatches: Callable[[Any, Any], list]) -> None:
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

        self.step_fn = jax.jit(step_fn, donate_argnums=0)
        self._watch = CompileWatch(self.step_fn, "pipe.train_step", executor.compiled_check())
        self._abstract_opt = executor.opt_state_abstract(self._init_opt)
        shardings = jax.tree.map(lambda a: getattr(a, "sharding", None), self._abstract_opt)
        self._init_jit = jax.jit(self._init_opt, out_shardings=shardings)

    def step(self, state: TrainState, batch: Any, key: Any = None) -> tuple[TrainState, dict]:
        """One step of :attr:`step_fn` (inputs already checked and placed)."""
        return self._watch(state, batch, key)

    def init_opt_state(self, param_leaves: list) -> Any:
        """Optimizer state in the executor's layout for these parameter leaves."""
        return self._init_jit(param_leaves)

    def abstract_opt_state(self) -> Any:
        """Shape/dtype/sharding of the optimizer state (values not needed)."""
        return self._abstract_opt

    def __repr__(self) -> str:
        return f"Trainer({self.optimizer!r}, {self.options})"

