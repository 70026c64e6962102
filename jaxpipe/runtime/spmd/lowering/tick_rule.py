"""The tick rule of the lowering: when an action may run, given when the others do.

An action runs a tick after its device's previous action and after its producers on
other devices (their outputs move at the end of a tick); an action with a partner (a B
fused into its F's step, a W in its I's) runs in the partner's tick. :func:`settle`
applies the rule to a whole wish list of ticks (:func:`.ticks.assign_ticks`);
:func:`resettle` re-applies it from one action on, which is what the local search over
ticks (:mod:`.refine`) does once per move.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxpipe.schedule.graph import ScheduleGraph

__all__ = ["resettle", "settle", "tick_constraints"]


def settle(graph: ScheduleGraph, want: Sequence[int], partner: np.ndarray) -> np.ndarray:
    """Each action's tick: ``want``, or later where its device's previous action (one
    tick earlier) or another device's producer (one tick earlier) needs it; an action
    with a partner runs in the partner's tick. Empty ticks are dropped."""
    tick = resettle(tick_constraints(graph), list(want), [], 0, partner.tolist())
    return np.unique(np.asarray(tick, np.int64), return_inverse=True)[1].reshape(-1)


def tick_constraints(graph: ScheduleGraph) -> list[list[int]]:
    """Per action, the actions it must run a tick after: its device's previous action and
    its producers on other devices."""
    devices, prev, data = graph.devices.tolist(), graph.prev.tolist(), graph.data_deps.tolist()
    return [([prev[k]] if prev[k] >= 0 else [])
            + [q for q in data[k] if q >= 0 and devices[q] != devices[k]]
            for k in range(len(devices))]


def resettle(after: Sequence[Sequence[int]], want: Sequence[int], tick: Sequence[int],
             first: int, partner: Sequence[int] | None = None) -> list[int]:
    """:func:`settle` before empty ticks are dropped, from action ``first`` on: ``tick``
    holds the settled ticks of the actions before it (graph order puts producers and
    device predecessors first, so they do not change). ``after``: from
    :func:`tick_constraints`."""
    tick = list(tick[:first]) + [0] * (len(want) - first)
    for k in range(first, len(want)):
        if partner is not None and partner[k] != k:
            tick[k] = tick[partner[k]]
            continue
        t = want[k]
        for q in after[k]:
            if tick[q] >= t:
                t = tick[q] + 1
        tick[k] = t
    return tick
