"""Liveness of residual sets: when a (stage, microbatch) holds memory, and the peak.

A (stage, microbatch) *unit* stores its residuals from its forward ``F`` until its
last backward action: ``B``, or ``W`` when the backward is split (``I`` still reads
them). The simulator counts peaks with these two helpers along each device's action
order; the lowering sizes its buffers with them along its ticks. Any orderable
position works as time (list index, tick, simulated time)::

    lifetimes = unit_lifetimes((a, pos) for pos, a in enumerate(actions))
    peak = peak_overlap(lifetimes.values())
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

from .action import Action

__all__ = ["unit_lifetimes", "peak_overlap"]

#: A (stage, microbatch) pair.
Unit = tuple[int, int]

T = TypeVar("T")


def unit_lifetimes(events: Iterable[tuple[Action, T]]) -> dict[Unit, tuple[T, T]]:
    """Per (stage, microbatch): ``(time of its F, time of its last backward action)``.

    ``events`` are the ``(action, time)`` pairs of one device. The last backward
    action is the unit's ``B``, or its ``W`` when the backward is split; ``I``
    does not end a lifetime. A unit whose backward is missing (only possible in an
    unvalidated schedule) lives until the last time in ``events``. Units are listed
    in the order of their forwards.
    """
    start: dict[Unit, T] = {}
    end: dict[Unit, T] = {}
    last: Any = None
    for action, time in events:
        last = time
        unit = (action.stage, action.microbatch)
        if action.kind == "F":
            start[unit] = time
        elif action.kind in ("B", "W"):
            end[unit] = time
    return {unit: (t, end.get(unit, last)) for unit, t in start.items()}


def peak_overlap(intervals: Iterable[tuple[Any, Any]]) -> int:
    """The most closed intervals ``[start, end]`` that contain one point (0 if none).

    Intervals that touch (one ends at the time the next starts) count as overlapping.
    """
    intervals = list(intervals)
    if intervals and all(type(a) is int and type(b) is int for a, b in intervals):
        # integer positions (steps, list indices): vectorised, for schedules at scale
        import numpy as np

        iv = np.asarray(intervals, np.int64)
        times = np.concatenate([iv[:, 0], iv[:, 1]])
        closes = np.concatenate([np.zeros(len(iv), np.int64), np.ones(len(iv), np.int64)])
        order = np.lexsort((closes, times))  # at equal times, opens before closes
        return int(np.cumsum(1 - 2 * closes[order]).max())
    points = []
    for start, end in intervals:
        points.append((start, 0))  # at equal times, opens sort before closes
        points.append((end, 1))
    points.sort(key=lambda point: (point[0], point[1]))
    live = peak = 0
    for _, closes in points:
        live += -1 if closes else 1
        peak = max(peak, live)
    return peak
