"""The weight of ``reduction="weighted"``: what it depends on, as the runtimes need it.

:func:`batch_weight` is the weight as a function of the batch alone, where no parameter
enters it (a token count): the runtimes total it before any backward and seed each
microbatch's loss with ``1 / total``. :func:`weight_has_gradient` says whether a weight a
parameter enters has a gradient in it: the runtimes divide the summed loss gradients by
the total weight as a constant, so such a weight is refused at build.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from jaxpipe.jax_compat import dce_jaxpr
from jaxpipe.jaxpr.avals import is_key
from jaxpipe.jaxpr.markers import holds_marker
from jaxpipe.jaxpr.trace import Traced

__all__ = ["batch_weight", "weight_has_gradient"]


def batch_weight(traced: Traced) -> jcore.ClosedJaxpr | None:
    """With ``reduction="weighted"``, the weight as a function of the microbatch leaves
    alone (``traced``'s batch inputs, one microbatch) when no parameter enters it (a
    token count): a runtime then has the total weight before any backward and seeds each
    microbatch's loss with ``1 / total``, as ``jax.value_and_grad`` of the quotient
    does, rather than dividing the summed gradients at the end (which a ``custom_vjp``
    nonlinear in its cotangent, one clipping the gradient, tells apart). ``None`` where a
    parameter, a key-typed leaf or a cut marker enters it."""
    if not traced.objective.weighted:
        return None
    jaxpr = traced.jaxpr
    want = jaxpr.outvars[1]
    if not isinstance(want, jcore.Var):
        return None
    needed, eqns = {want}, []
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars):
            if holds_marker(eqn):
                return None
            eqns.append(eqn)
            needed |= {v for v in eqn.invars if isinstance(v, jcore.Var)}
    params = set(jaxpr.invars[:traced.num_params])
    batch = jaxpr.invars[traced.num_params:]
    if needed & params or any(is_key(v.aval) for v in batch if v in needed):
        return None
    sliced = jaxpr.replace(invars=list(batch), outvars=[want], eqns=eqns[::-1])
    return jcore.ClosedJaxpr(sliced, traced.closed_jaxpr.consts)


def weight_has_gradient(traced: Traced) -> bool:
    """With ``reduction="weighted"``, whether the weight has a gradient in a parameter:
    whether the parameters' cotangents of the weight alone read its cotangent, once JAX's
    dead-code elimination (into calls) has dropped what ``stop_gradient`` and integer
    paths cut off. The runtimes divide the summed loss gradients by the total weight, a
    constant (a weight with a gradient of its own is refused at build)."""
    if not traced.objective.weighted or batch_weight(traced) is not None:
        return False
    n, closed = traced.num_params, traced.closed_jaxpr
    avals = [v.aval for v in closed.jaxpr.invars]
    diff = [i for i in range(n) if jnp.issubdtype(avals[i].dtype, jnp.inexact)]
    if not diff:
        return False

    def weight_vjp(diff_params: list, rest: list, ct: Any) -> Any:
        def weight(dp: list) -> Any:
            args = list(rest)
            for i, x in zip(diff, dp, strict=True):
                args[i] = x
            return jcore.jaxpr_as_fun(closed)(*args)[1]

        return jax.vjp(weight, diff_params)[1](ct)

    sds = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    w = closed.out_avals[1]
    jx = jax.make_jaxpr(weight_vjp)([sds[i] for i in diff], sds,
                                    jax.ShapeDtypeStruct(w.shape, w.dtype)).jaxpr
    _, used = dce_jaxpr()(jx, [True] * len(jx.outvars), instantiate=False)
    return bool(used[-1])  # the weight's cotangent (the last input)
