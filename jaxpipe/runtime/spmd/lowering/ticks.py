"""Steps 1 and 2 of the lowering: which actions the program runs, and in which tick.

1. :func:`expand` -- the actions the program runs: the schedule's own, with a full
   backward ``B`` optionally run as its two halves ``I`` then ``W`` (same device, same
   order, same memory; only the work per step changes).
2. :func:`assign_ticks` -- when every action runs: its tick, and its step within the
   tick (a tick may hold several actions of one device; they run one per step).
   Messages move at the end of a tick: an action reads another device's output only
   from an earlier tick, and its own device's outputs from any earlier step. Given
   per-action costs, ticks follow the simulation with those costs instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jaxpipe.runtime.spmd.lowering.fusion import (
    fused_backwards,
    joined_weights,
    w_after_own_i,
)
from jaxpipe.runtime.spmd.lowering.tick_rule import settle
from jaxpipe.runtime.spmd.lowering.types import Ticks
from jaxpipe.schedule import Action, Schedule
from jaxpipe.schedule.graph import ScheduleGraph

__all__ = ["assign_ticks", "expand", "ticks_of"]


class _Expanded(Schedule):
    """``base`` with the backward of ``split`` units run as I then W."""

    def __init__(self, base: Schedule, split: frozenset[tuple[int, int]]) -> None:
        super().__init__(base.num_devices, base.num_microbatches, base.stages_per_device)
        self._base, self._split = base, split

    def placement(self, stage: int) -> int:
        return self._base.placement(stage)

    def device_actions(self, device: int) -> list[Action]:
        out = []
        for a in self._base.graph().lists[device]:
            if a.kind == "B" and (a.stage, a.microbatch) in self._split:
                out += [Action("I", a.stage, a.microbatch), Action("W", a.stage, a.microbatch)]
            else:
                out.append(a)
        return out


def expand(schedule: Schedule, split_backward: bool) -> tuple[Schedule, frozenset]:
    """The schedule the program runs, and the units whose B it runs as I then W."""
    if not split_backward:
        return schedule, frozenset()
    units = frozenset((a.stage, a.microbatch) for a in schedule.graph().actions
                      if a.kind == "B")
    if not units:  # nothing to split (a forward-only schedule, say)
        return schedule, units
    return _Expanded(schedule, units), units


def assign_ticks(schedule: Schedule, iw_same_tick: bool = False,
                 fuse_fb: bool = False, costs: Sequence[float] | None = None,
                 nearest: bool = False, delay: int = 1) -> Ticks:
    """One action per device per tick, ticks from the unit-cost simulation's start times
    (each device runs its actions in order, each as soon as its inputs exist).

    ``iw_same_tick``: a W that directly follows its own I on a device runs in the I's
    tick (the tick's messages, the I's cotangent among them, move after both): in the
    I's step where :func:`~.fusion.joined_weights` allows (the hand-off passed straight
    on), else as the tick's second step. Fewer ticks, and fewer steps where joined.

    ``fuse_fb``: the B actions :func:`fused_backwards` picks run in their F's step.

    ``costs`` (per action of ``schedule.graph()``): ticks from the simulation with these
    costs instead, in steps of the cheapest action: an action's tick is its start time
    over that step (rounded down, or to the nearest with ``nearest``), or later where
    its device's previous action or another device's producer needs it (then empty ticks
    are dropped). Devices with cheap actions then run ahead in ticks, as they would in
    time.

    ``delay``: ticks from a producer to a reader on another device (``Exchange.delay``):
    with 2, every action runs as early as the tick rule allows (:func:`.tick_rule.settle`).
    """
    graph = schedule.graph()
    n = len(graph.actions)
    partner = np.arange(n)
    packed = np.zeros(n, bool)
    fused = fused_backwards(graph) if fuse_fb else np.zeros(n, bool)
    if fused.any():
        partner[fused] = graph.prev[fused]
    if iw_same_tick:
        # a W right after its own I: in the I's step (joined, whole stages) or the tick's
        # second step (packed)
        after_i, joined = w_after_own_i(graph), joined_weights(graph)
        fused = fused | joined
        packed = after_i & ~joined
        partner[after_i] = graph.prev[after_i]
    merged = packed | fused
    if costs is None and delay == 1:
        starts, _ = graph.run_costs(np.where(merged, 0, 1).tolist())
        tick = np.array(starts, np.int64)[partner]
    elif costs is None:
        tick = settle(graph, [0] * n, partner, delay)
    else:
        tick = _cost_grid(graph, np.asarray(costs, np.float64), merged, partner, nearest,
                          delay)
    return ticks_of(graph, tick, packed, fused)


def ticks_of(graph: ScheduleGraph, tick: np.ndarray, packed: np.ndarray,
             fused: np.ndarray) -> Ticks:
    """:class:`Ticks` from each action's tick: a tick's steps are one per action, and a
    second for a ``packed`` W after its I; a ``fused`` B shares its F's step."""
    sub = packed.astype(np.int64)
    n_ticks = int(tick.max()) + 1 if len(tick) else 0
    per_tick = np.ones(n_ticks, np.int64)
    np.maximum.at(per_tick, tick, sub + 1)
    first = np.concatenate([[0], np.cumsum(per_tick)[:-1]]).astype(np.int64)
    return Ticks(graph, graph.devices, tick, first[tick] + sub,
                 first + per_tick - 1, fused)


def _cost_grid(graph: ScheduleGraph, costs: np.ndarray, merged: np.ndarray,
               partner: np.ndarray, nearest: bool, delay: int) -> np.ndarray:
    """Ticks from the simulation with ``costs`` (see :func:`assign_ticks`)."""
    costs = np.where(merged, 0.0, costs)
    starts, _ = graph.run_costs(costs.tolist())
    positive = costs[costs > 0]
    step = positive.min() if len(positive) else 1.0
    at = np.asarray(starts) / step
    grid = (np.round(at) if nearest else np.floor(at + 1e-9)).astype(np.int64).tolist()
    return settle(graph, grid, partner, delay)
