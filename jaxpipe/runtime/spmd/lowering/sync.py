"""How long the lowered program takes when devices run concurrently: the sync model.

Devices are not held in a global barrier. Each runs its steps back to back; at the end
of a tick in which messages move, every pair that exchanges a message then meets (the
program's ``ppermute`` over each direction lists only those pairs: a send completes when
the receiver is there, a receive when the sender is). So after a tick, a device's clock
is the latest of its own and those of the devices it sends to or receives from at that
tick (plus the transfer time, if given); a device that exchanges nothing waits for
nobody. The *lowered makespan* is the largest clock at the end; comparing it with the
schedule's own asynchronous makespan (``Schedule.simulate`` with the same costs) gives
the *lowered efficiency*: 1.0 means the one SPMD program loses nothing to lock-step
against an ideal MPMD runtime with free communication.

Costs are per action (kind and stage), e.g. from the cutter
(``CutResult.action_cost``). A full backward that the lowering runs as I then W costs
its halves.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from jaxpipe.runtime.spmd.lowering.types import Lowering, Messages, Ticks
from jaxpipe.schedule import Action, Schedule, Timeline, TimelineEvent
from jaxpipe.schedule.simulate import resolve_costs

__all__ = ["SyncReport", "clock_makespan", "lowered_makespan", "lowered_timeline",
           "lowered_times", "meet", "split_cost", "sync_report", "tick_pairs", "tick_table",
           "ticks_makespan"]

Cost = Callable[[Action], float]


def split_cost(cost: Cost, split: frozenset) -> Cost:
    """Cost of an action the lowering runs: the halves of a split B cost half of B."""

    def f(a: Action) -> float:
        if a.kind in ("I", "W") and (a.stage, a.microbatch) in split:
            return 0.5 * float(cost(Action("B", a.stage, a.microbatch)))
        return float(cost(a))

    return f


def tick_pairs(lowering: Lowering) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per tick, ``(senders, receivers)``: the pairs that exchange a message at its end
    (the pairs its permutations list)."""
    D = lowering.num_devices
    out = [(np.zeros(0, np.int64), np.zeros(0, np.int64))] * lowering.num_ticks
    ex = lowering.table.exchange[:, 0, :]  # same for every device
    for step in np.flatnonzero(ex.any(axis=1)):
        used = [(np.asarray(lowering.perm_patterns[j][k - 1], np.int64), off)
                for j, (k, off) in enumerate(zip(ex[step], lowering.perm_offsets, strict=True))
                if k]
        out[lowering.tick_of_step[step]] = (np.concatenate([s for s, _ in used]),
                                            np.concatenate([(s + off) % D for s, off in used]))
    return out


def meet(clock: np.ndarray, src: np.ndarray, dst: np.ndarray,
         transfer: float = 0.0) -> np.ndarray:
    """Clocks after every pair ``(src[i], dst[i])`` has met (each waits for the other),
    plus ``transfer`` on every device that took part."""
    new = clock.copy()
    np.maximum.at(new, src, clock[dst])
    np.maximum.at(new, dst, clock[src])
    if transfer:
        involved = np.zeros(len(clock), bool)
        involved[src] = involved[dst] = True
        new[involved] += transfer
    return new


def ticks_makespan(ticks: Ticks, messages: Messages, costs: np.ndarray) -> float:
    """The sync model's makespan of a tick assignment before it is lowered to a table
    (``costs``: per action of ``ticks.graph``, as the program runs it): what
    :func:`~.lower.lower` compares tick assignments by. Arrays, one tick at a time
    (at p=64 m=512 several times faster than :func:`clock_makespan`)."""
    D = len(ticks.graph.lists)
    work = np.zeros((ticks.num_ticks, D))
    np.add.at(work, (ticks.tick, ticks.device), costs)
    remote = messages.src != messages.dst
    at = ticks.tick[messages.producer[remote]]
    order = np.argsort(at, kind="stable")
    at, src, dst = at[order], messages.src[remote][order], messages.dst[remote][order]
    bounds = np.searchsorted(at, np.arange(ticks.num_ticks + 1))
    clock = np.zeros(D)
    for t in range(ticks.num_ticks):
        clock += work[t]
        lo, hi = bounds[t], bounds[t + 1]
        if hi > lo:
            clock = meet(clock, src[lo:hi], dst[lo:hi])
    return float(clock.max())


def clock_makespan(tick: Sequence[int], device: Sequence[int], costs: Sequence[float],
                   pairs: Sequence[tuple[int, int, int]], num_devices: int) -> float:
    """:func:`ticks_makespan` from plain lists, for the local search (:mod:`.refine`),
    which calls it once per move: with a few devices and a few pairs per tick, faster
    than array calls, and its ticks need not be dense.

    ``tick``, ``device``, ``costs``: per action (ticks may have gaps or start below 0:
    an empty tick changes nothing). ``pairs``: per message between devices,
    ``(producer, sender, receiver)``; the pair meets at the end of the producer's tick.
    """
    lo = min(tick, default=0)
    T = max(tick, default=-1) + 1 - lo
    work = [[0.0] * num_devices for _ in range(T)]
    for t, d, c in zip(tick, device, costs, strict=True):
        work[t - lo][d] += c
    meets: list[list[tuple[int, int]]] = [[] for _ in range(T)]
    for p, s, r in pairs:
        meets[tick[p] - lo].append((s, r))
    clock = [0.0] * num_devices
    for t in range(T):
        clock = [x + w for x, w in zip(clock, work[t], strict=True)]
        if meets[t]:
            new = list(clock)
            for s, r in meets[t]:  # each waits for the other
                if clock[r] > new[s]:
                    new[s] = clock[r]
                if clock[s] > new[r]:
                    new[r] = clock[s]
            clock = new
    return max(clock, default=0.0)


def lowered_times(lowering: Lowering, cost: Cost, transfer: float = 0.0
                  ) -> dict[Action, tuple[float, float]]:
    """``action -> (start, end)`` of the lowered program under the sync model.

    ``cost(action)`` is the schedule's cost of an action; ``transfer`` is added to every
    device that exchanges a message at a tick's end.
    """
    D = lowering.num_devices
    c = split_cost(cost, lowering.split_backward)
    by_tick: list[list[list[Action]]] = [[[] for _ in range(D)]
                                         for _ in range(lowering.num_ticks)]
    for a, tm in sorted(lowering.actions.items(), key=lambda kv: kv[1].step):
        by_tick[tm.tick][tm.device].append(a)
    pairs = tick_pairs(lowering)
    clock = np.zeros(D)
    out = {}
    for t in range(lowering.num_ticks):
        for d in range(D):
            for a in by_tick[t][d]:
                out[a] = (float(clock[d]), float(clock[d]) + c(a))
                clock[d] += c(a)
        src, dst = pairs[t]
        if len(src):
            clock = meet(clock, src, dst, transfer)
    return out


def lowered_makespan(lowering: Lowering, cost: Cost, transfer: float = 0.0) -> float:
    """Makespan of the lowered program under the sync model (see the module docstring)."""
    times = lowered_times(lowering, cost, transfer)
    return max((end for _, end in times.values()), default=0.0)


def lowered_timeline(lowering: Lowering, cost: Cost, transfer: float = 0.0) -> Timeline:
    """The lowered program as a :class:`~jaxpipe.schedule.Timeline` (for plots, traces)."""
    times = lowered_times(lowering, cost, transfer)
    events = [TimelineEvent(lowering.actions[a].device, a, start, end)
              for a, (start, end) in times.items()]
    return Timeline(events, lowering.num_devices, title="lowered program (sync model)")


def tick_table(lowering: Lowering, max_ticks: int | None = None) -> str:
    """One row per device, one column per tick: the actions that share each tick."""
    D = lowering.num_devices
    cells = [[""] * lowering.num_ticks for _ in range(D)]
    for a, tm in sorted(lowering.actions.items(), key=lambda kv: kv[1].step):
        cells[tm.device][tm.tick] += str(a) if not cells[tm.device][tm.tick] else f"+{a}"
    T = lowering.num_ticks if max_ticks is None else min(max_ticks, lowering.num_ticks)
    width = max((len(x) for row in cells for x in row[:T]), default=1)
    head = "tick  " + " ".join(f"{t:<{width}}" for t in range(T))
    rows = [head] + [f"dev {d:<2}" + " ".join(f"{(x or '.'):<{width}}" for x in cells[d][:T])
                     for d in range(D)]
    if T < lowering.num_ticks:
        rows.append(f"... {lowering.num_ticks - T} more ticks")
    return "\n".join(rows)


@dataclass(frozen=True)
class SyncReport:
    """The lowered program's time against the schedule's own.

    Attributes:
      async_makespan: ``schedule.simulate(cost).makespan`` (devices wait only for data).
      lowered_makespan: the lowered program's under the sync model.
      efficiency: ``async_makespan / lowered_makespan`` (1.0: nothing lost).
      num_ticks, num_steps: of the lowered program.
      split_backward: how many full backwards run as I then W.
    """

    async_makespan: float
    lowered_makespan: float
    efficiency: float
    num_ticks: int
    num_steps: int
    split_backward: int

    def summary(self) -> str:
        split = (f", {self.split_backward} backwards run as I+W" if self.split_backward
                 else "")
        return (f"lowered efficiency {self.efficiency:.3f} (async makespan "
                f"{self.async_makespan:.4g} / lowered {self.lowered_makespan:.4g}; "
                f"{self.num_ticks} ticks, {self.num_steps} steps{split})")


def sync_report(schedule: Schedule, lowering: Lowering, cost: Cost | None = None,
                transfer: float = 0.0, *, async_makespan: float | None = None) -> SyncReport:
    """Compare the lowered program with the schedule's asynchronous makespan.

    ``cost``: per action; default F=1, B=2, I=W=1. ``async_makespan``:
    ``schedule.simulate(cost).makespan`` when the caller has already simulated it.
    """
    cost = resolve_costs(cost)
    if async_makespan is None:
        async_makespan = schedule.simulate(cost).makespan
    asyn = float(async_makespan)
    low = lowered_makespan(lowering, cost, transfer)
    return SyncReport(asyn, low, asyn / low if low else 1.0, lowering.num_ticks,
                      lowering.num_steps, len(lowering.split_backward))
