"""How a pipeline uses its mesh axes: the pipe axis, batch axes, parameter sharding.

A mesh can have more axes than the pipe axis. Each one plays one or both of two roles:

- a **batch axis** splits every microbatch along its axis 0 (data parallelism);
  gradients are averaged over it;
- a **parameter axis** is named by some parameter's ``PartitionSpec`` (tensor
  parallelism, e.g. ``P(None, 'model')``; FSDP, e.g. ``P('fsdp', None)`` with ``fsdp``
  also a batch axis).

The SPMD program is manual (``jax.shard_map(..., axis_names=...)``) over the pipe axis
and over the batch axes that shard no parameter (their data parallelism is explicit:
every device traces its own batch shard and gradients are ``pmean``-ed). Parameter axes
stay under JAX's sharding inside every stage: stages are traced on the global view of
those axes, and XLA partitions them as the parameters' (and batch's) shardings say.
Where a parameter axis is Explicit (sharding in types), the stages are traced with the
parameters' sharded types under the mesh (:mod:`jaxpipe.sharding.typed`), and the
program's buffers take their values' types.

:class:`MeshAxes` is that split, computed once from the user's ``batch_axes=`` and
``param_specs=`` (:func:`resolve_mesh_axes`, which also checks them; without
``param_specs`` each parameter keeps the sharding it is placed with, :func:`placed_spec`);
the runtime reads it from :class:`~jaxpipe.runtime.RuntimeSpec`.

Specs are kept as *dims*: one tuple of mesh axis names per array dimension
(``P(None, ('data', 'model'))`` -> ``((), ('data', 'model'))``), which compare and
sort; :func:`to_spec` turns dims back into a ``PartitionSpec``.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe.errors import PipelineError, PipelineTypeError

__all__ = ["Dims", "MeshAxes", "constrain", "constrain_to", "manual_spec", "placed_batch_axes",
           "placed_spec", "resolve_mesh_axes", "spec_dims", "to_spec"]

#: One tuple of mesh axis names per array dimension (``()``: not sharded).
Dims = tuple[tuple[str, ...], ...]


def spec_dims(spec: Any, ndim: int) -> Dims:
    """``PartitionSpec`` (or ``None``) -> dims, padded with ``()`` to ``ndim``."""
    if spec is None:
        entries: tuple = ()
    else:
        entries = tuple(spec)
    out = []
    for e in entries:
        if e is None:
            out.append(())
        elif isinstance(e, str):
            out.append((e,))
        else:
            out.append(tuple(e))
    return tuple(out) + ((),) * (ndim - len(out))


def to_spec(dims: Dims, *lead: Any) -> P:
    """Dims -> ``PartitionSpec``, after the ``lead`` entries (e.g. the pipe axis)."""
    entries = [None if not d else d[0] if len(d) == 1 else d for d in dims]
    while entries and entries[-1] is None:
        entries.pop()
    return P(*lead, *entries)


def manual_spec(spec: P, manual: Collection[str]) -> P:
    """The part of ``spec`` over the ``manual`` axes (what a partial-manual
    ``jax.shard_map`` takes as its in/out spec); the rest is the array's sharding outside.

    Within one dimension the manual axes must come first (major), as
    :meth:`MeshAxes.batch_spec` orders them.
    """
    entries = []
    for e in spec:
        names = () if e is None else (e,) if isinstance(e, str) else tuple(e)
        kept = tuple(a for a in names if a in manual)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def constrain(x: Any, dims: Dims) -> Any:
    """Inside a partial-manual ``shard_map``: ``x`` sharded as ``dims`` over the automatic
    axes (nothing to do when ``dims`` shard nothing)."""
    if not any(dims):
        return x
    return constrain_to(x, jax.sharding.get_abstract_mesh(), to_spec(dims))


def constrain_to(x: Any, mesh: Any, spec: P) -> Any:
    """``x`` sharded as ``spec`` on ``mesh`` (inside jit): ``reshard`` over its Explicit
    axes (sharding in types: a new type), ``with_sharding_constraint`` over its Auto ones
    (a mesh may mix them). With no mesh in context, ``spec``'s axes are taken as Auto."""
    def part(kind: Any) -> P:
        if mesh.empty:
            keep: Any = (lambda a: kind == AxisType.Auto)
        else:
            keep = (lambda a: mesh.axis_types[mesh.axis_names.index(a)] == kind)
        return to_spec(tuple(tuple(a for a in d if keep(a))
                             for d in spec_dims(spec, len(spec))))

    types = set() if mesh.empty else set(mesh.axis_types)
    if AxisType.Explicit in types:  # (an empty part replicates over those axes)
        explicit = part(AxisType.Explicit)
        x = jax.sharding.reshard(x, NamedSharding(mesh, explicit)
                                 if isinstance(mesh, Mesh) else explicit)
    if AxisType.Auto in types or mesh.empty:
        auto = part(AxisType.Auto)
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, auto)
                                             if isinstance(mesh, Mesh) else auto)
    return x


def dims_axes(dims: Dims) -> tuple[str, ...]:
    return tuple(a for d in dims for a in d)


@dataclass(frozen=True)
class MeshAxes:
    """The roles of a pipeline's mesh axes.

    Attributes:
      axis: the pipe axis.
      batch_axes: axes the batch is split over (gradients averaged over them).
      param_axes: axes left to JAX's sharding inside the stages (in mesh order): those
        some parameter is sharded over, and batch axes a model on Explicit axes shards
        its own values over (:func:`~jaxpipe.sharding.constraints.explicit_batch_axes_automatic`).
    """

    axis: str
    batch_axes: tuple[str, ...]
    param_axes: tuple[str, ...] = ()

    @property
    def manual_batch_axes(self) -> tuple[str, ...]:
        """Batch axes the program is manual over (they shard no parameter)."""
        return tuple(a for a in self.batch_axes if a not in self.param_axes)

    @property
    def auto_batch_axes(self) -> tuple[str, ...]:
        """Batch axes left to JAX's sharding (they also shard parameters: FSDP)."""
        return tuple(a for a in self.batch_axes if a in self.param_axes)

    @property
    def manual_axes(self) -> tuple[str, ...]:
        """The axes the SPMD program is manual over: the pipe axis, manual batch axes."""
        return (self.axis, *self.manual_batch_axes)

    def batch_spec(self, *lead: Any) -> P:
        """How the batch is split: axis 0 (after ``lead``) over the batch axes, manual
        ones first (so a shard_map takes its manual part without moving data)."""
        axes = (*self.manual_batch_axes, *self.auto_batch_axes)
        return P(*lead, axes if axes else None)

    def shard_map_kwargs(self, mesh: Mesh) -> dict:
        """``axis_names=`` for ``jax.shard_map`` when it is manual over only some axes."""
        manual = frozenset(self.manual_axes)
        return {} if manual == frozenset(mesh.axis_names) else {"axis_names": manual}


def _bad_axes_message(axes: Any, what: str) -> str:
    return (f"{what} must be a tuple of mesh axis names, got {axes!r}; e.g. "
            "batch_axes=('data',).")


def _check_batch_axes(batch_axes: Any, mesh: Mesh, axis: str) -> tuple[str, ...]:
    if isinstance(batch_axes, str):
        batch_axes = (batch_axes,)
    if not isinstance(batch_axes, Sequence) or not all(isinstance(a, str) for a in batch_axes):
        raise PipelineTypeError(_bad_axes_message(batch_axes, "batch_axes"))
    batch_axes = tuple(batch_axes)
    for a in batch_axes:
        if a == axis:
            raise PipelineError(
                f"batch_axes {batch_axes} names the pipe axis '{axis}'; the batch is "
                f"replicated over the pipe axis. Drop '{axis}' from batch_axes.")
        if a not in mesh.axis_names:
            raise PipelineError(
                f"batch_axes {batch_axes} names '{a}', but the mesh has axes "
                f"{tuple(mesh.axis_names)}; use axes of the mesh.")
    if len(set(batch_axes)) != len(batch_axes):
        raise PipelineError(f"batch_axes {batch_axes} names an axis twice; name each once.")
    # mesh order, so the batch sharding does not depend on how the user listed them
    return tuple(a for a in mesh.axis_names if a in batch_axes)


def _leaf_dims(spec: Any, shape: tuple[int, ...], path: str, mesh: Mesh, axis: str,
               placed: bool = False) -> Dims:
    """One leaf's spec checked against the mesh and the leaf's shape (``placed``: the spec
    is the parameter's own sharding, not a ``param_specs`` entry)."""
    if placed:
        for a in spec_dims(spec, len(shape)):
            if axis in a:
                raise PipelineError(
                    f"params{path} is placed sharded over the pipe axis '{axis}' "
                    f"({spec}); the pipeline places each stage's parameters on its pipe "
                    "device itself. Place it without the pipe axis (e.g. "
                    f"NamedSharding(mesh, P(None, 'model'))) or pass param_specs=.")
    if spec is not None and not isinstance(spec, P):
        raise PipelineTypeError(
            f"param_specs{path} is a {type(spec).__name__}; every leaf of param_specs is a "
            "jax.sharding.PartitionSpec (or None for replicated), e.g. P(None, 'model').")
    if spec is not None and len(spec) > len(shape):
        raise PipelineError(
            f"param_specs{path} = {spec} has {len(spec)} entries but the parameter has "
            f"shape {shape} ({len(shape)} dimensions); give at most one entry per dimension.")
    dims = spec_dims(spec, len(shape))
    used = dims_axes(dims)
    for a in used:
        if a == axis:
            raise PipelineError(
                f"param_specs{path} = {spec} shards over the pipe axis '{axis}'; the pipeline "
                "places each stage's parameters on its pipe device itself. Shard parameters "
                "only over the other mesh axes (e.g. 'model', 'fsdp').")
        if a not in mesh.axis_names:
            raise PipelineError(
                f"param_specs{path} = {spec} names mesh axis '{a}', but the mesh has axes "
                f"{tuple(mesh.axis_names)}; use an axis of the mesh (or add it to the mesh).")
    if len(set(used)) != len(used):
        raise PipelineError(
            f"param_specs{path} = {spec} uses a mesh axis twice; a mesh axis shards at most "
            "one dimension of a parameter.")
    check_divisible(shape, dims, mesh, f"param_specs{path} = {spec}")
    return dims


def check_divisible(shape: Sequence[int], dims: Dims, mesh: Mesh, what: str,
                    rows: str = "") -> None:
    """Every sharded dimension of ``shape`` divisible by its axes' size, or a clear error
    (``rows``: what ``shape`` is when it is only part of the parameter)."""
    shape = tuple(shape)
    for i, d in enumerate(dims):
        n = math.prod(mesh.shape[a] for a in d)
        if shape[i] % n:
            raise PipelineError(
                f"{what} splits dimension {i} (size {shape[i]}) of the parameter{rows} of "
                f"shape {shape} over {d} ({n} devices), which does not divide it; use a "
                f"size divisible by {n} or shard another dimension.")


def _same_devices(a: Any, b: Mesh) -> bool:
    """``a`` (a mesh or abstract mesh) names the axes of ``b`` with the same sizes, and
    (if concrete) holds its devices in the same order; axis types may differ."""
    if tuple(a.axis_names) != tuple(b.axis_names) or tuple(a.axis_sizes) != tuple(b.axis_sizes):
        return False
    # an AbstractMesh (nnx.eval_shape's shardings) has no devices; its property raises
    devices = None if isinstance(a, jax.sharding.AbstractMesh) else a.devices
    return devices is None or (devices.shape == b.devices.shape
                               and all(x == y for x, y in zip(devices.flat, b.devices.flat,
                                                              strict=True)))


def _check_on_mesh(sharding: NamedSharding, mesh: Mesh, name: str, fix: str) -> None:
    """``name``'s placement is on ``mesh`` (same axis names, sizes and devices), or an
    error that says where it is and ``fix``."""
    if not _same_devices(sharding.mesh, mesh):
        raise PipelineError(f"{name} is placed on a mesh with axes {_where(sharding.mesh)}, "
                            f"not on the pipeline's mesh, {_where(mesh)}{fix}")


def _where(m: Any) -> str:
    """A mesh's axes, and its device ids where it has devices (an AbstractMesh has none)."""
    axes = dict(zip(m.axis_names, m.axis_sizes, strict=True))
    if isinstance(m, jax.sharding.AbstractMesh):
        return str(axes)
    ids = [d.id for d in m.devices.flat]
    return f"{axes} on devices {ids if len(ids) <= 8 else ids[:8] + ['...']}"


def placed_spec(x: Any, mesh: Mesh, path: str) -> P | None:
    """The ``PartitionSpec`` a parameter is placed with, as the default ``param_specs``.

    A ``NamedSharding`` (of an array or a ``ShapeDtypeStruct``) on ``mesh`` gives its spec;
    no sharding, one device or a fully replicated sharding gives replicated (``None``); a
    sharding on another mesh, or one that shards without naming mesh axes, is an error.
    """
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        return None
    if isinstance(sharding, NamedSharding):
        _check_on_mesh(sharding, mesh, f"params{path}",
                       " (it needs the same axis names, sizes and devices). Place it on the "
                       "pipeline's mesh (jax.device_put(x, NamedSharding(mesh, spec))), or "
                       "pass param_specs= to say how to shard it.")
        return sharding.spec
    if len(sharding.device_set) == 1 or sharding.is_fully_replicated:
        return None
    raise PipelineError(
        f"params{path} is sharded by a {type(sharding).__name__}, which names no mesh axes; "
        "place it with a NamedSharding on the pipeline's mesh, or pass param_specs=.")


def placed_batch_axes(batch: Any, mesh: Mesh, axis: str) -> tuple[str, ...] | None:
    """The mesh axes a batch is placed split over along its axis 0, as the default
    ``batch_axes`` (``jax.jit`` keeps an input's sharding too); ``None`` when no leaf is
    split over mesh axes. Leaves that disagree, a split over the pipe axis or along
    another dimension are errors naming the fix."""
    found: dict[tuple[str, ...], str] = {}
    for path, x in jax.tree.flatten_with_path(batch)[0]:
        sharding, name = getattr(x, "sharding", None), f"batch{jax.tree_util.keystr(path)}"
        if not isinstance(sharding, NamedSharding) or sharding.is_fully_replicated:
            continue
        _check_on_mesh(sharding, mesh, name,
                       "; place it on the pipeline's mesh (or pass a host array) and say how "
                       "to split it with batch_axes=.")
        dims = spec_dims(sharding.spec, len(x.shape))
        if any(dims[1:]) or axis in dims[0]:
            why = (f"never over the pipe axis '{axis}' (each microbatch goes to every pipe "
                   "position)" if any(axis in d for d in dims)
                   else "only along its axis 0 (the rows), not along another dimension")
            raise PipelineError(
                f"{name} is placed with {sharding.spec}: the pipeline splits a batch {why}. "
                "Place it split along axis 0 over other axes (e.g. P('data')), or "
                "replicated.")
        found.setdefault(dims[0], name)
    if len(found) > 1:
        (a, x), (b, y) = list(found.items())[:2]
        raise PipelineError(
            f"the batch's leaves are placed split over different mesh axes ({x} over {a}, "
            f"{y} over {b}); place them alike, or pass batch_axes= to say how to split "
            "the batch.")
    return next(iter(found), None)


def resolve_mesh_axes(mesh: Mesh, axis: str, batch_axes: Any, param_specs: Any,
                      params: Any, treedef: Any, shapes: Sequence[tuple[int, ...]],
                      placed_batch: tuple[str, ...] | None = None
                      ) -> tuple[MeshAxes, tuple[Dims, ...]]:
    """The roles of the mesh axes and the dims of every user parameter leaf.

    Args:
      batch_axes: ``None`` (default: the axes the batch is placed split over,
        ``placed_batch``; else every non-pipe axis no parameter is sharded over) or the
        axis names.
      param_specs: ``None`` (default; ``"params"`` says the same): each parameter's own
        sharding, as ``jax.jit`` keeps an input's (:func:`placed_spec`); or a pytree of
        ``PartitionSpec`` / ``None`` with the structure of ``params``.
    """
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree.flatten_with_path(
        jax.tree.unflatten(treedef, list(range(treedef.num_leaves))))[0]]
    placed = param_specs is None or (isinstance(param_specs, str) and param_specs == "params")
    if placed:
        specs: list = [placed_spec(x, mesh, path)
                       for x, path in zip(jax.tree.leaves(params), paths, strict=True)]
    else:
        try:
            specs = treedef.flatten_up_to(param_specs)
        except (ValueError, TypeError) as err:
            raise PipelineError(
                "param_specs must have the structure of params (one PartitionSpec or None "
                f"per parameter leaf): {' '.join(str(err).split())[:300]}") from err
    dims = tuple(_leaf_dims(s, shape, p, mesh, axis, placed)
                 for s, shape, p in zip(specs, shapes, paths, strict=True))
    used = {a for d in dims for a in dims_axes(d)}
    param_axes = tuple(a for a in mesh.axis_names if a in used)
    if batch_axes is None and placed_batch is not None:
        batch = tuple(a for a in mesh.axis_names if a in placed_batch)
    elif batch_axes is None:
        batch = tuple(a for a in mesh.axis_names if a != axis and a not in used)
    else:
        batch = _check_batch_axes(batch_axes, mesh, axis)
    return MeshAxes(axis, batch, param_axes), dims
