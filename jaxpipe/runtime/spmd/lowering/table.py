"""The static table the SPMD program scans: one row of integer fields per (step, device).

Step 5 of the lowering (:mod:`.lower`): given when every action runs, the messages
between actions and where the buffers keep them, :func:`fill_table` writes which branch
each device runs at each step and every slot it reads or writes.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import numpy as np

from jaxpipe.runtime.spmd.lowering.tick_table import IDLE, PROGRAM_KINDS, TickTable
from jaxpipe.runtime.spmd.lowering.types import Allocation, Messages, Pool, Ticks

__all__ = ["exchange_patterns", "fill_table", "offset_index"]

_KIND = {kind: i for i, kind in enumerate(PROGRAM_KINDS)}  # kind -> its index

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
    p_step = ticks.step[messages.producer]
    local = messages.src == messages.dst
    local_slot[p_step[local], messages.src[local]] = slot[local]
    # a message to another device goes out in unit r of its direction: the r-th message its
    # device sends that way in the exchange that moves it (none waits across another)
    remote = np.flatnonzero(~local)
    src, dst = messages.src[remote], messages.dst[remote]
    j = offset_index(perm_offsets, (dst - src) % D)
    end = messages.sent[remote]  # the step at whose end it arrives
    r = _rank_in_group((end * D + src) * len(perm_offsets) + j)
    out_unit[p_step[remote], src, j] = r
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
