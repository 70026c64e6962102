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
(``CutResult.device_memory``).

**Memory models.** What a device *allocates* depends on the runtime, which says so
with a :class:`MemoryModel` passed to :func:`choose_cuts` (``Cut.memory_model``
overrides it for experiments); the cutter never assumes a runtime's layout:

* padded (:data:`SPMD_MEMORY`, jaxpipe's one-program SPMD runtime): all devices
  run the same program, so buffers have one shape. Parameters (and their
  gradients and optimizer state) are padded per storage class
  (``MemoryModel.param_class``; SPMD: whole-array slots per (shape, dtype)) to
  the busiest device, so an embedding costs one slot everywhere and repeated
  blocks pad to the device with the most. Residual/message pools are as large as
  the *busiest device's*, and the workspace is that of the stage with the largest
  residual set. Peak = ``(1 + grad + opt) * sum_class max_device(params of the
  class) + max_device(residuals + transfers) + workspace_residual_sets *
  max_stage(residual bytes)`` (``CutResult.padded_memory``).
* not padded (:data:`DEVICE_MEMORY`): each device holds exactly its own stages'
  bytes (``max_device(sum of its stages)``), as an MPMD runtime would.

Because early 1F1B stages hold more microbatches, a compute-balanced cut
over-fills the first devices; the ``"memory"`` objective moves layers towards
later stages within a time slack.

**Search.** Stages are contiguous, so every objective is built from min-max
(bottleneck) problems over the ``(n+1)^2`` segment ranges, solved by dynamic
programming over stages (``O(stages * segments^2)``, vectorised; 200 segments x 16
stages takes milliseconds). With one stage per device the searches are exact
(:mod:`jaxpipe.cut.search`); memory budgets bisect over achievable stage times, and
ties are broken by a second objective (memory for "time", time for "memory"), then
by sums of squares so non-bottleneck stages are balanced too. Devices holding
several stages are enumerated exactly when small, else searched heuristically
(:mod:`jaxpipe.cut.shared`; ``CutResult.exact`` says which).

The package: ``options.py`` (:class:`Cut`, :class:`CutError`), ``model.py``
(:class:`MemoryModel`, parameter padding groups), ``problem.py`` (range matrices
and DPs), ``search.py`` and ``shared.py`` (the searches), ``result.py``
(:class:`CutResult`, :class:`MemoryBreakdown`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from jaxpipe.avals import format_bytes
from jaxpipe.cost import SegmentCost
from jaxpipe.cut.model import DEVICE_MEMORY, SPMD_MEMORY, MemoryModel
from jaxpipe.cut.options import Cut, CutError
from jaxpipe.cut.problem import Problem
from jaxpipe.cut.result import CutResult, MemoryBreakdown, describe
from jaxpipe.cut.search import search_single
from jaxpipe.cut.shared import search_shared

__all__ = [
    "Cut",
    "CutError",
    "CutResult",
    "MemoryBreakdown",
    "MemoryModel",
    "SPMD_MEMORY",
    "DEVICE_MEMORY",
    "choose_cuts",
    "partition",
]


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
    *,
    memory_model: MemoryModel = SPMD_MEMORY,
) -> CutResult:
    """Choose contiguous stages for ``costs`` given the stage placement and in-flight counts.

    This is the schedule-independent core of :func:`choose_cuts`: ``placement[s]``
    is the device of stage ``s`` and ``in_flight[s]`` its peak number of live
    residual sets. ``len(placement)`` is the number of stages. ``memory_model`` is
    the runtime's (``cut.memory_model`` overrides it).

    Raises:
      CutError: more stages than segments, a bad explicit cut, or an infeasible
        memory budget (the message names the smallest feasible budget).
    """
    cut = cut or Cut()
    if not isinstance(memory_model, MemoryModel):
        raise CutError(f"memory_model must be a jaxpipe.cut.MemoryModel (e.g. "
                       f"jaxpipe.cut.SPMD_MEMORY), got {memory_model!r}")
    model = cut.resolve_memory_model(memory_model)
    costs = list(costs)
    placement = [int(d) for d in placement]
    n, S = len(costs), len(placement)
    _check_inputs(n, S, placement, in_flight)
    pb = Problem(costs, placement, in_flight, cut, model)
    t_opt, _ = pb.minmax(lambda k: pb.time)

    if cut.indices is not None:
        bounds = _explicit_bounds(cut.indices, n, S)
        objective, exact = "explicit", True
        if cut.memory_budget is not None and pb.memory(bounds) > cut.memory_budget:
            raise CutError(
                f"the explicit cut {list(cut.indices)} needs {format_bytes(pb.memory(bounds))} "
                f"per device ({model.name} memory model), over the memory budget of "
                f"{format_bytes(cut.memory_budget)}"
            )
    elif pb.single:
        bounds, objective = search_single(pb, t_opt)
        exact = objective == "time" or not pb.padded or pb.params_exact
    else:
        bounds, objective, exact = search_shared(pb, t_opt)
    return describe(pb, costs, bounds, objective, exact, t_opt)


def choose_cuts(
    costs: Sequence[SegmentCost],
    schedule: Any,
    cut: Cut | None = None,
    *,
    memory_model: MemoryModel = SPMD_MEMORY,
    in_flight: Sequence[int] | None = None,
) -> CutResult:
    """Choose the stages of a pipeline for ``schedule`` (what ``cut="auto"`` runs).

    Args:
      costs: one :class:`~jaxpipe.cost.SegmentCost` per segment, in program order
        (:func:`jaxpipe.cost.segment_costs`).
      schedule: a ``jp.Schedule``; supplies ``num_stages``, ``placement(stage)``,
        and, through ``simulate()``, every stage's peak in-flight microbatches.
      cut: options (objective, memory budget, explicit indices); default
        ``Cut()`` balances compute.
      memory_model: how the runtime that will run the pipeline lays out memory
        (:data:`SPMD_MEMORY` for jaxpipe's SPMD runtime, the default);
        ``cut.memory_model`` overrides it.
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
    result = partition(costs, placement, counts, cut, memory_model=memory_model)
    timeline = schedule.simulate(costs=result.action_cost)
    if in_flight is None:
        # In-flight counts follow from each device's action order, not from timing,
        # but a simulator is free to differ: re-cut once if the chosen costs change them.
        peaks = timeline.stage_peak_in_flight
        if [int(peaks[s]) for s in range(S)] != counts:
            counts = [int(peaks[s]) for s in range(S)]
            result = partition(costs, placement, counts, cut, memory_model=memory_model)
            timeline = schedule.simulate(costs=result.action_cost)
    return replace(result, makespan=float(timeline.makespan),
                   bubble_fraction=float(timeline.bubble_fraction))
