"""Where the SPMD program keeps values: buffers per value class, with a leading slot axis.

Every device runs the same program, so buffers have one shape on all devices, while
stages differ (embedding first, head last). Values are grouped by *class* (shape and
dtype, :class:`ValueClass`); a buffer of a class is ``[slots, *shape]``. Nothing is
raveled: a value keeps its shape (and so any sharding over other mesh axes), and reads
and writes index the leading slot axis only.

- Parameters (:class:`SlotLayout`): device ``d`` needs, per class, as many slots as its
  stages have leaves of that class; every device gets the most any device needs.
  Homogeneous stages need no padding; an embedding costs one slot of its class on every
  device.
- A stage's stored values (residuals, the I -> W hand-off) and its messages are
  :class:`Packing`\\ s: leaf ``i`` lives in row ``rows[i]`` of its class within a group of
  ``counts[class]`` consecutive slots; the lowering chooses where each group starts.
- Messages travel in fixed-size *units* (:class:`StageLayouts.unit`): per class the most
  rows any message needs, so one inbox slot or outbox unit fits any message.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jaxpipe.jaxpr.avals import aval_bytes
from jaxpipe.runtime.spmd.lowering.types import Pool
from jaxpipe.runtime.spmd.program.writes import DeferredStore, get_rows, opaque, put_rows
from jaxpipe.sharding.mesh_axes import Dims, constrain, spec_dims, to_spec
from jaxpipe.stages.stage_fn import StageFn

__all__ = ["Bufs", "Packing", "SlotLayout", "StageLayouts", "ValueClass", "param_slots",
           "value_class"]


@dataclass(frozen=True, order=True)
class ValueClass:
    """What values a buffer holds: shape, dtype name and sharding over the non-pipe mesh
    axes (the buffer is [slots, *shape]).

    ``dims`` is empty for a value replicated over those axes (every residual and message:
    their sharding is JAX's to propagate) and, for a sharded parameter, its
    :data:`~jaxpipe.sharding.mesh_axes.Dims`: two parameters share slots only if they are sharded
    alike.

    ``buffer`` names a separate buffer for values of the same shape and dtype: the I -> W
    hand-off (``"handoff"``) is kept apart from the residuals. I reads residuals and writes
    the hand-off in one step; in one buffer, XLA cannot prove the dynamic rows disjoint and
    copies the whole storage on every I (measured: +40% step time on the GPT blocks).
    """

    shape: tuple[int, ...]
    dtype: str
    dims: Dims = ()
    buffer: str = ""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    @property
    def row_shape(self) -> tuple[int, ...]:
        """One row of a buffer of this class: the shape without its size-1 dimensions
        after the first. (Kept, XLA:CPU's layout assignment placed such a dimension
        differently inside and outside a scan, and copied the whole storage twice per
        forward to change it: 12 kernels at L=64 p=8.)"""
        return self.shape[:1] + tuple(d for d in self.shape[1:] if d != 1)

    def zeros(self, slots: int) -> jax.Array:
        """A buffer of ``slots`` rows (each :attr:`row_shape`)."""
        buf = jnp.zeros((slots, *self.row_shape), self.dtype)
        return constrain(buf, ((), *self.row_dims)) if self.dims else buf

    @property
    def row_dims(self) -> Dims:
        """:attr:`dims` of one row (:attr:`row_shape`)."""
        if not self.dims:
            return ()
        return self.dims[:1] + tuple(d for n, d in zip(self.shape[1:], self.dims[1:],
                                                        strict=True) if n != 1)

    def spec(self, *lead: Any) -> P:
        """The value's ``PartitionSpec`` after the ``lead`` entries (e.g. the pipe axis)."""
        return to_spec(self.dims, *lead)


#: one buffer per value class (storage, inbox and outbox units, a message's parts)
Bufs = dict[ValueClass, jax.Array]


def value_class(aval: Any, dims: Dims = ()) -> ValueClass:
    """The class of ``aval``; ``dims`` as in :attr:`ValueClass.dims` (all-unsharded dims
    count as none). A value sharded over Explicit mesh axes (sharding in types) brings
    its own dims: its buffer must have its type."""
    if not any(dims):
        dims = _explicit_dims(aval)
    return ValueClass(tuple(int(d) for d in aval.shape), np.dtype(aval.dtype).name,
                      tuple(dims) if any(dims) else ())


def _explicit_dims(aval: Any) -> Dims:
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty:
        return ()
    explicit = {a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
                if t == AxisType.Explicit}
    dims = spec_dims(sharding.spec, len(aval.shape))
    return tuple(tuple(a for a in d if a in explicit) for d in dims)


#: Leaves up to this many bytes are recorded by runs of rows (a DeferredStore: Packing.write).
_GROUP_BYTES = 16384


class Packing:
    """A list of values grouped by class: where each leaf lives within its class's group.

    Attributes:
      avals: the values.
      classes: the class of every leaf.
      rows: every leaf's row within its class's group (0, 1, ... per class).
      counts: rows per class (the size of the group).
    """

    def __init__(self, avals: Sequence[Any], buffer: str = "") -> None:
        self.avals = list(avals)
        self.classes = [dataclasses.replace(value_class(a), buffer=buffer) for a in self.avals]
        self.counts: dict[ValueClass, int] = {}
        self.rows: list[int] = []
        for c in self.classes:
            self.rows.append(self.counts.get(c, 0))
            self.counts[c] = self.counts.get(c, 0) + 1

    def __len__(self) -> int:
        return len(self.avals)

    def nbytes(self) -> int:
        return sum(aval_bytes(a) for a in self.avals)

    def _runs(self, skip: frozenset[int]) -> list[tuple[ValueClass, int, list[int]]]:
        """``(class, first row, leaves)`` of each run of consecutive rows of a class (but
        the leaves in ``skip``); leaves over ``_GROUP_BYTES`` run alone."""
        runs: list[tuple[ValueClass, int, list[int]]] = []
        open_run: dict[ValueClass, tuple[int, list[int]]] = {}
        for i, (c, r) in enumerate(zip(self.classes, self.rows, strict=True)):
            if i in skip:
                continue
            start, idx = open_run.get(c, (-1, []))
            if not idx or r != start + len(idx) or c.nbytes > _GROUP_BYTES:
                start, idx = r, []
                runs.append((c, start, idx))
                open_run[c] = (start, idx)
            idx.append(i)
        return runs

    def read(self, bufs: Mapping[ValueClass, jax.Array], base: Mapping[ValueClass, Any],
             skip: frozenset[int] = frozenset()) -> list[jax.Array | None]:
        """Leaf ``i`` = ``bufs[class][base[class] + rows[i]]`` (base may be traced);
        ``None`` for the leaves in ``skip`` (read elsewhere).

        Each leaf is read at its own row, the row an :func:`~.writes.opaque` operand: XLA
        compiles one kernel per distinct fused computation, and a read fused into the op
        that uses it is one kernel for every alike leaf of every block and stage, where a
        run of rows read at once and sliced by constant rows made one per row (MLP of 16
        tanh blocks, 1F1B p=4: 44 -> 34 kernels, compile 1.08 -> 0.79 s). Recorded stores
        (:class:`~.writes.DeferredStore`, the accelerator program) read by runs."""
        out: list[jax.Array | None] = [None] * len(self.avals)
        if not isinstance(bufs, DeferredStore):
            for i, (c, r) in enumerate(zip(self.classes, self.rows, strict=True)):
                if i not in skip:
                    out[i] = get_rows(bufs, c, base[c], opaque(r), 1)[0].reshape(c.shape)
            return out
        for c, start, idx in self._runs(skip):
            rows = get_rows(bufs, c, base[c], start, len(idx))
            for j, i in enumerate(idx):
                out[i] = rows[j].reshape(c.shape)
        return out

    def write(self, bufs: Mapping[ValueClass, jax.Array], base: Mapping[ValueClass, Any],
              leaves: Sequence[jax.Array | None], skip: frozenset[int] = frozenset()
              ) -> Mapping[ValueClass, jax.Array]:
        """In-place updates of the rows of ``leaves``, but those in ``skip`` (already
        written): each leaf computed straight into its row, the row an opaque operand, so
        alike writes share one compiled kernel (as :meth:`read`). A
        :class:`~.writes.DeferredStore` records the writes instead (the accelerator
        program makes them after its conditional), small leaves by runs of consecutive
        rows, one update per run, each run built in a temporary buffer first."""
        if not isinstance(bufs, DeferredStore):
            for i, (c, r) in enumerate(zip(self.classes, self.rows, strict=True)):
                if i not in skip:
                    row = jnp.asarray(leaves[i], c.dtype).reshape(c.row_shape)
                    bufs = put_rows(bufs, c, base[c], opaque(r), row[None])
            return bufs
        for c, start, idx in self._runs(skip):
            rows = jnp.stack([jnp.asarray(leaves[i], c.dtype).reshape(c.row_shape)
                              for i in idx])
            bufs = put_rows(bufs, c, base[c], start, rows)
        return bufs

    def location(self, i: int, base: Mapping[ValueClass, Any]) -> tuple[ValueClass, Any, int]:
        """``(class, base, offset)`` of leaf ``i``: row ``base + offset`` of its class's
        buffer (``base`` as given, shared by the class; ``offset`` static)."""
        return self.classes[i], base[self.classes[i]], self.rows[i]


def merge_counts(packings: Sequence[Packing]) -> dict[ValueClass, int]:
    """Rows per class that fit any of ``packings`` (sorted by class)."""
    out: dict[ValueClass, int] = {}
    for p in packings:
        for c, n in p.counts.items():
            out[c] = max(out.get(c, 0), n)
    return dict(sorted(out.items()))


class SlotLayout:
    """Per-stage lists of values as *slots*: whole arrays every device holds.

    Each stage's values are assigned slots of their class on the stage's device, in
    stage order, the ``late`` values after all others (so that values every stage has
    take the same slots on every device, whichever stages also hold others); a device
    needs as many slots of a class as its stages have values of it, and every device
    gets the maximum. Used for parameters (and their gradients) and
    for optimizer state. Slots are separate arrays (a flat list, class by class): the
    program reads a parameter and accumulates its gradient in place, without slicing
    a stacked buffer.

    Attributes:
      counts: slots per class.
      slots: ``(class, i)`` of every slot, in list order.
      where: per stage, per value of the stage, its slot's position in the list.
    """

    def __init__(self, stage_avals: Sequence[Sequence[Any]],
                 device_stages: Sequence[Sequence[int]],
                 stage_dims: Sequence[Sequence[Dims]] | None = None,
                 late: Sequence[Sequence[bool]] | None = None) -> None:
        counts: dict[ValueClass, int] = {}
        local: dict[int, list[tuple[ValueClass, int]]] = {}
        for mine in device_stages:
            used: dict[ValueClass, int] = {}
            order = sorted(((s, i) for s in mine for i in range(len(stage_avals[s]))),
                           key=lambda si: bool(late and late[si[0]][si[1]]))
            for s in mine:
                local[s] = [None] * len(stage_avals[s])
            for s, i in order:
                c = value_class(stage_avals[s][i],
                                stage_dims[s][i] if stage_dims is not None else ())
                local[s][i] = (c, used.get(c, 0))
                used[c] = used.get(c, 0) + 1
            for c, n in used.items():
                counts[c] = max(counts.get(c, 0), n)
        self.counts = dict(sorted(counts.items()))
        self.slots = [(c, i) for c, n in self.counts.items() for i in range(n)]
        pos = {slot: k for k, slot in enumerate(self.slots)}
        self.where: list[list[int]] = [[pos[x] for x in local[s]]
                                       for s in range(len(stage_avals))]

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def classes(self) -> list[ValueClass]:
        """The class of every slot, in list order."""
        return [c for c, _ in self.slots]

    def nbytes(self) -> int:
        """Bytes of one device's slots."""
        return sum(c.nbytes for c, _ in self.slots)

    def zeros(self) -> list[jax.Array]:
        return [jnp.zeros(c.shape, c.dtype) for c, _ in self.slots]

    def constrain(self, bufs: Sequence[jax.Array]) -> list[jax.Array]:
        """Inside a partial-manual shard_map: one device's slot list, each array sharded
        as its class says over the automatic axes."""
        return [constrain(x, c.dims) for x, c in zip(bufs, self.classes, strict=True)]

    def gather(self, bufs: Sequence[jax.Array], stage: int) -> list[jax.Array]:
        """The values of ``stage`` from one device's slot list."""
        return [bufs[k] for k in self.where[stage]]

    def scatter(self, bufs: Sequence[jax.Array], stage: int,
                values: Sequence[jax.Array]) -> list[jax.Array]:
        """One device's slot list with ``stage``'s values replaced."""
        bufs = list(bufs)
        for k, x in zip(self.where[stage], values, strict=True):
            bufs[k] = jnp.asarray(x, self.slots[k][0].dtype)
        return bufs


def param_slots(stages: Sequence[StageFn], param_avals: Sequence[Any],
                device_stages: Sequence[Sequence[int]],
                param_dims: Sequence[Dims] = ()) -> SlotLayout:
    """The parameter slots: each stage's parameter leaves (tied leaves on every owner),
    sharded over the non-pipe axes as ``param_dims`` says (empty: replicated).

    A stage split into parts (:mod:`jaxpipe.stages.shared_cores`) takes slots for its core's
    parameters first: its prologue's or epilogue's (an embedding, a head) would otherwise
    shift the core's slots on its device, and a body shared by the cores would pick among
    more slots (``Body.candidates``) and move parameters in by switch, not slice."""
    late = [[st.parts is not None and q not in st.parts.param_pos[st.parts.core]
             for q in range(len(st.param_ids))] for st in stages]
    return SlotLayout([[param_avals[pid] for pid in st.param_ids] for st in stages],
                      device_stages,
                      [[param_dims[pid] for pid in st.param_ids] for st in stages]
                      if param_dims else None, late)


@dataclass(frozen=True)
class StageLayouts:
    """Packings of every stage's stored values and messages, and the parameter slots.

    Attributes:
      slots: the parameter slots of every device.
      residuals: all residuals a stage stores per microbatch (for sizes).
      pools: per :class:`~..lowering.types.Pool`, per stage, the part of its stored values kept
        in that pool: residuals only the input-gradient reads, residuals the
        weight-gradient reads too (``StageFn.w_res_ids``), and the I -> W hand-off.
      act_out / act_in: the forward message (stage carry) a stage sends / receives.
      ct_out / ct_in: the cotangent message a stage receives (for its differentiable
        carry out) / sends back (for its differentiable carry in).
      unit: rows per class of one message unit (fits every message).
    """

    slots: SlotLayout
    residuals: list[Packing]
    pools: dict[Pool, list[Packing]]
    act_out: list[Packing]
    act_in: list[Packing]
    ct_out: list[Packing]
    ct_in: list[Packing]
    unit: dict[ValueClass, int]

    @classmethod
    def build(cls, stages: Sequence[StageFn], param_avals: Sequence[Any],
              device_stages: Sequence[Sequence[int]],
              param_dims: Sequence[Dims] = ()) -> StageLayouts:
        pools = {
            Pool.RESIDUAL_A: [Packing([st.residual_avals[i] for i in st.i_only_residual_ids])
                              for st in stages],
            Pool.RESIDUAL_B: [Packing([st.residual_avals[i] for i in st.w_res_ids])
                              for st in stages],
            Pool.HANDOFF: [Packing(st.w_residual_avals, buffer="handoff") for st in stages],
        }
        act_out = [Packing([] if st.is_last else st.out_avals) for st in stages]
        ct_in = [Packing(st.ct_in_avals()) for st in stages]
        return cls(
            slots=param_slots(stages, param_avals, device_stages, param_dims),
            residuals=[Packing(st.residual_avals) for st in stages],
            pools=pools,
            act_out=act_out,
            act_in=[Packing(st.in_avals) for st in stages],
            ct_out=[Packing([] if st.is_last else st.ct_out_avals()) for st in stages],
            ct_in=ct_in,
            unit=merge_counts(act_out + ct_in),
        )

    def pool_counts(self) -> dict[Pool, list[dict[ValueClass, int]]]:
        """Per pool, per stage, slots per class one microbatch stores (for the lowering)."""
        return {pool: [dict(p.counts) for p in packings] for pool, packings in self.pools.items()}

    def unit_bytes(self) -> int:
        return sum(c.nbytes * n for c, n in self.unit.items())
