"""Step 4 of the lowering: liveness-sized buffer slots for stored values and messages.

A stored value lives from the step that writes it to its last reader's step; a message
from its arrival to the step that reads it. Slots are assigned first-fit in order of the
first step (:func:`first_fit`), so a buffer has as many slots as are live at once on the
busiest device. Everything is read from the integer arrays of the ticks and messages
(:mod:`.types`), so a 64-device, 512-microbatch schedule allocates in well under a
second.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Mapping, Sequence

import numpy as np

from jaxpipe.runtime.spmd.lowering.types import Allocation, Messages, Pool, Ticks
from jaxpipe.schedule.graph import grouped_peaks

__all__ = ["allocate", "first_fit"]


def _first_fit(intervals: Sequence[tuple[int, int, int, object]]) -> tuple[dict, int]:
    """Offsets for ``(start, end, size, key)`` values live over steps ``(start, end]``.

    A value is written by (or at the end of) step ``start`` and last read at step
    ``end``, so two values may share slots when one is last read in the step whose action
    writes the other: the program finishes an action's reads before its writes.
    """
    placed: list[tuple[int, int, int, int]] = []  # (start, end, offset, size), still live
    offsets = {}
    top = 0
    for start, end, size, key in sorted(intervals, key=lambda iv: (iv[0], -iv[2])):
        if size == 0:
            offsets[key] = 0
            continue
        # starts only grow: a value last read at or before this start never overlaps again
        placed = [iv for iv in placed if iv[1] > start]
        busy = sorted((o, o + s) for (a, b, o, s) in placed if a < end)
        off = 0
        for lo, hi in busy:
            if off + size <= lo:
                break
            off = max(off, hi)
        offsets[key] = off
        placed.append((start, end, off, size))
        top = max(top, off + size)
    return offsets, top


def first_fit(start: np.ndarray, end: np.ndarray, size: np.ndarray) -> tuple[np.ndarray, int]:
    """:func:`_first_fit` of values ``i`` (arrays): ``(offset per value, slots used)``.

    Values of size 1 that outlive the step they start in (every message; the stored values
    of most schedules) take the lowest free slot from a heap, which is what first-fit
    picks for them; anything else runs the general first-fit.
    """
    n = len(start)
    offsets = np.zeros(n, np.int64)
    if n == 0:
        return offsets, 0
    if size.max() > 1 or not (start < end)[size > 0].all():
        off, top = _first_fit(list(zip(start.tolist(), end.tolist(), size.tolist(), range(n),
                                       strict=True)))
        offsets[:] = [off[i] for i in range(n)]
        return offsets, top
    order = np.lexsort((-size, start))  # stable: sorted by (start, -size)
    live: list[tuple[int, int]] = []  # (end, offset) of placed values
    free: list[int] = []  # offsets below `top` that no live value holds
    top = 0
    out = [0] * n
    ends, starts, sizes = end.tolist(), start.tolist(), size.tolist()
    for i in order.tolist():
        if not sizes[i]:
            continue
        s = starts[i]
        while live and live[0][0] <= s:  # last read at or before this start: free again
            heapq.heappush(free, heapq.heappop(live)[1])
        if free:
            off = heapq.heappop(free)
        else:
            off, top = top, top + 1
        out[i] = off
        heapq.heappush(live, (ends[i], off))
    offsets[:] = out
    return offsets, top


_KIND = {"F": 0, "B": 1, "I": 2, "W": 3}  # index in ACTION_KINDS


def allocate(ticks: Ticks, messages: Messages,
             pool_counts: Mapping[Pool, Sequence[Mapping[Hashable, int]]]) -> Allocation:
    """Liveness-sized slots for stored values (per class) and messages (per device).

    ``pool_counts[pool][stage]`` gives, per class, the slots one microbatch of ``stage``
    keeps in ``pool``. All pools of a class share one buffer: parts freed early (I-only
    residuals) make room for others, so its size is the peak of what is live at once.
    (The runtime gives the hand-off classes of their own, ``ValueClass.buffer``.)
    """
    graph = ticks.graph
    n = len(graph.actions)
    D = 1 + int(ticks.device.max()) if n else 0
    D = max(D, len(graph.lists))
    # 1. Per unit (stage, mb), the action index and step of each kind (-1: none); units
    #    in the order of their forwards.
    m = int(graph.microbatches.max()) + 1 if n else 1
    unit = graph.stages * m + graph.microbatches
    n_units = int(unit.max()) + 1 if n else 0
    index = np.full((4, n_units), -1, np.int64)
    index[graph.kinds, unit] = np.arange(n)
    step = np.where(index >= 0, ticks.step[np.maximum(index, 0)], -1)
    units = np.flatnonzero(index[0] >= 0)
    units = units[np.argsort(index[0, units], kind="stable")]
    # a unit whose B runs in its F's step (ticks.fused) stores nothing
    b_of = index[_KIND["B"], units]
    stores = ~((b_of >= 0) & ticks.fused[np.maximum(b_of, 0)])
    units = units[stores]
    # a unit whose W runs in its I's step writes and reads its hand-off within that step
    # (the core passes its own straight on; a shared core's prologue and epilogue store
    # theirs): live during the step, so it shares slots with no value live then
    w_of = index[_KIND["W"], units]
    joined = (w_of >= 0) & ticks.fused[np.maximum(w_of, 0)]
    unit_device = ticks.device[index[0, units]]
    unit_stage = units // m
    # residual sets live from F to the last backward action (the simulator's count)
    peaks = grouped_peaks(unit_device, step[0, units], step[1:, units].max(axis=0), D)

    # 2. One value per (unit, pool) whose writer runs: live from the writer's step to its
    #    last reader's, listed by unit then pool; per class, first-fit on each device.
    classes = sorted({c for counts in pool_counts.values() for row in counts for c in row},
                     key=repr)
    base = {(pool, c): np.full(n, -1, np.int64) for pool in Pool for c in classes}
    slots = dict.fromkeys(classes, 0)
    per_device: list[dict[Hashable, int]] = [{} for _ in range(D)]
    if classes:
        rows = []  # per pool: (unit position, pool, start, end) of its values
        for pool in Pool:
            w = _KIND[pool.writer]
            has = step[w, units] >= 0
            readers = step[[_KIND[r] for r in pool.readers]][:, units]
            last = np.maximum(readers.max(axis=0), step[w, units])
            first = step[w, units] - (joined if pool is Pool.HANDOFF else 0)
            at = np.flatnonzero(has)
            rows.append((at, np.full(len(at), int(pool)), first[at], last[at]))
        at, pools, start, end = (np.concatenate(col) for col in zip(*rows, strict=True))
        order = np.lexsort((pools, at, unit_device[at]))  # by device, then unit, then pool
        at, pools, start, end = at[order], pools[order], start[order], end[order]
        dev = unit_device[at]
        bounds = np.searchsorted(dev, np.arange(D + 1))
        for c in classes:
            table = np.array([[row.get(c, 0) for row in pool_counts[pool]] for pool in Pool],
                             np.int64).reshape(len(Pool), -1)
            size = table[pools, unit_stage[at]] if table.size else np.zeros(len(at), np.int64)
            offset = np.zeros(len(at), np.int64)
            for d in range(D):
                lo, hi = bounds[d], bounds[d + 1]
                offset[lo:hi], top = first_fit(start[lo:hi], end[lo:hi], size[lo:hi])
                slots[c] = max(slots[c], top)
                per_device[d][c] = top
            for pool in Pool:
                mine = (pools == int(pool)) & (size > 0)
                for kind in (pool.writer, *pool.readers):
                    acts = index[_KIND[kind], units[at[mine]]]
                    base[(pool, c)][acts[acts >= 0]] = offset[mine][acts >= 0]

    # 3. Messages, per receiving device. One to another device arrives at the end of step
    #    `sent`; one from the same device is written *during* step `sent`, so it must not
    #    share with a message read in that step (start one step earlier).
    message_slot = np.zeros(len(messages), np.int64)
    num_inbox = 0
    start = messages.sent - (messages.src == messages.dst)
    ones = np.ones(len(messages), np.int64)
    for d in range(D):
        idx = np.flatnonzero(messages.dst == d)
        message_slot[idx], top = first_fit(start[idx], messages.read[idx], ones[idx])
        num_inbox = max(num_inbox, top)
    return Allocation(base, slots, tuple(per_device), message_slot, num_inbox, tuple(peaks))
