"""A shared body's parameters that live in a different slot for each member on a device.

Two stages of one body on a device (the chunks of an interleaved schedule) run through
one branch, but each has its own parameters, in slots of its own: the branch picks the
running stage's at run time, and adds its gradient into the running stage's slot.

- Parameters: the staged parameters are slots (what the optimizer updates in place),
  picked with a ``select_n`` over the candidates; a scanned layer stack's are picked
  layer by layer inside the scan (:mod:`.scan_buffers`), where the layer's slice is read
  anyway, so they cost no kernel and no copy. The public ``value_and_grad`` moves the
  user's leaves into groups directly (:func:`.param_moves.to_slots`), and its branches read a
  group's row like a stored value (``pbuf[k]`` is then ``None``: :meth:`Groups.param`).
- Gradients: added into separate slot arrays, a pick costs a masked add into *every*
  candidate, a kernel each per leaf and branch, and a scan's per-layer gradients could
  not go straight into a slot row. So inside the program the gradient slots that such
  a parameter may use are held as one stacked array, ``[candidates, *shape]`` (a
  *group*), in place of those slots: a gradient is added into row ``q`` in place, a
  dynamic row like any stored value, and a scan adds each layer's gradient into its row
  directly. The groups become slots again once, after the last step (:meth:`Groups.fold`),
  or, in the public ``value_and_grad``, are gathered whole (:func:`.param_moves.from_slots`).
- A group holding a stacked leaf cut evenly over the chunks of an interleaved schedule
  (:func:`.param_moves.interleaved_leaf`) is, for the public ``value_and_grad``'s parameters,
  the user's leaf itself (*whole*: every device's rows, ``[chunks * devices, *shape]``),
  read at the running stage's global row. Each device slicing its own rows out of it
  first cost a kernel per leaf shape and a copy; the leaf is on every device anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxpipe.runtime.spmd.program.bodies import Body
from jaxpipe.runtime.spmd.program.layout import ValueClass
from jaxpipe.runtime.spmd.program.writes import add_grad
from jaxpipe.sharding.mesh_axes import constrain

__all__ = ["Groups", "of_stage", "pick"]


def pick(body: Body, j: int, row_stage: jax.Array) -> jax.Array:
    """The running stage's position in parameter ``j``'s :meth:`~.bodies.Body.candidates`."""
    return of_stage(body.choice(j), row_stage)


def of_stage(table: np.ndarray, row_stage: jax.Array) -> jax.Array:
    """The running stage's entry of a per-stage table (a stage is never negative: no
    index wrap, which put a comparison and a select beside every such read)."""
    return lax.dynamic_index_in_dim(jnp.asarray(table, jnp.int32), row_stage, 0,
                                    keepdims=False, allow_negative_indices=False)


class Groups:
    """The slot groups of a program's bodies: of the gradients always, of the parameters
    in the public ``value_and_grad``.

    The candidate slots of every parameter with more than one are joined into groups
    (slots that two parameters' candidates share end up in one group). Within the
    program, a list grouped so holds ``None`` at a grouped slot and, after the slots, each
    group's stacked array (group ``g`` at position ``len(classes) + g``).

    ``whole(group)``: whether the public ``value_and_grad`` holds that group's parameters
    whole (the user's leaf, every device's rows: row ``q`` of device ``d`` is row
    ``q * devices + d``); ``placement``: every stage's device; ``axis``: the pipe axis.
    """

    def __init__(self, bodies: Sequence[Body], classes: Sequence[ValueClass], *,
                 whole: Callable[[tuple[int, ...]], bool] | None = None,
                 placement: Sequence[int] = (), axis: str = "") -> None:
        self.classes = list(classes)
        parent = list(range(len(classes)))

        def root(k: int) -> int:
            while parent[k] != k:
                k = parent[k]
            return k

        for b in bodies:
            for j in range(len(b.param_classes)):
                cands = b.candidates(j)
                for k in cands[1:]:
                    parent[root(k)] = root(cands[0])
        members: dict[int, list[int]] = {}
        for k in range(len(classes)):
            members.setdefault(root(k), []).append(k)
        self.groups = [tuple(g) for _, g in sorted(members.items()) if len(g) > 1]
        #: slot -> (position of its group in the gradient list, its row there)
        self.where = {k: (len(classes) + i, q) for i, g in enumerate(self.groups)
                      for q, k in enumerate(g)}
        #: positions (in the lists) of the groups whose parameters are held whole
        self.whole = frozenset(len(classes) + i for i, g in enumerate(self.groups)
                               if whole is not None and whole(g))
        self.placement = np.asarray(placement, np.int32)
        self.devices = int(self.placement.max()) + 1 if len(self.placement) else 1
        self.axis = axis

    def of(self, body: Body, j: int) -> tuple[int, np.ndarray] | None:
        """Parameter ``j``'s group: its position in the gradient list and, per stage, the
        row of the stage's slot (``None``: ``j``'s slot is in no group)."""
        slots = body.param_slot[:, j]
        first = int(slots[body.stages[0]])
        if first not in self.where:
            return None
        pos = self.where[first][0]
        rows = np.array([self.where[int(k)][1] if int(k) in self.where else 0
                         for k in slots], np.int32)
        return pos, rows

    def param_of(self, body: Body, j: int) -> tuple[int, np.ndarray]:
        """As :meth:`of`, for reading parameter ``j`` where the program holds parameters
        by group: a whole group's rows are global (row ``q`` of device ``d``: ``q *
        devices + d``)."""
        pos, rows = self.of(body, j)
        if pos in self.whole:
            rows = rows * self.devices + self.placement
        return pos, rows

    def held_whole(self, i: int) -> bool:
        """Whether the public ``value_and_grad`` holds group ``i``'s parameters whole."""
        return len(self.classes) + i in self.whole

    def constrain(self, x: jax.Array, g: tuple[int, ...]) -> jax.Array:
        """A group's array sharded as its slots are over the automatic axes."""
        return constrain(x, ((), *self.classes[g[0]].dims))

    def param(self, pbuf: Sequence[jax.Array | None], k: int) -> jax.Array:
        """Slot ``k``'s parameter: from its slot, or from its group's row where the
        program holds parameters by group (``pbuf[k]`` is then ``None``)."""
        if pbuf[k] is not None:
            return pbuf[k]
        pos, q = self.where[k]
        if pos not in self.whole:
            return pbuf[pos][q]
        row = q * self.devices + lax.axis_index(self.axis)
        return lax.dynamic_index_in_dim(pbuf[pos], row, 0, keepdims=False,
                                        allow_negative_indices=False)

    def zero_grads(self) -> list[jax.Array | None]:
        """The program's gradient list, zero: ``None`` at a grouped slot, then the
        groups."""
        out: list = [None if k in self.where else constrain(jnp.zeros(c.shape, c.dtype), c.dims)
                     for k, c in enumerate(self.classes)]
        for g in self.groups:
            c = self.classes[g[0]]
            out.append(self.constrain(jnp.zeros((len(g), *c.shape), c.dtype), g))
        return out

    def specs(self, slot_specs: Sequence[P], axis: str, params: bool = False
              ) -> tuple[list, list[P]]:
        """Specs of ``(slots, group arrays)`` outside the program, from the slots' own
        (``None`` at a grouped slot; a group's array is ``[devices, len(group), ...]``).
        ``params``: of the parameters the program holds by group, where a whole group's
        array is the user's leaf, ``[len(group) * devices, ...]`` on every device."""
        return ([None if k in self.where else x for k, x in enumerate(slot_specs)],
                [self.classes[g[0]].spec(None) if params and self.held_whole(i)
                 else self.classes[g[0]].spec(axis, None) for i, g in enumerate(self.groups)])

    def local(self, arrays: Sequence[jax.Array], params: bool = False) -> list[jax.Array]:
        """The group arrays a program's shard_map gets (``arrays`` as :meth:`specs` says)
        as the program holds them: without the leading device axis, but a whole group's
        parameters (``params``), which are the user's leaf."""
        return [self.constrain(x if params and self.held_whole(i) else x[0], g)
                for i, (x, g) in enumerate(zip(arrays, self.groups, strict=True))]

    def add(self, gbuf: list, k: int, ct: jax.Array, row: jax.Array | None = None) -> None:
        """Add ``ct`` into slot ``k``'s gradient in place (``row``: the row in ``k``'s
        group, when it is picked at run time; ``k`` is then any slot of the group)."""
        if k not in self.where:
            add_grad(gbuf, k, ct)
            return
        pos, q = self.where[k]
        add_grad(gbuf, pos, ct, q if row is None else row)

    def fold(self, gbuf: Sequence[jax.Array | None]) -> list[jax.Array]:
        """The gradient slots again: every grouped slot its group's row."""
        return [gbuf[self.where[k][0]][self.where[k][1]] if k in self.where else x
                for k, x in enumerate(gbuf[:len(self.classes)])]
