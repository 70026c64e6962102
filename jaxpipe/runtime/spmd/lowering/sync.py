"""How long the lowered program takes when devices run concurrently: the sync model.

Devices are not held in a global barrier. Each runs its steps back to back, and a
collective-permute is where two devices wait for each other (a send completes when the
receiver is there, a receive when the sender is). How often pairs meet is the program's
:class:`~.types.Exchange`:

- the CPU program (``every_tick=False``): at the end of a tick in which messages move,
  only the pairs that exchange a message then meet (its ``ppermute`` over each direction
  lists only those pairs); a device that exchanges nothing waits for nobody. Where its
  devices run concurrently the exchange is lazy (``Exchange.lazy``): messages between
  two devices move together, so pairs meet at as few tick ends as their readers allow
  (:func:`~.messages.merge_exchanges`);
- the accelerator program (``every_tick=True``): every tick ends with one unconditional
  permutation per direction over the fixed pairs, so every device meets its neighbours
  every tick. With ``delay=1`` the permutation sends what the tick computed: a device's
  tick ends when it and its partners have finished computing (plus the transfer). With
  ``delay=2`` it sends the previous tick's outbox, starting with the tick: it overlaps
  the compute, and a tick ends at the later of the device's compute and the transfer,
  which starts once the device and its partners have started the tick.

A device's time in a tick is all it computes there (in the accelerator program one
branch runs per tick; an idle device computes nothing). The *lowered makespan* is the
largest clock at the end; comparing it with the schedule's own asynchronous makespan
(``Schedule.simulate`` with the same costs) gives the *lowered efficiency*: 1.0 means
the one SPMD program loses nothing to lock-step against an ideal MPMD runtime with free
communication.

Costs are per action (kind and stage), e.g. from the cutter
(``CutResult.action_cost``). A full backward that the lowering runs as I then W costs
its halves.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from jaxpipe.runtime.spmd.lowering.messages import meeting_points
from jaxpipe.runtime.spmd.lowering.types import (
    CPU_EXCHANGE,
    Exchange,
    Lowering,
    Messages,
    Ticks,
)
from jaxpipe.schedule import Action, Schedule, Timeline, TimelineEvent
from jaxpipe.schedule.simulate import resolve_costs

__all__ = ["SyncReport", "advance", "clock_makespan", "fixed_pairs", "lowered_makespan",
           "lowered_timeline", "lowered_times", "meet", "split_cost", "sync_report",
           "tick_pairs", "tick_table", "ticks_makespan"]

Cost = Callable[[Action], float]


def split_cost(cost: Cost, split: frozenset) -> Cost:
    """Cost of an action the lowering runs: the halves of a split B cost half of B."""

    def f(a: Action) -> float:
        if a.kind in ("I", "W") and (a.stage, a.microbatch) in split:
            return 0.5 * float(cost(Action("B", a.stage, a.microbatch)))
        return float(cost(a))

    return f


def fixed_pairs(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct ``(sender, receiver)`` pairs of messages between devices: those the
    accelerator program's permutations list every tick."""
    pairs = np.unique(np.stack([src, dst], axis=1).reshape(-1, 2), axis=0)
    return pairs[:, 0], pairs[:, 1]


def tick_pairs(lowering: Lowering) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per tick, ``(senders, receivers)``: the pairs that meet at its end (the pairs its
    permutations list)."""
    D = lowering.num_devices
    if lowering.exchange.every_tick:
        return [lowering.fixed_pairs] * lowering.num_ticks
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


def advance(clock: np.ndarray, work: np.ndarray, src: np.ndarray, dst: np.ndarray,
            exchange: Exchange, transfer: float = 0.0) -> np.ndarray:
    """Clocks after one tick: every device computes ``work``, then the pairs ``(src[i],
    dst[i])`` meet as ``exchange`` says (see the module docstring)."""
    end = clock + work
    if not len(src):
        return end
    if not exchange.every_tick or exchange.delay == 1:
        return meet(end, src, dst, transfer)
    # the permutation of the previous tick's outbox runs alongside the compute
    return np.maximum(end, meet(clock, src, dst, transfer))


def ticks_makespan(ticks: Ticks, messages: Messages, costs: np.ndarray,
                   exchange: Exchange = CPU_EXCHANGE) -> float:
    """The sync model's makespan of a tick assignment before it is lowered to a table
    (``costs``: per action of ``ticks.graph``, as the program runs it): what
    :func:`~.lower.lower` compares tick assignments by. Arrays, one tick at a time
    (at p=64 m=512 several times faster than :func:`clock_makespan`)."""
    D = len(ticks.graph.lists)
    work = np.zeros((ticks.num_ticks, D))
    np.add.at(work, (ticks.tick, ticks.device), costs)
    remote = messages.src != messages.dst
    clock = np.zeros(D)
    if exchange.every_tick:
        src, dst = fixed_pairs(messages.src[remote], messages.dst[remote])
        for t in range(ticks.num_ticks):
            clock = advance(clock, work[t], src, dst, exchange)
        return float(clock.max())
    at = ticks.tick_of(messages.sent[remote])  # the tick at whose end it moves
    order = np.argsort(at, kind="stable")
    at, src, dst = at[order], messages.src[remote][order], messages.dst[remote][order]
    bounds = np.searchsorted(at, np.arange(ticks.num_ticks + 1))
    for t in range(ticks.num_ticks):
        lo, hi = bounds[t], bounds[t + 1]
        clock = advance(clock, work[t], src[lo:hi], dst[lo:hi], exchange)
    return float(clock.max())


def clock_makespan(tick: Sequence[int], device: Sequence[int], costs: Sequence[float],
                   pairs: Sequence[tuple[int, int, int]], num_devices: int,
                   exchange: Exchange = CPU_EXCHANGE) -> float:
    """:func:`ticks_makespan` from plain lists, for the local search (:mod:`.refine`),
    which calls it once per move: with a few devices and a few pairs per tick, faster
    than array calls, and its ticks need not be dense.

    ``tick``, ``device``, ``costs``: per action (ticks may have gaps or start below 0:
    an empty tick changes nothing). ``pairs``: per message between devices,
    ``(producer, consumer, sender, receiver)``; the pair meets at the end of the
    producer's tick, or lazily (``exchange.lazy``) at the meetings
    :func:`~.messages.merge_exchanges` would give it (a window ends at the last tick with
    an action before the consumer's: as on the dense ticks).
    """
    lo = min(tick, default=0)
    T = max(tick, default=-1) + 1 - lo
    work = [[0.0] * num_devices for _ in range(T)]
    for t, d, c in zip(tick, device, costs, strict=True):
        work[t - lo][d] += c
    meets: list[list[tuple[int, int]]] = [[] for _ in range(T)]
    if exchange.every_tick:
        meets = [sorted({(s, r) for _, _, s, r in pairs})] * T
    elif exchange.lazy:
        busy = sorted(set(tick))
        windows: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for p, c, s, r in pairs:
            last = busy[bisect.bisect_right(busy, tick[c] - 1) - 1]
            windows.setdefault((s, r) if s < r else (r, s), []).append((tick[p], last))
        for two, ws in windows.items():
            for t in meeting_points(ws):
                meets[t - lo].append(two)
    else:
        for p, _, s, r in pairs:
            meets[tick[p] - lo].append((s, r))
    overlap = exchange.every_tick and exchange.delay == 2
    clock = [0.0] * num_devices
    for t in range(T):
        start = clock
        clock = [x + w for x, w in zip(clock, work[t], strict=True)]
        if meets[t]:
            at = start if overlap else clock  # when each side's permute is issued
            new = list(clock)
            for s, r in meets[t]:  # each waits for the other
                if at[r] > new[s]:
                    new[s] = at[r]
                if at[s] > new[r]:
                    new[r] = at[s]
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
        work = np.zeros(D)
        for d in range(D):
            for a in by_tick[t][d]:
                out[a] = (float(clock[d] + work[d]), float(clock[d] + work[d]) + c(a))
                work[d] += c(a)
        src, dst = pairs[t]
        clock = advance(clock, work, src, dst, lowering.exchange, transfer)
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
        n = self.split_backward
        split = f", {n} backward{'s' if n > 1 else ''} run as I+W" if n else ""
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
