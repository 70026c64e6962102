"""The lowered program's table: one row of integer fields per (step, device).

:class:`TickTable` is what :func:`.table.fill_table` writes and the program scans;
:class:`ActionFields` and :class:`StepFields` are its two forms inside the program, the
fields the branches read and the fields the step reads around them. :func:`branch_id`
numbers the program's branches (:data:`IDLE` is a step in which a device does nothing).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import jax
import numpy as np

from jaxpipe.runtime.spmd.lowering.pools import Pool
from jaxpipe.schedule import ACTION_KINDS

__all__ = ["IDLE", "PROGRAM_KINDS", "ActionFields", "StepFields", "TickTable", "branch_id"]


#: Branch id of a step in which a device does nothing.
IDLE = 0

#: What a program step runs: a schedule action kind, ``"FB"``, a forward and its own
#: backward in one step (see :func:`.fusion.fused_backwards`), or ``"IW"``, an I and its
#: own W in one step (:func:`.fusion.joined_weights`).
PROGRAM_KINDS = (*ACTION_KINDS, "FB", "IW")



def branch_id(kind: str, body: int, num_bodies: int) -> int:
    """The program branch that runs ``kind`` (one of :data:`PROGRAM_KINDS`) for ``body``
    (:data:`IDLE` is 0)."""
    return 1 + PROGRAM_KINDS.index(kind) * num_bodies + body


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TickTable:
    """Integer fields of every (step, device); the program scans over the steps, in the
    form :meth:`actions` and :meth:`steps` give.

    Every array's leading axes are ``[steps, devices]``.

    Attributes:
      branch: the branch to run (:func:`branch_id`, or :data:`IDLE`).
      stage: the action's stage (selects a shared body's parameters).
      microbatch: the action's microbatch.
      in_slot: inbox slot holding the action's input message (stage carry or cotangent).
      local_slot: inbox slot for the action's output message when it stays on the
        device (the turn of a V); the dummy slot otherwise (not written).
      out_unit: ``[steps, devices, offsets]``: the unit of the outbox of each direction
        the action's output message goes to (``units[j]``, one past the last unit, when
        it sends nothing that way: the program writes no outbox then).
      recv_slot: ``[steps, devices, offsets, units]``: inbox slot for each unit arriving
        over each permutation offset at the end of the step (the dummy slot if none).
      pool_base: per (pool, class), the first slot of that class where the action writes
        or reads that pool's part of its stored values.
      exchange: ``[steps, devices, offsets]`` int (same for every device): ``0``, or
        ``1 + k`` where the permutation over that offset runs at the end of the step
        with the ``k``-th sender set of that offset (:func:`exchange_patterns`).
    """

    branch: np.ndarray
    stage: np.ndarray
    microbatch: np.ndarray
    in_slot: np.ndarray
    local_slot: np.ndarray
    out_unit: np.ndarray
    recv_slot: np.ndarray
    pool_base: dict[tuple[Pool, Hashable], np.ndarray]
    exchange: np.ndarray

    @property
    def num_steps(self) -> int:
        return int(self.branch.shape[0])

    def actions(self, part_stages: Sequence[int] = ()) -> ActionFields:
        """The fields the branches read; ``part_stages``: the stages whose prologue or
        epilogue a branch runs gated (:mod:`..program.stage_ends`)."""
        # many (pool, class) pairs have equal columns (each class's part of a residual set
        # starts at the same slot; a class with one slot is always 0): each distinct
        # column is scanned once, not once per pair
        distinct: dict[bytes, int] = {}
        values: list[np.ndarray] = []
        index = []
        for key, col in self.pool_base.items():
            col = np.ascontiguousarray(col, np.int32)
            i = distinct.setdefault(col.tobytes(), len(values))
            if i == len(values):
                values.append(col)
            index.append((key, i))
        return ActionFields(self.stage, self.microbatch, self.in_slot, tuple(values),
                            {s: (self.stage == s).astype(np.int32) for s in part_stages},
                            tuple(index))

    def steps(self, branches: Sequence[int], num_inbox: int, units: Sequence[int]
              ) -> StepFields:
        """What the step reads around its branch: ``branches`` the program has (the ids
        of :func:`branch_id`), ``num_inbox`` the dummy inbox slot, ``units`` each
        direction's outbox units."""
        i32 = lambda x: np.ascontiguousarray(x, np.int32)  # noqa: E731
        J = range(self.out_unit.shape[2])
        return StepFields(
            runs={b: i32(self.branch == b) for b in branches},
            keep=i32(self.local_slot != num_inbox), local_slot=i32(self.local_slot),
            send=tuple(i32(self.out_unit[..., j] != units[j]) for j in J),
            out_unit=tuple(i32(self.out_unit[..., j]) for j in J),
            exchange=tuple(i32(self.exchange[..., j] > 0) for j in J),
            pattern=tuple(i32(np.maximum(self.exchange[..., j] - 1, 0)) for j in J),
            recv_slot=tuple(tuple(i32(self.recv_slot[..., j, r]) for r in range(units[j]))
                            for j in J))

    def digest_bytes(self) -> bytes:
        """Every field, in a fixed order (for cross-process consistency checks)."""
        parts = [self.branch, self.stage, self.microbatch, self.in_slot, self.local_slot,
                 self.out_unit,
                 self.recv_slot, self.exchange]
        parts += [self.pool_base[k] for k in sorted(self.pool_base, key=repr)]
        return b"".join(np.ascontiguousarray(p).tobytes() + str(p.shape).encode()
                        for p in parts)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ActionFields:
    """The fields of the action a device runs at a step (:meth:`TickTable.actions`), as
    the branches read them: one ``[steps, devices]`` array each (see :class:`StepFields`).

    Attributes:
      stage, microbatch, in_slot: as :class:`TickTable`'s.
      base_values: the distinct columns of ``TickTable.pool_base``; ``base_index``
        (static): per (pool, class), which one is its.
      at_stage: per stage whose parts run gated, whether the action is that stage's (a
        trip count).
    """

    stage: np.ndarray
    microbatch: np.ndarray
    in_slot: np.ndarray
    base_values: tuple[np.ndarray, ...]
    at_stage: dict[int, np.ndarray]
    base_index: tuple[tuple[tuple[Pool, Hashable], int], ...] = field(
        metadata={"static": True})

    def bases(self, pool: Pool) -> dict:
        """Per class, the first slot of ``pool``'s part (of a row: where it reads or
        writes)."""
        return {c: self.base_values[i] for (p, c), i in self.base_index if p is pool}


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepFields:
    """What a step does around its branch (:meth:`TickTable.steps`): one ``[steps,
    devices]`` array per scalar, the gates as trip counts (``1``: it runs).

    XLA:CPU compiles one kernel per distinct fused computation. Equal-shaped scalars read
    from equal-shaped arrays are one kernel for all of them, where a ``[steps, devices,
    k]`` field costs a kernel per shape and a gate computed on the device (``branch ==
    b``) one per constant: GPT d64, L=64, p=8, v=2, scanned, 197 -> 185 compiled kernels.

    Attributes:
      runs: per branch id, whether that branch runs.
      keep: whether the output message stays on the device; ``local_slot``: where.
      send: per offset, whether the output message goes that way; ``out_unit``: in
        which outbox unit.
      exchange: per offset, whether its permutation runs at the end of the step;
        ``pattern``: with which sender set (``TickTable.exchange - 1``).
      recv_slot: per offset and unit, the inbox slot of what arrives.
    """

    runs: dict[int, np.ndarray]
    keep: np.ndarray
    local_slot: np.ndarray
    send: tuple[np.ndarray, ...]
    out_unit: tuple[np.ndarray, ...]
    exchange: tuple[np.ndarray, ...]
    pattern: tuple[np.ndarray, ...]
    recv_slot: tuple[tuple[np.ndarray, ...], ...]
