"""Exact searches when every device holds one stage.

Each objective is a min-max problem over ranges (:class:`~jaxpipe.cut.problem.Problem`):

* time: the DP over stage times, ties broken by least memory, then by the sum of
  squared stage times (so non-bottleneck stages are balanced too);
* memory within a time slack: under a padded model the peak is a sum of three
  maxima (parameters, residual set, activations), solved exactly by sweeping the
  residual and parameter thresholds along the Pareto front (:func:`padded_front`);
  unpadded, one DP over every stage's own bytes;
* memory budget: bisection over achievable stage times
  (:func:`min_time_within_budget`, shared with :mod:`jaxpipe.cut.virtual_stages`).

With a choice of recomputation policies, every min-memory search runs on the
problem's view for its time cap (:meth:`~jaxpipe.cut.problem.Problem.view`: each range
on its least-storing policy within the cap), which keeps it as exact for cut and
policies together as for cuts alone (several parameter padding groups make the padded
search a heuristic: ``CutResult.exact`` and the budget error say so); :func:`relax`
then hands memory the objective does not need back to time,
switching stages to faster policies while the peak stays within what was found (or
the budget).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from jaxpipe.cut.options import CutError
from jaxpipe.cut.problem import Problem, inf_unless
from jaxpipe.jaxpr.avals import format_bytes
from jaxpipe.stages.remat import Remat

__all__ = ["search_single", "min_memory_single", "min_time_within_budget", "infeasible",
           "padded_front", "relax"]

#: ``(problem, time cap, good_enough) -> partition bounds`` of least memory.
MinMemory = Callable[..., list[int]]


def min_memory_single(pb: Problem, cap: float, good_enough: float | None = None) -> list[int]:
    """A partition of least peak memory with every stage time <= cap (cap >= optimum).

    Exact (every device holds one stage), for the policies of ``pb.view(cap)``. May
    stop early once it is clear whether some partition's memory is <= ``good_enough``:
    with one that is, or with any when none can be.
    """
    pb = pb.view(cap)
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
    max_s workspace + max_s act`` (params: the padding-group bytes; exact with one
    group). For a workspace threshold (outer loop) and a
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
    r_floor = pb.minmax(lambda k: inf_unless(ok, pb.work))[0] if pb.has_work else 0.0
    front: list[tuple[float, float, float, float, list[int]]] = []
    best = math.inf
    r_thr = math.inf
    while True:
        ok_r = ok & (pb.work < r_thr) if math.isfinite(r_thr) else ok
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
            total = pb.memory(bounds)  # bytes_per_param (const + p_used) + r_used + act_max
            front.append((total, p_used, r_used, act_max, bounds))
            best = min(best, total)
            # Tighter parameter thresholds only raise act_max.
            bound = pb.bytes_per_param * p_floor + r_floor + act_max
            if best <= target or bound > best or (good_enough is not None and bound > target):
                break
            p_thr = p_used
        # Tighter workspace thresholds only raise the first (unconstrained-params) act.
        if first is None or not pb.has_work or best <= target:
            break
        bound = pb.bytes_per_param * p_floor + r_floor + first
        if bound > best or (good_enough is not None and bound > target):
            break
        r_thr = r_seen
    return front


def _box_mask(pb: Problem, p_max: float, r_max: float, x_max: float
              ) -> Callable[[int], np.ndarray]:
    """Ranges within (params, workspace, activations) maxima: padded peak stays below."""
    return lambda k: (pb.pvar <= p_max) & (pb.work <= r_max) & (pb.act(k) <= x_max)


def _polish_masks(pb: Problem, bounds: Sequence[int]) -> Callable[[int], np.ndarray]:
    """Per-stage masks under which every partition's memory is <= that of ``bounds``."""
    _, X, W, PG = pb.stage_parts(np.asarray(bounds))
    if pb.padded:
        return _box_mask(pb, float(PG.sum(axis=-1).max()), float(W.max()), float(X.max()))
    m_max = pb.memory(bounds)
    return lambda k: pb.mem(k) <= m_max


def search_single(pb: Problem, t_opt: float) -> tuple[list[int], tuple[Remat, ...], str]:
    """Exact search when every device holds one stage: (bounds, policies, objective)."""
    cut = pb.cut
    if cut.memory_budget is not None:
        budget = float(cut.memory_budget)
        t_b = min_time_within_budget(pb, t_opt, budget, min_memory_single,
                                     exact=not pb.padded or pb.params_exact)
        view = pb.view(t_b)
        time = view.time
        best = min_memory_single(view, t_b)
        mask = _polish_masks(view, best)
        _, bounds = view.minsum(lambda k: inf_unless((time <= t_b) & mask(k), time**2))
        objective, limit = "budget", budget
    elif cut.objective == "time":
        view, time = pb, pb.time
        best = min_memory_single(pb, t_opt)
        mask = _polish_masks(pb, best)
        _, bounds = pb.minsum(lambda k: inf_unless((time <= t_opt) & mask(k), time**2))
        objective, limit = "time", None
    else:
        cap = (1.0 + cut.time_slack) * t_opt
        view = pb.view(cap)
        time = view.time
        if view.padded:
            # Fastest among all memory-optimal cuts: they lie on the front's minima.
            front = padded_front(view, time <= cap)
            m_opt, *_, best = min(front, key=lambda f: f[0])
            t_b, mask = math.inf, None
            for total, p_max, r_max, x_max, _ in front:
                if total > m_opt * (1 + 1e-12):
                    continue
                m = _box_mask(view, p_max, r_max, x_max)
                t, _ = view.minmax(lambda k, m=m: inf_unless((time <= cap) & m(k), time))
                if t < t_b:
                    t_b, mask = t, m
            assert mask is not None
        else:
            best = min_memory_single(view, cap)
            mask = _polish_masks(view, best)
            t_b, _ = view.minmax(lambda k: inf_unless((time <= cap) & mask(k), time))
        square = view.act if view.padded else view.mem
        _, bounds = view.minsum(
            lambda k: inf_unless((time <= t_b) & mask(k), square(k) ** 2))
        objective, limit = "memory", None
    assert bounds is not None
    if view.memory(bounds) > view.memory(best):  # polish masks are loose with 2+ groups
        bounds = best
    policies = view.stage_policies(bounds)
    if limit is None:
        limit = view.memory(bounds)
    return bounds, relax(pb, bounds, policies, limit), objective


def relax(pb: Problem, bounds: Sequence[int], policies: Sequence[Remat], limit: float
          ) -> tuple[Remat, ...]:
    """Switch stages to faster policies while the peak memory stays <= ``limit``.

    Greedy: each round takes the switch that saves the most stage time (the cut's
    slowest stage never gets slower). Without a choice of policy, ``policies``.
    """
    pols = list(policies)
    if not pb.remat_choice:
        return tuple(pols)
    times = pb.stage_times(bounds, pols)
    while True:
        best: tuple[float, int, Remat] | None = None
        for k in range(pb.S):
            for p in pb.policies:
                t = float(pb.stage_times(bounds, pols[:k] + [p] + pols[k + 1:])[k])
                if t >= times[k] or (best is not None and times[k] - t <= best[0]):
                    continue
                if pb.memory(bounds, pols[:k] + [p] + pols[k + 1:]) <= limit:
                    best = (float(times[k] - t), k, p)
        if best is None:
            return tuple(pols)
        _, k, p = best
        pols[k] = p
        times = pb.stage_times(bounds, pols)


def min_time_within_budget(pb: Problem, t_opt: float, budget: float,
                           min_memory: MinMemory, exact: bool) -> float:
    """Smallest stage-time cap whose least-memory cut fits ``budget`` (bisection).

    ``min_memory(pb, cap, good_enough)`` is the search for a cap: exact for one stage
    per device (:func:`min_memory_single`) with one parameter padding group, heuristic
    for several groups or shared devices (``exact`` says which, for the error). Caps run
    over every achievable stage time of every policy; at each, the policies are the
    view's (least-storing within the cap).
    """
    loosest = min_memory(pb, math.inf, good_enough=budget)
    if pb.view(math.inf).memory(loosest) > budget:  # infeasible: name the true minimum
        raise infeasible(pb, min_memory(pb, math.inf), exact)
    ts = pb.cap_candidates()
    ts = ts[(ts >= t_opt) & (ts <= pb.view(math.inf).max_time(loosest))]
    lo, hi = 0, len(ts) - 1  # invariant: ts[hi] is feasible
    while lo < hi:
        mid = (lo + hi) // 2
        cap = float(ts[mid])
        if pb.view(cap).memory(min_memory(pb, cap, good_enough=budget)) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return float(ts[hi])


def infeasible(pb: Problem, bounds: Sequence[int], exact: bool) -> CutError:
    """The error for an unmeetable budget, naming the smallest one found (reached by the
    least-memory partition ``bounds``) and the cut and recomputation that reach it."""
    budget = pb.cut.memory_budget
    view = pb.view(math.inf)
    smallest = view.memory(bounds)
    qual = "smallest feasible" if exact else "smallest found (heuristic search)"
    cuts = [int(b) - 1 for b in bounds[1:-1]]
    choice = f"cut after markers {cuts}"
    if pb.remat_choice:
        policies = [str(p.value) for p in view.stage_policies(bounds)]
        choice += f" with recomputation {policies} per stage"
        hint = ""
    elif pb.policies == (Remat.NONE,):
        hint = ", allow recomputation (jp.Cut(remat='auto'))"
    else:
        hint = ""
    source = f" (from {pb.cut.budget_source})" if pb.cut.budget_source else ""
    return CutError(
        f"memory budget of {format_bytes(budget)} ({budget} bytes){source} per device is "
        f"infeasible for this model and schedule ({pb.model.name} memory model): the "
        f"{qual} budget is {format_bytes(smallest)} ({math.ceil(smallest)} bytes), "
        f"{choice}; raise memory_budget{hint}, use more stages, a schedule with fewer "
        f"microbatches in flight, or less optimizer state", smallest_budget=math.ceil(smallest)
    )
