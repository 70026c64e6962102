"""Trace a per-microbatch loss function to one flat jaxpr and find its candidate cuts.

The traced program has the parameter leaves and the microbatch leaves as inputs and the
scalar loss as its first output (then, as the pipeline's :class:`~jaxpipe.jaxpr.objective.Objective`
says, a weight and the aux leaves). ``jaxpipe_boundary`` equations at the top level are
the candidate cut points. Boundaries hidden inside ``jit``-ted helpers are inlined to
the top level, and so are those inside a ``jax.checkpoint`` (a checkpointed
``@jaxpipe.layer``), whose stretches between markers are checkpointed again with its
policy. A top-level ``scan`` whose body holds boundaries is kept as it is: it is a
scanned layer stack, cut between its iterations by :mod:`jaxpipe.stages.stacks`. Boundaries
inside other control flow (``cond``, ``while``) or custom derivative rules cannot be cut
there and raise a clear error.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.sharding import PartitionSpec as P

from jaxpipe.errors import PipelineError
from jaxpipe.jax_compat import is_ordered_effect
from jaxpipe.jaxpr.interpret import CALLS, eval_eqns, eval_slice, read, sub_jaxprs
from jaxpipe.jaxpr.markers import boundary_p, has_marker, holds_marker
from jaxpipe.jaxpr.objective import MEAN, Objective
from jaxpipe.jaxpr.param_values import computed_where_read

__all__ = ["Traced", "microbatch_like", "segments", "split_output", "trace", "trace_shard",
           "with_key"]

# Call bodies holding markers are inlined (interpret.CALLS), so the markers become cuttable;
# a ``jax.checkpoint``'s (``remat2``; older releases' names too) keeps its recomputation:
# what lies between its markers is checkpointed again as the user asked.
_REMAT = {"remat2", "remat", "checkpoint"}


@dataclass(frozen=True)
class Traced:
    """A traced loss: flat jaxpr, how its inputs map to pytrees, and the marker positions."""

    closed_jaxpr: jcore.ClosedJaxpr
    params_treedef: Any
    batch_treedef: Any
    num_params: int
    markers: tuple[int, ...]
    marker_names: tuple[str | None, ...]
    objective: Objective = MEAN

    @property
    def jaxpr(self) -> jcore.Jaxpr:
        return self.closed_jaxpr.jaxpr


def _inline_eval(jaxpr: jcore.Jaxpr, consts, args, remat: dict | None = None) -> list:
    """Evaluate ``jaxpr`` into the current trace, inlining call bodies that hold markers.

    ``remat``: the parameters of the ``jax.checkpoint`` this body was inlined from (its
    ``policy`` and ``prevent_cse``): every stretch between markers runs under a
    ``jax.checkpoint`` of its own with them, so a checkpointed layer (``jax.checkpoint``
    or ``nn.remat`` around a ``@jaxpipe.layer``) keeps its recomputation while its
    markers become cuts."""
    env: dict = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def inline_marked_calls(eqn, invals):
        subs = jcore.jaxprs_in_params(eqn.params)
        if not (subs and any(has_marker(s) for s in subs)):
            return None  # plain equation: bind it
        name = eqn.primitive.name
        if name == "scan" and remat is not None:
            raise PipelineError(
                "a lax.scan holding jaxpipe.boundary / @jaxpipe.layer markers runs inside a "
                "jax.checkpoint: its stack is cut between iterations, which would drop the "
                "checkpoint around it. Checkpoint each layer inside the scan instead "
                "(jax.checkpoint around the scan body, as nn.scan(nn.remat(Block)) does).")
        if name == "scan":
            return None  # a scanned layer stack: jaxpipe.stages.stacks cuts it between iterations
        if name not in CALLS:
            raise PipelineError(
                f"jaxpipe.boundary / @jaxpipe.layer was used inside `{name}` "
                "(e.g. lax.cond, a while loop or a custom_vjp function). Cuts must be at the "
                "top level of the loss function or between the iterations of a lax.scan over "
                "layers: move the marker out of the control-flow body, or unroll that loop "
                "in Python."
            )
        inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
        inner_consts = getattr(inner, "consts", [])
        inner_remat = ({"policy": eqn.params.get("policy"),
                        "prevent_cse": eqn.params.get("prevent_cse", True)}
                       if name in _REMAT else remat)
        return _inline_eval(getattr(inner, "jaxpr", inner), inner_consts, invals, inner_remat)

    if remat is None:
        eval_eqns(jaxpr.eqns, env, override=inline_marked_calls)
    else:
        stretches = _stretches(jaxpr.eqns)
        # what is read after each stretch (or returned): one pass from the end
        read_after, later = [], {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}
        for eqns, _ in reversed(stretches):
            read_after.append(set(later))
            later |= {v for e in eqns for v in e.invars if isinstance(v, jcore.Var)}
        for (eqns, marked), needed in zip(stretches, reversed(read_after), strict=True):
            if marked:
                eval_eqns(eqns, env, override=inline_marked_calls)
            else:
                _eval_checkpointed(eqns, env, remat, needed)
    return [read(env, v) for v in jaxpr.outvars]


def _stretches(eqns) -> list[tuple[list, bool]]:
    """``eqns`` in runs: each equation holding a marker alone, the rest in maximal runs."""
    out: list[tuple[list, bool]] = []
    for e in eqns:
        marked = holds_marker(e)
        if marked or not out or out[-1][1]:
            out.append(([e], marked))
        else:
            out[-1][0].append(e)
    return out


def _eval_checkpointed(eqns, env: dict, remat: dict, needed: set) -> None:
    """Run ``eqns`` as one ``jax.checkpoint(policy=, prevent_cse=)`` call, writing the
    values read later (``needed``) to ``env``."""
    defined = {v for e in eqns for v in e.outvars}
    free = list(dict.fromkeys(v for e in eqns for v in e.invars
                              if isinstance(v, jcore.Var) and v not in defined))
    outs = [v for e in eqns for v in e.outvars if v in needed]

    def run(*vals):
        return eval_slice(eqns, free, outs, vals)

    env.update(zip(outs, jax.checkpoint(run, **remat)(*[env[v] for v in free]), strict=True))


def _holds_primitive(jaxpr: jcore.Jaxpr, name: str) -> bool:
    """Whether an equation of ``jaxpr`` (or of a jaxpr one holds) binds ``name``."""
    return any(e.primitive.name == name or any(_holds_primitive(sub, name)
                                               for sub in sub_jaxprs(e.params))
               for e in jaxpr.eqns)


def _check_array_leaves(tree: Any, what: str) -> None:
    """Raise a PipelineError naming the first leaf of ``tree`` that is not array-like."""
    for path, x in jax.tree.flatten_with_path(tree)[0]:
        if not (hasattr(x, "shape") and hasattr(x, "dtype")
                or isinstance(x, (bool, int, float, complex))):
            raise PipelineError(
                f"{what} leaf {jax.tree_util.keystr(path)} is a {type(x).__name__}, not an "
                f"array; {what} leaves must be arrays (or jax.ShapeDtypeStruct). Keep static "
                "configuration out of the pytree (close over it in loss_fn)."
            )


def microbatch_like(batch: Any, num_microbatches: int) -> Any:
    """Abstract shape of one microbatch: every leaf's leading axis divided by m.

    Raises a :class:`PipelineError` naming the leaf when a leading dimension is missing,
    inconsistent across leaves, or not divisible by ``num_microbatches``.
    """
    _check_array_leaves(batch, "batch")
    leaves, treedef = jax.tree.flatten_with_path(batch)
    if not leaves:
        raise PipelineError("the batch pytree has no array leaves; pass at least one array.")
    sizes = {}
    for path, leaf in leaves:
        shape = jnp.shape(leaf)
        if len(shape) == 0:
            raise PipelineError(
                f"batch leaf {jax.tree_util.keystr(path)} is a scalar; every batch leaf needs a "
                "leading batch axis to split into microbatches (close over constants instead)."
            )
        sizes[jax.tree_util.keystr(path)] = shape[0]
    if len(set(sizes.values())) > 1:
        raise PipelineError(
            f"batch leaves have inconsistent leading dimensions {sizes}; every leaf must have "
            "the same batch size along axis 0."
        )
    n = next(iter(sizes.values()))
    if n % num_microbatches:
        raise PipelineError(
            f"batch size {n} is not divisible by num_microbatches={num_microbatches}; use a "
            f"batch size that is a multiple of {num_microbatches} or change the schedule's m."
        )
    return jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((jnp.shape(x)[0] // num_microbatches, *jnp.shape(x)[1:]),
                                       jnp.result_type(x)),
        batch,
    )


def trace(loss_fn: Callable[[Any, Any], Any], params: Any, microbatch: Any,
          objective: Objective = MEAN, param_shardings: Sequence[Any] | None = None,
          batch_shardings: Sequence[Any] | None = None) -> Traced:
    """Trace ``loss_fn(params, microbatch)`` to a flat ClosedJaxpr with top-level markers.

    ``params`` and ``microbatch`` may be arrays or ``jax.ShapeDtypeStruct`` pytrees. The
    jaxpr outputs the loss, then (``objective``) the weight and the aux leaves; the
    returned :attr:`Traced.objective` records the aux leaves' shapes and structure.
    ``param_shardings`` / ``batch_shardings``: per flat leaf, the sharding its traced
    type carries (``None``: none).
    """
    _check_array_leaves(params, "params")
    p_leaves, p_tree = jax.tree.flatten(params)
    b_leaves, b_tree = jax.tree.flatten(microbatch)
    aux_tree: list = []

    # traced on the two pytrees, as loss_fn (its name, file and argument names): JAX's
    # errors then point at the user's loss and name "argument batch['x']", not ours
    @functools.wraps(loss_fn)
    def flat_loss(p: Any, b: Any) -> list:
        main, aux = split_output(loss_fn(p, b), objective)
        aux_leaves, tree = jax.tree.flatten(aux)
        aux_tree.append(tree)
        return [*main, *aux_leaves]

    shardings = (list(param_shardings or [None] * len(p_leaves))
                 + list(batch_shardings or [None] * len(b_leaves)))
    avals = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x), sharding=sh)
             for x, sh in zip(p_leaves + b_leaves, shardings, strict=True)]
    raw = jax.make_jaxpr(flat_loss)(jax.tree.unflatten(p_tree, avals[:len(p_leaves)]),
                                    jax.tree.unflatten(b_tree, avals[len(p_leaves):]))
    if any(isinstance(v, jcore.Literal) for v in raw.jaxpr.outvars):
        # a constant output (``return 0.0`` while the model is being written): an equation
        # of its own, so the stages see a value (whose gradient is zero)
        fixed = raw
        raw = jax.make_jaxpr(lambda *a: [
            lax.optimization_barrier(x) if isinstance(v, jcore.Literal) else x
            for x, v in zip(jcore.jaxpr_as_fun(fixed)(*a),
                            fixed.jaxpr.outvars, strict=True)])(*avals)
    if any(e.primitive is not boundary_p and holds_marker(e)  # markers hidden in sub-jaxprs
           for e in raw.jaxpr.eqns):
        raw = jax.make_jaxpr(lambda *a: _inline_eval(raw.jaxpr, raw.consts, a))(*avals)
    raw = computed_where_read(raw, len(p_leaves), avals)
    if _holds_primitive(raw.jaxpr, "shard_map"):
        raise PipelineError(
            "loss_fn calls jax.shard_map. Every stage already runs inside the pipeline's "
            "shard_map (manual over the pipe axis), and a shard_map nested in a stage is not "
            "supported (its body was typed outside the pipeline, and JAX refuses it there). "
            "Write the layer with sharded parameters instead: place them (or pass "
            "param_specs=) over the axis your shard_map used, and XLA partitions the layer "
            "with the collectives it needs (docs/multihost.md).")
    ordered = [e for e in raw.effects if is_ordered_effect(e)]
    if ordered:
        raise PipelineError(
            f"the loss has an ordered effect ({type(ordered[0]).__name__}: "
            "jax.debug.print(..., ordered=True) or an ordered io_callback), which JAX runs on "
            "one device only, and every stage runs on its own pipe device. Drop ordered=True "
            "(unordered prints and callbacks work; they run in schedule order).")
    markers = tuple(i for i, e in enumerate(raw.jaxpr.eqns) if e.primitive is boundary_p)
    names = tuple(raw.jaxpr.eqns[i].params.get("name") for i in markers)
    n_main = 1 + int(objective.weighted)
    traced_objective = dataclasses.replace(
        objective, aux_avals=tuple(raw.out_avals[n_main:]),
        aux_treedef=aux_tree[0] if objective.has_aux else None)
    return Traced(raw, p_tree, b_tree, len(p_leaves), markers, names, traced_objective)


def split_output(out: Any, objective: Objective) -> tuple[list, Any]:
    """``loss_fn``'s return value as ``([loss, weight?], aux)``; a clear error where it is
    not what ``objective`` says it returns."""
    if objective.has_aux:
        if not (isinstance(out, tuple | list) and len(out) == 2):
            raise PipelineError(
                f"has_aux=True: loss_fn must return a pair (loss, aux), got "
                f"{_describe(out)}. Return (loss, aux), or drop has_aux=True.")
        main, aux = out
        for path, leaf in jax.tree.flatten_with_path(aux)[0]:
            if not isinstance(leaf, jax.Array | np.ndarray | np.generic | float | int | bool):
                raise PipelineError(
                    f"aux leaf {jax.tree_util.keystr(path) or '(root)'} is a "
                    f"{type(leaf).__name__}; aux must be a pytree of arrays (keep other "
                    "values out of it, or make them arrays).")
    else:
        main, aux = out, None
    if objective.weighted:
        if not (isinstance(main, tuple | list) and len(main) == 2):
            raise PipelineError(
                "reduction='weighted': loss_fn must return (loss_sum, weight) "
                f"{'as the first element of (loss, aux) ' if objective.has_aux else ''}"
                f"(e.g. the summed loss of the microbatch's real tokens and their count), "
                f"got {_describe(main)}.")
        return [_scalar(main[0], "loss_sum", objective),
                _scalar(main[1], "weight", objective, float_only=False)], aux
    return [_scalar(main, "loss", objective)], aux


def _describe(x: Any) -> str:
    leaves = jax.tree.leaves(x)
    shapes = [tuple(jnp.shape(v)) for v in leaves]
    if isinstance(x, jax.Array | np.ndarray):  # (a tracer here: its type means nothing)
        return f"one array of shape {shapes[0]}"
    return f"{type(x).__name__} with {len(leaves)} leaves of shapes {shapes}"


def _scalar(x: Any, what: str, objective: Objective, float_only: bool = True) -> Any:
    leaves = jax.tree.leaves(x)
    if len(leaves) != 1 or jnp.shape(leaves[0]) != ():
        hint = ("" if objective.has_aux or len(leaves) != 2 else
                " If it returns (loss, aux), pass has_aux=True.")
        name = "" if what == "loss" else f" {what}"
        raise PipelineError(
            f"loss_fn must return one scalar{name} (the per-microbatch {what}); it "
            f"returned {len(leaves)} leaves with shapes {[jnp.shape(v) for v in leaves]}. "
            f"Reduce it, e.g. with jnp.mean.{hint}")
    dtype = jnp.result_type(leaves[0])
    if float_only and not jnp.issubdtype(dtype, jnp.floating):
        name = "" if what == "loss" else f" {what}"
        raise PipelineError(
            f"loss_fn must return a floating-point scalar{name}, got dtype {dtype}; cast "
            f"it, e.g. {what}.astype(jnp.float32).")
    if not float_only and not jnp.issubdtype(dtype, jnp.number):
        raise PipelineError(f"the weight must be a number, got dtype {dtype}.")
    return leaves[0]


def segments(traced: Traced) -> list[tuple[int, int]]:
    """Equation ranges ``[start, end)`` of the ``len(markers) + 1`` segments.

    Segment ``k`` ends right after marker ``k``; the last segment runs to the end.
    """
    bounds = [0, *(i + 1 for i in traced.markers), len(traced.jaxpr.eqns)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def with_key(loss_fn: Callable[..., jax.Array]) -> Callable[[Any, Any], jax.Array]:
    """``loss_fn(params, mb, key)`` as a two-argument loss over ``(mb, keys)``."""
    def traced(params: Any, batch: Any) -> jax.Array:
        microbatch, keys = batch
        if any(jax.typeof(keys).sharding.spec):  # split over Explicit axes: every piece
            keys = jax.sharding.reshard(keys, P())  # draws with the first
        return loss_fn(params, microbatch, keys[0])

    return traced


def trace_shard(loss_fn: Callable[..., jax.Array], params: Any, microbatch: Any,
                manual_shards: int, key_shards: int = 0, key_dtype: Any = None,
                objective: Objective = MEAN, param_shardings: Sequence[Any] | None = None,
                batch_sharding: Any = None) -> Traced:
    """Trace ``loss_fn`` on what one stage call sees: one manual batch shard of a microbatch.

    Stage functions run on one manual batch shard (the global view of the automatic batch
    axes is left to JAX's sharding), so the leading axis of every ``microbatch`` leaf is
    divided by ``manual_shards``. With ``key_shards`` (a loss that draws random numbers),
    one key per automatic batch shard rides along as a hidden batch leaf, and the stage
    draws with the first (:func:`with_key`). ``batch_sharding``: the sharding every
    microbatch leaf's traced type carries (``None``: none).
    """
    shard = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((a.shape[0] // manual_shards, *a.shape[1:]), a.dtype),
        microbatch)
    rows = [batch_sharding] * len(jax.tree.leaves(shard))
    if not key_shards:
        return trace(loss_fn, params, shard, objective, param_shardings, rows)
    keys = jax.ShapeDtypeStruct((key_shards,), key_dtype)
    return trace(with_key(loss_fn), params, (shard, keys), objective, param_shardings,
                 [*rows, batch_sharding])
