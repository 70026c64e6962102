"""Lower a schedule to lanes: every tick runs a forward lane, then a backward lane.

The lanes program (:mod:`..program.lane_ticks`) runs the stages' compute with no
conditional around it: where every stage is one shared body (repeated ``jp.layer``
blocks, the embedding and head as its first and last members' prologue and epilogue),
each tick runs that body's forward once and then its backward once, on every device, on
the microbatch the table names (or on nothing, its writes dropped, where the device's
lane is idle). The FSDP all-gathers and tensor-parallel reductions XLA puts inside a
stage then run on every device together, outside any conditional, where XLA can schedule
them against the rest of the tick (MaxText's pipeline does the same for its one
repeated layer).

:func:`assign_lanes` gives every action its tick: each device takes, in its own order,
its next action if its inputs exist, and then the one after if it runs in the other lane
and its inputs exist too; a forward runs before the backward of its tick (the last stage
runs a microbatch's F and B in one tick). A message moves at the end of its tick, one
per device and lane. In 1F1B's steady state a tick holds one F and one B on every device,
as the schedule does; :func:`lane_segments` marks the fill (no backward anywhere yet)
and the drain (no forward left) as runs of one lane only, which the program scans
without the other lane, so it runs no masked work there either.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from jaxpipe.runtime.spmd.lowering.allocate import allocate
from jaxpipe.runtime.spmd.lowering.lower import lowering_of
from jaxpipe.runtime.spmd.lowering.messages import list_messages
from jaxpipe.runtime.spmd.lowering.types import (
    ACCELERATOR_EXCHANGE,
    Lowering,
    Messages,
    Pool,
    Ticks,
)
from jaxpipe.schedule import Action, Schedule
from jaxpipe.schedule.graph import KB, KF, ScheduleGraph, paused_gc

__all__ = ["Segment", "assign_lanes", "lane_offsets", "lane_segments", "lanes_in_flight",
           "lanes_makespan", "lanes_refusal", "lower_lanes"]

#: Lane of each action kind the lanes program runs (F, B).
F_LANE, B_LANE = 0, 1

#: assign_lanes per schedule graph (cached on the schedule, like the graph itself): the
#: refusal check, the in-flight counts, the predicted time and the lowering all read it
_TICKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Segment:
    """Ticks ``start`` to ``stop`` (exclusive), with the lanes ``lanes`` busy on some
    device: the program scans them with those lanes only."""

    start: int
    stop: int
    lanes: tuple[int, ...]


def lanes_refusal(schedule: Schedule, body_of_stage: Sequence[int],
                  split_backward: bool) -> str | None:
    """Why ``schedule`` cannot run as lanes (``None``: it can): its stages must be one
    body, its actions F and B only, and each lane's messages must go one way."""
    if len(set(body_of_stage)) != 1:
        return (f"its stages are {len(set(body_of_stage))} distinct bodies, not one "
                "shared body (stages differ by more than their parameters)")
    kinds = set(np.unique(schedule.graph().kinds).tolist())
    if split_backward or kinds - {KF, KB}:
        return "it splits backwards into I and W (the lanes run F and B)"
    if lane_offsets(assign_lanes(schedule), schedule.num_devices) is None:
        return ("a lane's messages go both ways (a V placement: the lanes send one "
                "permutation each)")
    return None


def assign_lanes(schedule: Schedule) -> Ticks:
    """Every action's tick and lane (its step: ``2 * tick + lane``); see the module
    docstring. Computed once per schedule; the arrays are read-only."""
    graph = schedule.graph()
    if graph not in _TICKS:
        _TICKS[graph] = _assign(graph)
    return _TICKS[graph]


def _assign(graph: ScheduleGraph) -> Ticks:
    n = len(graph.actions)
    index = {a: i for i, a in enumerate(graph.actions)}
    order = [[index[a] for a in graph.lists[d]] for d in sorted(graph.lists)]
    kinds = graph.kinds.tolist()
    if set(kinds) - {KF, KB}:
        raise ValueError("the lanes program runs F and B actions only")
    lane = [F_LANE if k == KF else B_LANE for k in kinds]
    deps = [[int(p) for p in row if p >= 0] for row in graph.data_deps]
    device = graph.devices.tolist()
    tick = [-1] * n
    at = [0] * len(order)
    left, t, idle = n, 0, 0
    while left:
        progress = False
        for d, mine in enumerate(order):
            used: set[int] = set()
            while at[d] < len(mine):
                i = mine[at[d]]
                if lane[i] in used or not all(
                        tick[p] >= 0 and (tick[p] < t or (device[p] == d and tick[p] == t
                                                          and lane[p] < lane[i]))
                        for p in deps[i]):
                    break
                tick[i], at[d] = t, at[d] + 1
                used.add(lane[i])
                left -= 1
                progress = True
        idle = 0 if progress else idle + 1
        if idle > 1:  # nothing ran for two ticks: only a cycle can wait forever
            raise ValueError("the schedule cannot run as lanes (an action waits on one "
                             "that runs after it in its lane)")
        t += 1
    tick_arr = np.asarray(tick, np.int64)
    # drop ticks where nothing runs (a message arrives at the end of the tick anyway)
    used_ticks = np.unique(tick_arr)
    tick_arr = np.searchsorted(used_ticks, tick_arr)
    step = 2 * tick_arr + np.asarray(lane, np.int64)
    T = len(used_ticks)
    arrays = (tick_arr, step, 2 * np.arange(T, dtype=np.int64) + 1, np.zeros(n, bool))
    for a in arrays:
        a.flags.writeable = False
    return Ticks(graph, graph.devices, *arrays)


def lane_offsets(ticks: Ticks, num_devices: int, messages: Messages | None = None
                 ) -> tuple[int | None, int | None] | None:
    """Per lane, the one offset (``(dst - src) % devices``) its messages to another device
    go (``None``: it sends none); ``None`` where a lane sends two ways. ``messages``:
    the ticks' (:func:`~.messages.list_messages`), if the caller has them."""
    messages = list_messages(ticks) if messages is None else messages
    remote = messages.src != messages.dst
    lane = ticks.step[messages.producer[remote]] % 2
    off = (messages.dst - messages.src)[remote] % num_devices
    out: list[int | None] = []
    for k in (F_LANE, B_LANE):
        ways = np.unique(off[lane == k])
        if len(ways) > 1:
            return None
        out.append(int(ways[0]) if len(ways) else None)
    return out[0], out[1]


def lower_lanes(schedule: Schedule,
                pool_counts: Mapping[Pool, Sequence[Mapping[Hashable, int]]],
                body_of_stage: Sequence[int] | None = None) -> Lowering:
    """The lowering of ``schedule`` for the lanes program: steps ``2t`` (forward lane) and
    ``2t + 1`` (backward lane) of every tick ``t``, buffers sized by liveness as
    :func:`~.lower.lower`'s, messages moved at every tick's end."""
    with paused_gc():
        schedule.graph()
        S = schedule.num_stages
        if body_of_stage is None:
            body_of_stage = [0] * S
        ticks = assign_lanes(schedule)
        messages = list_messages(ticks)
        if lane_offsets(ticks, schedule.num_devices, messages) is None:
            raise ValueError("a lane's messages go both ways; see lanes_refusal")
        counts = {pool: list(pool_counts.get(pool) or [{} for _ in range(S)]) for pool in Pool}
        alloc = allocate(ticks, messages, counts)
        return lowering_of(schedule, ticks, messages, alloc, counts, body_of_stage,
                           min(4 * schedule.num_devices + 4, 64), frozenset(),
                           ACCELERATOR_EXCHANGE)


def lane_segments(ticks: Ticks) -> list[Segment]:
    """Maximal runs of ticks with the same lanes busy on some device (a tick with none
    busy, which :func:`assign_lanes` never makes, would count as a forward one)."""
    busy = np.zeros((ticks.num_ticks, 2), bool)
    busy[ticks.tick, ticks.step % 2] = True
    out: list[Segment] = []
    for t in range(ticks.num_ticks):
        lanes = tuple(k for k in (F_LANE, B_LANE) if busy[t, k]) or (F_LANE,)
        if out and out[-1].lanes == lanes:
            out[-1] = Segment(out[-1].start, t + 1, lanes)
        else:
            out.append(Segment(t, t + 1, lanes))
    return out


def lanes_makespan(lowering: Lowering, cost: Callable[[Action], float]) -> float:
    """The lanes program's time under per-action ``cost``: every device runs each lane of
    a tick's segment (busy or masked) at that lane's cost, the costliest action of its
    kind (the shared body, with the prologue and epilogue it runs on every device), and
    waits for the others at the tick's end."""
    ticks = lowering.ticks
    lane = ticks.step % 2
    costs = np.array([cost(a) for a in ticks.graph.actions], np.float64)
    lane_cost = [float(costs[lane == k].max(initial=0.0)) for k in (F_LANE, B_LANE)]
    return sum((seg.stop - seg.start) * sum(lane_cost[k] for k in seg.lanes)
               for seg in lane_segments(ticks))


def lanes_in_flight(schedule: Schedule, split_backward: bool = False) -> list[int] | None:
    """Per stage, the most microbatches whose forward ran and whose backward has not, in
    the lanes' steps (a forward before its tick's backward); ``None`` where the schedule
    cannot run as lanes (its stages' bodies aside)."""
    if lanes_refusal(schedule, [0] * schedule.num_stages, split_backward) is not None:
        return None
    ticks = assign_lanes(schedule)
    g = ticks.graph
    order = np.argsort(ticks.step, kind="stable")
    live = np.zeros(schedule.num_stages, np.int64)
    peak = np.zeros(schedule.num_stages, np.int64)
    for i in order:
        s = g.stages[i]
        live[s] += 1 if g.kinds[i] == KF else -1
        peak[s] = max(peak[s], live[s])
    return [int(x) for x in peak]
