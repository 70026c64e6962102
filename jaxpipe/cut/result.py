"""What the cutter reports: :class:`CutResult` and its :class:`MemoryBreakdown`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from jaxpipe.cut.cost import SegmentCost
from jaxpipe.cut.problem import Problem
from jaxpipe.stages.remat import Remat

__all__ = ["CutResult", "MemoryBreakdown", "describe"]


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
      in_flight: live residual sets of every stage at its device's peak under the
        schedule (:func:`jaxpipe.cut.pooled_in_flight`; one stage per device: its peak).
      stage_fwd, stage_bwd: forward / backward cost of every stage (FLOPs, or
        seconds when profiled), recomputation excluded.
      stage_recompute: what every stage's backward spends recomputing under its
        policy (same unit); ``stage_time = stage_fwd + stage_bwd + stage_recompute``.
      remat: every stage's recomputation policy (:class:`~jaxpipe.stages.remat.Remat`);
        ``jaxpipe.stages.split(..., remat=result.remat)`` applies it.
      stage_memory: predicted bytes of every stage, by kind.
      device_memory: what every device needs for its own stages (sum of its
        stages' breakdowns).
      padded_memory: what every device allocates when buffers are padded to one
        shape (one SPMD program): parameters padded per storage class
        (``MemoryModel.param_class``) to the busiest device (and grads/optimizer
        alike), residuals and transfers of the device with the most activation
        bytes, the largest workspace of any stage.
      memory_model: name of the memory model the search used.
      objective: what was optimised ("time", "memory", "budget" or "explicit").
      exact: the primary objective is provably optimal (False only for the
        local-search fallback on large problems with several stages per device).
      time_optimum: the smallest achievable maximum stage time for this model.
      makespan, bubble_fraction: from ``schedule.simulate`` with these stage costs
        (``None`` when no schedule was given).
      time_unit: ``"flops"``, or ``"s"`` when profiled.
      padded: the memory model pads (``MemoryModel.padded``): ``peak_memory`` is
        ``padded_memory.total``, else ``max_device_memory``.
      memory_budget: the budget the cut was chosen under (bytes per device), or
        ``None``; budget_source: where it came from (``Cut.budget_source``).
    """

    cuts: tuple[int, ...]
    stage_segments: tuple[tuple[int, int], ...]
    stage_devices: tuple[int, ...]
    in_flight: tuple[float, ...]
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
    padded: bool = True
    segment_names: tuple[str, ...] = field(default=(), repr=False)
    remat: tuple[Remat, ...] = ()
    stage_recompute: tuple[float, ...] = ()
    memory_budget: float | None = None
    budget_source: str | None = None

    def __post_init__(self) -> None:
        S = len(self.stage_fwd)
        if not self.remat:
            object.__setattr__(self, "remat", (Remat.NONE,) * S)
        if not self.stage_recompute:
            object.__setattr__(self, "stage_recompute", (0.0,) * S)

    @property
    def stage_time(self) -> tuple[float, ...]:
        """Forward + backward + recomputation of every stage."""
        return tuple(f + b + r for f, b, r in zip(self.stage_fwd, self.stage_bwd,
                                                  self.stage_recompute, strict=True))

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
        return self.padded_memory.total if self.padded else self.max_device_memory

    def action_cost(self, action: Any) -> float:
        """Cost of one schedule action under this cut (for ``schedule.simulate``).

        A split backward's halves cost half the backward each; the recomputation runs
        in the input-gradient half (I), which needs the activations first.
        """
        s = action.stage
        kind = action.kind
        if kind == "F":
            return self.stage_fwd[s]
        if kind == "B":
            return self.stage_bwd[s] + self.stage_recompute[s]
        if kind == "I":
            return 0.5 * self.stage_bwd[s] + self.stage_recompute[s]
        if kind == "W":
            return 0.5 * self.stage_bwd[s]
        raise ValueError(f"unknown action kind {kind!r}")


def describe(
    pb: Problem,
    costs: Sequence[SegmentCost],
    bounds: Sequence[int],
    policies: Sequence[Remat],
    objective: str,
    exact: bool,
    t_opt: float,
) -> CutResult:
    """The :class:`CutResult` of partition ``bounds`` with ``policies``: per-stage costs
    and memory."""
    cut = pb.cut
    policies = tuple(policies)
    rows = [pb.policies.index(p) for p in policies]
    stage_mem = []
    for k in range(pb.S):
        a, b = bounds[k], bounds[k + 1]
        p = float(pb.params[a, b])
        stored = pb.policy_residual[rows[k], a, b]
        stage_mem.append(
            MemoryBreakdown(
                params=p,
                grads=cut.grad_bytes_per_param_byte * p,
                optimizer=cut.optimizer_bytes_per_param_byte * p,
                residuals=float(pb.model.residual_bytes(pb.in_flight[k], stored)),
                transfers=float(pb.transfers[a, b]),
                workspace=float(pb.stage_work(a, b, stored)),
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
        in_flight=tuple(float(c) for c in pb.in_flight),
        stage_fwd=tuple(float(pb.fwd_p[bounds[k + 1]] - pb.fwd_p[bounds[k]])
                        for k in range(pb.S)),
        stage_bwd=tuple(float(pb.bwd_p[bounds[k + 1]] - pb.bwd_p[bounds[k]])
                        for k in range(pb.S)),
        stage_memory=tuple(stage_mem),
        device_memory=tuple(device_mem),
        padded_memory=padded,
        memory_model=pb.model.name,
        objective=objective,
        exact=exact,
        time_optimum=float(t_opt),
        time_unit=pb.time_unit,
        padded=pb.padded,
        segment_names=tuple(c.name for c in costs),
        remat=policies,
        stage_recompute=tuple(float(pb.policy_recompute[rows[k], bounds[k], bounds[k + 1]])
                              for k in range(pb.S)),
        memory_budget=None if cut.memory_budget is None else float(cut.memory_budget),
        budget_source=cut.budget_source,
    )
