"""Local search over a lowering's ticks under the sync model.

Where devices run concurrently, how actions are grouped into ticks decides who waits for
whom (:mod:`.sync`). The unit-cost and cost-grid ticks of :func:`.lowering.assign_ticks`
are good starts but not optimal when stages cost different amounts (a V schedule's
device 0 holds both the embedding and the head). :func:`refine` walks from a start: it
moves one action a tick later or earlier (:func:`.lowering.settle` then keeps every
dependency rule), keeps the move when the sync model's makespan does not grow, and stops
after ``evals`` evaluations (fewer on large schedules: :data:`WORK_LIMIT`) or when
nothing is left to gain (the asynchronous makespan). A fixed seed makes it
deterministic: every process of a multi-process pipeline lowers to the same table.

Measured (``python benchmarks/lowering.py``, GPT costs, I+W): DualPipeV p=8 m=16 0.961
from the cost-grid ticks -> above 0.97 within a few hundred evaluations.
"""

from __future__ import annotations

import numpy as np

from jaxpipe.runtime.spmd.lowering import Ticks, list_messages, settle, ticks_of

__all__ = ["WORK_LIMIT", "refine"]

#: At most this many action-evaluations in total (an evaluation re-settles and re-times
#: every action): 400 evaluations at p=8 m=16, a handful at p=64 m=128 (0.1 s each).
WORK_LIMIT = 400_000


def refine(ticks: Ticks, costs: np.ndarray, evals: int, seed: int = 0) -> Ticks:
    """A tick assignment at least as fast as ``ticks`` under the sync model.

    ``ticks``: one action per device and step (no fused or packed pairs). ``costs``: per
    action of ``ticks.graph``, as the program runs it.
    """
    from jaxpipe.runtime.spmd.sync import ticks_makespan  # sync imports the lowering

    graph = ticks.graph
    n = len(graph.actions)
    evals = min(evals, WORK_LIMIT // max(n, 1))
    if evals <= 0 or n == 0:
        return ticks
    _, ends = graph.run_costs(costs.tolist())
    bound = max(ends)  # the asynchronous makespan: no tick assignment beats it
    identity, no_pairs = np.arange(n), np.zeros(n, bool)
    base = ticks.tick.copy()
    delay = np.zeros(n, np.int64)
    best, best_time = ticks, ticks_makespan(ticks, list_messages(ticks), costs)
    rng = np.random.default_rng(seed)
    for _ in range(evals):
        if best_time <= bound * (1 + 1e-9):
            break
        k, d = int(rng.integers(n)), int(rng.choice((-1, 1)))
        delay[k] += d
        cand = ticks_of(graph, settle(graph, (base + delay).tolist(), identity),
                        no_pairs, ticks.fused)
        t = ticks_makespan(cand, list_messages(cand), costs)
        if t <= best_time:  # equal moves too: they walk across plateaus
            best, best_time = cand, t
        else:
            delay[k] -= d
    return best

