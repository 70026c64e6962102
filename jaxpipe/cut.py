"""Memory-aware cutter: choose where the pipeline's stages begin.

The traced model is a chain of *segments* (code between consecutive
``jp.boundary`` markers, costed by :mod:`jaxpipe.cost`). A cut assigns a
contiguous run of segments to each of ``schedule.num_stages`` stages.

**Time.** A stage's forward time is the sum of its segments' forward FLOPs (or
measured seconds with ``profile=True``), its backward 2x that. The cutter
balances the per-stage time ``F + B``; the predicted step time comes from
``schedule.simulate`` with these per-stage costs.

**Memory.** For each stage ``s`` on a device (a device may hold several:
interleaved / V placements, via ``schedule.placement``)::

    params     = bytes of the parameter leaves stage s reads (shared leaves once)
    grads      = grad_bytes_per_param_byte      * params   (default 1.0)
    optimizer  = optimizer_bytes_per_param_byte * params   (default 2.0: Adam m, v)
    residuals  = in_flight(s) * residual bytes per microbatch of stage s
    transfers  = 2 * (bytes received + bytes sent)  (activation + cotangent buffers)
    workspace  = workspace_residual_sets * residual bytes per microbatch of stage s

``in_flight(s)`` is the stage's peak number of live residual sets under the
schedule (from the simulator; 1F1B: ``min(m, p - s)``). The workspace is what a
device holds while it runs one action beyond the stored residuals: the write
window and read slice of the residual pool, branch outputs and the backward's own
temporaries, each about one residual set of the stage in size (measured on CPU
with jaxpipe's SPMD runtime: about 2 sets for GPT blocks, 3-5 for plain MLPs whose
matmul backward temporaries are large next to their small residuals). A device
*needs* the sum over its stages, with the workspace of its largest stage only
(``CutResult.device_memory``). Two memory models turn that into the number to
minimise (``Cut.memory_model``):

* ``"spmd"`` (default): what jaxpipe's one-program SPMD runtime allocates. All
  devices run the same program, so buffers have one shape. Parameters (and their
  gradients and optimizer state) are whole-array slots: every device gets, for
  each (shape, dtype) class, as many slots as the busiest device needs, so an
  embedding costs one slot everywhere and repeated blocks pad to the device with
  the most. Residual/message pools are as large as the *busiest device's*, and
  the workspace is that of the stage with the largest residual set. Peak =
  ``(1 + grad + opt) * sum_class max_device(params of the class) +
  max_device(residuals + transfers) + workspace_residual_sets *
  max_stage(residual bytes)`` (``CutResult.padded_memory``).
* ``"device"``: each device holds exactly its own stages' bytes
  (``max_device(sum of its stages)``), as an MPMD runtime would.

Because early 1F1B stages hold more microbatches, a compute-balanced cut
over-fills the first devices; the ``"memory"`` objective moves layers towards
later stages within a time slack.

**Search.** Stages are contiguous, so every objective is built from min-max
(bottleneck) problems over the ``(n+1)^2`` segment ranges, solved exactly by
dynamic programming over stages (``O(stages * segments^2)``, vectorised; 200
segments x 16 stages takes milliseconds). The ``"spmd"`` model has three maxima
(parameters and residual sets over stages, activations over devices); it is solved
exactly by sweeping the residual and parameter thresholds along the Pareto front.
Memory budgets bisect over achievable stage times. Ties are broken by a second
objective (memory for "time", time for "memory"), then by sums of squares so
non-bottleneck stages are balanced too. When a device holds several stages its
activation memory is a sum over non-adjacent stages, which the stage-by-stage DP
cannot express; then small problems are enumerated exactly and large ones use a
weighted DP followed by a local search over cut positions (``CutResult.exact``
says which).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

from jaxpipe.cost import SegmentCost

__all__ = ["Cut", "CutError", "CutResult", "MemoryBreakdown", "choose_cuts", "partition"]

Objective = Literal["time", "memory"]
MemoryModel = Literal["spmd", "device"]

# Enumerate all cuts exactly when a device holds several stages and there are at most
# this many candidate cuts (vectorised; tens of ms at the limit).
_ENUM_LIMIT = 60_000


class CutError(ValueError):
    """The requested cut is impossible; the message says what would make it possible."""


@dataclass(frozen=True)
class Cut:
    """How to cut a model into pipeline stages (``jp.pipeline(..., cut=jp.Cut(...))``).

    Examples::

        jp.Cut()                              # balance compute (min max stage time)
        jp.Cut(objective="memory")            # min peak device memory, <=10% slower
        jp.Cut(memory_budget=40 * 2**30)      # fastest cut fitting 40 GiB per device
        jp.Cut(indices=[3, 7, 11])            # new stages begin after markers 3, 7, 11

    Attributes:
      indices: explicit cut: sorted indices into the model's markers after which a
        new stage begins (``num_stages - 1`` of them). Overrides the objective.
      objective: ``"time"`` minimises the maximum stage time; ``"memory"``
        minimises peak device memory among cuts whose maximum stage time is within
        ``time_slack`` of the best possible.
      memory_budget: bytes per device. When set, minimise the maximum stage time
        subject to the peak device memory fitting the budget (the objective is
        ignored). An infeasible budget raises :class:`CutError` naming the smallest
        feasible one.
      time_slack: allowed slow-down for ``objective="memory"`` (0.10 = 10%).
      optimizer_bytes_per_param_byte: optimizer state per parameter byte (2.0 for
        Adam's two moments in the parameter dtype; 0.0 for SGD; 1.0 for momentum).
      grad_bytes_per_param_byte: gradient bytes per parameter byte (1.0).
      memory_model: ``"spmd"`` (default; buffers padded to one shape on every
        device, as jaxpipe's runtime allocates them) or ``"device"`` (each device
        holds only its own stages' bytes). See the module docstring.
      workspace_residual_sets: transient memory while a stage runs, in residual
        sets (per-microbatch residual bytes) of that stage; 1.0 matches the SPMD
        runtime's compiled MLP and transformer programs on CPU within 5% (the running
        stage's residuals are written straight into the pool, so about one set is
        transient), 0.0 ignores it.
      profile: time each segment's compiled forward/backward instead of counting
        FLOPs (slower to plan, noisy on shared machines).

    Memory per parameter byte is ``1 + grad_bytes_per_param_byte +
    optimizer_bytes_per_param_byte`` (4.0 by default).
    """

    indices: Sequence[int] | None = None
    objective: Objective = "time"
    memory_budget: int | None = None
    time_slack: float = 0.10
    optimizer_bytes_per_param_byte: float = 2.0
    grad_bytes_per_param_byte: float = 1.0
    memory_model: MemoryModel = "spmd"
    workspace_residual_sets: float = 1.0
    profile: bool = False

    def __post_init__(self) -> None:
        if self.objective not in ("time", "memory"):
            raise CutError(f"Cut.objective must be 'time' or 'memory', got {self.objective!r}")
        if self.memory_model not in ("spmd", "device"):
            raise CutError(
                f"Cut.memory_model must be 'spmd' or 'device', got {self.memory_model!r}"
            )
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise CutError(f"Cut.memory_budget must be positive bytes, got {self.memory_budget}")
        if not self.time_slack >= 0:
            raise CutError(f"Cut.time_slack must be >= 0, got {self.time_slack}")
        if self.optimizer_bytes_per_param_byte < 0 or self.grad_bytes_per_param_byte < 0:
            raise CutError("Cut: bytes per parameter byte must be >= 0")
        if not self.workspace_residual_sets >= 0:
            raise CutError(
                f"Cut.workspace_residual_sets must be >= 0, got {self.workspace_residual_sets}")
        if self.indices is not None:
            idx = tuple(int(i) for i in self.indices)
            if list(idx) != sorted(set(idx)):
                raise CutError(f"Cut.indices must be strictly increasing, got {list(idx)}")
            object.__setattr__(self, "indices", idx)

    @property
    def bytes_per_param_byte(self) -> float:
        """Parameters + gradients + optimizer state, per parameter byte."""
        return 1.0 + self.grad_bytes_per_param_byte + self.optimizer_bytes_per_param_byte


@dataclass(frozen=True)
class MemoryBreakdown:
    """Predicted bytes of one stage or one device, by kind."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    residuals: float = 0.0
    transfers: float = 0.0
    workspace: float = 0.0

    @property
    def total(self) -> float:
        return (self.params + self.grads + self.optimizer + self.residuals + self.transfers
                + self.workspace)

    def __add__(self, other: MemoryBreakdown) -> MemoryBreakdown:
        """Two stages on one device: everything adds up but the workspace (one runs at
        a time, so the larger one counts)."""
        return MemoryBreakdown(
            self.params + other.params,
            self.grads + other.grads,
            self.optimizer + other.optimizer,
            self.residuals + other.residuals,
            self.transfers + other.transfers,
            max(self.workspace, other.workspace),
        )


@dataclass(frozen=True)
class CutResult:
    """The chosen cut and what it predicts.

    Attributes:
      cuts: marker indices after which a new stage begins (``num_stages - 1``).
      stage_segments: ``[start, end)`` segment range of every stage.
      stage_devices: device of every stage (``schedule.placement``).
      in_flight: peak live residual sets of every stage under the schedule.
      stage_fwd, stage_bwd: forward / backward cost of every stage (FLOPs, or
        seconds when profiled); ``stage_time = stage_fwd + stage_bwd``.
      stage_memory: predicted bytes of every stage, by kind.
      device_memory: what every device needs for its own stages (sum of its
        stages' breakdowns).
      padded_memory: what every device allocates under the SPMD runtime (buffers
        of one shape): parameter slots padded per class to the busiest device (and
        grads/optimizer alike), residuals and transfers of the device with the
        most activation bytes, the workspace of the stage with the largest
        residual set.
      memory_model: which of the two the search minimised; ``peak_memory`` is it.
      objective: what was optimised ("time", "memory", "budget" or "explicit").
      exact: the primary objective is provably optimal (False only for the
        local-search fallback on large problems with several stages per device).
      time_optimum: the smallest achievable maximum stage time for this model.
      makespan, bubble_fraction: from ``schedule.simulate`` with these stage costs
        (``None`` when no schedule was given).
      time_unit: ``"flops"``, or ``"s"`` when profiled.
    """

    cuts: tuple[int, ...]
    stage_segments: tuple[tuple[int, int], ...]
    stage_devices: tuple[int, ...]
    in_flight: tuple[int, ...]
    stage_fwd: tuple[float, ...]
    stage_bwd: tuple[float, ...]
    stage_memory: tuple[MemoryBreakdown, ...]
    device_memory: tuple[MemoryBreakdown, ...]
    padded_memory: MemoryBreakdown
    memory_model: str
    objective: str
    exact: bool
    time_optimum: float
    makespan: float | None = None
    bubble_fraction: float | None = None
    time_unit: str = "flops"
    segment_names: tuple[str, ...] = field(default=(), repr=False)

    @property
    def stage_time(self) -> tuple[float, ...]:
        return tuple(f + b for f, b in zip(self.stage_fwd, self.stage_bwd, strict=True))

    @property
    def max_stage_time(self) -> float:
        return max(self.stage_time)

    @property
    def max_device_memory(self) -> float:
        """The largest per-device need (sum over the device's own stages)."""
        return max(m.total for m in self.device_memory)

    @property
    def peak_memory(self) -> float:
        """Predicted peak bytes per device under ``memory_model`` (what was minimised)."""
        return self.padded_memory.total if self.memory_model == "spmd" else self.max_device_memory

    def action_cost(self, action: Any) -> float:
        """Cost of one schedule action under this cut (for ``schedule.simulate``)."""
        s = action.stage
        kind = action.kind
        if kind == "F":
            return self.stage_fwd[s]
        if kind == "B":
            return self.stage_bwd[s]
        if kind in ("I", "W"):  # split backward: input and weight grads, half each
            return 0.5 * self.stage_bwd[s]
        raise ValueError(f"unknown action kind {kind!r}")


def _fmt_bytes(b: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


# ---------------------------------------------------------------------------
# The problem: range matrices and partition evaluation


class _Problem:
    """Prefix sums and range matrices shared by all searches.

    Ranges are ``[a, b)`` over segment indices, ``0 <= a < b <= n``; matrices are
    ``(n+1, n+1)``. A *partition* is the list of ``S+1`` bounds ``0 = b_0 < ... <
    b_S = n``; stage ``k`` holds segments ``[b_k, b_{k+1})``.
    """

    def __init__(
        self,
        costs: Sequence[SegmentCost],
        placement: Sequence[int],
        in_flight: Sequence[int],
        cut: Cut,
    ) -> None:
        n, S = len(costs), len(placement)
        self.n, self.S = n, S
        self.cut = cut
        self.placement = np.asarray(placement, dtype=np.int64)
        self.D = int(self.placement.max()) + 1
        self.onehot = np.eye(self.D)[self.placement]  # (S, D)
        self.spd = int(np.bincount(self.placement).max())
        self.single = self.spd == 1  # every device holds at most one stage
        self.spmd = cut.memory_model == "spmd"
        self.A = cut.bytes_per_param_byte
        self.kw = cut.workspace_residual_sets
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

        # Parameter bytes of [a, b), in total and per padding group (see _param_groups).
        groups, self.p_const, self.params = _param_groups(costs, self.single)
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
        """Everything stage k needs over each range, alone on its device ("device" model)."""
        if k not in self._mem:
            self._mem[k] = self.A * self.params + self.act(k) + self.kw * self.residual
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
        """Parameter bytes every device holds under SPMD padding, for (C, S, G) groups."""
        per_device = np.einsum("csg,sd->cdg", PG, self.onehot)
        return self.p_const + per_device.max(axis=1).sum(axis=-1)

    def keys(self, P: np.ndarray, X: np.ndarray, R: np.ndarray, PG: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray]:
        """(peak memory under the model, sum of squared device needs) for (C, S) stages."""
        # workspace of each device: its largest stage's residual set
        work = np.where(self.onehot.T[None], R[:, None, :], 0.0).max(axis=-1)  # (C, D)
        own = (self.A * P + X) @ self.onehot + self.kw * work  # what each device needs
        if self.spmd:
            peak = (self.A * self.padded_params(PG) + (X @ self.onehot).max(axis=-1)
                    + self.kw * R.max(axis=-1))
        else:
            peak = own.max(axis=-1)
        return peak, (own**2).sum(axis=-1)

    def memory(self, bounds: Sequence[int]) -> float:
        return float(self.keys(*self.stage_parts(np.asarray(bounds)[None, :]))[0][0])

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


def _range_bytes(n: int, additive: np.ndarray, shared: list[tuple[list[int], float]]
                 ) -> np.ndarray:
    """Bytes of segment ranges ``[a, b)`` as an ``(n+1, n+1)`` matrix.

    ``additive[k]``: bytes only segment ``k`` reads. ``shared``: (reader segments,
    bytes) of leaves several segments read; such a leaf counts once if any of its
    readers lies in the range.
    """
    idx = np.arange(n + 1)
    pre = np.concatenate([[0.0], np.cumsum(additive)])
    out = pre[None, :] - pre[:, None]
    for segs, nbytes in shared:
        nxt = np.full(n + 1, n + 1)  # first reader at or after a
        for s in sorted(segs, reverse=True):
            nxt[: s + 1] = s
        out = out + nbytes * (nxt[:, None] < idx[None, :])
    return out


def _param_groups(costs: Sequence[SegmentCost], single: bool
                  ) -> tuple[list[np.ndarray], float, np.ndarray]:
    """Parameter bytes of every range: per padding group, a constant, and in total.

    jaxpipe's SPMD runtime stores parameters as whole-array slots: a device needs one
    slot per leaf of its stages, per (shape, dtype) class, and every device gets the
    most slots of each class any device needs. So the padded bytes are a sum over
    classes of a maximum over devices. A class with a single leaf costs its bytes
    whatever the cut (when devices hold one stage each, or one segment reads it);
    classes whose per-segment bytes are proportional (the same block repeated) merge
    into one group. Leaves without a class (hand-built costs) and private bytes form
    one group, which makes the padding ``max_device(params)``.
    """
    n = len(costs)
    readers: dict[int, list[int]] = {}
    nbytes: dict[int, int] = {}
    klass: dict[int, Any] = {}
    anon: Any = object()
    for k, c in enumerate(costs):
        for leaf, b in c.param_leaf_bytes.items():
            readers.setdefault(leaf, []).append(k)
            nbytes[leaf] = b
            klass.setdefault(leaf, c.param_leaf_class.get(leaf, anon))
    members: dict[Any, list[int]] = {}
    for leaf, key in klass.items():
        members.setdefault(key, []).append(leaf)
    private = np.array([c.private_param_bytes for c in costs], np.float64)
    members.setdefault(anon, [])

    const = 0.0
    merged: dict[tuple, list[Any]] = {}  # proportional signature -> [additive, shared]
    total = np.zeros((n + 1, n + 1))
    for key, leaves in members.items():
        additive = private.copy() if key is anon else np.zeros(n)
        shared = []
        for leaf in leaves:
            if len(readers[leaf]) == 1:
                additive[readers[leaf][0]] += nbytes[leaf]
            else:
                shared.append((readers[leaf], float(nbytes[leaf])))
        matrix = _range_bytes(n, additive, shared)
        total += matrix
        if key is not anon and len(leaves) == 1 and (single or not shared):
            const += float(sum(nbytes[leaf] for leaf in leaves))
            continue
        if not additive.any() and not shared:
            continue
        if shared or key is anon:
            sig: tuple = ("own", id(key))
        else:  # proportional per-segment bytes merge
            sig = tuple(np.round(additive / additive.max(), 12))
        if sig in merged:
            merged[sig][0] += additive
            merged[sig][1] += shared
        else:
            merged[sig] = [additive, list(shared)]
    groups = [_range_bytes(n, add, sh) for add, sh in merged.values()]
    idx = np.arange(n + 1)
    total = np.where(idx[:, None] >= idx[None, :], np.inf, total)
    return groups, const, total


def _inf_unless(ok: np.ndarray, m: np.ndarray) -> np.ndarray:
    return np.where(ok, m, np.inf)


# ---------------------------------------------------------------------------
# Minimum memory for a time cap


def _min_memory(pb: _Problem, cap: float, good_enough: float | None = None) -> list[int]:
    """A partition of least peak memory with every stage time <= cap (cap >= optimum).

    Exact when every device holds one stage; otherwise a heuristic. May stop early
    once it is clear whether some partition's memory is <= ``good_enough``: with one
    that is, or (exact searches only) with any when none can be.
    """
    if not pb.single:
        return _min_memory_shared(pb, cap, good_enough)
    ok = pb.time <= cap
    if not pb.spmd:
        _, bounds = pb.minmax(lambda k: _inf_unless(ok, pb.mem(k)))
        assert bounds is not None
        return bounds
    return min(_spmd_front(pb, ok, good_enough), key=lambda f: f[0])[-1]


def _spmd_front(
    pb: _Problem, ok: np.ndarray, good_enough: float | None = None
) -> list[tuple[float, float, float, float, list[int]]]:
    """Pareto front of the "spmd" peak for single-stage devices.

    The peak has three maxima, ``A * (const + max_s params) + kw * max_s residual
    set + max_s act`` (params: the padding-group bytes; exact with one group). For
    a residual threshold (outer loop) and a parameter threshold (inner loop), a DP
    minimises ``max_s act`` over the cuts allowed by ``ok`` whose
    stages stay below both; each next threshold is strictly below what the cuts
    found so far used. Every optimal cut has the parameter and residual maxima of
    some visited point, so the minimum over the returned ``(total, params,
    residual, act, bounds)`` points is exact. Lower bounds stop both loops early;
    with ``good_enough`` they also stop once that level is reached or out of reach.
    """
    target = -math.inf if good_enough is None else good_enough
    p_floor, _ = pb.minmax(lambda k: _inf_unless(ok, pb.pvar))
    p_floor += pb.p_const
    r_floor = pb.minmax(lambda k: _inf_unless(ok, pb.residual))[0] if pb.kw else 0.0
    front: list[tuple[float, float, float, float, list[int]]] = []
    best = math.inf
    r_thr = math.inf
    while True:
        ok_r = ok & (pb.residual < r_thr) if math.isfinite(r_thr) else ok
        p_thr, r_seen, first = math.inf, 0.0, None
        while True:
            allowed = ok_r & (pb.pvar < p_thr) if math.isfinite(p_thr) else ok_r
            act_max, bounds = pb.minmax(
                lambda k, allowed=allowed: _inf_unless(allowed, pb.act(k)))
            if bounds is None:
                break
            first = act_max if first is None else first
            _, _, R, PG = pb.stage_parts(np.asarray(bounds))
            p_used, r_used = float(PG.sum(axis=-1).max()), float(R.max())
            r_seen = max(r_seen, r_used)
            total = pb.memory(bounds)  # = A (const + p_used) + kw r_used + act_max
            front.append((total, p_used, r_used, act_max, bounds))
            best = min(best, total)
            # Tighter parameter thresholds only raise act_max.
            bound = pb.A * p_floor + pb.kw * r_floor + act_max
            if best <= target or bound > best or (good_enough is not None and bound > target):
                break
            p_thr = p_used
        # Tighter residual thresholds only raise the first (unconstrained-params) act.
        if first is None or not pb.kw or best <= target:
            break
        bound = pb.A * p_floor + pb.kw * r_floor + first
        if bound > best or (good_enough is not None and bound > target):
            break
        r_thr = r_seen
    return front


def _box_mask(pb: _Problem, p_max: float, r_max: float, x_max: float
              ) -> Callable[[int], np.ndarray]:
    """Ranges within (params, residual set, activations) maxima: spmd peak stays below."""
    return lambda k: (pb.pvar <= p_max) & (pb.residual <= r_max) & (pb.act(k) <= x_max)


def _polish_masks(pb: _Problem, bounds: Sequence[int]) -> Callable[[int], np.ndarray]:
    """Per-stage masks under which every partition's memory is <= that of ``bounds``."""
    _, X, R, PG = pb.stage_parts(np.asarray(bounds))
    if pb.spmd:
        return _box_mask(pb, float(PG.sum(axis=-1).max()), float(R.max()), float(X.max()))
    m_max = pb.memory(bounds)
    return lambda k: pb.mem(k) <= m_max


def _search_single(pb: _Problem, t_opt: float) -> tuple[list[int], str]:
    """Exact search when every device holds one stage."""
    cut = pb.cut
    time = pb.time
    if cut.memory_budget is not None:
        budget = float(cut.memory_budget)
        t_b = _min_time_within_budget(pb, t_opt, budget, exact=True)
        best = _min_memory(pb, t_b)
        mask = _polish_masks(pb, best)
        _, bounds = pb.minsum(lambda k: _inf_unless((time <= t_b) & mask(k), time**2))
        objective = "budget"
    elif cut.objective == "time":
        best = _min_memory(pb, t_opt)
        mask = _polish_masks(pb, best)
        _, bounds = pb.minsum(lambda k: _inf_unless((time <= t_opt) & mask(k), time**2))
        objective = "time"
    else:
        cap = (1.0 + cut.time_slack) * t_opt
        if pb.spmd:
            # Fastest among all memory-optimal cuts: they lie on the front's minima.
            front = _spmd_front(pb, time <= cap)
            m_opt, *_, best = min(front, key=lambda f: f[0])
            t_b, mask = math.inf, None
            for total, p_max, r_max, x_max, _ in front:
                if total > m_opt * (1 + 1e-12):
                    continue
                m = _box_mask(pb, p_max, r_max, x_max)
                t, _ = pb.minmax(lambda k, m=m: _inf_unless((time <= cap) & m(k), time))
                if t < t_b:
                    t_b, mask = t, m
            assert mask is not None
        else:
            best = _min_memory(pb, cap)
            mask = _polish_masks(pb, best)
            t_b, _ = pb.minmax(lambda k: _inf_unless((time <= cap) & mask(k), time))
        square = pb.act if pb.spmd else pb.mem
        _, bounds = pb.minsum(
            lambda k: _inf_unless((time <= t_b) & mask(k), square(k) ** 2))
        objective = "memory"
    assert bounds is not None
    if pb.memory(bounds) > pb.memory(best):  # polish masks are loose with 2+ groups
        bounds = best
    return bounds, objective


def _min_time_within_budget(pb: _Problem, t_opt: float, budget: float, exact: bool) -> float:
    """Smallest stage-time cap whose least-memory cut fits ``budget`` (bisection)."""
    loosest = _min_memory(pb, math.inf, good_enough=budget)
    if pb.memory(loosest) > budget:  # infeasible: find the true minimum for the message
        raise _infeasible(pb, pb.memory(_min_memory(pb, math.inf)), exact)
    ts = np.unique(pb.time[np.isfinite(pb.time)])
    ts = ts[(ts >= t_opt) & (ts <= pb.max_time(loosest))]
    lo, hi = 0, len(ts) - 1  # invariant: ts[hi] is feasible
    while lo < hi:
        mid = (lo + hi) // 2
        if pb.memory(_min_memory(pb, float(ts[mid]), good_enough=budget)) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return float(ts[hi])


def _infeasible(pb: _Problem, smallest: float, exact: bool) -> CutError:
    budget = pb.cut.memory_budget
    qual = "smallest feasible" if exact else "smallest found (heuristic search)"
    return CutError(
        f"memory budget of {_fmt_bytes(budget)} ({budget} bytes) per device is infeasible "
        f"for this model and schedule ({pb.cut.memory_model} memory model): the {qual} "
        f"budget is {_fmt_bytes(smallest)} ({math.ceil(smallest)} bytes); raise "
        f"memory_budget, use more stages, a schedule with fewer microbatches in flight, "
        f"or less optimizer state"
    )


# ---------------------------------------------------------------------------
# Devices holding several stages


def _search_shared(pb: _Problem, t_opt: float) -> tuple[list[int], str, bool]:
    """Devices hold several stages: enumerate small problems, else DP + local search."""
    cut = pb.cut
    objective = "budget" if cut.memory_budget is not None else cut.objective
    if math.comb(pb.n - 1, pb.S - 1) <= _ENUM_LIMIT:
        return _enumerate(pb, t_opt), objective, True
    if objective == "budget":
        t_b = _min_time_within_budget(pb, t_opt, float(cut.memory_budget), exact=False)
        return _min_memory(pb, t_b), objective, False
    # Time is per stage, so the "time" objective stays exact; memory is heuristic.
    bounds = _min_memory(pb, t_opt)
    if objective == "memory":
        # A looser cap must never come out worse: also polish the time-optimal answer.
        cap = (1.0 + cut.time_slack) * t_opt
        cands = [_min_memory(pb, cap), _local_search(pb, bounds, cap)]
        bounds = min(cands, key=lambda b: _key(pb, b))
    return bounds, objective, objective == "time"


def _min_memory_shared(pb: _Problem, cap: float, good_enough: float | None) -> list[int]:
    """Heuristic min peak memory with stage times <= cap, devices holding several stages.

    Give stage ``s`` a share ``w_s`` of its device (shares on a device sum to 1)
    and minimise ``max_s q_s / w_s`` exactly by DP, where ``q_s`` is bytes that add
    up per device: every device's sum is then at most that value, and with the
    optimal cut's own shares this finds the optimum. Shares are re-estimated from
    each round's cut (damped fixed-point iteration); the best cut of each run is
    polished by local search. The "device" model's ``q`` is everything a stage
    needs; the "spmd" peak is a sum of separate maxima, so several ``q`` are tried
    (activations; plus parameters; plus the workspace) and, for activations, a few
    parameter thresholds down the Pareto front.
    """
    good_enough = -math.inf if good_enough is None else good_enough
    ok = pb.time <= cap
    per_device = np.bincount(pb.placement, minlength=pb.D)[pb.placement]
    _, best = pb.minmax(lambda k: pb.time)  # the compute-balanced cut is always allowed
    assert best is not None
    best_key = _key(pb, best)

    def q_act(P: np.ndarray, X: np.ndarray, R: np.ndarray) -> np.ndarray:
        return X

    def q_act_params(P: np.ndarray, X: np.ndarray, R: np.ndarray) -> np.ndarray:
        return X + pb.A * P

    def q_all(P: np.ndarray, X: np.ndarray, R: np.ndarray) -> np.ndarray:
        return X + pb.A * P + pb.kw * R

    # (per-stage quantity over ranges, same for a partition's stages, thresholds)
    runs: list[tuple[Callable[[int], np.ndarray], Callable[..., np.ndarray], int]]
    if pb.spmd:
        runs = [(pb.act, q_act, 4),
                (lambda k: pb.act(k) + pb.A * pb.pvar, q_act_params, 1),
                (lambda k: pb.act(k) + pb.A * pb.pvar + pb.kw * pb.residual, q_all, 1)]
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
                                 _inf_unless(allowed, quantity(k) / w[k]))
                if b is None:
                    break
                key = _key(pb, b)
                if key[0] <= good_enough:
                    return b
                if key < round_key:
                    round_best, round_key = b, key
                P, X, R, PG = pb.stage_parts(np.asarray(b))
                q = q_of(PG.sum(axis=-1) if pb.spmd else P, X, R)
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
        polished = _local_search(pb, b, cap)
        key = _key(pb, polished)
        if key < best_key:
            best, best_key = polished, key
        if best_key[0] <= good_enough:
            break
    return best


def _key(pb: _Problem, bounds: Sequence[int]) -> tuple[float, float]:
    peak, sq = pb.keys(*pb.stage_parts(np.asarray(bounds)[None, :]))
    return float(peak[0]), float(sq[0])


def _local_search(pb: _Problem, bounds: Sequence[int], cap: float) -> list[int]:
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
    best = _key(pb, b)

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


def _enumerate(pb: _Problem, t_opt: float) -> list[int]:
    """Exact search over every cut (small problems with several stages per device)."""
    cut, n, S = pb.cut, pb.n, pb.S
    inner = np.array(list(itertools.combinations(range(1, n), S - 1)), dtype=np.int64)
    inner = inner.reshape(-1, S - 1)
    K = inner.shape[0]
    bounds = np.concatenate([np.zeros((K, 1), np.int64), inner, np.full((K, 1), n)], axis=1)
    times = pb.time[bounds[:, :-1], bounds[:, 1:]]
    max_t = times.max(axis=1)
    peak, sq = pb.keys(*pb.stage_parts(bounds))
    if cut.memory_budget is not None:
        ok = peak <= cut.memory_budget
        if not ok.any():
            raise _infeasible(pb, float(peak.min()), exact=True)
        order = np.lexsort(((times**2).sum(1), peak, max_t, ~ok))
    elif cut.objective == "time":
        ok = max_t <= t_opt
        order = np.lexsort(((times**2).sum(1), peak, ~ok))
    else:
        ok = max_t <= (1.0 + cut.time_slack) * t_opt
        order = np.lexsort((sq, max_t, peak, ~ok))
    return [int(x) for x in bounds[order[0]]]


# ---------------------------------------------------------------------------
# Public entry points


def _check_inputs(n: int, S: int, placement: Sequence[int], in_flight: Sequence[int]) -> None:
    if S < 1:
        raise CutError("the schedule has no stages")
    if n < S:
        raise CutError(
            f"the schedule has {S} stages but the model has only {n} cuttable segment"
            f"{'s' if n != 1 else ''} ({n - 1} marker{'s' if n != 2 else ''}); add at least "
            f"{S - 1} markers (jp.boundary or @jp.layer) or use fewer stages"
        )
    if len(in_flight) != S:
        raise CutError(f"in_flight has {len(in_flight)} entries for {S} stages")
    if any(int(d) < 0 for d in placement):
        raise CutError(f"placement has a negative device: {list(placement)}")


def _explicit_bounds(indices: Sequence[int], n: int, S: int) -> list[int]:
    if len(indices) != S - 1:
        raise CutError(
            f"Cut.indices has {len(indices)} entries but {S} stages need exactly {S - 1}"
        )
    if indices and (indices[0] < 0 or indices[-1] > n - 2):
        raise CutError(
            f"Cut.indices must lie in [0, {n - 2}] (the model has {n - 1} markers), "
            f"got {list(indices)}"
        )
    return [0] + [i + 1 for i in indices] + [n]


def partition(
    costs: Sequence[SegmentCost],
    placement: Sequence[int],
    in_flight: Sequence[int],
    cut: Cut | None = None,
) -> CutResult:
    """Choose contiguous stages for ``costs`` given the stage placement and in-flight counts.

    This is the schedule-independent core of :func:`choose_cuts`: ``placement[s]``
    is the device of stage ``s`` and ``in_flight[s]`` its peak number of live
    residual sets. ``len(placement)`` is the number of stages.

    Raises:
      CutError: more stages than segments, a bad explicit cut, or an infeasible
        memory budget (the message names the smallest feasible budget).
    """
    cut = cut or Cut()
    costs = list(costs)
    placement = [int(d) for d in placement]
    n, S = len(costs), len(placement)
    _check_inputs(n, S, placement, in_flight)
    pb = _Problem(costs, placement, in_flight, cut)
    t_opt, _ = pb.minmax(lambda k: pb.time)

    if cut.indices is not None:
        bounds = _explicit_bounds(cut.indices, n, S)
        objective, exact = "explicit", True
        if cut.memory_budget is not None and pb.memory(bounds) > cut.memory_budget:
            raise CutError(
                f"the explicit cut {list(cut.indices)} needs {_fmt_bytes(pb.memory(bounds))} "
                f"per device ({cut.memory_model} memory model), over the memory budget of "
                f"{_fmt_bytes(cut.memory_budget)}"
            )
    elif pb.single:
        bounds, objective = _search_single(pb, t_opt)
        exact = objective == "time" or not pb.spmd or pb.params_exact
    else:
        bounds, objective, exact = _search_shared(pb, t_opt)
    return _result(pb, costs, bounds, objective, exact, t_opt)


def _result(
    pb: _Problem,
    costs: Sequence[SegmentCost],
    bounds: Sequence[int],
    objective: str,
    exact: bool,
    t_opt: float,
) -> CutResult:
    cut = pb.cut
    stage_mem = []
    for k in range(pb.S):
        a, b = bounds[k], bounds[k + 1]
        p = float(pb.params[a, b])
        stage_mem.append(
            MemoryBreakdown(
                params=p,
                grads=cut.grad_bytes_per_param_byte * p,
                optimizer=cut.optimizer_bytes_per_param_byte * p,
                residuals=float(pb.in_flight[k] * pb.residual[a, b]),
                transfers=float(pb.transfers[a, b]),
                workspace=float(pb.kw * pb.residual[a, b]),
            )
        )
    device_mem = [MemoryBreakdown() for _ in range(pb.D)]
    for k, d in enumerate(pb.placement):
        device_mem[d] = device_mem[d] + stage_mem[k]
    p_pad = float(pb.padded_params(pb.stage_parts(np.asarray(bounds)[None, :])[3])[0])
    busiest = max(device_mem, key=lambda m: m.residuals + m.transfers)
    padded = MemoryBreakdown(
        params=p_pad,
        grads=cut.grad_bytes_per_param_byte * p_pad,
        optimizer=cut.optimizer_bytes_per_param_byte * p_pad,
        residuals=busiest.residuals,
        transfers=busiest.transfers,
        workspace=max(m.workspace for m in stage_mem),
    )
    return CutResult(
        cuts=tuple(int(b) - 1 for b in bounds[1:-1]),
        stage_segments=tuple((int(bounds[k]), int(bounds[k + 1])) for k in range(pb.S)),
        stage_devices=tuple(int(d) for d in pb.placement),
        in_flight=tuple(int(c) for c in pb.in_flight),
        stage_fwd=tuple(float(pb.fwd_p[bounds[k + 1]] - pb.fwd_p[bounds[k]])
                        for k in range(pb.S)),
        stage_bwd=tuple(float(pb.bwd_p[bounds[k + 1]] - pb.bwd_p[bounds[k]])
                        for k in range(pb.S)),
        stage_memory=tuple(stage_mem),
        device_memory=tuple(device_mem),
        padded_memory=padded,
        memory_model=cut.memory_model,
        objective=objective,
        exact=exact,
        time_optimum=float(t_opt),
        time_unit=pb.time_unit,
        segment_names=tuple(c.name for c in costs),
    )


def choose_cuts(
    costs: Sequence[SegmentCost],
    schedule: Any,
    cut: Cut | None = None,
    *,
    in_flight: Sequence[int] | None = None,
    memory_model: Any = None,
) -> CutResult:
    """Choose the stages of a pipeline for ``schedule`` (what ``cut="auto"`` runs).

    Args:
      costs: one :class:`~jaxpipe.cost.SegmentCost` per segment, in program order
        (:func:`jaxpipe.cost.segment_costs`).
      schedule: a ``jp.Schedule``; supplies ``num_stages``, ``placement(stage)``,
        and, through ``simulate()``, every stage's peak in-flight microbatches.
      cut: options (objective, memory budget, explicit indices); default
        ``Cut()`` balances compute.
      in_flight: override the simulator's per-stage peak in-flight counts.

    Returns:
      A :class:`CutResult` whose ``makespan`` / ``bubble_fraction`` come from
      simulating the schedule with the chosen stage costs.
    """
    S = schedule.num_stages
    placement = [int(schedule.placement(s)) for s in range(S)]
    if in_flight is None:
        peaks = schedule.simulate(costs=None).stage_peak_in_flight
        counts = [int(peaks[s]) for s in range(S)]
    else:
        counts = list(in_flight)
    result = partition(costs, placement, counts, cut)
    timeline = schedule.simulate(costs=result.action_cost)
    if in_flight is None:
        # In-flight counts follow from each device's action order, not from timing,
        # but a simulator is free to differ: re-cut once if the chosen costs change them.
        peaks = timeline.stage_peak_in_flight
        if [int(peaks[s]) for s in range(S)] != counts:
            counts = [int(peaks[s]) for s in range(S)]
            result = partition(costs, placement, counts, cut)
            timeline = schedule.simulate(costs=result.action_cost)
    return replace(result, makespan=float(timeline.makespan),
                   bubble_fraction=float(timeline.bubble_fraction))


SPMD_MEMORY = "spmd"  # temporary placeholders (the cut package defines MemoryModel)
DEVICE_MEMORY = "device"
