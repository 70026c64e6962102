"""Structural identity of jaxpr fragments: the same equations up to variable names.

The layers of a deep model trace to fragments that differ only in which parameter
leaves they read: the blocks of an unrolled transformer, the one-layer pieces of a
scanned stack the cutter costs. Turning a fragment into a stage (a ``jax.vjp`` trace
of its forward and one of its backward) costs tens of milliseconds, so
:func:`jaxpipe.stages.split` builds one stage per *structure* and reuses it for every
fragment with the same key; the SPMD runtime compiles one body for stages whose jaxprs
match the same way.

A key is the printed jaxpr (which fixes how values flow) plus everything printing does
not show, compared by value where the object's type defines value equality and by
identity otherwise:

- every equation parameter, at every depth (a ``custom_jvp``'s rule, a sharding, a
  dtype), sub-jaxprs walked the same way; a rule JAX wraps anew at every call (the
  memoized thunk of ``custom_jvp_call``) by the rule it wraps (:func:`_rule_key`);
- constants, and array literals (printed as ``[...]``), by identity;
- every equation's context (``eqn.ctx``: compute type, PRNG partitioning, XLA metadata;
  interned, so equal contexts are one object).

Cut markers' names are left out: they label plans and compute nothing. Equal keys mean
the fragments compute the same function of their inputs; two equal fragments that hold
such objects anew get different keys and are simply built twice.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

from jaxpipe.jax_compat import JAX_WRAPPER_MODULES
from jaxpipe.jaxpr.markers import boundary_p

__all__ = ["fragment_key", "same_function", "unprinted"]




def _rule_key(fn: Any, depth: int = 0) -> Hashable:
    """A key for a rule JAX wraps anew at every call (a ``custom_jvp_call``'s
    ``jvp_jaxpr_fun``: a memoized thunk around the rule): the rule functions and objects
    it reaches, by identity, through JAX's own wrappers (their code, their transforms'
    names, their closures; memo tables, stores, traces and sentinels are left out). Two
    calls of one ``custom_jvp`` function key alike; two different rules never do."""
    if depth > 12:
        return id(fn)
    if hasattr(fn, "transforms") and hasattr(fn, "f") and hasattr(fn, "call_wrapped"):
        names = tuple(getattr(t[0], "__qualname__", repr(t[0])) for t in fn.transforms)
        return ("wrapped", names, _rule_key(fn.f, depth + 1))
    if getattr(fn, "__module__", None) in JAX_WRAPPER_MODULES and hasattr(fn, "__code__"):
        cells = []
        for cell in fn.__closure__ or ():
            try:
                v = cell.cell_contents
            except ValueError:  # not filled yet
                continue
            if isinstance(v, dict) or type(v) is object or type(v).__name__.endswith(
                    ("Trace", "Store")) or (isinstance(v, list) and all(
                        x is None or type(x).__name__.endswith("Store") for x in v)):
                continue  # memo tables, sentinels, traces, stores: not the rule
            cells.append(tuple(_rule_key(x, depth + 1) for x in v)
                         if isinstance(v, (tuple, list)) else _rule_key(v, depth + 1))
        return ("code", fn.__code__, tuple(cells))
    try:
        hash(fn)
    except TypeError:
        return id(fn)
    return fn if isinstance(fn, (int, float, str, bool, type(None))) else id(fn)


def _param(value: Any, out: list) -> None:
    if hasattr(value, "transforms") and hasattr(value, "call_wrapped"):
        out.append(_rule_key(value))
    elif isinstance(value, jcore.ClosedJaxpr):
        out.extend(id(c) for c in value.consts)
        _eqns(value.jaxpr.eqns, out)
    elif isinstance(value, jcore.Jaxpr):
        _eqns(value.eqns, out)
    elif isinstance(value, (tuple, list)):
        out.append(len(value))
        for v in value:
            _param(v, out)
    else:
        try:
            hash(value)
        except TypeError:  # no value equality to rely on (arrays, dicts)
            out.append(id(value))
        else:  # compared with its own __eq__: by value or, for most objects, identity
            out.append(value)


def _eqns(eqns: Sequence[jcore.JaxprEqn], out: list) -> None:
    for eqn in eqns:
        out.append(eqn.ctx)
        out.extend(id(v.val) for v in eqn.invars
                   if isinstance(v, jcore.Literal) and np.ndim(v.val) > 0)
        for name, value in eqn.params.items():
            if eqn.primitive is boundary_p and name == "name":
                continue
            out.append(name)
            _param(value, out)


def unprinted(jaxpr: jcore.Jaxpr | jcore.ClosedJaxpr) -> tuple:
    """What two jaxprs printing alike must also share to compute the same function (see
    the module docstring); a closed jaxpr's own constants are left to the caller."""
    out: list = []
    _eqns(getattr(jaxpr, "jaxpr", jaxpr).eqns, out)
    return tuple(out)


def same_function(x: jcore.ClosedJaxpr, y: jcore.ClosedJaxpr,
                  text: dict[int, str] | None = None) -> bool:
    """Whether closed jaxprs ``x`` and ``y`` compute the same function: the same printed
    form, the same :func:`unprinted` parts, and equal constants (one object, or equal
    concrete arrays; a tracer of an enclosing trace equals only itself).

    ``text`` caches printed forms by ``id``: the caller keeps the jaxprs in it alive.
    """
    if x is y:
        return True
    text = {} if text is None else text
    for f in (x, y):
        if id(f) not in text:
            text[id(f)] = str(f.jaxpr)
    return (text[id(x)] == text[id(y)] and unprinted(x) == unprinted(y)
            and _same_consts(list(x.consts), list(y.consts)))


def _same_consts(a: list, b: list) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x is y:
            continue
        if isinstance(x, jax.core.Tracer) or isinstance(y, jax.core.Tracer):
            return False
        xa, ya = np.asarray(x), np.asarray(y)
        if xa.shape != ya.shape or xa.dtype != ya.dtype or not np.array_equal(xa, ya):
            return False
    return True


def fragment_key(jaxpr: jcore.Jaxpr, eqns: Sequence[jcore.JaxprEqn],
                 invars: Sequence[jcore.Var], outvars: Sequence[Any],
                 const_vals: Mapping[jcore.Var, Any],
                 texts: dict[int, tuple[Any, str]] | None = None) -> Hashable:
    """A key equal for two fragments only if they compute the same function.

    ``eqns`` are equations of ``jaxpr``; ``invars`` and ``outvars`` fix the fragment's
    signature (positions matter); ``const_vals`` maps ``jaxpr``'s constvars to their
    values (a constant enters the key by identity). ``texts`` caches printed sub-jaxprs
    by ``id`` (with the object, so a reused ``id`` is not mistaken) across calls.
    """
    consts: list[jcore.Var] = []
    for eqn in eqns:
        for v in eqn.invars:
            if isinstance(v, jcore.Var) and v in const_vals and v not in consts:
                consts.append(v)
    subs: list[str] = []
    texts = {} if texts is None else texts
    printed = [_printable(e, subs, texts) for e in eqns]
    text = str(jaxpr.replace(constvars=consts, invars=list(invars), outvars=list(outvars),
                             eqns=printed, debug_info=jaxpr.debug_info.with_unknown_names()))
    opaque: list = [id(const_vals[v]) for v in consts]
    _eqns(eqns, opaque)
    return text, tuple(subs), tuple(opaque)


class _Sub:
    """Prints in place of a sub-jaxpr parameter: its position in the key's list of
    printed sub-jaxprs."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __str__(self) -> str:
        return f"<sub-jaxpr {self.n}>"


def _sub_text(value: Any, texts: dict[int, tuple[Any, str]]) -> str:
    if isinstance(value, tuple):
        return "\n".join(_sub_text(v, texts) for v in value)
    j = getattr(value, "jaxpr", value)  # printing a closed jaxpr prints its jaxpr
    hit = texts.get(id(j))
    if hit is None or hit[0] is not j:
        hit = texts[id(j)] = (j, str(j))
    return hit[1]


def _is_sub(value: Any) -> bool:
    if isinstance(value, tuple):
        return bool(value) and all(isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr))
                                   for v in value)
    return isinstance(value, (jcore.Jaxpr, jcore.ClosedJaxpr))


def _printable(eqn: jcore.JaxprEqn, subs: list[str],
               texts: dict[int, tuple[Any, str]]) -> jcore.JaxprEqn:
    """``eqn`` as the key prints it: a marker's name left out, and the sub-jaxprs of
    control flow (a scan's body: the same object in every piece of a scanned stack)
    printed once per object and shown as their position in ``subs``."""
    if eqn.primitive is boundary_p:
        return eqn.replace(params={**eqn.params, "name": None})
    if eqn.primitive.name not in _CONTROL:  # others may have printing rules of their own
        return eqn
    params = dict(eqn.params)
    for name, value in eqn.params.items():
        if _is_sub(value):
            subs.append(_sub_text(value, texts))
            params[name] = _Sub(len(subs) - 1)
    return eqn.replace(params=params)


#: Primitives whose sub-jaxpr parameters print as plain ``name=jaxpr`` pairs.
_CONTROL = frozenset({"scan", "while", "cond", "checkpoint", "remat", "remat2"})
