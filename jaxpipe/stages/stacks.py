"""Scanned layer stacks: cut a ``lax.scan`` over stacked layers between its iterations.

Models written the way MaxText and many flax models are (one layer, its parameters
stacked along a leading axis, run with ``lax.scan`` / ``nnx.scan`` / ``nn.scan``) trace to
one top-level ``scan`` equation whose body holds a :func:`jaxpipe.boundary` (or a
``@jaxpipe.layer`` call). Such a scan is a *stack*: the pipeline may cut between any
two of its iterations.

A cut stack is rewritten as consecutive *pieces*: a scan over iterations ``[a, b)``,
one per stage that holds part of the stack, chained through the scan's carry, with a
cut marker after each piece. A stacked parameter the scan reads directly (as one of its
scanned inputs) is passed as one :class:`ParamView` per piece, the rows ``[a, b)`` of
the user's array, so every stage holds only its own layers' weights, and gradients come
back in the user's stacked layout. Each stage then runs a scan of its own length: its
program does not grow with the number of layers, and stages with the same number of
layers share one compiled body.

Two rewrites are used: every iteration its own piece (for costing, so the cutter sees one
segment per layer) and the pieces of the chosen cut (for the stages).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax import lax
from jax.extend import core as jcore

from jaxpipe.errors import PipelineError
from jaxpipe.jaxpr.avals import typed_sds
from jaxpipe.jaxpr.interpret import read
from jaxpipe.jaxpr.markers import boundary_p
from jaxpipe.jaxpr.trace import Traced
from jaxpipe.sharding.param_views import ParamView, ParamViews

__all__ = ["MarkerId", "ParamView", "Stack", "StackCut", "cut_stacks", "find_stacks",
           "per_layer", "for_stages"]

#: Identity of a cut marker across rewrites: ``("top", k)`` for the k-th top-level
#: marker of the traced loss, ``("iter", eqn, i)`` for the cut after iteration ``i`` of
#: the stack at equation ``eqn``.
MarkerId = tuple


@dataclass(frozen=True)
class Stack:
    """A top-level scan whose body holds cut markers."""

    eqn: int  # its position in the traced jaxpr's equations
    length: int
    name: str | None  # the first marker's name in the body, for plans


def _body_markers(jaxpr: Any) -> list[Any]:
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive is boundary_p:
            out.append(eqn)
        for sub in jcore.jaxprs_in_params(eqn.params):
            out += _body_markers(sub)
    return out


def find_stacks(jaxpr: jcore.Jaxpr) -> list[Stack]:
    """The top-level scans of ``jaxpr`` that hold markers, checked to be cuttable."""
    out = []
    for k, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name != "scan":
            continue
        marks = _body_markers(eqn.params["jaxpr"])
        if not marks:
            continue
        if eqn.params["reverse"]:
            raise PipelineError(
                "a reversed lax.scan (reverse=True) holds jaxpipe.boundary / @jaxpipe.layer "
                "markers; jaxpipe cuts scanned layer stacks only when they run forwards: "
                "scan over the reversed stack instead, or move the marker out of the scan.")
        out.append(Stack(k, int(eqn.params["length"]), marks[0].params.get("name")))
    return out


def _split_leaves(jaxpr: jcore.Jaxpr, num_params: int, stacks: Sequence[Stack]
                  ) -> dict[int, int]:
    """Parameter leaf -> stack eqn, for leaves read only as a scanned input of one stack
    (those are passed as per-piece views)."""
    params = {v: i for i, v in enumerate(jaxpr.invars[:num_params])}
    uses: dict[int, list[tuple[int, bool]]] = {}
    stack_eqns = {s.eqn for s in stacks}
    for k, eqn in enumerate(jaxpr.eqns):
        first_x = (eqn.params["num_consts"] + eqn.params["num_carry"]
                   if k in stack_eqns else None)
        for pos, v in enumerate(eqn.invars):
            if isinstance(v, jcore.Var) and v in params:
                scanned = first_x is not None and pos >= first_x
                uses.setdefault(params[v], []).append((k, scanned))
    for v in jaxpr.outvars:
        if isinstance(v, jcore.Var) and v in params:
            uses.setdefault(params[v], []).append((-1, False))
    return {leaf: u[0][0] for leaf, u in uses.items() if len(u) == 1 and u[0][1]}


def cut_stacks(closed: jcore.ClosedJaxpr, num_params: int, stacks: Sequence[Stack],
               bounds: Mapping[int, Sequence[int]]
               ) -> tuple[jcore.ClosedJaxpr, list[ParamView], list[MarkerId], list[Any]]:
    """Rewrite every stack as pieces ``[bounds[i], bounds[i+1])`` (``bounds[eqn]`` runs from
    0 to the stack's length).

    Returns ``(jaxpr, views, marker_ids, marker_names)``: the new jaxpr (inputs: one per
    view, then the batch leaves), the parameter view behind each of its parameter inputs,
    and the identity and name of each of its top-level markers, in order.
    """
    jaxpr = closed.jaxpr
    split = _split_leaves(jaxpr, num_params, stacks)
    by_eqn = {s.eqn: s for s in stacks}
    views: list[ParamView] = []
    for leaf in range(num_params):
        if leaf in split:
            b = list(bounds[split[leaf]])
            views += [ParamView(leaf, a, c) for a, c in zip(b[:-1], b[1:], strict=True)]
        else:
            views.append(ParamView(leaf))
    view_index = {(w.leaf, w.start): i for i, w in enumerate(views)}
    params = {v: i for i, v in enumerate(jaxpr.invars[:num_params])}
    # Stacked outputs (ys) nothing reads are not gathered over the pieces: nnx.scan, for
    # one, returns the layers' weights as ys, and gathering them would send every
    # stage's weights down the pipeline.
    used = {v for e in jaxpr.eqns for v in e.invars if isinstance(v, jcore.Var)}
    used |= {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}
    marker_ids: list[MarkerId] = []
    names: list[Any] = []

    def run(*args: Any) -> Any:
        env: dict = dict(zip(jaxpr.constvars, closed.consts, strict=True))
        vals = args[: len(views)]
        for i, w in enumerate(views):
            if w.start is None:
                env[jaxpr.invars[w.leaf]] = vals[i]
        env.update(zip(jaxpr.invars[num_params:], args[len(views):], strict=True))
        top = 0
        for k, eqn in enumerate(jaxpr.eqns):
            if k in by_eqn:
                scanned = {pos: params[v] for pos, v in enumerate(eqn.invars)
                           if isinstance(v, jcore.Var) and params.get(v) in split}
                outs = _run_pieces(eqn, by_eqn[k], list(bounds[k]), env, vals, view_index,
                                   scanned, marker_ids, names, used)
            else:
                invals = [read(env, v) for v in eqn.invars]
                with eqn.ctx.manager:
                    outs = eqn.primitive.bind(*invals,
                                              **eqn.primitive.get_bind_params(eqn.params))
                if not eqn.primitive.multiple_results:
                    outs = [outs]
                if eqn.primitive is boundary_p:
                    marker_ids.append(("top", top))
                    names.append(eqn.params.get("name"))
                    top += 1
            env.update(zip(eqn.outvars, outs, strict=True))
        return [read(env, v) for v in jaxpr.outvars]

    avals = [typed_sds(jaxpr.invars[w.leaf].aval, _view_shape(jaxpr.invars[w.leaf].aval, w))
             for w in views]
    avals += [typed_sds(v.aval) for v in jaxpr.invars[num_params:]]
    new = jax.make_jaxpr(run)(*avals)
    return new, views, marker_ids, names


def _view_shape(aval: Any, w: ParamView) -> tuple[int, ...]:
    if w.start is None:
        return tuple(aval.shape)
    return (w.stop - w.start, *aval.shape[1:])


def _run_pieces(eqn: Any, stack: Stack, bounds: list[int], env: dict, vals: Sequence[Any],
                view_index: Mapping[tuple[int, int | None], int], params_of: Mapping[int, int],
                marker_ids: list[MarkerId], names: list[Any], used: set) -> list[Any]:
    """Bind the stack's scan once per piece, a cut marker on the carry after each.

    ``params_of``: scanned input position -> the parameter leaf passed there as views.
    """
    p = eqn.params
    nc, ncarry = p["num_consts"], p["num_carry"]
    invars = eqn.invars
    consts = [read(env, v) for v in invars[:nc]]
    carry = [read(env, v) for v in invars[nc:nc + ncarry]]
    ys_parts: list[list[Any]] = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        xs = []
        for pos in range(nc + ncarry, len(invars)):
            if pos in params_of:
                xs.append(vals[view_index[(params_of[pos], a)]])
            else:
                xs.append(lax.slice_in_dim(read(env, invars[pos]), a, b))
        with eqn.ctx.manager:
            outs = eqn.primitive.bind(*consts, *carry, *xs,
                                      **{**eqn.primitive.get_bind_params(p), "length": b - a})
        carry = list(boundary_p.bind(*outs[:ncarry], name=_piece_name(stack, a, b)))
        ys_parts.append(list(outs[ncarry:]))
        marker_ids.append(("iter", stack.eqn, b - 1))
        names.append(_piece_name(stack, a, b))
    ys = []
    for i, v in enumerate(eqn.outvars[ncarry:]):
        parts = [part[i] for part in ys_parts]
        # an unread ys: any value will do (nothing reads it), so nothing is gathered
        ys.append(parts[-1] if len(parts) == 1 or v not in used
                  else lax.concatenate(parts, 0))
    return carry + ys


def _piece_name(stack: Stack, a: int, b: int) -> str:
    base = stack.name or "scan"
    return f"{base}[{a}]" if b - a == 1 else f"{base}[{a}:{b}]"


@dataclass(frozen=True)
class StackCut:
    """A traced loss with its stacks rewritten into pieces.

    Attributes:
      traced: the rewritten loss; its parameter inputs are ``views.views`` (a flat list)
        and its markers are the top-level markers and the cut after every piece.
      views: the parameter views behind its parameter inputs.
      marker_ids: the identity of each marker in ``traced.markers`` (stable across
        rewrites of the same loss).
      bounds: per stack (by equation), the iteration bounds of its pieces.
    """

    traced: Traced
    views: ParamViews
    marker_ids: tuple[MarkerId, ...]
    bounds: Mapping[int, tuple[int, ...]]


def _rewrite(traced: Traced, stacks: Sequence[Stack],
             bounds: Mapping[int, Sequence[int]]) -> StackCut:
    closed, views, ids, _ = cut_stacks(traced.closed_jaxpr, traced.num_params, stacks, bounds)
    eqns = closed.jaxpr.eqns
    markers = tuple(i for i, e in enumerate(eqns) if e.primitive is boundary_p)
    assert len(markers) == len(ids), (markers, ids)
    leaf_avals = tuple(v.aval for v in traced.jaxpr.invars[: traced.num_params])
    new = Traced(closed, jax.tree.structure(list(range(len(views)))), traced.batch_treedef,
                 len(views), markers, tuple(eqns[i].params.get("name") for i in markers),
                 traced.objective)
    return StackCut(new, ParamViews(tuple(views), leaf_avals), tuple(ids),
                    {k: tuple(b) for k, b in bounds.items()})


def per_layer(traced: Traced, stacks: Sequence[Stack]) -> StackCut:
    """Every iteration of every stack its own piece, a marker after each: the loss as the
    cost model and the cutter see it (one segment per layer)."""
    return _rewrite(traced, stacks, {s.eqn: tuple(range(s.length + 1)) for s in stacks})


def for_stages(traced: Traced, stacks: Sequence[Stack], layers: StackCut,
               cuts: Sequence[int]) -> tuple[StackCut, list[int]]:
    """The loss as the stages run it: each stack cut only where a stage ends.

    ``cuts`` are marker indices into ``layers.traced`` (what the cutter chose). Returns
    the rewrite whose pieces are the stages' parts of every stack, and the same cuts as
    marker indices into it.
    """
    chosen = [layers.marker_ids[c] for c in cuts]
    bounds = {}
    for s in stacks:
        inner = sorted({i + 1 for kind, *rest in chosen if kind == "iter" and rest[0] == s.eqn
                        for i in rest[1:] if i + 1 < s.length})
        bounds[s.eqn] = (0, *inner, s.length)
    staged = _rewrite(traced, stacks, bounds)
    index = {mid: i for i, mid in enumerate(staged.marker_ids)}
    return staged, [index[mid] for mid in chosen]
