"""Exact searches when every device holds one stage.

Each objective is a min-max problem over ranges (:class:`~jaxpipe.cut.problem.Problem`):

* time: the DP over stage times, ties broken by least memory, then by the sum of
  squared stage times (so non-bottleneck stages are balanced too);
* memory within a time slack: under a padded model the peak is a sum of three
  maxima (parameters, residual set, activations), solved exactly by sweeping the
  residual and parameter thresholds along the Pareto front (:func:`padded_front`);
  unpadded, one DP over every stage's own bytes;
* memory budget: bisection over achievable stage times
  (:func:`min_time_within_budget`, shared with :mod:`jaxpipe.cut.shared`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from jaxpipe.avals import format_bytes
from jaxpipe.cut.options import CutError
from jaxpipe.cut.problem import Problem, inf_unless

__all__ = ["search_single", "min_memory_single", "min_time_within_budget", "infeasible",
           "padded_front"]

#: ``(problem, time cap, good_enough) -> partition bounds`` of least memory.
MinMemory = Callable[..., list[int]]


def min_memory_single(pb: Problem, cap: float, good_enough: float | None = None) -> list[int]:
    """A partition of least peak memory with every stage time <= cap (cap >= optimum).

    Exact (every device holds one stage). May stop early once it is clear whether
    some partition's memory is <= ``good_enough``: with one that is, or with any
    when none can be.
    """
    ok = pb.time <= cap
    if not pb.padded:
        _, bounds = pb.minmax(lambda k: inf_unless(ok, pb.mem(k)))
        assert bounds is not None
        return bounds
    return min(padded_front(pb, ok, good_enough), key=lambda f: f[0])[-1]


def padded_front(
    pb: Problem, ok: np.ndarray, good_enough: float | None = None
) -> list[tuple[float, float, float, float, list[int]]]:
    """Pareto front of the padded peak for single-stage devices.

    The peak has three maxima, ``bytes_per_param * (const + max_s params) +
    workspace_sets * max_s residual set + max_s act`` (params: the padding-group
    bytes; exact with one group). For a residual threshold (outer loop) and a
    parameter threshold (inner loop), a DP minimises ``max_s act`` over the cuts
    allowed by ``ok`` whose stages stay below both; each next threshold is strictly
    below what the cuts found so far used. Every optimal cut has the parameter and
    residual maxima of some visited point, so the minimum over the returned
    ``(total, params, residual, act, bounds)`` points is exact. Lower bounds stop
    both loops early; with ``good_enough`` they also stop once that level is reached
    or out of reach.
    """
    target = -math.inf if good_enough is None else good_enough
    p_floor, _ = pb.minmax(lambda k: inf_unless(ok, pb.pvar))
    p_floor += pb.p_const
    r_floor = pb.minmax(lambda k: inf_unless(ok, pb.residual))[0] if pb.workspace_sets else 0.0
    front: list[tuple[float, float, float, float, list[int]]] = []
    best = math.inf
    r_thr = math.inf
    while True:
        ok_r = ok & (pb.residual < r_thr) if math.isfinite(r_thr) else ok
        p_thr, r_seen, first = math.inf, 0.0, None
        while True:
            allowed = ok_r & (pb.pvar < p_thr) if math.isfinite(p_thr) else ok_r
            act_max, bounds = pb.minmax(
                lambda k, allowed=allowed: inf_unless(allowed, pb.act(k)))
            if bounds is None:
                break
            first = act_max if first is None else first
            _, _, R, PG = pb.stage_parts(np.asarray(bounds))
            p_used, r_used = float(PG.sum(axis=-1).max()), float(R.max())
            r_seen = max(r_seen, r_used)
            total = pb.memory(bounds)  # bytes_per_param (const + p_used) + ... + act_max
            front.append((total, p_used, r_used, act_max, bounds))
            best = min(best, total)
            # Tighter parameter thresholds only raise act_max.
            bound = pb.bytes_per_param * p_floor + pb.workspace_sets * r_floor + act_max
            if best <= target or bound > best or (good_enough is not None and bound > target):
                break
            p_thr = p_used
        # Tighter residual thresholds only raise the first (unconstrained-params) act.
        if first is None or not pb.workspace_sets or best <= target:
            break
        bound = pb.bytes_per_param * p_floor + pb.workspace_sets * r_floor + first
        if bound > best or (good_enough is not None and bound > target):
            break
        r_thr = r_seen
    return front


def _box_mask(pb: Problem, p_max: float, r_max: float, x_max: float
              ) -> Callable[[int], np.ndarray]:
    """Ranges within (params, residual set, activations) maxima: padded peak stays below."""
    return lambda k: (pb.pvar <= p_max) & (pb.residual <= r_max) & (pb.act(k) <= x_max)


def _polish_masks(pb: Problem, bounds: Sequence[int]) -> Callable[[int], np.ndarray]:
    """Per-stage masks under which every partition's memory is <= that of ``bounds``."""
    _, X, R, PG = pb.stage_parts(np.asarray(bounds))
    if pb.padded:
        return _box_mask(pb, float(PG.sum(axis=-1).max()), float(R.max()), float(X.max()))
    m_max = pb.memory(bounds)
    return lambda k: pb.mem(k) <= m_max


def search_single(pb: Problem, t_opt: float) -> tuple[list[int], str]:
    """Exact search when every device holds one stage."""
    cut = pb.cut
    time = pb.time
    if cut.memory_budget is not None:
        budget = float(cut.memory_budget)
        t_b = min_time_within_budget(pb, t_opt, budget, min_memory_single, exact=True)
        best = min_memory_single(pb, t_b)
        mask = _polish_masks(pb, best)
        _, bounds = pb.minsum(lambda k: inf_unless((time <= t_b) & mask(k), time**2))
        objective = "budget"
    elif cut.objective == "time":
        best = min_memory_single(pb, t_opt)
        mask = _polish_masks(pb, best)
        _, bounds = pb.minsum(lambda k: inf_unless((time <= t_opt) & mask(k), time**2))
        objective = "time"
    else:
        cap = (1.0 + cut.time_slack) * t_opt
        if pb.padded:
            # Fastest among all memory-optimal cuts: they lie on the front's minima.
            front = padded_front(pb, time <= cap)
            m_opt, *_, best = min(front, key=lambda f: f[0])
            t_b, mask = math.inf, None
            for total, p_max, r_max, x_max, _ in front:
                if total > m_opt * (1 + 1e-12):
                    continue
                m = _box_mask(pb, p_max, r_max, x_max)
                t, _ = pb.minmax(lambda k, m=m: inf_unless((time <= cap) & m(k), time))
                if t < t_b:
                    t_b, mask = t, m
            assert mask is not None
        else:
            best = min_memory_single(pb, cap)
            mask = _polish_masks(pb, best)
            t_b, _ = pb.minmax(lambda k: inf_unless((time <= cap) & mask(k), time))
        square = pb.act if pb.padded else pb.mem
        _, bounds = pb.minsum(
            lambda k: inf_unless((time <= t_b) & mask(k), square(k) ** 2))
        objective = "memory"
    assert bounds is not None
    if pb.memory(bounds) > pb.memory(best):  # polish masks are loose with 2+ groups
        bounds = best
    return bounds, objective


def min_time_within_budget(pb: Problem, t_opt: float, budget: float,
                           min_memory: MinMemory, exact: bool) -> float:
    """Smallest stage-time cap whose least-memory cut fits ``budget`` (bisection).

    ``min_memory(pb, cap, good_enough)`` is the search for a cap: exact for one stage
    per device (:func:`min_memory_single`), heuristic for shared devices.
    """
    loosest = min_memory(pb, math.inf, good_enough=budget)
    if pb.memory(loosest) > budget:  # infeasible: find the true minimum for the message
        raise infeasible(pb, pb.memory(min_memory(pb, math.inf)), exact)
    ts = np.unique(pb.time[np.isfinite(pb.time)])
    ts = ts[(ts >= t_opt) & (ts <= pb.max_time(loosest))]
    lo, hi = 0, len(ts) - 1  # invariant: ts[hi] is feasible
    while lo < hi:
        mid = (lo + hi) // 2
        if pb.memory(min_memory(pb, float(ts[mid]), good_enough=budget)) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return float(ts[hi])


def infeasible(pb: Problem, smallest: float, exact: bool) -> CutError:
    """The error for an unmeetable budget, naming the smallest one (found)."""
    budget = pb.cut.memory_budget
    qual = "smallest feasible" if exact else "smallest found (heuristic search)"
    return CutError(
        f"memory budget of {format_bytes(budget)} ({budget} bytes) per device is infeasible "
        f"for this model and schedule ({pb.model.name} memory model): the {qual} "
        f"budget is {format_bytes(smallest)} ({math.ceil(smallest)} bytes); raise "
        f"memory_budget, use more stages, a schedule with fewer microbatches in flight, "
        f"or less optimizer state"
    )
