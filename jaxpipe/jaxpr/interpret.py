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

__all__ = ["eval_eqns", "read", "sub_jaxprs"]

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
