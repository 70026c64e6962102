"""Which optimizers a pipeline can run per stage, found from the optimizer's own update.

The optimizer runs per stage (:class:`jaxpipe.train.state.StageOptimizer`). That equals the
same optimizer on the whole tree when the update of every leaf reads only leaves its
stage holds (:func:`check_separable`) and, for a scanned stack split over stages, when
the update of a layer's rows reads only those rows (:func:`check_rows_separable`).
``Pipeline.init`` runs both and refuses an optimizer that couples stages, with the fix.
"""

from __future__ import annotations

import functools
import operator
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend import core as jcore

from jaxpipe.errors import PipelineError, PipelineTypeError
from jaxpipe.jax_compat import dce_jaxpr
from jaxpipe.jaxpr.avals import is_differentiable, is_key

if TYPE_CHECKING:
    from jaxpipe.train.seams import ParamLayout

__all__ = ["check_optimizer", "check_rows_separable", "check_separable"]


def _output_inputs(closed: Any) -> list[list[int]]:
    """For every output of ``closed``, the inputs it reads."""
    n_in = len(closed.jaxpr.invars)
    masks = _dependencies(closed.jaxpr, [1 << i for i in range(n_in)])
    return [[i for i in range(n_in) if m >> i & 1] for m in masks]


def _dependencies(jaxpr: Any, in_masks: list[int]) -> list[int]:
    """Per output of ``jaxpr``, the union of the masks of the inputs it reads (``in_masks``:
    one per input; at the top, bit ``i`` for input ``i``), in one forward pass. (Dead-code
    elimination per output gives the same answer in a pass per output: 24 s for AdamW on
    the 32 blocks of a 6.5B GPT.) A first-order equation's outputs read all its inputs;
    a jit's body is followed inside; any other equation with a body (scan, while, cond,
    custom derivatives) asks JAX's own dead-code rule of that one equation, per output."""
    env = dict(zip(jaxpr.invars, in_masks, strict=True))

    def read(v: Any) -> int:
        return 0 if isinstance(v, jcore.Literal) else env.get(v, 0)  # consts read nothing

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        body = eqn.params.get("jaxpr") if eqn.primitive.name in ("jit", "pjit") else None
        if body is not None:
            outs = _dependencies(getattr(body, "jaxpr", body), ins)
        elif any(isinstance(x, (jcore.Jaxpr, jcore.ClosedJaxpr))
                 for v in eqn.params.values() for x in (v if isinstance(v, tuple) else (v,))):
            outs = _per_output(eqn, ins)
        else:
            every = functools.reduce(operator.or_, ins, 0)
            outs = [every] * len(eqn.outvars)
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _per_output(eqn: Any, ins: list[int]) -> list[int]:
    """``eqn``'s output masks from JAX's dead-code rule of the equation alone."""
    dce = dce_jaxpr()  # no public per-output DCE
    invars = list(dict.fromkeys(v for v in eqn.invars if not isinstance(v, jcore.Literal)))
    mask = {v: 0 for v in invars}
    for v, m in zip(eqn.invars, ins, strict=True):
        if not isinstance(v, jcore.Literal):
            mask[v] |= m
    one = jcore.Jaxpr([], invars, list(eqn.outvars), [eqn], eqn.effects)
    n = len(eqn.outvars)
    outs = []
    for j in range(n):
        _, used = dce(one, [k == j for k in range(n)], instantiate=False)
        outs.append(functools.reduce(operator.or_, (mask[v] for v, u in zip(
            invars, used, strict=True) if u), 0))
    return outs


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


def check_separable(optimizer: optax.GradientTransformation, spec: ParamLayout) -> None:
    """Raise :class:`PipelineError` if ``optimizer`` couples leaves held by different stages.

    The optimizer runs per stage (:class:`jaxpipe.train.state.StageOptimizer`); that equals
    running it on the whole tree exactly when the update of every leaf reads only leaves
    its stage holds. This traces one ``optimizer.update`` on the whole trainable tree and
    asks, per output, which gradient / parameter / state inputs it reads; state carries
    those dependencies to the next step (iterated to a fixed point). A leaf whose update,
    now or through the state in a later step, reads a leaf of another stage is refused
    with its path and the stages involved.
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
    except TypeError as err:
        if "keyword" in str(err) and "value" in str(err):
            raise PipelineError(
                f"the optimizer's update needs the loss (value=...), which pipe.train_step "
                f"does not pass ({err}): optimizers reading the loss "
                "(optax.contrib.reduce_on_plateau, optax.polyak_sgd) are not supported; use "
                "one that reads only gradients and parameters.") from None
        return  # the per-stage trace reports the optimizer's own error
    except Exception:  # the per-stage trace below reports the optimizer's own error
        return
    if _draws_random_numbers(closed.jaxpr) or any(is_key(x) for x in jax.tree.leaves(state)):
        raise PipelineError(
            "the optimizer draws random numbers (a PRNG key in its state: optax.add_noise, "
            "or your own): it runs per stage, and every stage would draw from the same key "
            "by its leaves' positions, so stages would get the same noise where the "
            "optimizer without a pipeline draws it per leaf. Add the noise in your own "
            "update outside the pipeline (pipe.value_and_grad, then optax), or drop it.")
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
        stages = sorted({s for q in inputs_of[others[0]] for s in owners[q]})  # its own
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


#: primitives that draw or derive random numbers (an optimizer using them is refused)
_RANDOM = frozenset({"random_bits", "random_split", "random_fold_in", "random_seed",
                     "threefry2x32", "rng_bit_generator", "rng_uniform"})


def _draws_random_numbers(jaxpr: Any) -> bool:
    return any(eqn.primitive.name in _RANDOM
               or any(_draws_random_numbers(j.jaxpr if hasattr(j, "jaxpr") else j)
                      for j in jcore.jaxprs_in_params(eqn.params))
               for eqn in jaxpr.eqns)


def check_rows_separable(optimizer: optax.GradientTransformation, spec: ParamLayout) -> None:
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


