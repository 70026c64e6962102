"""The cutting problem: prefix sums, range matrices and the DPs every search uses.

Stages are contiguous, so a stage is a segment range ``[a, b)``; everything a search
needs (time, parameter bytes, residual bytes, transfers) is an ``(n+1, n+1)`` matrix
over ranges, built once. Min-max and min-sum objectives over partitions are then
dynamic programs over stages (``O(stages * segments^2)``, vectorised).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from jaxpipe.cost import SegmentCost
from jaxpipe.cut.model import MemoryModel, param_groups
from jaxpipe.cut.options import Cut

__all__ = ["Problem", "inf_unless"]


def inf_unless(ok: np.ndarray, m: np.ndarray) -> np.ndarray:
    """``m`` where ``ok``, else ``inf`` (a forbidden range)."""
    return np.where(ok, m, np.inf)


class Problem:
    """Prefix sums and range matrices shared by all searches.

    Ranges are ``[a, b)`` over segment indices, ``0 <= a < b <= n``; matrices are
    ``(n+1, n+1)``. A *partition* is the list of ``S+1`` bounds ``0 = b_0 < ... <
    b_S = n``; stage ``k`` holds segments ``[b_k, b_{k+1})``.

    Memory follows ``model`` (the runtime's :class:`~jaxpipe.cut.MemoryModel`, or
    the one ``cut`` names): ``padded`` picks the peak formula, ``param_class`` the
    parameter padding groups. Per parameter byte a device holds ``bytes_per_param``
    bytes (parameters, gradients, optimizer state); a running stage needs
    ``workspace_sets`` residual sets of workspace.
    """

    def __init__(
        self,
        costs: Sequence[SegmentCost],
        placement: Sequence[int],
        in_flight: Sequence[int],
        cut: Cut,
        model: MemoryModel,
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
        self.workspace_sets = cut.workspace_sets(model)
        self.in_flight = np.asarray(in_flight, dtype=np.float64)

        profiled = all(c.profiled for c in costs)
        self.time_unit = "s" if profiled else "flops"
        fwd = np.array([c.fwd_time if profiled else c.flops for c in costs], np.float64)
        bwd = np.array([c.bwd_time if profiled else c.bwd_flops for c in costs], np.float64)
        self.fwd_p = np.concatenate([[0.0], np.cumsum(fwd)])
        self.bwd_p = np.concatenate([[0.0], np.cumsum(bwd)])
        res_p = np.concatenate([[0.0], np.cumsum([c.residual_bytes for c in costs])])

        idx = np.arange(n + 1)
        a, b = idx[:, None], idx[None, :]
        self.empty = a >= b
        tot_p = self.fwd_p + self.bwd_p
        self.time = np.where(self.empty, np.inf, tot_p[b] - tot_p[a])
        self.residual = res_p[b] - res_p[a]

        # Parameter bytes of [a, b), in total and per padding group (see param_groups).
        groups, self.p_const, self.params = param_groups(costs, model.param_class, self.single)
        self.pgroups = np.stack(groups, axis=-1) if groups else np.zeros((n + 1, n + 1, 0))
        # The DP bounds the parameter padding through one matrix: exact with one group.
        self.pvar = np.where(self.empty, np.inf, self.pgroups.sum(axis=-1))
        self.params_exact = len(groups) <= 1

        out = [c.out_bytes for c in costs]
        recv = np.array([0.0, *out], np.float64)  # received by a stage starting at a
        send = np.array([0.0, *out[:-1], 0.0], np.float64)  # sent by one ending at b < n
        # activation in + out, and their cotangents back: one buffer each
        self.transfers = 2.0 * (recv[:, None] + send[None, :])
        self._act: dict[int, np.ndarray] = {}
        self._mem: dict[int, np.ndarray] = {}

    # -- per-stage matrices (inf on empty ranges) --------------------------
    def act(self, k: int) -> np.ndarray:
        """Activation bytes of stage k over each range: residuals in flight + transfers."""
        if k not in self._act:  # cached: the sweeps ask for it in every DP
            self._act[k] = np.where(self.empty, np.inf,
                                    self.in_flight[k] * self.residual + self.transfers)
        return self._act[k]

    def mem(self, k: int) -> np.ndarray:
        """Everything stage k needs over each range, alone on its device (unpadded model)."""
        if k not in self._mem:
            self._mem[k] = (self.bytes_per_param * self.params + self.act(k)
                            + self.workspace_sets * self.residual)
        return self._mem[k]

    # -- evaluating partitions ---------------------------------------------
    def stage_parts(self, bounds: np.ndarray) -> tuple[np.ndarray, ...]:
        """Per stage: (params, activation bytes, residual set, params per padding group).

        ``bounds`` is (S+1,) or (C, S+1); the last array has a trailing group axis.
        """
        a, b = bounds[..., :-1], bounds[..., 1:]
        r = self.residual[a, b]
        return (self.params[a, b], self.in_flight * r + self.transfers[a, b], r,
                self.pgroups[a, b])

    def padded_params(self, PG: np.ndarray) -> np.ndarray:
        """Parameter bytes every device holds under per-class padding, for (C, S, G) groups."""
        per_device = np.einsum("csg,sd->cdg", PG, self.onehot)
        return self.p_const + per_device.max(axis=1).sum(axis=-1)

    def keys(self, P: np.ndarray, X: np.ndarray, R: np.ndarray, PG: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray]:
        """(peak memory under the model, sum of squared device needs) for (C, S) stages."""
        # workspace of each device: its largest stage's residual set
        work = np.where(self.onehot.T[None], R[:, None, :], 0.0).max(axis=-1)  # (C, D)
        # what each device needs
        own = (self.bytes_per_param * P + X) @ self.onehot + self.workspace_sets * work
        if self.padded:
            peak = (self.bytes_per_param * self.padded_params(PG)
                    + (X @ self.onehot).max(axis=-1) + self.workspace_sets * R.max(axis=-1))
        else:
            peak = own.max(axis=-1)
        return peak, (own**2).sum(axis=-1)

    def memory(self, bounds: Sequence[int]) -> float:
        """Peak memory of one partition under the model."""
        return self.rank(bounds)[0]

    def rank(self, bounds: Sequence[int]) -> tuple[float, float]:
        """(peak memory, sum of squared device needs) of one partition: smaller is better."""
        peak, sq = self.keys(*self.stage_parts(np.asarray(bounds)[None, :]))
        return float(peak[0]), float(sq[0])

    def max_time(self, bounds: Sequence[int]) -> float:
        b = np.asarray(bounds)
        return float(self.time[b[:-1], b[1:]].max())

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
