"""Local search over a lowering's ticks under the sync model.

Where devices run concurrently, how actions are grouped into ticks decides who waits for
whom (:mod:`.sync`). The unit-cost and cost-grid ticks of :func:`.ticks.assign_ticks`
are good starts but not optimal when stages cost different amounts (a V schedule's
device 0 holds both the embedding and the head), or when an F shares a tick with a B on
a neighbour (interleaved schedules with the backward unsplit). :func:`refine` walks from
a start: it moves one action a tick later or earlier (the rules of
:func:`.tick_rule.settle` then hold again), keeps the move when the sync model's makespan
does not grow, and stops after ``evals`` evaluations (fewer on large schedules:
:data:`WORK_LIMIT`) or when nothing is left to gain (the asynchronous makespan). A fixed
seed makes it deterministic: every process of a multi-process pipeline lowers to the
same table.

An evaluation re-settles only the actions after the moved one
(:func:`.tick_rule.resettle`: graph order puts producers and device predecessors first, so
nothing before it can change) and times the ticks from plain lists
(:func:`.sync.clock_makespan`: :func:`.sync.ticks_makespan`'s model, which
``tests/test_lower.py`` holds it equal to).

Measured (sync model, GPT benchmark costs, 1,200 evaluations, 0.3-0.7 s): DualPipeV
p=8 m=16 with I+W 0.961 from the cost-grid ticks -> 0.975; Interleaved1F1B p=8 m=32
with B unsplit 0.867 -> 0.954.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jaxpipe.runtime.spmd.lowering.messages import list_messages
from jaxpipe.runtime.spmd.lowering.sync import clock_makespan
from jaxpipe.runtime.spmd.lowering.tick_rule import compact, resettle, tick_constraints
from jaxpipe.runtime.spmd.lowering.ticks import ticks_of
from jaxpipe.runtime.spmd.lowering.types import CPU_EXCHANGE, Exchange, Ticks

__all__ = ["WORK_LIMIT", "refine"]

#: At most this many action-evaluations in total (an evaluation re-settles and re-times
#: the actions after the one it moves): 1,200 evaluations at p=8 m=16, a few dozen at
#: p=64 m=128.
WORK_LIMIT = 1_200_000


def refine(ticks: Ticks, costs: np.ndarray, evals: int, fits: Callable[[Ticks], bool],
           seed: int = 0, exchange: Exchange = CPU_EXCHANGE, tick_cost: float = 0.0
           ) -> Ticks | None:
    """A tick assignment faster than ``ticks`` under the sync model, or ``None``.

    ``ticks``: one action per device and step (no fused or packed pairs). ``costs``: per
    action of ``ticks.graph``, as the program runs it. ``fits``: whether an assignment's
    buffers fit (checked at every improvement, which is rejected where they do not, and
    at the end: a walk across equal makespans may gather messages in flight).
    ``tick_cost``: the program's fixed cost of a tick, added per tick (a move that merges
    or opens a tick changes it).
    """
    graph = ticks.graph
    n = len(graph.actions)
    evals = min(evals, WORK_LIMIT // max(n, 1))
    if evals <= 0 or n == 0:
        return None

    def as_ticks(tick: list[int]) -> Ticks:
        return ticks_of(graph, compact(after, tick, np.arange(n)), np.zeros(n, bool),
                        ticks.fused)

    # the walk's ticks stay lists before empty ticks are dropped (a move may leave a tick
    # empty or make one below 0)
    after = tick_constraints(graph, exchange.delay)
    messages = list_messages(ticks)
    remote = messages.src != messages.dst
    pairs = list(zip(messages.producer[remote].tolist(), messages.consumer[remote].tolist(),
                     messages.src[remote].tolist(), messages.dst[remote].tolist(),
                     strict=True))
    devices, cost_list, D = graph.devices.tolist(), costs.tolist(), len(graph.lists)

    def makespan(tick: list[int]) -> tuple[float, float]:
        """``(makespan + the ticks' cost, makespan)``."""
        span = clock_makespan(tick, devices, cost_list, pairs, D, exchange)
        return (span + tick_cost * len(set(tick)) if tick_cost else span), span

    _, ends = graph.run_costs(cost_list)
    bound = max(ends)  # the asynchronous makespan: no tick assignment beats it
    want = ticks.tick.tolist()
    best = list(want)
    best_time, best_span = makespan(best)
    last: tuple[list[int], Ticks] | None = None  # the latest improvement that fits
    rng = np.random.default_rng(seed)
    for _ in range(evals):
        if best_span <= bound * (1 + 1e-9):
            break
        k, d = int(rng.integers(n)), int(rng.choice((-1, 1)))
        want[k] += d
        cand = resettle(after, want, best, k)
        t, span = makespan(cand)
        accept = t <= best_time  # equal moves too: they walk across plateaus
        if t < best_time:
            cand_ticks = as_ticks(cand)
            accept = fits(cand_ticks)
            if accept:
                last = (cand, cand_ticks)
        if accept:
            best, best_time, best_span = cand, t, span
        else:
            want[k] -= d
    if last is None:
        return None
    if best is last[0]:
        return last[1]
    end = as_ticks(best)  # as fast as the last improvement
    return end if fits(end) else last[1]
