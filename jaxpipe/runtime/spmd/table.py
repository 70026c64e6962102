"""The static table the SPMD program scans: one row of integer fields per (step, device).

Step 5 of the lowering (:mod:`.lowering`): given when every action runs, the messages
between actions and where the buffers keep them, :func:`fill_table` writes which branch
each device runs at each step and every slot it reads or writes.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import jax
import numpy as np

from jaxpipe.runtime.spmd.allocate import Allocation, Pool
from jaxpipe.schedule import ACTION_KINDS

if TYPE_CHECKING:
    from jaxpipe.runtime.spmd.lowering import Messages, Ticks

__all__ = ["IDLE", "PROGRAM_KINDS", "ActionFields", "StepFields", "TickTable", "branch_id",
           "exchange_patterns", "fill_table", "offset_index"]

#: Branch id of a step in which a device does nothing.
IDLE = 0

#: What a program step runs: a schedule action kind, ``"FB"``, a forward and its own
#: backward in one step (see :func:`.fusion.fused_backwards`), or ``"IW"``, an I and its
#: own W in one step (:func:`.fusion.joined_weights`).
PROGRAM_KINDS = (*ACTION_KINDS, "FB", "IW")

_KIND = {kind: i for i, kind in enumerate(PROGRAM_KINDS)}  # kind -> its index


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
        epilogue a branch runs gated (:mod:`.ends`)."""
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


def fill_table(ticks: Ticks, messages: Messages, alloc: Allocation,
               perm_offsets: Sequence[int], units: Sequence[int],
               body_of_stage: Sequence[int], num_bodies: int,
               pool_classes: Mapping[Pool, Sequence[Hashable]],
               max_patterns: int | None = None
               ) -> tuple[TickTable, tuple[tuple[tuple[int, ...], ...], ...]]:
    """One row per (step, device); idle rows point at the dummy inbox slot. Also returns
    each offset's sender sets (:func:`exchange_patterns`)."""
    graph = ticks.graph
    D = len(graph.lists)
    T = ticks.num_steps
    dummy = alloc.num_inbox
    shape = (T, D)
    # a fused B shares its F's row, which runs the FB branch; a joined W its I's (IW)
    rows = np.flatnonzero(~ticks.fused)
    kind = graph.kinds.copy()
    for second, pair in (("B", "FB"), ("W", "IW")):
        kind[graph.prev[ticks.fused & (graph.kinds == _KIND[second])]] = _KIND[pair]
    kind, stage_of, mb_of = kind[rows], graph.stages[rows], graph.microbatches[rows]
    t, d = ticks.step[rows], ticks.device[rows]
    branch = np.full(shape, IDLE, np.int32)
    branch[t, d] = 1 + kind * num_bodies + np.asarray(body_of_stage, np.int64)[stage_of]
    stage = np.zeros(shape, np.int32)
    stage[t, d] = stage_of
    microbatch = np.zeros(shape, np.int32)
    microbatch[t, d] = mb_of
    pool_base = {}
    for pool in Pool:
        for c in pool_classes[pool]:
            col = np.zeros(shape, np.int32)
            b = alloc.base[(pool, c)][rows]
            used = b >= 0
            col[t[used], d[used]] = b[used]
            pool_base[(pool, c)] = col
    in_slot = np.full(shape, dummy, np.int32)
    local_slot = np.full(shape, dummy, np.int32)
    out_unit = np.zeros((T, D, len(perm_offsets)), np.int32)
    out_unit[:] = np.asarray(units, np.int32)  # the dummy unit of each direction
    recv_slot = np.full((T, D, len(perm_offsets), max(units, default=0)), dummy, np.int32)
    slot = alloc.message_slot
    in_slot[messages.read, messages.dst] = slot
    p_step, p_tick = ticks.step[messages.producer], ticks.tick[messages.producer]
    local = messages.src == messages.dst
    local_slot[p_step[local], messages.src[local]] = slot[local]
    # a message to another device goes out in unit r of its direction: the r-th message its
    # device sends that way in the tick
    remote = np.flatnonzero(~local)
    src, dst = messages.src[remote], messages.dst[remote]
    j = offset_index(perm_offsets, (dst - src) % D)
    r = _rank_in_group((p_tick[remote] * D + src) * len(perm_offsets) + j)
    out_unit[p_step[remote], src, j] = r
    end = ticks.tick_end[p_tick[remote]]
    recv_slot[end, dst, j, r] = slot[remote]
    exchange, patterns = exchange_patterns(end, j, src, T, D, len(perm_offsets),
                                           max_patterns)
    table = TickTable(branch, stage, microbatch, in_slot, local_slot, out_unit, recv_slot,
                      pool_base, exchange)
    return table, patterns


def exchange_patterns(end: np.ndarray, j: np.ndarray, src: np.ndarray, num_steps: int,
                      num_devices: int, num_offsets: int, max_patterns: int | None = None
                      ) -> tuple[np.ndarray, tuple[tuple[tuple[int, ...], ...], ...]]:
    """Which devices send over each offset at the end of each step, as pattern numbers.

    A permutation lists only the pairs that carry a message at that step, so a device
    waits for the devices it exchanges with, not for every neighbour whenever anyone
    sends that way (the sync model, :mod:`.sync`). ``end``, ``j``, ``src``: per remote
    message, the step at whose end it moves, its offset index and its sender.
    ``max_patterns``: per offset, keep the most used sender sets and let the other steps
    use every device that ever sends that way (a superset: more meetings, same data).

    Returns ``exchange`` (``[steps, devices, offsets]``: 0, or 1 + the pattern) and, per
    offset, its sender sets.
    """
    senders = np.zeros((num_steps, num_offsets, num_devices), bool)
    senders[end, j, src] = True
    exchange = np.zeros((num_steps, num_devices, num_offsets), np.int32)
    patterns = []
    for jj in range(num_offsets):
        steps = np.flatnonzero(senders[:, jj].any(axis=1))
        rows, first, inverse, count = np.unique(senders[steps, jj], axis=0, return_index=True,
                                                return_inverse=True, return_counts=True)
        inverse = inverse.reshape(-1)
        if max_patterns is not None and len(rows) > max_patterns:
            # the rarest sets share one permutation over every device sending this way
            everyone = rows.any(axis=0)
            keep = np.argsort(-count, kind="stable")[:max_patterns - 1]
            keep = keep[~(rows[keep] == everyone).all(axis=1)]
            remap = np.full(len(rows), len(keep))
            remap[keep] = np.arange(len(keep))
            inverse = remap[inverse]
            first = np.append(first[keep], first[remap == len(keep)].min())
            rows = np.concatenate([rows[keep], everyone[None]])
        order = np.argsort(first, kind="stable")  # number them by first use
        rank = np.empty(len(order), np.int32)
        rank[order] = np.arange(len(order), dtype=np.int32)
        exchange[steps, :, jj] = 1 + rank[inverse][:, None]
        patterns.append(tuple(tuple(int(d) for d in np.flatnonzero(rows[k]))
                              for k in order))
    return exchange, tuple(patterns)


def offset_index(offsets: Sequence[int], offset: np.ndarray) -> np.ndarray:
    """The index in ``offsets`` of every entry of ``offset`` (each one of them)."""
    return np.searchsorted(np.asarray(offsets, np.int64), offset)


def _rank_in_group(key: np.ndarray) -> np.ndarray:
    """For every entry, how many earlier entries have the same key."""
    order = np.argsort(key, kind="stable")
    sorted_key = key[order]
    first = np.searchsorted(sorted_key, sorted_key)  # the start of each entry's group
    rank = np.empty(len(key), np.int64)
    rank[order] = np.arange(len(key)) - first
    return rank
