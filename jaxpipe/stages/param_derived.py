"""Residuals a stage recomputes from its parameters instead of storing them per microbatch.

Autodiff keeps, for the backward, values the forward computed from the parameters alone:
the bfloat16 copy of a float32 weight (mixed precision), the whole weight an FSDP shard
is gathered into, a weight normalized or merged from factors. They are the same for every
microbatch, and a schedule holds several microbatches' residuals at once (1F1B: up to
``p`` on the first device), so storing them per microbatch would hold as many copies of
the stage's (gathered) weights. The stage backward recomputes them from the parameters
instead, which are resident on the device anyway (as FSDP re-gathers its weights in the
backward): one cast or gather per microbatch's backward, against ``in-flight`` copies of
the weights.

:func:`param_derived` finds them with JAX's partial evaluation of the stage's forward
(parameters known, microbatch and carry unknown), which also splits scans, so a scanned
layer stack's per-layer casts are found too. Not recomputed: values computed from
constants alone (a causal mask: a stage's later layers receive it as a carry wherever a
cut falls between them, so what a stage stores would not be the sum of its layers'),
and values whose computation has an effect (a callback would run twice). Weights cast
at the top of the loss are computed again where each stage reads them, before the cut
(:mod:`jaxpipe.jaxpr.param_values`). Under the I / W split the weight half
computes them again too (:func:`~jaxpipe.stages.backward_split.split_backward`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jax.extend import core as jcore

from jaxpipe.jax_compat import dce_jaxpr, partial_eval_jaxpr

__all__ = ["ParamDerived", "param_derived"]


@dataclass(frozen=True)
class ParamDerived:
    """Values of a stage's forward computed from its parameters alone.

    Attributes:
      values: the forward's variables it found, in the order asked.
      jaxpr: computes them (in that order) from the parameters at ``param_pos``.
      param_pos: positions, among the forward's parameter inputs, of ``jaxpr``'s inputs.
    """

    values: tuple[jcore.Var, ...]
    jaxpr: jcore.ClosedJaxpr
    param_pos: tuple[int, ...]


def param_derived(fwd: jcore.ClosedJaxpr, n_params: int,
                  candidates: Sequence[jcore.Var]) -> ParamDerived | None:
    """Of ``candidates`` (outputs of ``fwd``, whose first ``n_params`` inputs are the
    stage's parameters), those computable from the parameters alone and a jaxpr computing
    them; ``None`` when there are none."""
    j = fwd.jaxpr
    # One pass over the top-level equations settles most candidates: a value no batch or
    # carry input reaches is one; one they reach through a first-order equation is not.
    # A value out of an equation holding jaxprs (a scan, a call) that some batch or carry
    # input enters may still be one: JAX's partial evaluation, which splits such bodies,
    # decides, where :func:`_may_split` says it could find one (it costs ~20 ms a stage).
    # Only values that read a parameter: one computed from constants alone (a causal
    # mask) reaches a stage's later layers as a carry wherever a cut falls between them,
    # so recomputing it would make what a stage stores differ from the sum of its layers'
    # (which the cost model counts).
    reached = set(j.invars[n_params:])
    from_params = set(j.invars[:n_params])
    wanted = set(candidates)
    maybe = False
    for e in j.eqns:
        ins = [v for v in e.invars if isinstance(v, jcore.Var)]
        if any(v in from_params for v in ins):
            from_params.update(e.outvars)
        if any(v in reached for v in ins):
            reached.update(e.outvars)
            maybe = maybe or (any(v in wanted and v in from_params for v in e.outvars)
                              and _may_split(e, reached))
    candidates = [v for v in candidates if v in from_params]
    if maybe:
        return _partially_evaluated(fwd, n_params, candidates)
    values = tuple(v for v in candidates if v not in reached)
    if not values:
        return None
    return _found(values, j.replace(outvars=list(values)), fwd.consts, n_params)


def _may_split(eqn: jcore.JaxprEqn, reached: set) -> bool:
    """Whether partial evaluation could find an output of ``eqn`` (which a batch or carry
    value enters) computed from its other inputs alone: never for a first-order equation
    or one whose every input is reached; for a call (``jit``), where its body has such an
    output; otherwise (a scan's body, a loop) maybe."""
    subs = list(jcore.jaxprs_in_params(eqn.params))
    known = [not (isinstance(v, jcore.Var) and v in reached) for v in eqn.invars]
    if not subs or not any(known):
        return False
    if eqn.primitive.name not in ("jit", "pjit", "closed_call", "core_call") or len(subs) != 1:
        return True
    inner = getattr(subs[0], "jaxpr", subs[0])
    inner_reached = {v for v, k in zip(inner.invars, known, strict=True) if not k}
    for e in inner.eqns:
        if any(isinstance(v, jcore.Var) and v in inner_reached for v in e.invars):
            inner_reached.update(e.outvars)
            if _may_split(e, inner_reached):
                return True
    return any(isinstance(v, jcore.Var) and v not in inner_reached for v in inner.outvars)


def _partially_evaluated(fwd: jcore.ClosedJaxpr, n_params: int,
                         candidates: Sequence[jcore.Var]) -> ParamDerived | None:
    j = fwd.jaxpr
    unknowns = [i >= n_params for i in range(len(j.invars))]
    known, _, out_unknowns, _ = partial_eval_jaxpr()(fwd, unknowns, instantiate=False)
    # the known jaxpr returns the known outputs (in the forward's order), then residuals
    known_outs = [v for v, u in zip(j.outvars, out_unknowns, strict=True) if not u]
    at: dict = {}
    for k, v in enumerate(known_outs):
        if isinstance(v, jcore.Var):
            at.setdefault(v, k)
    kj = known.jaxpr
    # (the known jaxpr is small: casts, gathers, masks; one pass a value keeps those that
    # read a parameter, as the caller's coarse pass cannot tell inside a call)
    values = tuple(v for v in candidates if v in at and any(dce_jaxpr()(
        kj.replace(outvars=[kj.outvars[at[v]]]), [True], instantiate=False)[1]))
    if not values:
        return None
    return _found(values, kj.replace(outvars=[kj.outvars[at[v]] for v in values]),
                  known.consts, n_params)


def _found(values: tuple, full: jcore.Jaxpr, consts: Sequence[Any], n_params: int
           ) -> ParamDerived | None:
    """``values`` (``full``'s outputs, read from its inputs, the first ``n_params`` the
    parameters) computed by their equations alone."""
    picked, used = dce_jaxpr()(full, [True] * len(values), instantiate=False)
    if picked.effects:
        # A value whose computation has an effect (a callback, a print) stays stored: the
        # backward recomputes values, and the effect would run (and a callback's result be
        # read) a second time. One by one, keep the values computed without one.
        keep = [k for k in range(len(values)) if not dce_jaxpr()(
            full.replace(outvars=[full.outvars[k]]), [True], instantiate=False)[0].effects]
        if not keep:
            return None
        values = tuple(values[k] for k in keep)
        picked, used = dce_jaxpr()(full.replace(outvars=[full.outvars[k] for k in keep]),
                                   [True] * len(keep), instantiate=False)
    pos = tuple(i for i, u in enumerate(used) if u)
    if any(i >= n_params for i in pos):  # by construction only parameters reach them
        raise AssertionError(f"a parameter-derived value reads input {max(pos)} of "
                             f"{len(used)}, past the {n_params} parameters")
    return ParamDerived(values, jcore.ClosedJaxpr(picked, consts), pos)
