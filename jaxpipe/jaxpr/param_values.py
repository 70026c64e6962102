"""Values computed from the parameters alone, computed where each segment reads them.

A loss that casts its weights at the top (``params = jax.tree.map(lambda w:
w.astype(jnp.bfloat16), params)``, jmp's ``policy.cast_to_compute(params)``) computes
every layer's bf16 copy before the first marker. Cut as traced, the first stage would own
every layer's float32 weight (it reads them all), and each copy would travel through the
pipeline as an activation, once a microbatch, to the stage that uses it. So the loss's
jaxpr is re-emitted with each such value computed in every segment (the stretch between
two markers) that reads it, just before its first use there: each stage then reads its
own layers' weights, and nothing parameter-sized moves between stages.

Moved: equations without effects that read a parameter and otherwise only constants or
values of such equations, whose values are at least a quarter of the parameters' bytes
they come from (not an L2 penalty of every weight: see :func:`_param_only`). A value a
marker passes on is the user's choice to carry it, and stays. A stacked weight prepared
before the ``lax.scan`` over its layers is prepared in the scan's body, a layer at a time
(:mod:`jaxpipe.jaxpr.scanned_prep`).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.extend import core as jcore

from jaxpipe.jaxpr.avals import aval_bytes
from jaxpipe.jaxpr.interpret import eval_slice, from_parameters, read
from jaxpipe.jaxpr.markers import boundary_p
from jaxpipe.jaxpr.scanned_prep import prepared_in_body, rescans

__all__ = ["computed_where_read"]


def _param_only(jaxpr: jcore.Jaxpr, computing: dict[int, frozenset]) -> set[int]:
    """Indices of the equations computing from the parameters (and constants) alone
    (``computing``: :func:`~jaxpipe.jaxpr.interpret.from_parameters`), reading some
    parameter, whose values are at least a quarter of the bytes of the parameters they
    come from (a weight's copy, cast or transpose). A small value of many weights (an L2
    penalty computed at the top) is carried as it was: computed again in a later segment,
    that stage would read, and hold, every weight it comes from. A value from constants
    alone (a causal mask) stays too, as what the stages store is counted per layer
    (``stages.param_derived``)."""
    return {k for k, read in computing.items()
            if read and 4 * sum(aval_bytes(v.aval) for v in jaxpr.eqns[k].outvars)
            >= sum(aval_bytes(p.aval) for p in read)}


def _read_in_later_segment(jaxpr: jcore.Jaxpr, moved: set[int]) -> bool:
    """Whether a later segment than its own reads a value of a ``moved`` equation."""
    segment_of: dict = {}
    segment = 0
    for k, e in enumerate(jaxpr.eqns):
        if any(segment_of.get(v, segment) < segment for v in e.invars
               if isinstance(v, jcore.Var)):
            return True
        if k in moved:
            segment_of.update((v, segment) for v in e.outvars)
        if e.primitive is boundary_p:
            segment += 1
    return any(segment_of.get(v, segment) < segment for v in jaxpr.outvars
               if isinstance(v, jcore.Var))


def computed_where_read(closed: jcore.ClosedJaxpr, n_params: int,
                        avals: list[Any]) -> jcore.ClosedJaxpr:
    """``closed`` (a traced loss whose first ``n_params`` inputs are the parameters,
    traced from ``avals``) with every parameter-only value computed in each segment that
    reads it, and stacks prepared for a scan prepared in its body; ``closed`` itself
    where neither changes anything."""
    j = closed.jaxpr
    computing = from_parameters(j, n_params, opaque=[boundary_p])
    moved = _param_only(j, computing)
    chains = rescans(j, n_params, {v: j.eqns[k] for k in computing for v in j.eqns[k].outvars})
    if not chains and not (moved and _read_in_later_segment(j, moved)):
        return closed
    index = {id(e): k for k, e in enumerate(j.eqns)}
    # computed where read, and not before: in a scan's body, or in each segment reading it
    lazy = moved | {index[id(q)] for c in chains.values() for eqns, _ in c.values()
                    for q in eqns}
    producer = {v: j.eqns[k] for k in lazy for v in j.eqns[k].outvars}

    def run(*args: Any) -> list[Any]:
        env: dict = dict(zip(j.constvars, closed.consts, strict=True))
        env.update(zip(j.invars, args, strict=True))
        here: dict = {}  # the moved values computed in the current segment

        def get(v: Any) -> Any:
            if not isinstance(v, jcore.Var) or v in env:
                return read(env, v)
            if v not in here:
                here.update(bind(producer[v]))
            return here[v]

        def bind(eqn: Any) -> dict:  # its outputs, its inputs read through get
            ins = [x for x in eqn.invars if isinstance(x, jcore.Var)]
            return dict(zip(eqn.outvars, eval_slice([eqn], ins, eqn.outvars,
                                                    [get(x) for x in ins]), strict=True))

        for k, eqn in enumerate(j.eqns):
            if k in lazy:
                continue
            env.update(zip(eqn.outvars, prepared_in_body(eqn, chains[k], get), strict=True)
                       if k in chains else bind(eqn))
            if eqn.primitive is boundary_p:
                here.clear()  # a new segment computes its own
        return [get(v) for v in j.outvars]

    return jax.make_jaxpr(run)(*avals)
