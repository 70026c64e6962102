"""Cut markers: ``boundary`` (a candidate stage cut) and ``layer`` (one cuttable unit).

``boundary`` is a JAX primitive that is the identity on its operands. It survives
``jax.make_jaxpr`` (so the tracer can find candidate cut points) and is transparent
to ``jit`` (lowers to nothing), ``grad`` (identity JVP/transpose) and ``vmap``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

__all__ = ["boundary", "layer", "boundary_p"]

boundary_p = Primitive("jaxpipe_boundary")
boundary_p.multiple_results = True
boundary_p.def_impl(lambda *xs, name=None: list(xs))
boundary_p.def_abstract_eval(lambda *avals, name=None: list(avals))
mlir.register_lowering(boundary_p, lambda ctx, *xs, name=None: list(xs))


def _jvp(primals, tangents, *, name=None):
    # Tangents pass straight through: the marker only matters on the primal trace.
    return boundary_p.bind(*primals, name=name), list(tangents)


ad.primitive_jvps[boundary_p] = _jvp
batching.primitive_batchers[boundary_p] = (
    lambda args, dims, name=None: (boundary_p.bind(*args, name=name), dims)
)

T = TypeVar("T")


def boundary(x: T, name: str | None = None) -> T:
    """Mark a candidate pipeline cut after ``x`` and return ``x`` unchanged.

    ``x`` may be any pytree of arrays. Inside ``jaxpipe.pipeline`` tracing, the
    cutter may split the program here: everything computed before this point runs in
    an earlier stage than everything after it. Outside a pipeline it is the identity
    and costs nothing, also under ``jax.jit``, ``jax.grad`` and ``jax.vmap``::

        def loss_fn(params, batch):
            h = batch["x"]
            for w in params["layers"]:
                h = jp.boundary(jnp.tanh(h @ w))
            return jnp.mean((h - batch["y"]) ** 2)

    Args:
      x: the value(s) that flow over the cut.
      name: optional label shown in ``Pipeline.plan``.
    """
    leaves, treedef = jax.tree.flatten(x)
    if not leaves:
        return x
    out = boundary_p.bind(*leaves, name=name)
    return jax.tree.unflatten(treedef, out)


F = TypeVar("F", bound=Callable[..., Any])


def layer(fn: F | None = None, *, name: str | None = None) -> F:
    """Decorate a function (or a flax Module class) so that every call is one cuttable unit.

    The decorated callable behaves exactly like the original; its outputs pass through
    :func:`boundary`, so a pipeline may cut after any call::

        @jp.layer
        def block(w, h):
            return jnp.tanh(h @ w)

    For flax ``nnx.Module`` and ``linen.Module`` classes the class's ``__call__`` is
    wrapped (see :mod:`jaxpipe.flax`); parameters and serialization are unchanged.

    Args:
      fn: the function or Module class to decorate.
      name: label for the plan table (default: the function's ``__qualname__``).
    """
    if fn is None:
        return functools.partial(layer, name=name)  # type: ignore[return-value]
    if isinstance(fn, type):
        from jaxpipe import flax as _jpflax

        return _jpflax.layer_class(fn, name=name)  # type: ignore[return-value]
    label = name or getattr(fn, "__qualname__", None) or repr(fn)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        return boundary(fn(*args, **kwargs), name=label)

    wrapped.__jaxpipe_layer__ = label  # type: ignore[attr-defined]
    return wrapped  # type: ignore[return-value]
