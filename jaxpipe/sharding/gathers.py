"""Gathers and scatters inside a stage: their operand whole on the stage's devices.

XLA's SPMD partitioner (jaxlib 0.10) cannot partition a gather or scatter whose operand
is split over a mesh axis when it sits in a ``lax.switch`` inside a loop of a
``shard_map`` that is manual over another axis, which is where every stage of the
pipeline's program runs: it aborts the process (``spmd_partitioner_util.cc:497 Check
failed: partition_group_list ...``) or emits a collective-permute whose devices never
meet (a CPU rendezvous timeout). flax's embedding (``nnx.Embed`` with
``embedding_metadata={'out_sharding': ...}``, Gemma's ``fsdp_tp_sharding``) is such a
gather. ``tests/test_xla_gather_bug.py`` keeps the JAX-only reproducer.

The partitioner handles the same gather when its operand is replicated over the axes the
program is not manual over. So inside the program every gather and scatter of a stage
gets its operand (and a scatter its updates) constrained whole first, and its result
moved back to the sharding the model gave it: one all-gather of the operand per call,
which an FSDP-sharded weight pays anyway (its shards meet before use), and a gathered
result split again as the model placed it. :func:`with_whole_operands` rewrites a stage's
jaxpr so; :func:`needed` says when (the context is manual over some axes and splits
another in more than one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe.jaxpr.interpret import eval_eqns, like, read, sub_jaxprs

__all__ = ["needed", "with_whole_operands"]

_GATHERS = frozenset({"gather"})
_SCATTERS = frozenset({"scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul",
                       "scatter-min", "scatter_min", "scatter-max", "scatter_max"})


_HOLDS: dict[int, tuple[Jaxpr, bool]] = {}


def _holds(jaxpr: Jaxpr) -> bool:
    """Whether ``jaxpr`` (or a jaxpr its equations hold) gathers or scatters."""
    hit = _HOLDS.get(id(jaxpr))
    if hit is not None and hit[0] is jaxpr:
        return hit[1]
    found = any(e.primitive.name in _GATHERS | _SCATTERS
                or any(_holds(s) for s in sub_jaxprs(e.params)) for e in jaxpr.eqns)
    if len(_HOLDS) > 4096:
        _HOLDS.clear()
    _HOLDS[id(jaxpr)] = (jaxpr, found)
    return found


def needed(jaxpr: Jaxpr) -> bool:
    """True when ``jaxpr`` gathers or scatters and the current context is manual over
    some mesh axes and splits another (of size > 1) automatically or explicitly."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return False
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    manual = any(t == AxisType.Manual for t in types.values())
    split = any(t != AxisType.Manual and sizes[a] > 1 for a, t in types.items())
    return manual and split and _holds(jaxpr)


def _whole(x: Any, context: Any) -> Any:
    """``x`` replicated over every axis that is not manual in its type's mesh, or where
    its type has none (a value on Auto axes), in the program's ``context`` mesh."""
    sharding = jax.typeof(x).sharding
    mesh = sharding.mesh if not sharding.mesh.empty else context
    if mesh.empty:
        return x
    if any(e is not None for e in sharding.spec):
        x = jax.sharding.reshard(x, P())
    free = [t for t in mesh.axis_types if t != AxisType.Manual]
    if free and all(t == AxisType.Auto for t in free):
        # Auto axes (an ``auto_axes`` region): the type says nothing; constrain the value
        x = jax.lax.with_sharding_constraint(
            x, P() if mesh is sharding.mesh else NamedSharding(mesh, P()))
    return x


def _as_typed(x: Any, aval: Any) -> Any:
    """``x`` moved to the explicit sharding ``aval`` records (the model's placement)."""
    want = getattr(aval, "sharding", None)
    if want is None or want.mesh.empty or jax.typeof(x).sharding.spec == want.spec:
        return x
    if not any(t == AxisType.Explicit for t in want.mesh.axis_types):
        return x
    return jax.sharding.reshard(x, want.spec)


def _bind_whole(eqn: Any, invals: list[Any]) -> list[Any]:
    whole_at = (0,) if eqn.primitive.name in _GATHERS else (0, 2)
    # the program's mesh: the equation's own context records the mesh the model was
    # traced under (often none)
    context = jax.sharding.get_abstract_mesh()
    with eqn.ctx.manager:
        args = [_whole(x, context) if i in whole_at else x for i, x in enumerate(invals)]
        out = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(eqn.params))
        outs = out if eqn.primitive.multiple_results else [out]
        return [_as_typed(y, v.aval) for y, v in zip(outs, eqn.outvars, strict=True)]


def _override(eqn: Any, invals: list[Any]) -> list[Any] | None:
    name = eqn.primitive.name
    if name in _GATHERS | _SCATTERS:
        return _bind_whole(eqn, invals)
    if not any(_holds(s) for s in sub_jaxprs(eqn.params)):
        return None
    params = {k: _rewritten_value(v) for k, v in eqn.params.items()}
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
    return out if eqn.primitive.multiple_results else [out]


def _evaluate(jaxpr: Jaxpr, consts: Any, args: list[Any]) -> list[Any]:
    env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    eval_eqns(jaxpr.eqns, env, override=_override)
    return [read(env, v) for v in jaxpr.outvars]


def _sds(aval: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=getattr(aval, "sharding", None))


def _rewritten_value(v: Any) -> Any:
    if isinstance(v, ClosedJaxpr):
        return with_whole_operands(v) if _holds(v.jaxpr) else v
    if isinstance(v, Jaxpr) and _holds(v):
        new = with_whole_operands(ClosedJaxpr(v, ()))
        # an open jaxpr (remat's) takes no constants; keep it as it was if some appeared
        return new.jaxpr if not new.consts else v
    if isinstance(v, tuple | list) and any(isinstance(x, ClosedJaxpr | Jaxpr) for x in v):
        return like(v, (_rewritten_value(x) for x in v))
    return v


def with_whole_operands(closed: ClosedJaxpr,
                        in_types: Sequence[jax.ShapeDtypeStruct] | None = None) -> ClosedJaxpr:
    """``closed`` traced again (in the current context, on ``in_types``: default its
    input types) with every gather's and scatter's operand replicated over the axes the
    context is not manual over (see the module doc); ``closed`` itself when it neither
    gathers nor scatters."""
    if not _holds(closed.jaxpr):
        return closed
    fn: Callable[..., list[Any]] = lambda *args: _evaluate(closed.jaxpr, closed.consts, list(args))
    types = in_types if in_types is not None else [_sds(a) for a in closed.in_avals]
    return jax.make_jaxpr(fn)(*types)
