"""Local search over a lowering's ticks under the sync model.

Where devices run concurrently, how actions are grouped into ticks decides who waits for
whom (:mod:`.sync`). The unit-cost and cost-grid ticks of :func:`.lowering.assign_ticks`
are good starts but not optimal when stages cost different amounts (a V schedule's
device 0 holds both the embedding and the head), or when an F shares a tick with a B on
a neighbour (interleaved schedules with the backward unsplit). :func:`refine` walks from
a start: it moves one action a tick later or earlier (the rules of
:func:`.lowering.settle` then hold again), keeps the move when the sync model's makespan
does not grow, and stops after ``evals`` evaluations (fewer on large schedules:
:data:`WORK_LIMIT`) or when nothing is left to gain (the asynchronous makespan). A fixed
seed makes it deterministic: every process of a multi-process pipeline lowers to the
same table.

An evaluation re-settles only the actions after the moved one (graph order puts
producers and device predecessors first, so nothing before it can change) and times the
ticks with plain Python numbers (a few devices, a few pairs per tick: faster than array
calls), exactly as :func:`.sync.ticks_makespan` does.

Measured (sync model, GPT benchmark costs, 1,200 evaluations, 0.3-0.7 s): DualPipeV
p=8 m=16 with I+W 0.961 from the cost-grid ticks -> 0.975; Interleaved1F1B p=8 m=32
with B unsplit 0.867 -> 0.954.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jaxpipe.runtime.spmd.lowering import Ticks, list_messages, ticks_of

__all__ = ["WORK_LIMIT", "refine"]

#: At most this many action-evaluations in total (an evaluation re-settles and re-times
#: the actions after the one it moves): 1,200 evaluations at p=8 m=16, a few dozen at
#: p=64 m=128.
WORK_LIMIT = 1_200_000


class _Walk:
    """What the walk evaluates against: each action's tick constraints, its cost and the
    messages between devices. Its ticks are kept as lists before empty ticks are dropped
    (a move may leave a tick empty or make one below 0)."""

    def __init__(self, ticks: Ticks, costs: np.ndarray) -> None:
        graph = ticks.graph
        self.n = len(graph.actions)
        self.D = len(graph.lists)
        devices = graph.devices.tolist()
        self.devices = devices
        prev, data = graph.prev.tolist(), graph.data_deps.tolist()
        # per action: the device predecessor (one tick earlier) and remote producers
        self.after = [([prev[k]] if prev[k] >= 0 else [])
                      + [q for q in data[k] if q >= 0 and devices[q] != devices[k]]
                      for k in range(self.n)]
        self.costs = costs.tolist()
        messages = list_messages(ticks)
        remote = messages.src != messages.dst
        self.pairs = list(zip(messages.producer[remote].tolist(),
                              messages.src[remote].tolist(), messages.dst[remote].tolist(),
                              strict=True))

    def settle(self, want: list[int], tick: list[int], first: int) -> list[int]:
        """``tick`` with actions ``first`` onwards re-settled to ``want`` (a new list)."""
        tick = tick[:first] + [0] * (self.n - first)
        after = self.after
        for k in range(first, self.n):
            t = want[k]
            for q in after[k]:
                if tick[q] >= t:
                    t = tick[q] + 1
            tick[k] = t
        return tick

    def makespan(self, tick: list[int]) -> float:
        """:func:`.sync.ticks_makespan` of these ticks (empty ticks change nothing; a
        walk moving the first actions earlier makes ticks below 0)."""
        lo = min(tick) if tick else 0
        T = max(tick) + 1 - lo if tick else 0
        D = self.D
        work = [[0.0] * D for _ in range(T)]
        for t, d, c in zip(tick, self.devices, self.costs, strict=True):
            work[t - lo][d] += c
        meets: list[list[tuple[int, int]]] = [[] for _ in range(T)]
        for p, s, r in self.pairs:
            meets[tick[p] - lo].append((s, r))
        clock = [0.0] * D
        for t in range(T):
            row = work[t]
            clock = [x + w for x, w in zip(clock, row, strict=True)]
            if meets[t]:
                new = list(clock)
                for s, r in meets[t]:
                    if clock[r] > new[s]:
                        new[s] = clock[r]
                    if clock[s] > new[r]:
                        new[r] = clock[s]
                clock = new
        return max(clock) if clock else 0.0


def refine(ticks: Ticks, costs: np.ndarray, evals: int,
           fits: Callable[[Ticks], bool] | None = None, seed: int = 0) -> Ticks | None:
    """A tick assignment faster than ``ticks`` under the sync model, or ``None``.

    ``ticks``: one action per device and step (no fused or packed pairs). ``costs``: per
    action of ``ticks.graph``, as the program runs it. ``fits``: whether an assignment's
    buffers fit (checked at every improvement, which is rejected where they do not, and
    at the end: a walk across equal makespans may gather messages in flight).
    """
    graph = ticks.graph
    n = len(graph.actions)
    evals = min(evals, WORK_LIMIT // max(n, 1))
    if evals <= 0 or n == 0:
        return None

    def as_ticks(tick: list[int]) -> Ticks:
        dense = np.unique(np.asarray(tick, np.int64), return_inverse=True)[1].reshape(-1)
        return ticks_of(graph, dense, np.zeros(n, bool), ticks.fused)

    def ok(t: Ticks) -> bool:
        return fits is None or fits(t)

    _, ends = graph.run_costs(costs.tolist())
    bound = max(ends)  # the asynchronous makespan: no tick assignment beats it
    walk = _Walk(ticks, costs)
    want = ticks.tick.tolist()
    best = list(want)
    best_time = walk.makespan(best)
    last: tuple[list[int], Ticks] | None = None  # the latest improvement that fits
    rng = np.random.default_rng(seed)
    for _ in range(evals):
        if best_time <= bound * (1 + 1e-9):
            break
        k, d = int(rng.integers(n)), int(rng.choice((-1, 1)))
        want[k] += d
        cand = walk.settle(want, best, k)
        t = walk.makespan(cand)
        accept = t <= best_time  # equal moves too: they walk across plateaus
        if t < best_time:
            cand_ticks = as_ticks(cand)
            accept = ok(cand_ticks)
            if accept:
                last = (cand, cand_ticks)
        if accept:
            best, best_time = cand, t
        else:
            want[k] -= d
    if last is None:
        return None
    if best is last[0]:
        return last[1]
    end = as_ticks(best)  # as fast as the last improvement
    return end if ok(end) else last[1]
