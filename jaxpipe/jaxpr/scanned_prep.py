"""A stacked weight's elementwise preparation, moved into the body of the scan over it.

``ws.astype(jnp.bfloat16)`` (or ``ws * scale``, ``jnp.tanh(ws)``) before ``lax.scan(block,
h, ws)`` over a stack of layers holding cut markers: the scan reads the whole prepared
stack, so the first stage (where it is computed) owned every layer's float32 rows, and the
prepared stack travelled through the pipeline once a microbatch. Rewritten, the scan reads
the parameter stack and its body prepares each layer's rows: each stage then owns its own
layers' rows (``jaxpipe.stages.stacks``), and only activations cross.

Only where that is what it means (:func:`rescans`): a chain of elementwise primitives
(:data:`ELEMENTWISE`, and ``jit`` calls of nothing else) from parameters and constants
shaped like the stack, and scalars; its values read by nothing but the chain and that
scanned input, and its parameters by nothing but the chain. A stack read elsewhere too (an
L2 penalty of the cast stack, its last layer reused as a head, a norm over the whole stack)
stays as traced: rewritten, every stage would own the whole stack.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jax import lax
from jax.extend import core as jcore

from jaxpipe.jaxpr.interpret import eval_slice
from jaxpipe.jaxpr.markers import holds_marker

__all__ = ["ELEMENTWISE", "Chain", "prepared_in_body", "rescans"]

#: Primitives computing each element from the same element of their operands (or from a
#: scalar), with no shape among their parameters: bound on one layer's rows of a stack,
#: they give that layer's rows of the result.
ELEMENTWISE = frozenset({
    "convert_element_type", "reduce_precision", "copy", "copy_p", "neg", "abs", "sign",
    "floor", "ceil", "round", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic",
    "sin", "cos", "sqrt", "rsqrt", "cbrt", "square", "integer_pow", "pow", "erf", "add",
    "sub", "mul", "div", "max", "min", "clamp", "select_n", "stop_gradient", "is_finite",
    "eq", "ne", "lt", "le", "gt", "ge", "not", "and", "or", "xor"})

_CALLS = ("pjit", "jit", "closed_call")

#: ``(equations, sources)``: the equations computing a prepared stack from its sources
#: (stacks shaped like it, and scalars), in order.
Chain = tuple[list[Any], list[Any]]


def _shape(x: Any) -> tuple:
    return tuple(getattr(x.aval, "shape", ()))


def _elementwise(e: Any, shape: tuple) -> bool:
    """``e`` computes each element of its one output, shaped ``shape``, from the same
    element of its operands (or from scalars)."""
    if (len(e.outvars) != 1 or _shape(e.outvars[0]) != shape
            or any(_shape(x) not in (shape, ()) for x in e.invars)):
        return False
    if e.primitive.name in _CALLS:
        inner = e.params.get("jaxpr") or e.params.get("call_jaxpr")
        body = getattr(inner, "jaxpr", inner)
        if any(_shape(c) != () for c in body.constvars):  # a stack it closes over is not
            return False  # sliced by the scan (_inline_calls would pass it whole)
        return all(_elementwise(q, shape) or
                   (len(q.outvars) == 1 and _shape(q.outvars[0]) == ()
                    and q.primitive.name in ELEMENTWISE) for q in body.eqns)
    return e.primitive.name in ELEMENTWISE


def _inline_calls(eqn: Any, ins: list) -> list | None:
    """A ``jit`` call's body evaluated in place (bound as a call, its jaxpr would expect
    the whole stack's shapes)."""
    if eqn.primitive.name not in _CALLS:
        return None
    inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
    consts = list(getattr(inner, "consts", ()))
    body = getattr(inner, "jaxpr", inner)
    return eval_slice(body.eqns, [*body.constvars, *body.invars], body.outvars,
                      [*consts, *ins], override=_inline_calls)


def _chain(producer: Mapping[Any, Any], v: Any, stacks: set) -> Chain | None:
    """How the scanned input ``v`` is computed element by element from ``stacks``
    (parameters and constants shaped like it) and scalars; ``None`` where it is not."""
    eqns: list[Any] = []
    sources: list[Any] = []
    seen: set = set()

    def walk(x: Any) -> bool:
        if not isinstance(x, jcore.Var):
            return _shape(x) == ()
        if x in seen:
            return True
        seen.add(x)
        e = producer.get(x)
        if _shape(x) == () or e is None:  # a scalar, small wherever it is computed
            sources.append(x)
            return _shape(x) == () or x in stacks
        if not _elementwise(e, _shape(v)):
            return False
        ok = all([walk(y) for y in e.invars])
        eqns.append(e)  # after its inputs' equations
        return ok

    return (eqns, sources) if walk(v) else None


def rescans(jaxpr: jcore.Jaxpr, n_params: int, producer: Mapping[Any, Any]
            ) -> dict[int, dict[int, Chain]]:
    """Per scan holding markers (equation index): its scanned inputs (operand position)
    prepared element by element from parameter stacks that nothing else reads, with
    their chains. ``producer``: variable -> the equation computing it, for every value
    computed from parameters and constants alone."""
    params = set(jaxpr.invars[:n_params])
    stacks = params | set(jaxpr.constvars)
    index = {id(e): j for j, e in enumerate(jaxpr.eqns)}
    readers: dict = {}
    for j, e in enumerate(jaxpr.eqns):
        for pos, x in enumerate(e.invars):
            if isinstance(x, jcore.Var):
                readers.setdefault(x, []).append((j, pos))
    for x in jaxpr.outvars:
        if isinstance(x, jcore.Var):
            readers.setdefault(x, []).append((-1, -1))
    out: dict[int, dict[int, Chain]] = {}
    for k, e in enumerate(jaxpr.eqns):
        if e.primitive.name != "scan" or not holds_marker(e):
            continue
        first = e.params["num_consts"] + e.params["num_carry"]
        chains = {i: c for i in range(first, len(e.invars))
                  if isinstance(e.invars[i], jcore.Var) and e.invars[i] in producer
                  and (c := _chain(producer, e.invars[i], stacks)) is not None}
        while chains:  # drop a chain something else reads, until none does
            inside = {index[id(q)] for eqns, _ in chains.values() for q in eqns}
            kept = {i: c for i, c in chains.items()
                    if _alone(c, (k, i), inside, readers, params)}
            if len(kept) == len(chains):
                break
            chains = kept
        if chains:
            out[k] = chains
    return out


def _alone(chain: Chain, reader: tuple[int, int], inside: set[int], readers: dict,
           params: set) -> bool:
    """Nothing but the chains' equations (``inside``) and the scanned input ``reader``
    (equation, operand) reads the values of ``chain`` or its parameters."""
    made = [o for q in chain[0] for o in q.outvars]
    return (all(j in inside or (j, pos) == reader
                for o in made for j, pos in readers.get(o, ()))
            and all(j in inside for s in chain[1] if s in params
                    for j, _ in readers.get(s, ())))


def prepared_in_body(eqn: Any, chains: Mapping[int, Chain], get: Any) -> list[Any]:
    """The outputs of the scan ``eqn``, each scanned input of ``chains`` (operand
    position -> :func:`rescans`' chain) computed in the body from its sources' rows, a
    layer at a time, rather than read whole. ``get``: a variable's value outside."""
    p = eqn.params
    first, n_carry = p["num_consts"] + p["num_carry"], p["num_carry"]
    body = p["jaxpr"]
    consts = [get(x) for x in eqn.invars[:p["num_consts"]]]
    init = [get(x) for x in eqn.invars[p["num_consts"]:first]]
    xs = {i: get(x) for i, x in enumerate(eqn.invars) if i >= first and i not in chains}
    stacked = list(dict.fromkeys(s for _, srcs in chains.values() for s in srcs
                                 if _shape(s) != ()))
    scalars = {s: get(s) for _, srcs in chains.values() for s in srcs if _shape(s) == ()}

    def step(carry: list, rows: tuple) -> tuple[list, list]:
        plain, src = rows
        row = dict(zip(stacked, src, strict=True)) | scalars
        ins = [*consts, *carry]
        for i in range(first, len(eqn.invars)):
            if i in chains:
                eqns, srcs = chains[i]
                ins += eval_slice(eqns, srcs, [eqn.invars[i]], [row[s] for s in srcs],
                                  override=_inline_calls)
            else:
                ins.append(plain[i])
        outs = eval_slice(body.jaxpr.eqns, [*body.jaxpr.constvars, *body.jaxpr.invars],
                          body.jaxpr.outvars, [*body.consts, *ins])
        return outs[:n_carry], outs[n_carry:]

    carry, ys = lax.scan(step, init, (xs, [get(s) for s in stacked]), length=p["length"],
                         reverse=p["reverse"], unroll=p["unroll"])
    return [*carry, *ys]
