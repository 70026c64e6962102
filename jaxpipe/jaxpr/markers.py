"""Cut markers: ``boundary`` (a candidate stage cut) and ``layer`` (one cuttable unit).

``boundary`` is a JAX primitive that is the identity on its operands. It survives
``jax.make_jaxpr`` (so the tracer can find candidate cut points) and is transparent
to ``jit`` (lowers to nothing), ``grad`` (identity JVP/transpose) and ``vmap``.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any, TypeVar

import jax
from jax.extend import core as jcore
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

__all__ = ["boundary", "boundary_p", "has_marker", "holds_marker", "layer", "layer_class"]

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
    if name is not None and not isinstance(name, str):
        raise TypeError(f"jp.boundary: name must be a str (a label for the plan), got {name!r}")
    leaves, treedef = jax.tree.flatten(x)
    if not leaves:
        return x
    for leaf in leaves:
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")
                or isinstance(leaf, bool | int | float | complex)):
            path = next(jax.tree_util.keystr(p) for p, v in jax.tree.flatten_with_path(x)[0]
                        if v is leaf)
            raise TypeError(
                f"jp.boundary marks arrays, but leaf {path or '(the value)'} is a "
                f"{type(leaf).__name__}; pass the arrays that flow over the cut (keep "
                "static values out of the marked pytree).")
    # A value marked twice crosses once (two outputs would be two names of one value,
    # which a stage's inputs cannot tell apart); a value no trace computes (a constant)
    # does not cross.
    first: dict[int, int] = {}
    for leaf in leaves:
        if isinstance(leaf, jax.core.Tracer):
            first.setdefault(id(leaf), len(first))
    if not first:
        return jax.tree.unflatten(treedef, boundary_p.bind(*leaves, name=name))
    crossing = list({id(leaf): leaf for leaf in leaves if id(leaf) in first}.values())
    out = boundary_p.bind(*crossing, name=name)
    return jax.tree.unflatten(treedef, [out[first[id(leaf)]] if id(leaf) in first else leaf
                                        for leaf in leaves])


F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C", bound=type)

_LAYER_ATTR = "__jaxpipe_layer__"  # label on a decorated callable, class and wrapped __call__
_INNER_ATTR = "__jaxpipe_inner__"  # the undecorated __call__ (lets a subclass be re-labelled)


def layer(fn: F | None = None, *, name: str | None = None) -> F:
    """Decorate a function (or a flax Module class) so that every call is one cuttable unit.

    The decorated callable behaves exactly like the original; its outputs pass through
    :func:`boundary`, so a pipeline may cut after any call::

        @jp.layer
        def block(w, h):
            return jnp.tanh(h @ w)

    For classes (flax ``nnx.Module`` and ``linen.Module`` included) the class's
    ``__call__`` is wrapped (see :func:`layer_class`); parameters and serialization
    are unchanged.

    Args:
      fn: the function or Module class to decorate (not a Module *instance*: decorate
        its class, or mark the call with :func:`boundary`).
      name: label for the plan table (default: the function's ``__qualname__``).

    Raises:
      TypeError: for a Module instance, a non-callable, or a ``name`` that is not a str.
    """
    if name is not None and not isinstance(name, str):
        raise TypeError(f"@jp.layer: name must be a str (a label for the plan), got {name!r}")
    if fn is None:
        return functools.partial(layer, name=name)  # type: ignore[return-value]
    if isinstance(fn, str):
        raise TypeError(
            f"@jp.layer got the string {fn!r} as the function to decorate; pass the label "
            f"by keyword: @jp.layer(name={fn!r})")
    if isinstance(fn, type):
        return layer_class(fn, name=name)  # type: ignore[return-value]
    if _is_module_instance(fn):
        cls = type(fn).__name__
        raise TypeError(
            f"jp.layer got an instance of the flax module {cls}, not the class: a wrapped "
            "instance would hide the module's parameters from flax, so nothing in it would "
            f"train. Decorate the class (jp.layer({cls}), or @jp.layer on its definition) and "
            "create instances of that, or mark the call instead: jp.boundary(module(x)).")
    if not callable(fn):
        raise TypeError(
            f"@jp.layer decorates a function or a Module class, got {type(fn).__name__} "
            f"{fn!r}")
    label = name or getattr(fn, "__qualname__", None) or repr(fn)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        return boundary(fn(*args, **kwargs), name=label)

    setattr(wrapped, _LAYER_ATTR, label)
    return wrapped  # type: ignore[return-value]


def _is_module_instance(obj: Any) -> bool:
    """True for an instance of a flax nnx or linen Module (checked without importing flax)."""
    import sys

    flax_nnx = sys.modules.get("flax.nnx")
    linen = sys.modules.get("flax.linen")
    return ((flax_nnx is not None and isinstance(obj, flax_nnx.Module))
            or (linen is not None and isinstance(obj, linen.Module)))


def layer_class(cls: C, name: str | None = None) -> C:
    """Return a subclass of ``cls`` whose every ``__call__`` is one cuttable pipeline unit.

    This is what ``@jp.layer`` does for classes. The subclass keeps the class's name,
    qualified name, module and docstring, so flax's automatic submodule names
    (``Block_0`` in linen), parameter trees and serialized checkpoints are unchanged;
    ``isinstance(obj, cls)`` still holds. Only ``__call__`` is wrapped: its outputs
    (any pytree) pass through :func:`jaxpipe.boundary`, which is the identity outside a
    pipeline trace.

    For linen modules the wrapper calls linen's own managed ``__call__`` (scope set up,
    ``nn.compact`` honoured) and is not re-managed itself, so ``init``/``apply``,
    ``method=``, interceptors and ``capture_intermediates`` behave as before.

    Args:
      cls: an ``nnx.Module`` or ``linen.Module`` subclass (any class with
        ``__call__`` works the same way).
      name: label for the plan table; default ``cls.__qualname__``.

    Raises:
      TypeError: if ``cls`` has no ``__call__`` of its own to wrap.
    """
    if not isinstance(cls, type):
        raise TypeError(f"layer_class expects a class, got {cls!r}")
    # The __call__ instances use: the first class in the MRO that defines one.
    call = next((k.__dict__["__call__"] for k in cls.__mro__ if "__call__" in k.__dict__), None)
    if call is None:
        raise TypeError(f"@jp.layer: class {cls.__qualname__} defines no __call__ to wrap")
    label = name or cls.__qualname__
    # Decorating a class that is already decorated re-labels it instead of stacking
    # two boundaries on the same output.
    inner = getattr(call, _INNER_ATTR, call)

    # functools.wraps copies linen's ``method_handler_wrapped`` flag (and ``compact``)
    # from ``inner``: linen then leaves this wrapper unmanaged, and the call it makes
    # to ``inner`` does all of linen's scope handling exactly once.
    @functools.wraps(inner)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        return boundary(inner(self, *args, **kwargs), name=label)

    setattr(__call__, _LAYER_ATTR, label)
    setattr(__call__, _INNER_ATTR, inner)

    namespace = {
        "__call__": __call__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        _LAYER_ATTR: label,
    }
    # types.new_class runs the metaclass and __init_subclass__ like a class statement:
    # linen re-applies its dataclass transform (fields are inherited unchanged), nnx
    # registers the subclass as a graph node.
    sub = types.new_class(cls.__name__, (cls,), {}, lambda ns: ns.update(namespace))
    return sub  # type: ignore[return-value]


def has_marker(jaxpr: Any) -> bool:
    """``jaxpr`` (or a closed one) holds a marker, at its top level or inside a call."""
    return any(holds_marker(e) for e in getattr(jaxpr, "jaxpr", jaxpr).eqns)


def holds_marker(eqn: Any) -> bool:
    """``eqn`` is a marker, or a call or loop with one inside."""
    return eqn.primitive is boundary_p or any(
        has_marker(s) for s in jcore.jaxprs_in_params(eqn.params))
