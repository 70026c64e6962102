"""Trace a per-microbatch loss function to one flat jaxpr and find its candidate cuts.

The traced program has the parameter leaves and the microbatch leaves as inputs and
the scalar loss as its only output. ``jaxpipe_boundary`` equations at the top level are
the candidate cut points. Boundaries hidden inside ``jit``-ted helpers are inlined to
the top level. A top-level ``scan`` whose body holds boundaries is kept as it is: it is a
scanned layer stack, cut between its iterations by :mod:`jaxpipe.stacks`. Boundaries
inside other control flow (``cond``, ``while``) or custom derivative rules cannot be cut
there and raise a clear error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from jaxpipe.errors import PipelineError
from jaxpipe.interpret import eval_eqns, read
from jaxpipe.markers import boundary_p

__all__ = ["Traced", "trace", "trace_shard", "segments", "microbatch_like", "with_key"]

# Call-like primitives whose bodies we may inline so markers inside them become cuttable.
_INLINE = {"pjit", "jit", "closed_call", "core_call", "remat", "checkpoint"}


@dataclass(frozen=True)
class Traced:
    """A traced loss: flat jaxpr, how its inputs map to pytrees, and the marker positions."""

    closed_jaxpr: jcore.ClosedJaxpr
    params_treedef: Any
    batch_treedef: Any
    num_params: int
    markers: tuple[int, ...]
    marker_names: tuple[str | None, ...]

    @property
    def jaxpr(self) -> jcore.Jaxpr:
        return self.closed_jaxpr.jaxpr

    @property
    def num_batch(self) -> int:
        return len(self.jaxpr.invars) - self.num_params


def _has_marker(jaxpr) -> bool:
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        if eqn.primitive is boundary_p:
            return True
        if any(_has_marker(sub) for sub in jcore.jaxprs_in_params(eqn.params)):
            return True
    return False


def _inline_eval(jaxpr: jcore.Jaxpr, consts, args) -> list:
    """Evaluate ``jaxpr`` into the current trace, inlining call bodies that hold markers."""
    env: dict = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def inline_marked_calls(eqn, invals):
        subs = jcore.jaxprs_in_params(eqn.params)
        if not (subs and any(_has_marker(s) for s in subs)):
            return None  # plain equation: bind it
        if eqn.primitive.name == "scan":
            return None  # a scanned layer stack: jaxpipe.stacks cuts it between iterations
        if eqn.primitive.name not in _INLINE:
            raise PipelineError(
                f"jaxpipe.boundary / @jaxpipe.layer was used inside `{eqn.primitive.name}` "
                "(e.g. lax.cond, a while loop or a custom_vjp function). Cuts must be at the "
                "top level of the loss function or between the iterations of a lax.scan over "
                "layers: move the marker out of the control-flow body, or unroll that loop "
                "in Python."
            )
        inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
        inner_consts = getattr(inner, "consts", [])
        return _inline_eval(getattr(inner, "jaxpr", inner), inner_consts, invals)

    eval_eqns(jaxpr.eqns, env, override=inline_marked_calls)
    return [read(env, v) for v in jaxpr.outvars]


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


def trace(loss_fn: Callable[[Any, Any], Any], params: Any, microbatch: Any) -> Traced:
    """Trace ``loss_fn(params, microbatch)`` to a flat ClosedJaxpr with top-level markers.

    ``params`` and ``microbatch`` may be arrays or ``jax.ShapeDtypeStruct`` pytrees.
    """
    _check_array_leaves(params, "params")
    p_leaves, p_tree = jax.tree.flatten(params)
    b_leaves, b_tree = jax.tree.flatten(microbatch)

    def flat_loss(*leaves):
        p = jax.tree.unflatten(p_tree, leaves[: len(p_leaves)])
        b = jax.tree.unflatten(b_tree, leaves[len(p_leaves):])
        out = loss_fn(p, b)
        out_leaves = jax.tree.leaves(out)
        if len(out_leaves) != 1 or jnp.shape(out_leaves[0]) != ():
            shapes = [jnp.shape(x) for x in out_leaves]
            raise PipelineError(
                f"loss_fn must return one scalar (the per-microbatch loss); it returned "
                f"{len(out_leaves)} leaves with shapes {shapes}. Reduce it, e.g. with jnp.mean."
            )
        if not jnp.issubdtype(jnp.result_type(out_leaves[0]), jnp.floating):
            raise PipelineError(
                f"loss_fn must return a floating-point scalar, got dtype "
                f"{jnp.result_type(out_leaves[0])}; cast it, e.g. loss.astype(jnp.float32)."
            )
        return out_leaves[0]

    avals = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)) for x in p_leaves + b_leaves]
    raw = jax.make_jaxpr(flat_loss)(*avals)
    if any(_has_marker_eqn(e) for e in raw.jaxpr.eqns):  # markers hidden in sub-jaxprs
        raw = jax.make_jaxpr(lambda *a: _inline_eval(raw.jaxpr, raw.consts, a))(*avals)
    markers = tuple(i for i, e in enumerate(raw.jaxpr.eqns) if e.primitive is boundary_p)
    names = tuple(raw.jaxpr.eqns[i].params.get("name") for i in markers)
    return Traced(raw, p_tree, b_tree, len(p_leaves), markers, names)


def _has_marker_eqn(eqn) -> bool:
    return any(_has_marker(s) for s in jcore.jaxprs_in_params(eqn.params))


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
        return loss_fn(params, microbatch, keys[0])

    return traced


def trace_shard(loss_fn: Callable[..., jax.Array], params: Any, microbatch: Any,
                manual_shards: int, key_shards: int = 0, key_dtype: Any = None) -> Traced:
    """Trace ``loss_fn`` on what one stage call sees: one manual batch shard of a microbatch.

    Stage functions run on one manual batch shard (the global view of the automatic batch
    axes is left to JAX's sharding), so the leading axis of every ``microbatch`` leaf is
    divided by ``manual_shards``. With ``key_shards`` (a loss that draws random numbers),
    one key per automatic batch shard rides along as a hidden batch leaf, and the stage
    draws with the first (:func:`with_key`).
    """
    shard = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((a.shape[0] // manual_shards, *a.shape[1:]), a.dtype),
        microbatch)
    if not key_shards:
        return trace(loss_fn, params, shard)
    keys = jax.ShapeDtypeStruct((key_shards,), key_dtype)
    return trace(with_key(loss_fn), params, (shard, keys))
