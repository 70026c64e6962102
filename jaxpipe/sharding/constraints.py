"""The model's own sharding constraints, inside the pipeline's manual program.

A model may constrain its activations: ``jax.lax.with_sharding_constraint(x,
NamedSharding(mesh, P(None, 'model')))``, or a bare ``P`` under ``jax.set_mesh``. The
traced jaxpr holds each constraint on the user's mesh, whose axes are all automatic;
inside the SPMD program's ``shard_map`` the pipe axis and the batch axes it splits by hand
are Manual, and JAX requires a constraint's mesh to be the context's.
:func:`stage_as_fun` evaluates a stage's jaxpr with every constraint re-made on the
context's axis types (the same devices and names; jaxprs without constraints run as they
are). :func:`constraint_axes` lists the mesh axes constraints name, so the frontend keeps
them out of the batch axes the program splits by hand.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr
from jax.extend.core import jaxpr_as_fun as _jax_jaxpr_as_fun
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe.errors import PipelineError
from jaxpipe.jax_compat import context_with_mesh, sharding_constraint_p
from jaxpipe.jaxpr.interpret import like, sub_jaxprs
from jaxpipe.sharding import gathers
from jaxpipe.sharding.mesh_axes import MeshAxes

#: the primitive of jax.lax.with_sharding_constraint (private in JAX)
_CONSTRAINT = sharding_constraint_p()

__all__ = ["constraint_axes", "entering", "explicit_batch_axes_automatic", "for_context",
           "leaving", "stage_as_fun", "without_constrained_batch_axes"]


def _spec_axes(spec: Any) -> set[str]:
    return {a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)}


def constraint_axes(jaxpr: Jaxpr) -> frozenset[str]:
    """The mesh axes named by the sharding constraints of ``jaxpr`` (and its sub-jaxprs)."""
    out: set[str] = set()
    for eqn in jaxpr.eqns:
        sharding = eqn.params.get("sharding") if eqn.primitive is _CONSTRAINT else None
        if isinstance(sharding, NamedSharding):
            out |= _spec_axes(sharding.spec)
        for sub in sub_jaxprs(eqn.params):
            out |= constraint_axes(sub)
    return frozenset(out)


def without_constrained_batch_axes(mesh: Mesh, mesh_axes: MeshAxes, jaxpr: Jaxpr,
                                   default: bool) -> MeshAxes | None:
    """``None`` when the model's constraints name no axis the program is manual over.
    Else, when the batch axes were the default, ``mesh_axes`` without the batch axes they
    name (the constraints then shard over them); when the user split the batch over them
    (``batch_axes=``, or its placement), ``mesh_axes`` with them left to JAX's sharding
    inside the stages (automatic batch axes, as an FSDP axis): the batch stays split over
    them, and the model's constraints shard its values over them too."""
    named = constraint_axes(jaxpr)
    if mesh_axes.axis in named:
        raise PipelineError(
            f"the model constrains an activation's sharding over the pipe axis "
            f"'{mesh_axes.axis}' (jax.lax.with_sharding_constraint); a stage runs on one "
            "pipe position, so nothing inside it can be split over that axis. Leave the "
            "pipe axis out of the model's constraints.")
    clash = tuple(a for a in mesh_axes.manual_batch_axes if a in named)
    if not clash:
        return None
    if not default:
        return _automatic(mesh, mesh_axes, clash)
    return MeshAxes(mesh_axes.axis, tuple(a for a in mesh_axes.batch_axes if a not in clash),
                    mesh_axes.param_axes)


def explicit_batch_axes_automatic(mesh: Mesh, mesh_axes: MeshAxes) -> MeshAxes | None:
    """``mesh_axes`` with the manual batch axes of type Explicit left to JAX's sharding
    inside the stages (automatic batch axes, as FSDP's), or ``None`` without such axes.

    On Explicit axes a model may shard its own values over a batch axis
    (``out_sharding=P('data')``, ``reshard``, a constraint, which there asserts the
    type): traced on one shard of the rows, as the program splits a manual batch axis,
    that fails (one row cannot be split over 'data'; an assert sees no 'data' in the
    batch's type). Over an automatic batch axis a stage sees the whole microbatch, its
    rows typed split over the axis, as the model was written for."""
    explicit = tuple(a for a in mesh_axes.manual_batch_axes
                     if mesh.axis_types[mesh.axis_names.index(a)] == AxisType.Explicit)
    if not explicit:
        return None
    return _automatic(mesh, mesh_axes, explicit)


def _automatic(mesh: Mesh, mesh_axes: MeshAxes, axes: Sequence[str]) -> MeshAxes:
    """``mesh_axes`` with the batch axes ``axes`` left to JAX's sharding inside the stages
    (automatic batch axes: parameter axes, kept in mesh order)."""
    auto = set(mesh_axes.param_axes) | set(axes)
    return MeshAxes(mesh_axes.axis, mesh_axes.batch_axes,
                    tuple(a for a in mesh.axis_names if a in auto))


def _target(m: Any, names: tuple, types: tuple) -> tuple | None:
    """The axis types a mesh recorded in the jaxpr takes in the context (the context's
    Manual axes become Manual, the others keep their type: a ``jax.sharding.auto_axes``
    region stays Auto); ``None`` when it is not the context's mesh or nothing changes."""
    if m is None or m.empty or tuple(m.axis_names) != names:
        return None
    target = tuple(c if c == AxisType.Manual else t
                   for t, c in zip(m.axis_types, types, strict=True))
    return None if target == tuple(m.axis_types) else target


def _on_context(sharding: NamedSharding, names: tuple, types: tuple) -> NamedSharding:
    """``sharding`` on its mesh with the axis types it takes in the context."""
    m = sharding.mesh
    target = _target(m, names, types)
    if target is None:
        return sharding
    if isinstance(m, Mesh):
        mesh: Any = Mesh(m.devices, m.axis_names, axis_types=target)
    else:
        mesh = m.update_axis_types(dict(zip(names, target, strict=True)))
    return NamedSharding(mesh, sharding.spec, memory_kind=sharding.memory_kind)


def _retarget_value(v: Any, names: tuple, types: tuple) -> Any:
    if isinstance(v, NamedSharding):
        return _on_context(v, names, types)
    if isinstance(v, ClosedJaxpr):
        new = _retarget(v.jaxpr, names, types)
        closed = v if new is v.jaxpr else ClosedJaxpr(new, v.consts)
        return _retraced(closed, names, types) if _stale(new, names, types) else closed
    if isinstance(v, Jaxpr):
        return _retarget(v, names, types)
    if isinstance(v, tuple | list) and any(
            isinstance(x, ClosedJaxpr | Jaxpr | NamedSharding) for x in v):
        return like(v, (_retarget_value(x, names, types) for x in v))
    return v


def _aval_target(aval: Any, names: tuple, types: tuple) -> tuple | None:
    return _target(getattr(getattr(aval, "sharding", None), "mesh", None), names, types)


def _stale(jaxpr: Jaxpr, names: tuple, types: tuple) -> bool:
    """Some input or output of ``jaxpr`` is typed on the mesh without the context's
    Manual axes: an equation holding it as a sub-jaxpr (``jit``, ``scan``...) returns
    those recorded types, so it is traced again."""
    return any(_aval_target(v.aval, names, types) is not None
               for v in (*jaxpr.invars, *jaxpr.outvars))


def _retyped(aval: Any, names: tuple, types: tuple) -> jax.ShapeDtypeStruct:
    sharding = getattr(aval, "sharding", None)
    if _aval_target(aval, names, types) is not None:
        sharding = _on_context(sharding, names, types)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding)


def _retraced(closed: ClosedJaxpr, names: tuple, types: tuple) -> ClosedJaxpr:
    """``closed`` traced again with its inputs on the axis types they take in the
    context, so that its recorded types (which an equation holding it returns) are
    those too."""
    return jax.make_jaxpr(_jax_jaxpr_as_fun(closed))(
        *(_retyped(a, names, types) for a in closed.in_avals))


def _retarget(jaxpr: Jaxpr, names: tuple, types: tuple) -> Jaxpr:
    """``jaxpr`` with every sharding its equations name (constraints, and the shardings
    of the values JAX derived from them) and every equation's mesh on the axis types
    they take in the context; ``jaxpr`` itself when nothing changes."""
    eqns, changed = [], False
    for eqn in jaxpr.eqns:
        params = {k: _retarget_value(v, names, types) for k, v in eqn.params.items()}
        ctx = _ctx_on_context(eqn.ctx, names, types)
        if ctx is not eqn.ctx or any(params[k] is not eqn.params[k] for k in params):
            eqn, changed = eqn.replace(params=params, ctx=ctx), True
        eqns.append(eqn)
    return jaxpr.replace(eqns=eqns) if changed else jaxpr


def _ctx_on_context(ctx: Any, names: tuple, types: tuple) -> Any:
    """An equation's context (it records the mesh it was traced under, and binding the
    equation enters it again) with the axis types it takes in the context."""
    m = ctx.cur_abstract_mesh
    target = _target(m, names, types)
    if target is None:
        return ctx
    return context_with_mesh(ctx, m.update_axis_types(dict(zip(names, target, strict=True))))


# (closed jaxpr, context axis names, types and sizes) -> the jaxpr to run there; the closed
# jaxpr is kept in the value so that its id is not reused while the entry lives.
_CACHE: dict[tuple[int, tuple, tuple, tuple], tuple[ClosedJaxpr, ClosedJaxpr]] = {}


def _for_context(closed: ClosedJaxpr, names: tuple, types: tuple, sizes: tuple
                 ) -> ClosedJaxpr:
    key = (id(closed), names, types, sizes)
    hit = _CACHE.get(key)
    if hit is None or hit[0] is not closed:
        if len(_CACHE) > 4096:
            _CACHE.clear()
        jaxpr = _retarget(closed.jaxpr, names, types)
        run = closed if jaxpr is closed.jaxpr else ClosedJaxpr(jaxpr, closed.consts)
        if gathers.needed(jaxpr):
            run = gathers.with_whole_operands(
                run, [_retyped(a, names, types) for a in closed.in_avals])
        hit = (closed, run)
        _CACHE[key] = hit
    return hit[1]


def for_context(closed: ClosedJaxpr) -> ClosedJaxpr:
    """``closed`` as it runs in the current context (for an evaluator of its equations
    that does not go through :func:`stage_as_fun`): its constraints and recorded meshes
    with the context's Manual axes."""
    context = jax.sharding.get_abstract_mesh()
    if context.empty:
        return closed
    return _for_context(closed, tuple(context.axis_names), tuple(context.axis_types),
                        tuple(context.axis_sizes))


def _into(x: Any, aval: Any, names: tuple, types: tuple) -> Any:
    target = _aval_target(aval, names, types)
    if target is None or target == types:
        return x
    mesh = aval.sharding.mesh.update_axis_types(dict(zip(names, target, strict=True)))
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.sharding.reshard(x, aval.sharding.spec)


def entering(closed: ClosedJaxpr, args: Sequence[Any]) -> list[Any]:
    """``args`` moved onto the axis types ``closed`` reads them on, where those are not
    the context's (the inputs of an ``auto_axes`` region), as ``auto_axes`` moves its
    arguments."""
    context = jax.sharding.get_abstract_mesh()
    if context.empty:
        return list(args)
    names, types = tuple(context.axis_names), tuple(context.axis_types)
    return [_into(x, a, names, types) for x, a in zip(args, closed.in_avals, strict=True)]


def leaving(outs: Sequence[Any]) -> list[Any]:
    """Values typed on other axis types than the context's (an ``auto_axes`` region's
    residuals) moved onto the context's, as ``auto_axes`` returns its outputs: the
    program's buffers hold the context's types."""
    context = jax.sharding.get_abstract_mesh()
    out = []
    for x in outs:
        if x is None:  # (an output written to a buffer elsewhere)
            out.append(x)
            continue
        m = jax.typeof(x).sharding.mesh
        if not (context.empty or m.empty or tuple(m.axis_types) == tuple(context.axis_types)):
            x = jax.sharding.reshard(x, P())
        out.append(x)
    return out


def stage_as_fun(closed: ClosedJaxpr) -> Callable[..., list[Any]]:
    """``jax.extend.core.jaxpr_as_fun`` for a stage's jaxpr inside the program: the
    model's sharding constraints and the meshes its equations recorded are re-made with
    the context's Manual axes; values typed on other axis types (``auto_axes`` regions)
    cross into and out of it as ``auto_axes`` moves them (:func:`entering`,
    :func:`leaving`)."""
    fn = _jax_jaxpr_as_fun(for_context(closed))
    return lambda *args: leaving(fn(*entering(closed, args)))
