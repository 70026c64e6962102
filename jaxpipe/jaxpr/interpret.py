"""Evaluate jaxpr equations into the current trace: the one interpreter every layer uses.

The tracer (inlining calls that hold markers), the stage splitter (tracing each stage's
forward) and the cost model (timing a segment) all run a slice of a jaxpr's equations on
values they already have. :func:`eval_eqns` is that loop, written once::

    env = dict(zip(jaxpr.invars, args))
    eval_eqns(jaxpr.eqns, env)
    outs = [read(env, v) for v in jaxpr.outvars]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, MutableMapping, Sequence
from typing import Any

from jax.extend import core as jcore

__all__ = ["CALLS", "eval_eqns", "eval_slice", "forwarded_outputs", "from_parameters",
           "like", "read", "sub_jaxprs"]

#: ``(equation, input values) -> output values``, or ``None`` to bind the primitive.
Override = Callable[[Any, list[Any]], Sequence[Any] | None]


def sub_jaxprs(params: dict[str, Any]) -> Iterator[jcore.Jaxpr]:
    """The jaxprs an equation holds in its ``params`` (a ``jit``'s, a ``scan``'s body,
    a ``cond``'s branches...), closed ones as their open jaxpr."""
    for v in params.values():
        for x in v if isinstance(v, tuple | list) else (v,):
            if isinstance(x, jcore.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jcore.Jaxpr):
                yield x


def like(params_value: tuple | list, items: Iterable[Any]) -> tuple | list:
    """``items`` in a sequence of the type of an equation parameter's ``params_value``:
    a tuple, a list, or a named tuple (``custom_linear_solve``'s jaxprs), which takes its
    fields as arguments."""
    if hasattr(params_value, "_fields"):
        return type(params_value)(*items)
    return type(params_value)(items)


def from_parameters(jaxpr: jcore.Jaxpr, n_params: int, *, opaque: Iterable[Any] = ()
                    ) -> dict[int, frozenset]:
    """The equations of ``jaxpr`` computing from its first ``n_params`` inputs (the
    parameters), constants and literals alone, through one another, without effects and
    not of a primitive in ``opaque``: equation index -> the parameter inputs it reads
    (empty: constants alone)."""
    opaque = frozenset(opaque)
    sources: dict = {v: frozenset([v]) for v in jaxpr.invars[:n_params]}
    sources.update((v, frozenset()) for v in jaxpr.constvars)
    out: dict[int, frozenset] = {}
    for k, e in enumerate(jaxpr.eqns):
        ins = [v for v in e.invars if isinstance(v, jcore.Var)]
        if e.effects or e.primitive in opaque or not all(v in sources for v in ins):
            continue
        out[k] = frozenset().union(*(sources[v] for v in ins))
        sources.update((v, out[k]) for v in e.outvars)
    return out


def read(env: MutableMapping[Any, Any], atom: Any) -> Any:
    """The value of a jaxpr atom: a Literal's constant, or the variable's value in ``env``."""
    return atom.val if isinstance(atom, jcore.Literal) else env[atom]


def eval_eqns(eqns: Iterable[Any], env: MutableMapping[Any, Any], *,
              override: Override | None = None) -> None:
    """Bind every equation's primitive in order, reading inputs from and writing outputs to ``env``.

    ``env`` maps jaxpr variables to values (arrays or tracers); it must hold every
    variable the equations read before they define it (invars, constvars). Each
    equation is bound under its own context (``eqn.ctx``).

    Args:
      eqns: the equations, in program order.
      env: variable -> value; updated in place with every equation's outputs.
      override: optional ``(eqn, input values) -> output values``; when it returns
        ``None`` the equation is bound as usual. The tracer uses it to inline call
        bodies that hold cut markers.
    """
    for eqn in eqns:
        invals = [read(env, v) for v in eqn.invars]
        outs = override(eqn, invals) if override is not None else None
        if outs is None:
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
            if not eqn.primitive.multiple_results:
                outs = [outs]
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x


def eval_slice(eqns: Sequence[Any], inputs: Sequence[Any], outputs: Sequence[Any],
               args: Sequence[Any], *, override: Override | None = None) -> list[Any]:
    """A run of equations as a function: ``args`` bound to the variables ``inputs``,
    the values of ``outputs`` returned (see :func:`eval_eqns`)."""
    env = dict(zip(inputs, args, strict=True))
    eval_eqns(eqns, env, override=override)
    return [read(env, v) for v in outputs]


#: Call-like primitives whose body runs once as it is: inlining one changes nothing.
CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "remat2", "remat", "checkpoint"})


def forwarded_outputs(closed: jcore.ClosedJaxpr) -> list[int | None]:
    """Per output of ``closed``: the input it returns unchanged, or ``None``.

    Seen through calls (``jit``, ``jax.checkpoint``) and scans: a value a call passes
    through comes out as a new variable, so flax nnx's lifted transforms (``nnx.jit``,
    ``nnx.remat``), which write their outputs back into a model's variables, look like
    updates to every variable; so do the stacked blocks ``nnx.scan`` returns (its body's
    outputs, those of such a call inside it). Followed through the equations, each is
    its input again."""
    return _forwarded(closed.jaxpr)


def _forwarded(jaxpr: jcore.Jaxpr) -> list[int | None]:
    source: dict = {v: i for i, v in enumerate(jaxpr.invars)}
    for eqn in jaxpr.eqns:
        for out, k in zip(eqn.outvars, _passes(eqn), strict=True):
            x = eqn.invars[k] if k is not None else None
            if isinstance(x, jcore.Var) and x in source:
                source[out] = source[x]
    return [source.get(v) if isinstance(v, jcore.Var) else None for v in jaxpr.outvars]


def _passes(eqn: Any) -> list[int | None]:
    """Per output of ``eqn``: the input it is unchanged, or ``None``."""
    name = eqn.primitive.name
    if name in CALLS:
        inner = eqn.params.get("jaxpr") or eqn.params.get("call_jaxpr")
        return _forwarded(getattr(inner, "jaxpr", inner))
    if name == "scan":
        nc, nk = eqn.params["num_consts"], eqn.params["num_carry"]
        body = _forwarded(eqn.params["jaxpr"].jaxpr)
        # a carry is unchanged when the body returns it in its place; a y is the
        # stacked x the body returns as it is
        carry = [i if i == nc + k else None for k, i in enumerate(body[:nk])]
        ys = [i if i is not None and i >= nc + nk else None for i in body[nk:]]
        return carry + ys
    return [None] * len(eqn.outvars)
