"""Moves between the user's parameter leaves and the SPMD runtime's slots.

Both directions run inside a ``shard_map`` manual over the pipe axis (the executor wraps
them), and both work on the user's *whole* leaves, not on the stages' views of them
(:mod:`jaxpipe.sharding.param_views`). A scanned stack cut over every device is one
stacked leaf whose rows ``[a, b)`` sit in the same slot on each device; taking the
stages' views first would put one slice per view into the program and pass each view into the
``shard_map`` as an input of its own (160 at 64 layers, p=8, v=2), where one dynamic
slice per slot (in) and one tiled ``all_gather`` per slot (out) do:

- :func:`to_slots`: a slot holding rows of one stacked leaf on every device takes them
  with one dynamic slice of that leaf at a per-device offset; the other slots are
  filled by a switch over devices, each branch copying its whole leaves (devices that
  hold the same leaves in the same slots share a branch).
- :func:`from_slots`: every slot is all-gathered once; each leaf is read back from the
  devices and slots holding it, and consecutive rows that one gathered slot holds in
  device order are read as one slice of it.
- The public ``value_and_grad`` holds the slots of a shared body's per-stage parameters
  as stacked groups (:mod:`.param_groups`), and both directions move a group whole. A stacked
  leaf cut evenly over the chunks of an interleaved schedule (:func:`interleaved_leaf`)
  goes in as itself, every device's rows (the program reads the running stage's global
  row), and its gradient is the gathered group, transposed.

The exception is a stacked leaf whose leading (layer) axis is itself sharded over a mesh
axis: cutting its rows inside the ``shard_map`` would move rows between the devices of
that axis, a collective inside the manual region (which the CPU runtime refuses). Such a
leaf crosses the ``shard_map`` as its stages' views, cut and joined outside it by the
partitioner (:class:`Crossing`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpipe.runtime.base import RuntimeSpec
from jaxpipe.runtime.spmd.program.gated import by_device
from jaxpipe.runtime.spmd.program.layout import SlotLayout
from jaxpipe.runtime.spmd.program.param_groups import Groups
from jaxpipe.sharding.mesh_axes import constrain

__all__ = ["Crossing", "from_slots", "interleaved_leaf", "rows_free", "slot_inputs",
           "to_slots"]


def rows_free(c: Any) -> bool:
    """Whether values of class ``c`` can be cut and joined along their leading axis
    without resharding (it exists and no mesh axis shards it)."""
    return bool(c.shape) and not (c.dims and c.dims[0])


class Crossing:
    """What crosses the moves' ``shard_map`` boundary: the user's leaves whole, except
    those cut outside it (a stacked leaf with a sharded leading axis), which cross as
    their views, in view order after the whole leaves.

    Attributes:
      whole: the user leaves that cross whole.
      views: the views (parameter inputs) that cross for the other leaves.
    """

    def __init__(self, spec: RuntimeSpec) -> None:
        self.spec = spec
        vs = spec.views
        cut = {w.leaf for w in vs.views if w.start is not None and spec.leaf_dims(w.leaf)[0]}
        self.whole = [i for i in range(len(vs.leaf_avals)) if i not in cut]
        self.views = [pid for pid, w in enumerate(vs.views) if w.leaf in cut]

    def flatten(self, leaves: list) -> list:
        """User leaves -> what crosses (traceable, outside the shard_map)."""
        vs = self.spec.views.views
        return ([leaves[i] for i in self.whole]
                + [vs[pid].take(leaves[vs[pid].leaf]) for pid in self.views])

    def unflatten(self, flat: list) -> list:
        """What crossed -> user leaves (the views of a cut leaf joined, outside)."""
        out: list = [None] * len(self.spec.views.leaf_avals)
        for i, x in zip(self.whole, flat[:len(self.whole)], strict=True):
            out[i] = x
        parts: dict[int, list] = {}
        for pid, x in zip(self.views, flat[len(self.whole):], strict=True):
            parts.setdefault(self.spec.views.views[pid].leaf, []).append(x)
        for leaf, xs in parts.items():
            out[leaf] = jnp.concatenate(xs)
        return out

    def dims(self) -> list:
        """The sharding over the non-pipe axes of everything that crosses."""
        return ([self.spec.leaf_dims(i) for i in self.whole]
                + [self.spec.dims(pid) for pid in self.views])

    def view(self, flat: list, pid: int) -> jax.Array:
        """View ``pid``'s value, from what crossed (inside the shard_map)."""
        if pid in self.views:
            return flat[len(self.whole) + self.views.index(pid)]
        w = self.spec.views.views[pid]
        return w.take(flat[self.whole.index(w.leaf)])

    def leaf(self, flat: list, leaf: int) -> jax.Array:
        """Whole leaf ``leaf`` (one that crossed whole), inside the shard_map."""
        return flat[self.whole.index(leaf)]


def slot_inputs(spec: RuntimeSpec, slots: SlotLayout) -> np.ndarray:
    """``[devices, slots]``: the parameter input (view) each slot holds on each device
    (-1: none)."""
    holds = np.full((spec.schedule.num_devices, len(slots)), -1, np.int64)
    for st in spec.stages:
        holds[spec.schedule.placement(st.index), slots.where[st.index]] = st.param_ids
    return holds


def _stacked(spec: RuntimeSpec, slots: SlotLayout, holds: np.ndarray, k: int) -> bool:
    """Whether slot ``k`` holds rows of one stacked leaf on several devices (and so is
    filled by one dynamic slice of that leaf)."""
    pids = {int(h) for h in holds[:, k]} - {-1}
    return (len(pids) > 1 and rows_free(slots.classes[k])
            and len({spec.tree_leaf(pid) for pid in pids}) == 1)


def to_slots(spec: RuntimeSpec, slots: SlotLayout, crossing: Crossing, flat: list,
             groups: Groups | None = None) -> Any:
    """What crossed (``crossing.flatten`` of the user's leaves; this device's shards over
    the non-pipe axes) -> this device's slots, each ``[1, *shape]``. Runs inside a
    shard_map manual over ``spec.axis``.

    With ``groups``, returns ``(slots, arrays)``: ``None`` at a grouped slot and each
    group's slots stacked, ``[1, len(group), *shape]``, but a whole group's
    (``groups.whole``): the user's leaf, ``[len(group) * devices, *shape]``."""
    views = spec.views.views
    holds = slot_inputs(spec, slots)
    stacked = [k for k in range(len(slots)) if _stacked(spec, slots, holds, k)]
    rest = [k for k in range(len(slots)) if k not in stacked]
    flat = [constrain(x, d) for x, d in zip(flat, crossing.dims(), strict=True)]
    dev = lax.axis_index(spec.axis)
    out: list = [None] * len(slots)

    def branch(d: int):
        def f(lv):  # every branch returns its values sharded alike (XLA demands it)
            got = []
            for k in rest:
                c, pid = slots.classes[k], holds[d, k]
                x = (jnp.asarray(crossing.view(lv, pid), c.dtype) if pid >= 0
                     else jnp.zeros(c.shape, c.dtype))
                got.append(constrain(x, c.dims))
            return got
        return f

    if rest:
        keys = [tuple(holds[d, rest]) for d in range(spec.schedule.num_devices)]
        firsts = list(dict.fromkeys(keys))
        got = by_device([branch(keys.index(key)) for key in firsts],
                        [firsts.index(key) for key in keys], spec.axis, flat)
        for k, x in zip(rest, got, strict=True):
            out[k] = x
    whole = [g for i, g in enumerate(groups.groups if groups else ()) if groups.held_whole(i)]
    for k in stacked:  # rows_free: the leaf crossed whole
        if any(k in g for g in whole):
            continue
        c = slots.classes[k]
        leaf = crossing.leaf(flat, spec.tree_leaf(int(max(holds[:, k]))))
        n, total = c.shape[0], leaf.shape[0]
        if (holds[:, k] < 0).any():  # a device without these rows reads zeros past the end
            leaf = jnp.concatenate([leaf, jnp.zeros((n, *leaf.shape[1:]), leaf.dtype)])
        start = np.array([views[h].start if h >= 0 else total for h in holds[:, k]],
                         np.int32)
        out[k] = lax.dynamic_slice_in_dim(leaf, jnp.asarray(start)[dev], n).astype(c.dtype)
    if groups is None:
        return [x[None] for x in slots.constrain(out)]
    arrays = []
    for g in groups.groups:
        c = slots.classes[g[0]]
        if g in whole:  # every device's rows: [len(g) * devices, *shape]
            leaf = crossing.leaf(flat, interleaved_leaf(spec, slots, holds, g))
            arrays.append(groups.constrain(leaf.reshape(-1, *c.shape).astype(c.dtype), g))
        else:
            arrays.append(groups.constrain(jnp.stack([out[k] for k in g]), g)[None])
    return ([None if k in groups.where else constrain(x, c.dims)[None]
             for k, (x, c) in enumerate(zip(out, slots.classes, strict=True))], arrays)


def interleaved_leaf(spec: RuntimeSpec, slots: SlotLayout, holds: np.ndarray,
                     group: tuple[int, ...]) -> int | None:
    """The user leaf whose rows ``group``'s slots hold in order, chunk by chunk and within
    a chunk device by device (slot ``q`` of device ``d`` holds rows ``(q * D + d) * n``
    on, ``n`` rows each: an interleaved schedule's even cut of a stack), or ``None``. The
    leaf viewed as ``[len(group) * D, n, ...]`` is then every device's group (row ``q *
    D + d``: device ``d``'s row ``q``), and the gathered group is the leaf transposed.
    ``holds``: :func:`slot_inputs`."""
    views, D = spec.views.views, spec.schedule.num_devices
    if not all(_stacked(spec, slots, holds, k) for k in group) or (holds[:, group] < 0).any():
        return None
    leaf = spec.tree_leaf(int(holds[0, group[0]]))
    n = slots.classes[group[0]].shape[0]
    want = [[(q * D + d) * n for q in range(len(group))] for d in range(D)]
    got = [[views[holds[d, k]].start for k in group] for d in range(D)]
    if got != want or spec.views.leaf_avals[leaf].shape[0] != len(group) * D * n:
        return None
    if any(spec.tree_leaf(int(holds[d, k])) != leaf for d in range(D) for k in group):
        return None
    return leaf


class _Gathered:
    """One slot of every device (``all_gather`` over the pipe axis). Gathered tiled
    along the leading axis where the class allows it (:func:`rows_free`), so the rows
    of a stacked leaf held by consecutive devices are one slice."""

    def __init__(self, x: jax.Array, axis: str, c: Any) -> None:
        self.n = x.shape[0] if rows_free(c) else None
        part = x if self.n is not None else x[None]
        if not part.size:  # (XLA refuses to gather a zero-size operand; it has no values)
            self.all = jnp.zeros((part.shape[0] * lax.axis_size(axis), *part.shape[1:]),
                                 part.dtype)
            return
        # untiled as a tiled gather of x[None]: the same array, and under sharding in
        # types the untiled rule gives the new axis the sharding of x's first
        self.all = lax.all_gather(part, axis, tiled=True)

    def of(self, first: int, count: int = 1) -> jax.Array:
        """Devices ``first .. first + count - 1``'s values (``count > 1``: tiled only)."""
        if self.n is None:
            return self.all[first]
        return self.all[first * self.n:(first + count) * self.n]


class _GroupRow(_Gathered):
    """One slot of every device, read from its gradient group (:mod:`.param_groups`), gathered
    whole once: row ``q`` of ``[devices, rows, *shape]``. (A leaf whose rows two rows of
    a group hold is one kernel, joining strided slices; gathered along the rows' axis
    instead, XLA:CPU transposes every group for the all-gather itself.)"""

    def __init__(self, gathered: jax.Array, q: int, c: Any) -> None:
        self.n = gathered.shape[2] if rows_free(c) else None
        self.all, self.q = gathered, q

    def of(self, first: int, count: int = 1) -> jax.Array:
        rows = self.all[first:first + count, self.q]
        return rows[0] if self.n is None else rows.reshape(-1, *rows.shape[2:])


def from_slots(spec: RuntimeSpec, slots: SlotLayout, crossing: Crossing, bufs: list,
               owner_only: bool, groups: Groups | None = None,
               arrays: Sequence[jax.Array] = ()) -> list[jax.Array]:
    """This device's slots -> what crosses back (``crossing.unflatten`` makes the user's
    leaves of it; replicated over the pipe axis, sharded over the others as the
    parameters are): each view is the sum over the stages holding it (``owner_only``:
    the first such stage's copy, for parameters), and a leaf crossing whole its views
    joined along the leading axis. Runs inside a shard_map manual over ``spec.axis``.

    ``groups`` / ``arrays``: slots held stacked, each group's array ``[1, len(group),
    *shape]`` (``bufs`` has ``None`` at those slots): each is gathered once, whole, and
    its slots read from it (a leaf whose rows two of them hold is then one kernel, not a
    slice per slot and a concatenation).

    The program grows with slots + leaves, not with leaves x devices (as a switch over
    devices, zero-filling the others' leaves, would)."""
    views = spec.views
    # per view: the (slot, device) pairs holding it
    where: list[list[tuple[int, int]]] = [[] for _ in views.views]
    for st in spec.stages:
        d = spec.schedule.placement(st.index)
        for pid, k in zip(st.param_ids, slots.where[st.index], strict=True):
            if not owner_only or spec.param_owners[pid][0] == st.index:
                where[pid].append((k, d))
    used = sorted({k for w in where for k, _ in w})
    bufs = [None if x is None else constrain(x[0], c.dims)
            for x, c in zip(bufs, slots.classes, strict=True)]
    every: dict[int, _Gathered] = {}
    holds = slot_inputs(spec, slots)
    whole: dict[int, jax.Array] = {}  # leaves that are a gathered group, transposed
    for members, arr in zip(groups.groups if groups else (), arrays, strict=True):
        c = slots.classes[members[0]]
        # untiled as a tiled gather of x[None], as _Gathered does: under sharding in
        # types the untiled rule shards the new axis as x's first
        gathered = lax.all_gather(groups.constrain(arr[0], members)[None], spec.axis,
                                  tiled=True)
        every.update((k, _GroupRow(gathered, q, c)) for q, k in enumerate(members))
        leaf = interleaved_leaf(spec, slots, holds, members)
        if leaf is not None and all(len(where[pid]) == 1 for pid, w in enumerate(views.views)
                                    if w.leaf == leaf):
            x = jnp.swapaxes(gathered, 0, 1)
            whole[leaf] = x.reshape(-1, *x.shape[3:])
    every.update((k, _Gathered(bufs[k], spec.axis, slots.classes[k]))
                 for k in used if k not in every)
    parts: list[list[Any]] = [[] for _ in views.leaf_avals]
    viewed_ids = frozenset(crossing.views)
    viewed: dict[int, jax.Array] = {}  # the views that cross back as views
    run: tuple[int, int, int, int] | None = None  # (leaf, slot, first device, count)

    def close() -> None:
        if run is not None:
            parts[run[0]].append(every[run[1]].of(run[2], run[3]))

    for pid, (w, a) in enumerate(zip(views.views, views.avals, strict=True)):
        if w.leaf in whole:
            continue
        single = len(where[pid]) == 1 and every[where[pid][0][0]].n is not None
        if single and pid not in viewed_ids:
            k, d = where[pid][0]
            if run is not None and run[:2] == (w.leaf, k) and run[2] + run[3] == d:
                run = (w.leaf, k, run[2], run[3] + 1)  # the next device's rows: one slice
                continue
            close()
            run = (w.leaf, k, d, 1)
            continue
        close()
        run = None
        terms = [every[k].of(d) for k, d in where[pid]]
        x = sum(terms[1:], terms[0]) if terms else jnp.zeros(a.shape, a.dtype)
        if pid in viewed_ids:
            viewed[pid] = x
        else:
            parts[w.leaf].append(x)
    close()
    out = []
    for leaf in crossing.whole:
        if leaf in whole:
            x = whole[leaf]
        else:
            x = parts[leaf][0] if len(parts[leaf]) == 1 else jnp.concatenate(parts[leaf])
        out.append(x.astype(views.leaf_avals[leaf].dtype))
    for pid in crossing.views:
        out.append(viewed[pid].astype(views.avals[pid].dtype))
    return [constrain(x, d) for x, d in zip(out, crossing.dims(), strict=True)]
