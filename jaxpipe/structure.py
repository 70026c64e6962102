"""Structural identity of jaxpr fragments: the same equations up to variable names.

The layers of a deep model trace to fragments that differ only in which parameter
leaves they read: the blocks of an unrolled transformer, the one-layer pieces of a
scanned stack the cutter costs. Turning a fragment into a stage (a ``jax.vjp`` trace
of its forward and one of its backward) costs tens of milliseconds, so
:func:`jaxpipe.stages.split` builds one stage per *structure* and reuses it for every
fragment with the same key.

The key is conservative: equal keys mean the fragments compute the same function of
their inputs (cut markers' names aside: they label plans and compute nothing), so
anything the printed jaxpr does not show (constant values, Python
callables in equation parameters such as a ``custom_vjp``'s rules) enters the key by
identity. Two fragments that are equal but hold such objects anew get different keys
and are simply built twice.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from jax.extend import core as jcore

from jaxpipe.markers import boundary_p

__all__ = ["fragment_key"]

# Parameter values whose printed form says everything about them.
_PLAIN = (int, float, bool, str, bytes, type(None), complex)


def _opaque(value: Any, out: list[int]) -> None:
    """Append ``id`` of every object inside ``value`` the printed jaxpr does not show."""
    if isinstance(value, _PLAIN):
        return
    if isinstance(value, jcore.ClosedJaxpr):
        out.extend(id(c) for c in value.consts)
        _opaque(value.jaxpr, out)
        return
    if isinstance(value, jcore.Jaxpr):
        for eqn in value.eqns:
            for v in eqn.params.values():
                _opaque(v, out)
        return
    if isinstance(value, (tuple, list)):
        for v in value:
            _opaque(v, out)
        return
    try:  # dtypes, enums, shardings, frozen dataclasses: printed from their value
        hash(value)
    except TypeError:
        out.append(id(value))
        return
    if callable(value) and not isinstance(value, type):
        out.append(id(value))


def fragment_key(jaxpr: jcore.Jaxpr, eqns: Sequence[jcore.JaxprEqn],
                 invars: Sequence[jcore.Var], outvars: Sequence[Any],
                 const_vals: Mapping[jcore.Var, Any]) -> Hashable:
    """A key equal for two fragments only if they compute the same function.

    ``eqns`` are equations of ``jaxpr``; ``invars`` and ``outvars`` fix the fragment's
    signature (positions matter); ``const_vals`` maps ``jaxpr``'s constvars to their
    values (a constant enters the key by identity).
    """
    consts: list[jcore.Var] = []
    for eqn in eqns:
        for v in eqn.invars:
            if isinstance(v, jcore.Var) and v in const_vals and v not in consts:
                consts.append(v)
    # A cut marker's name labels plans; it is not part of what the fragment computes.
    unnamed = [e.replace(params={**e.params, "name": None}) if e.primitive is boundary_p
               else e for e in eqns]
    text = str(jaxpr.replace(constvars=consts, invars=list(invars), outvars=list(outvars),
                             eqns=unnamed, debug_info=jaxpr.debug_info.with_unknown_names()))
    opaque = [id(const_vals[v]) for v in consts]
    for eqn in eqns:
        for v in eqn.params.values():
            _opaque(v, opaque)
    return text, tuple(opaque)
