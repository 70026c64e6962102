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
marker passes on is the user's choice to carry it, and stays.

A stacked weight cast before the ``lax.scan`` over its layers (``ws.astype(bf16)``, then
``lax.scan(block, h, ws)``) is cast in the scan's body instead, a layer at a time
(:func:`_layerwise`): the scan reads the float32 stack itself, so each stage owns its
layers' rows of it (``jaxpipe.stages.stacks``), where the whole cast stack would have been
the first stage's and travelled through the pipeline once a microbatch. That holds for
chains of elementwise operations (casts, scaling by a constant) of parameters shaped
like the stack; anything that mixes layers (a norm over the whole stack) stays where it is.
"""

from __future__ import annotations

from typing import Any

import jax
from jax import lax
from jax.extend import core as jcore

from jaxpipe.jaxpr.avals import aval_bytes
from jaxpipe.jaxpr.interpret import eval_slice, from_parameters, read
from jaxpipe.jaxpr.markers import boundary_p, holds_marker

__all__ = ["computed_where_read"]

#: Primitives computing each element from the same element of their operands (or from a
#: scalar): run on one layer's rows of a stack, they give that layer's rows of the result.
_ELEMENTWISE = frozenset({
    "convert_element_type", "reduce_precision", "copy", "copy_p", "neg", "abs", "sign",
    "floor", "ceil", "round", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic",
    "sin", "cos", "sqrt", "rsqrt", "cbrt", "square", "integer_pow", "pow", "add", "sub",
    "mul", "div", "max", "min", "clamp", "select_n"})


def _param_only(jaxpr: jcore.Jaxpr, n_params: int) -> set[int]:
    """Indices of the equations computing from the parameters (and constants) alone,
    reading some parameter, whose values are at least a quarter of the bytes of the
    parameters they come from (a weight's copy, cast or transpose). A small value of
    many weights (an L2 penalty computed at the top) is carried as it was: computed again
    in a later segment, that stage would read, and hold, every weight it comes from. A
    value from constants alone (a causal mask) stays too, as what the stages store is
    counted per layer (``stages.param_derived``)."""
    return {k for k, read in from_parameters(jaxpr, n_params, opaque=[boundary_p]).items()
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


def _layerwise(producer: dict, v: jcore.Var) -> tuple[list[Any], list[Any]] | None:
    """``(equations, sources)`` computing the stacked value ``v`` element by element
    from ``sources`` (variables shaped like ``v``, or scalars) in that order; ``None``
    where some equation on the way is not elementwise (it would mix layers)."""
    eqns: list[Any] = []
    sources: list[Any] = []
    seen: set = set()

    def walk(x: Any) -> bool:
        if not isinstance(x, jcore.Var):
            return x.aval.shape == ()
        if x in seen:
            return True
        seen.add(x)
        e = producer.get(x)
        if e is None:  # a parameter or a constant
            sources.append(x)
            return x.aval.shape in (v.aval.shape, ())
        if (e.primitive.name not in _ELEMENTWISE or len(e.outvars) != 1
                or e.outvars[0].aval.shape != v.aval.shape):
            return False
        ok = all([walk(y) for y in e.invars])
        eqns.append(e)  # after its inputs' equations
        return ok

    return (eqns, sources) if walk(v) else None


def _cast_in_body(eqn: Any, moved: dict[int, tuple[list, list]], get: Any) -> list[Any]:
    """The outputs of the scan ``eqn`` with each scanned input ``moved`` (position ->
    :func:`_layerwise`'s chain) computed in the body from its sources' rows, a layer at a
    time, instead of read whole."""
    p = eqn.params
    first_x, n_carry = p["num_consts"] + p["num_carry"], p["num_carry"]
    body = p["jaxpr"]
    consts = [get(x) for x in eqn.invars[:p["num_consts"]]]
    init = [get(x) for x in eqn.invars[p["num_consts"]:first_x]]
    xs = {i: get(x) for i, x in enumerate(eqn.invars) if i >= first_x and i not in moved}
    stacked = list(dict.fromkeys(s for _, srcs in moved.values() for s in srcs
                                 if s.aval.shape != ()))
    scalars = {s: get(s) for _, srcs in moved.values() for s in srcs if s.aval.shape == ()}

    def step(carry: list, rows: tuple) -> tuple[list, list]:
        plain, src = rows
        row = dict(zip(stacked, src, strict=True)) | scalars
        ins = [*consts, *carry]
        for i in range(first_x, len(eqn.invars)):
            if i in moved:
                chain, srcs = moved[i]
                ins += eval_slice(chain, srcs, [eqn.invars[i]], [row[s] for s in srcs])
            else:
                ins.append(plain[i])
        outs = eval_slice(body.jaxpr.eqns, [*body.jaxpr.constvars, *body.jaxpr.invars],
                          body.jaxpr.outvars, [*body.consts, *ins])
        return outs[:n_carry], outs[n_carry:]

    carry, ys = lax.scan(step, init, (xs, [get(s) for s in stacked]), length=p["length"],
                         reverse=p["reverse"], unroll=p["unroll"])
    return [*carry, *ys]


def _rescans(jaxpr: jcore.Jaxpr, producer: dict) -> dict[int, dict[int, tuple]]:
    """Per scan holding markers (a stack of layers): its scanned inputs computed from
    parameters element by element, with their chains (:func:`_layerwise`)."""
    out: dict[int, dict[int, tuple]] = {}
    for k, e in enumerate(jaxpr.eqns):
        if e.primitive.name != "scan" or not holds_marker(e):
            continue
        first_x = e.params["num_consts"] + e.params["num_carry"]
        for i in range(first_x, len(e.invars)):
            x = e.invars[i]
            if isinstance(x, jcore.Var) and x in producer:
                chain = _layerwise(producer, x)
                if chain is not None:
                    out.setdefault(k, {})[i] = chain
    return out


def computed_where_read(closed: jcore.ClosedJaxpr, n_params: int,
                        avals: list[Any]) -> jcore.ClosedJaxpr:
    """``closed`` (a traced loss whose first ``n_params`` inputs are the parameters,
    traced from ``avals``) with every parameter-only value computed in each segment that
    reads it; ``closed`` itself where no later segment reads one."""
    j = closed.jaxpr
    moved = _param_only(j, n_params)
    producer = {v: j.eqns[k] for k in moved for v in j.eqns[k].outvars}
    rescans = _rescans(j, producer)
    if not moved or not (rescans or _read_in_later_segment(j, moved)):
        return closed

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
            if k in moved:
                continue
            env.update(zip(eqn.outvars, _cast_in_body(eqn, rescans[k], get), strict=True)
                       if k in rescans else bind(eqn))
            if eqn.primitive is boundary_p:
                here.clear()  # a new segment computes its own
        return [get(v) for v in j.outvars]

    return jax.make_jaxpr(run)(*avals)
