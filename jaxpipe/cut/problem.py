"""The cutting problem: prefix sums, range matrices and the DPs every search uses.

Stages are contiguous, so a stage is a segment range ``[a, b)``; everything a search
needs (time, parameter bytes, residual bytes, transfers) is an ``(n+1, n+1)`` matrix
over ranges, built once. Min-max and min-sum objectives over partitions are then
dynamic programs over stages (``O(stages * segments^2)``, vectorised).

**Recomputation.** Time and stored residuals also depend on the stage's
recomputation policy, so they are kept per policy (``policy_time``,
``policy_residual``). A search never handles policies itself: it runs on a *view*
(:meth:`Problem.view`) for a time cap, in which every range uses, among the policies
that keep its time within the cap, the one that stores least. Parameters and
transfers do not depend on the policy, the workspace only through what the policy
stores (``MemoryModel.workspace_stored_sets``), and a stage's stored bytes only grow
with its residual set, so this choice minimises every memory objective at that cap
(for any memory model whose ``residual_bytes`` and ``workspace_bytes`` do not fall as
stored bytes grow, as the built-in ones): searching min-memory cuts on the view is as
exact for cut and policies together as the search is for cuts (exact with one stage a
device and one parameter padding group).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence

import numpy as np

from jaxpipe.cut.cost import SegmentCost
from jaxpipe.cut.memory_model import MemoryModel
from jaxpipe.cut.options import Cut
from jaxpipe.cut.padding import param_groups
from jaxpipe.stages.remat import Remat

__all__ = ["Problem", "inf_unless"]


def inf_unless(ok: np.ndarray, m: np.ndarray) -> np.ndarray:
    """``m`` where ``ok``, else ``inf`` (a forbidden range)."""
    return np.where(ok, m, np.inf)


def _prefix(values: Sequence[float]) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(np.asarray(values, np.float64))])


def _range(prefix: np.ndarray) -> np.ndarray:
    return prefix[None, :] - prefix[:, None]


def _whole_stage_residual(costs: Sequence[SegmentCost]) -> np.ndarray:
    """Stored bytes of every range recomputed as a whole (``Remat.FULL``).

    A wrapped run of segments ``[x, y)`` stores the values it reads that were defined
    before ``x`` (its inputs; parameters and batch are re-read); segments holding a
    user's ``jax.checkpoint`` are not wrapped and store what they store, and split
    the range into runs.
    """
    n = len(costs)
    # crossing[x, y]: bytes of values defined before x that some segment in [x, y) reads
    diff = np.zeros((n + 2, n + 2))
    values: dict[int, tuple[int, int, set[int]]] = {}
    for k, c in enumerate(costs):
        for vid, (d, nbytes) in c.input_values.items():
            values.setdefault(vid, (d, nbytes, set()))[2].add(k)
    for d, nbytes, readers in values.values():
        lo = d + 1
        for r in sorted(readers):
            if r >= lo:  # x in [lo, r]: the first reader at or after x is r
                diff[lo, r + 1] += nbytes
                diff[r + 1, r + 1] -= nbytes
            lo = r + 1
    crossing = np.cumsum(np.cumsum(diff, axis=0), axis=1)[: n + 1, : n + 1]
    pinned = [c.user_remat for c in costs]
    if not any(pinned):
        return crossing
    out = np.zeros((n + 1, n + 1))
    for a in range(n):
        done, start = 0.0, a  # bytes of finished runs and pinned segments; current run
        for b in range(a + 1, n + 1):
            k = b - 1
            if pinned[k]:
                if start < k:
                    done += crossing[start, k]
                done += costs[k].residual_bytes
                start = b
            out[a, b] = done + (crossing[start, b] if start < b else 0.0)
    return out


class Problem:
    """Prefix sums and range matrices shared by all searches.

    Ranges are ``[a, b)`` over segment indices, ``0 <= a < b <= n``; matrices are
    ``(n+1, n+1)``. A *partition* is the list of ``S+1`` bounds ``0 = b_0 < ... <
    b_S = n``; stage ``k`` holds segments ``[b_k, b_{k+1})``.

    Memory follows ``model`` (the runtime's :class:`~jaxpipe.cut.MemoryModel`, or
    the one ``cut`` names): ``padded`` picks the peak formula, ``param_class`` the
    parameter padding groups, ``residual_bytes`` and ``workspace_bytes`` the stored
    and transient bytes of a stage. Per parameter byte a device holds
    ``bytes_per_param`` bytes (parameters, gradients, optimizer state).

    ``policies`` are the recomputation policies the search may choose among (the first
    is ``Remat.NONE`` when there are several); the problem itself uses the first on
    every range, :meth:`view` the least-storing within a time cap.
    """

    def __init__(
        self,
        costs: Sequence[SegmentCost],
        placement: Sequence[int],
        in_flight: Sequence[float],
        cut: Cut,
        model: MemoryModel,
        policies: Sequence[Remat] = (Remat.NONE,),
    ) -> None:
        n, S = len(costs), len(placement)
        self.n, self.S = n, S
        self.cut = cut
        self.model = model
        self.placement = np.asarray(placement, dtype=np.int64)
        self.D = int(self.placement.max()) + 1
        self.onehot = np.eye(self.D)[self.placement]  # (S, D)
        self.stages_per_device = int(np.bincount(self.placement).max())
        self.single = self.stages_per_device == 1  # every device holds at most one stage
        self.padded = model.padded
        self.bytes_per_param = cut.bytes_per_param_byte
        self.in_flight = np.asarray(in_flight, dtype=np.float64)

        profiled = all(c.profiled for c in costs)
        self.time_unit = "s" if profiled else "flops"
        fwd = np.array([c.fwd_time if profiled else c.flops for c in costs], np.float64)
        bwd = np.array([c.bwd_time if profiled else c.bwd_flops for c in costs], np.float64)
        self.fwd_p = _prefix(fwd)
        self.bwd_p = _prefix(bwd)

        idx = np.arange(n + 1)
        a, b = idx[:, None], idx[None, :]
        self.empty = a >= b
        base_time = np.where(self.empty, np.inf, _range(self.fwd_p + self.bwd_p))

        # Per recomputation policy: stored residual bytes and recompute cost of [a, b).
        self.policies = tuple(policies)
        # profiled: a recomputed FLOP takes what the segment's forward FLOPs take
        per_flop = [(c.fwd_time / c.flops if c.flops else 0.0) if profiled else 1.0
                    for c in costs]
        residual, recompute = [], []
        for policy in self.policies:
            rc = [c.remat_cost(policy) for c in costs]
            recompute.append(_range(_prefix(
                [r.recompute_flops * f for r, f in zip(rc, per_flop, strict=True)])))
            if policy.whole_stage:
                residual.append(_whole_stage_residual(costs))
            else:
                residual.append(_range(_prefix([r.residual_bytes for r in rc])))
        self.policy_residual = np.stack(residual)
        self.policy_recompute = np.stack(recompute)
        self.policy_time = base_time[None] + self.policy_recompute
        full_residual = _range(_prefix([c.residual_bytes for c in costs]))

        # Parameter bytes of [a, b), in total and per padding group (see param_groups).
        groups, self.p_const, self.params = param_groups(costs, model.param_class, self.single)
        self.pgroups = np.stack(groups, axis=-1) if groups else np.zeros((n + 1, n + 1, 0))
        # The DP bounds the parameter padding through one matrix: exact with one group.
        self.pvar = np.where(self.empty, np.inf, self.pgroups.sum(axis=-1))
        self.params_exact = len(groups) <= 1
        # Transient bytes while a stage runs (MemoryModel.workspace_bytes): a backward
        # reads or rebuilds its full residual set whatever the policy; what the policy
        # stores enters too where the model copies it (set per policy in _resolve).
        self._full_residual = full_residual
        self._work_params = np.where(self.empty, 0.0, self.params)

        out = [c.out_bytes for c in costs]
        recv = np.array([0.0, *out], np.float64)  # received by a stage starting at a
        send = np.array([0.0, *out[:-1], 0.0], np.float64)  # sent by one ending at b < n
        # activation in + out, and their cotangents back: one buffer each
        self.transfers = 2.0 * (recv[:, None] + send[None, :])
        self._resolve(np.zeros((n + 1, n + 1), np.int64))
        self._views: dict[float, Problem] = {}

    def _resolve(self, choice: np.ndarray) -> None:
        """Use policy ``choice[a, b]`` (index into ``policies``) on every range."""
        self.policy = choice
        pick = choice[None]
        self.time = np.take_along_axis(self.policy_time, pick, 0)[0]
        self.residual = np.take_along_axis(self.policy_residual, pick, 0)[0]
        # the least-storing policy also copies least: searches on a view stay exact
        self.work = np.where(self.empty, np.inf, self.model.workspace_bytes(
            self._full_residual, self._work_params, self.residual))
        self.has_work = bool(np.any(self.work[~self.empty] > 0))
        self._act: dict[int, np.ndarray] = {}
        self._mem: dict[int, np.ndarray] = {}

    def stage_work(self, a: int, b: int, stored: float) -> float:
        """The workspace of range ``[a, b)`` storing ``stored`` bytes a microbatch."""
        return float(self.model.workspace_bytes(self._full_residual[a, b],
                                                self._work_params[a, b], stored))

    @property
    def remat_choice(self) -> bool:
        """True when the search may choose among several policies."""
        return len(self.policies) > 1

    def view(self, cap: float) -> Problem:
        """This problem with every range on its least-storing policy within time ``cap``.

        Ranges no policy keeps within ``cap`` get infinite time (forbidden under any
        cap). Without a choice of policy, the problem itself.
        """
        if not self.remat_choice:
            return self
        if cap not in self._views:
            ok = self.policy_time <= cap
            stored = np.where(ok, self.policy_residual, np.inf)
            least = ok & (stored <= stored.min(axis=0))  # least stored, then least time
            choice = np.argmin(np.where(least, self.policy_time, np.inf), axis=0)
            view = copy.copy(self)
            view._views = {}
            view._resolve(choice)
            view.time = np.where(ok.any(axis=0), view.time, np.inf)
            self._views[cap] = view
        return self._views[cap]

    def cap_candidates(self) -> np.ndarray:
        """Every distinct finite stage time (any policy), ascending: the caps that matter."""
        t = self.policy_time
        return np.unique(t[np.isfinite(t)])

    def stage_policies(self, bounds: Sequence[int]) -> tuple[Remat, ...]:
        """The policy this view gives each stage of partition ``bounds``."""
        return tuple(self.policies[int(self.policy[bounds[k], bounds[k + 1]])]
                     for k in range(self.S))

    # -- per-stage matrices (inf on empty ranges) --------------------------
    def act(self, k: int) -> np.ndarray:
        """Activation bytes of stage k over each range: residuals in flight + transfers."""
        if k not in self._act:  # cached: the sweeps ask for it in every DP
            self._act[k] = np.where(
                self.empty, np.inf,
                self.model.residual_bytes(self.in_flight[k], self.residual) + self.transfers)
        return self._act[k]

    def mem(self, k: int) -> np.ndarray:
        """Everything stage k needs over each range, alone on its device (unpadded model)."""
        if k not in self._mem:
            self._mem[k] = self.bytes_per_param * self.params + self.act(k) + self.work
        return self._mem[k]

    # -- evaluating partitions ---------------------------------------------
    def stage_parts(self, bounds: np.ndarray, policies: Sequence[Remat] | None = None
                    ) -> tuple[np.ndarray, ...]:
        """Per stage: (params, activation bytes, workspace, params per padding group).

        ``bounds`` is (S+1,) or (C, S+1); the last array has a trailing group axis.
        ``policies`` (one per stage, for one partition) overrides the view's choice.
        """
        a, b = bounds[..., :-1], bounds[..., 1:]
        if policies is None:
            r, w = self.residual[a, b], self.work[a, b]
        else:
            rows = np.array([self.policies.index(p) for p in policies])
            r = self.policy_residual[rows, a, b]
            # the workspace copies what these policies store (MemoryModel.workspace_stored_sets)
            w = self.model.workspace_bytes(self._full_residual[a, b], self._work_params[a, b], r)
        x = self.model.residual_bytes(self.in_flight, r) + self.transfers[a, b]
        return self.params[a, b], x, w, self.pgroups[a, b]

    def padded_params(self, PG: np.ndarray) -> np.ndarray:
        """Parameter bytes every device holds under per-class padding, for (C, S, G) groups."""
        per_device = np.einsum("csg,sd->cdg", PG, self.onehot)
        return self.p_const + per_device.max(axis=1).sum(axis=-1)

    def keys(self, P: np.ndarray, X: np.ndarray, W: np.ndarray, PG: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray]:
        """(peak memory under the model, sum of squared device needs) for (C, S) stages."""
        # workspace of each device: its largest stage's
        work = np.where(self.onehot.T[None], W[:, None, :], 0.0).max(axis=-1)  # (C, D)
        # what each device needs
        own = (self.bytes_per_param * P + X) @ self.onehot + work
        if self.padded:
            peak = (self.bytes_per_param * self.padded_params(PG)
                    + (X @ self.onehot).max(axis=-1) + W.max(axis=-1))
        else:
            peak = own.max(axis=-1)
        return peak, (own**2).sum(axis=-1)

    def memory(self, bounds: Sequence[int], policies: Sequence[Remat] | None = None) -> float:
        """Peak memory of one partition under the model."""
        return self.rank(bounds, policies)[0]

    def rank(self, bounds: Sequence[int], policies: Sequence[Remat] | None = None
             ) -> tuple[float, float]:
        """(peak memory, sum of squared device needs) of one partition: smaller is better."""
        peak, sq = self.keys(*self.stage_parts(np.asarray(bounds)[None, :], policies))
        return float(peak[0]), float(sq[0])

    def stage_times(self, bounds: Sequence[int], policies: Sequence[Remat] | None = None
                    ) -> np.ndarray:
        """Every stage's time (recomputation included) under ``policies`` or the view's."""
        b = np.asarray(bounds)
        if policies is None:
            return self.time[b[:-1], b[1:]]
        rows = np.array([self.policies.index(p) for p in policies])
        return self.policy_time[rows, b[:-1], b[1:]]

    def max_time(self, bounds: Sequence[int]) -> float:
        return float(self.stage_times(bounds).max())

    # -- dynamic programs over stages ----------------------------------------
    def minmax(self, cost: Callable[[int], np.ndarray]) -> tuple[float, list[int] | None]:
        """Minimise max_k cost(k)[b_k, b_k+1] over partitions (inf = forbidden)."""
        n = self.n
        dp = np.full(n + 1, np.inf)
        dp[0] = -np.inf
        cols = np.arange(n + 1)
        choices = []
        for k in range(self.S):
            cand = np.maximum(dp[:, None], cost(k))
            arg = np.argmin(cand, axis=0)
            dp = cand[arg, cols]
            choices.append(arg)
        return self._backtrack(float(dp[n]), choices)

    def minsum(self, cost: Callable[[int], np.ndarray]) -> tuple[float, list[int] | None]:
        """Minimise sum_k cost(k)[b_k, b_k+1] over partitions (inf = forbidden)."""
        n = self.n
        dp = np.full(n + 1, np.inf)
        dp[0] = 0.0
        cols = np.arange(n + 1)
        choices = []
        for k in range(self.S):
            cand = dp[:, None] + cost(k)
            arg = np.argmin(cand, axis=0)
            dp = cand[arg, cols]
            choices.append(arg)
        return self._backtrack(float(dp[n]), choices)

    def _backtrack(self, value: float, choices: list[np.ndarray]) -> tuple[float, list[int] | None]:
        if not math.isfinite(value):
            return math.inf, None
        bounds = [self.n]
        for arg in reversed(choices):
            bounds.append(int(arg[bounds[-1]]))
        return value, bounds[::-1]
