"""The tick rule of the lowering: when an action may run, given when the others do.

An action runs a tick after its device's previous action and ``delay`` ticks after its
producers on other devices (their outputs move at the end of a tick, or, where the
program sends the previous tick's outbox, during the next one: ``Exchange.delay``); an
action with a partner (a B fused into its F's step, a W in its I's) runs in the
partner's tick. :func:`settle`
applies the rule to a whole wish list of ticks (:func:`.ticks.assign_ticks`);
:func:`resettle` re-applies it from one action on, which is what the local search over
ticks (:mod:`.refine`) does once per move.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxpipe.schedule.graph import ScheduleGraph

__all__ = ["compact", "resettle", "settle", "tick_constraints"]


def settle(graph: ScheduleGraph, want: Sequence[int], partner: np.ndarray,
           delay: int = 1) -> np.ndarray:
    """Each action's tick: ``want``, or later where its device's previous action (one
    tick earlier) or another device's producer (``delay`` ticks earlier) needs it; an
    action with a partner runs in the partner's tick. Empty ticks are dropped."""
    after = tick_constraints(graph, delay)
    return compact(after, resettle(after, list(want), [], 0, partner.tolist()), partner)


def compact(after: Sequence[Sequence[tuple[int, int]]], tick: Sequence[int],
            partner: np.ndarray) -> np.ndarray:
    """Settled ticks from 0 without empty ticks, but those a message in flight needs (a
    producer on another device ``delay`` > 1 ticks before its reader: dropping the tick
    between them would bring them closer)."""
    dense = np.unique(np.asarray(tick, np.int64), return_inverse=True)[1].reshape(-1)
    if all(gap == 1 for deps in after for _, gap in deps):
        return dense
    return np.asarray(resettle(after, dense.tolist(), [], 0, partner.tolist()), np.int64)


def tick_constraints(graph: ScheduleGraph, delay: int = 1) -> list[list[tuple[int, int]]]:
    """Per action, ``(action, gap)``: the actions it must run ``gap`` ticks after at
    least: its device's previous action (1) and its producers on other devices
    (``delay``)."""
    devices, prev, data = graph.devices.tolist(), graph.prev.tolist(), graph.data_deps.tolist()
    return [([(prev[k], 1)] if prev[k] >= 0 else [])
            + [(q, delay) for q in data[k] if q >= 0 and devices[q] != devices[k]]
            for k in range(len(devices))]


def resettle(after: Sequence[Sequence[tuple[int, int]]], want: Sequence[int],
             tick: Sequence[int],
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
        for q, gap in after[k]:
            if tick[q] + gap > t:
                t = tick[q] + gap
        tick[k] = t
    return tick
