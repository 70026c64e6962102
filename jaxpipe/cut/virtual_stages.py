"""Cut searches when each device holds several (virtual) stages: interleaved and V placements.

A device's activation memory is then a sum over non-adjacent stages, which the
stage-by-stage DP cannot express. Small problems are enumerated exactly
(:func:`enumerate_cuts`, up to ``_ENUM_LIMIT`` candidate cuts); large ones use a
weighted DP (:func:`min_memory_virtual`) followed by a local search over cut
positions (:func:`local_search`). Stage time is still per stage, so the "time"
objective stays exact. With a choice of recomputation policies, every search runs on
the problem's view for its time cap (the least-storing policy of each range), which
keeps enumeration exact for cut and policies together.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np

from jaxpipe.cut.problem import Problem, inf_unless
from jaxpipe.cut.search import infeasible, min_time_within_budget, relax
from jaxpipe.stages.remat import Remat

__all__ = ["search_virtual", "min_memory_virtual", "local_search", "enumerate_cuts"]

# Enumerate all cuts exactly when a device holds several stages and there are at most
# this many candidate cuts (vectorised; tens of ms at the limit).
_ENUM_LIMIT = 60_000


def search_virtual(pb: Problem, t_opt: float
                  ) -> tuple[list[int], tuple[Remat, ...], str, bool]:
    """Devices hold several stages: enumerate small problems, else DP + local search.

    Returns ``(bounds, policies, objective, exact)``.
    """
    cut = pb.cut
    objective = "budget" if cut.memory_budget is not None else cut.objective
    if math.comb(pb.n - 1, pb.S - 1) <= _ENUM_LIMIT:
        view, bounds = enumerate_cuts(pb, t_opt)
        exact = True
    elif objective == "budget":
        t_b = min_time_within_budget(pb, t_opt, float(cut.memory_budget), min_memory_virtual,
                                     exact=False)
        view = pb.view(t_b)
        bounds, exact = min_memory_virtual(view, t_b), False
    else:
        # Time is per stage, so the "time" objective stays exact; memory is heuristic.
        view = pb
        bounds = min_memory_virtual(pb, t_opt)
        if objective == "memory":
            # A looser cap must never come out worse: also polish the time-optimal answer.
            cap = (1.0 + cut.time_slack) * t_opt
            view = pb.view(cap)
            cands = [min_memory_virtual(view, cap), local_search(view, bounds, cap)]
            bounds = min(cands, key=view.rank)
        exact = objective == "time"
    limit = float(cut.memory_budget) if objective == "budget" else view.memory(bounds)
    policies = relax(pb, bounds, view.stage_policies(bounds), limit)
    return bounds, policies, objective, exact


def min_memory_virtual(pb: Problem, cap: float, good_enough: float | None = None) -> list[int]:
    """Heuristic min peak memory with stage times <= cap, devices holding several stages.

    Give stage ``s`` a share ``w_s`` of its device (shares on a device sum to 1)
    and minimise ``max_s q_s / w_s`` exactly by DP, where ``q_s`` is bytes that add
    up per device: every device's sum is then at most that value, and with the
    optimal cut's own shares this finds the optimum. Shares are re-estimated from
    each round's cut (damped fixed-point iteration); the best cut of each run is
    polished by local search. An unpadded model's ``q`` is everything a stage
    needs; the padded peak is a sum of separate maxima, so several ``q`` are tried
    (activations; plus parameters; plus the workspace) and, for activations, a few
    parameter thresholds down the Pareto front. Policies: those of ``pb.view(cap)``.
    """
    pb = pb.view(cap)
    good_enough = -math.inf if good_enough is None else good_enough
    ok = pb.time <= cap
    per_device = np.bincount(pb.placement, minlength=pb.D)[pb.placement]
    _, best = pb.minmax(lambda k: pb.time)  # the compute-balanced cut is always allowed
    assert best is not None
    best_key = pb.rank(best)

    def q_act(P: np.ndarray, X: np.ndarray, W: np.ndarray) -> np.ndarray:
        return X

    def q_act_params(P: np.ndarray, X: np.ndarray, W: np.ndarray) -> np.ndarray:
        return X + pb.bytes_per_param * P

    def q_all(P: np.ndarray, X: np.ndarray, W: np.ndarray) -> np.ndarray:
        return X + pb.bytes_per_param * P + W

    # (per-stage quantity over ranges, same for a partition's stages, thresholds)
    runs: list[tuple[Callable[[int], np.ndarray], Callable[..., np.ndarray], int]]
    if pb.padded:
        def act_params(k: int) -> np.ndarray:
            return pb.act(k) + pb.bytes_per_param * pb.pvar

        def act_params_work(k: int) -> np.ndarray:
            return act_params(k) + pb.work

        runs = [(pb.act, q_act, 4), (act_params, q_act_params, 1), (act_params_work, q_all, 1)]
    else:
        runs = [(pb.mem, q_all, 1)]
    found: list[tuple[tuple[float, float], list[int]]] = []
    for quantity, q_of, thresholds in runs:
        thr = math.inf
        for _ in range(thresholds):
            if best_key[0] <= good_enough:
                return best
            allowed = ok & (pb.pvar < thr) if math.isfinite(thr) else ok
            w = 1.0 / per_device
            round_best, round_key = None, (math.inf, math.inf)
            for _ in range(6):
                _, b = pb.minmax(lambda k, w=w, allowed=allowed, quantity=quantity:
                                 inf_unless(allowed, quantity(k) / w[k]))
                if b is None:
                    break
                key = pb.rank(b)
                if key[0] <= good_enough:
                    return b
                if key < round_key:
                    round_best, round_key = b, key
                P, X, W, PG = pb.stage_parts(np.asarray(b))
                q = q_of(PG.sum(axis=-1) if pb.padded else P, X, W)
                share = q / np.maximum((q @ pb.onehot)[pb.placement], 1e-30)
                share = np.maximum(share, 1e-3)
                share /= np.bincount(pb.placement, weights=share, minlength=pb.D)[pb.placement]
                w_next = 0.5 * w + 0.5 * share
                if np.allclose(w_next, w, rtol=1e-6, atol=1e-9):
                    break
                w = w_next
            if round_best is None:
                break
            found.append((round_key, round_best))
            thr = float(pb.stage_parts(np.asarray(round_best))[3].sum(axis=-1).max())
    # Polish the two best DP cuts and the compute-balanced one: local search
    # dominates the cost, so not every run's cut gets it.
    found.sort(key=lambda f: f[0])
    for b in [f[1] for f in found[:2]] + [best]:
        polished = local_search(pb, b, cap)
        key = pb.rank(polished)
        if key < best_key:
            best, best_key = polished, key
        if best_key[0] <= good_enough:
            break
    return best


def local_search(pb: Problem, bounds: Sequence[int], cap: float) -> list[int]:
    """Improve a partition by moving cuts while (peak memory, sum of squares) drops.

    Moves: one cut to any position between its neighbours; two adjacent cuts
    together; and a block of consecutive cuts shifted by one segment (which moves a
    segment's worth of work between two distant stages). Candidates are evaluated
    in batches (per cut, then all block shifts) and the best of a batch is taken
    if it improves; the sum of squares lets it walk along plateaus.
    """
    S = pb.S
    b = np.asarray(bounds, dtype=np.int64)
    ij = [(i, j) for i in range(1, S) for j in range(i, S)]
    span = np.zeros((len(ij), S + 1), np.int64)
    for r, (i, j) in enumerate(ij):
        span[r, i : j + 1] = 1
    shifts = np.concatenate([span, -span])
    best = pb.rank(b)

    def try_candidates(cands: np.ndarray) -> bool:
        nonlocal b, best
        if not len(cands):
            return False
        ok = np.all(cands[:, 1:] > cands[:, :-1], axis=1)
        cands = np.where(ok[:, None], cands, b[None, :])
        ok &= pb.time[cands[:, :-1], cands[:, 1:]].max(axis=1) <= cap
        if not ok.any():
            return False
        peak, sq = pb.keys(*pb.stage_parts(cands))
        order = np.lexsort((np.where(ok, sq, np.inf), np.where(ok, peak, np.inf)))
        j = order[0]
        if (float(peak[j]), float(sq[j])) < best:
            b, best = cands[j], (float(peak[j]), float(sq[j]))
            return True
        return False

    improved = True
    while improved and S > 1:
        improved = False
        for i in range(1, S):  # cut i anywhere between its neighbours, or with cut i+1
            pos = np.arange(b[i - 1] + 1, b[i + 1])
            single = np.repeat(b[None, :], len(pos), axis=0)
            single[:, i] = pos
            moves = [single]
            if i < S - 1:
                pos = np.arange(b[i - 1] + 1, b[i + 2])
                p, q = np.meshgrid(pos, pos, indexing="ij")
                keep = p < q
                pair = np.repeat(b[None, :], int(keep.sum()), axis=0)
                pair[:, i], pair[:, i + 1] = p[keep], q[keep]
                moves.append(pair)
            improved |= try_candidates(np.concatenate(moves))
        improved |= try_candidates(b[None, :] + shifts)  # a block of cuts by one segment
    return [int(x) for x in b]


def enumerate_cuts(pb: Problem, t_opt: float) -> tuple[Problem, list[int]]:
    """Exact search over every cut (small problems with several stages per device).

    Returns the view whose policies the cut uses, and the cut. With a memory budget and
    a choice of policies, the least time cap whose least-memory cut fits is found by
    bisection over the caps first.
    """
    cut, n, S = pb.cut, pb.n, pb.S
    inner = np.array(list(itertools.combinations(range(1, n), S - 1)), dtype=np.int64)
    inner = inner.reshape(-1, S - 1)
    K = inner.shape[0]
    bounds = np.concatenate([np.zeros((K, 1), np.int64), inner, np.full((K, 1), n)], axis=1)

    def evaluate(view: Problem) -> tuple[np.ndarray, ...]:
        times = view.time[bounds[:, :-1], bounds[:, 1:]]
        peak, sq = view.keys(*view.stage_parts(bounds))
        return times, times.max(axis=1), peak, sq

    if cut.memory_budget is not None:
        view = pb.view(math.inf)
        times, max_t, peak, sq = evaluate(view)
        if not (peak <= cut.memory_budget).any():
            raise infeasible(pb, [int(x) for x in bounds[int(np.argmin(peak))]], exact=True)
        if pb.remat_choice:
            ts = pb.cap_candidates()
            ts = ts[ts >= t_opt]
            lo, hi = 0, len(ts) - 1  # ts[hi] (no cap binds at the largest time) fits
            while lo < hi:
                mid = (lo + hi) // 2
                _, mid_t, mid_peak, _ = evaluate(pb.view(float(ts[mid])))
                if ((mid_peak <= cut.memory_budget) & np.isfinite(mid_t)).any():
                    hi = mid
                else:
                    lo = mid + 1
            view = pb.view(float(ts[hi]))
            times, max_t, peak, sq = evaluate(view)
        ok = (peak <= cut.memory_budget) & np.isfinite(max_t)
        order = np.lexsort(((times**2).sum(1), peak, max_t, ~ok))
    elif cut.objective == "time":
        view = pb
        times, max_t, peak, sq = evaluate(view)
        ok = max_t <= t_opt
        order = np.lexsort(((times**2).sum(1), peak, ~ok))
    else:
        view = pb.view((1.0 + cut.time_slack) * t_opt)
        times, max_t, peak, sq = evaluate(view)
        ok = max_t <= (1.0 + cut.time_slack) * t_opt
        order = np.lexsort((sq, max_t, peak, ~ok))
    return view, [int(x) for x in bounds[order[0]]]
