"""Memory-aware cutter: choose where the pipeline's stages begin, and what each recomputes.

The traced model is a chain of *segments* (code between consecutive
``jp.boundary`` markers, costed by :mod:`jaxpipe.cut.cost`). A cut assigns a
contiguous run of segments to each of ``schedule.num_stages`` stages, and a
recomputation policy (:class:`Remat`) to each stage.

**Time.** A stage's forward time is the sum of its segments' forward FLOPs (or
measured seconds with ``profile=True``), its backward 2x that, plus what its
policy recomputes (counted from the backward's jaxpr). The cutter balances the
per-stage time ``F + B + recompute``; the predicted step time comes from
``schedule.simulate`` with these per-stage costs (the recomputation runs in the
backward, or in its input-gradient half when the schedule splits it).

**Memory.** For each stage ``s`` on a device (a device may hold several:
interleaved / V placements, via ``schedule.placement``)::

    params     = bytes of the parameter leaves stage s reads (shared leaves once)
    grads      = grad_bytes_per_param_byte      * params   (default 1.0)
    optimizer  = optimizer_bytes_per_param_byte * params   (default 2.0: Adam m, v)
    residuals  = in_flight(s) * residual bytes per microbatch of stage s, under
                 its policy                          (MemoryModel.residual_bytes)
    transfers  = 2 * (bytes received + bytes sent)  (activation + cotangent buffers)
    workspace  = workspace_residual_sets * residual bytes of stage s without
                 recomputation + workspace_param_sets * params
                 + workspace_stored_sets * residual bytes of stage s under its
                 policy (0 for the SPMD runtime)    (MemoryModel.workspace_bytes)

``in_flight(s)`` is the stage's peak number of live residual sets under the
schedule (from the simulator; 1F1B: ``min(m, p - s)``), scaled where a device holds
several stages so that they add up to the device's own peak (:func:`pooled_in_flight`).
The workspace is what a device holds while it runs one action beyond what is stored:
the slices of the residual storage a backward reads, or the activations it recomputes
-- about the same whatever the policy -- and the parameter gradients it produces and
their accumulated sums (measured on CPU with jaxpipe's SPMD runtime: 0.2-0.8 of the full
residual set for GPT stages plus about twice the stage's parameter bytes; see
:data:`SPMD_MEMORY`). A device *needs* the sum over its stages, with the workspace
of its largest stage only (``CutResult.device_memory``).

**Memory models.** What a device *allocates* depends on the runtime, which says so
with a :class:`MemoryModel` passed to :func:`choose_cuts` (``Cut.memory_model``
overrides it for experiments); the cutter never assumes a runtime's layout:

* padded (:data:`SPMD_MEMORY`, jaxpipe's one-program SPMD runtime): all devices
  run the same program, so buffers have one shape. Parameters (and their
  gradients and optimizer state) are padded per storage class
  (``MemoryModel.param_class``; SPMD: whole-array slots per (shape, dtype)) to
  the busiest device, so an embedding costs one slot everywhere and repeated
  blocks pad to the device with the most. Residual/message storage is as large as
  the *busiest device's*, and the workspace is the largest stage's. Peak =
  ``(1 + grad + opt) * sum_class max_device(params of the class) +
  max_device(residuals + transfers) + max_stage(workspace)``
  (``CutResult.padded_memory``).
* not padded (:data:`DEVICE_MEMORY`): each device holds exactly its own stages'
  bytes (``max_device(sum of its stages)``), as an MPMD runtime would.

Because early 1F1B stages hold more microbatches, a compute-balanced cut
over-fills the first devices; the ``"memory"`` objective moves layers towards
later stages within a time slack, and recomputes where that is cheaper.

**Recomputation** (``Cut.remat``, default ``"auto"``). Each stage may store
everything (``NONE``), matmul outputs (``DOTS``), weight-matmul outputs
(``DOTS_NO_BATCH``), its layers' inputs (``BOUNDARY``) or its own input (``FULL``);
see :mod:`jaxpipe.stages.remat`. Under a memory budget the cutter minimises the slowest
stage's time, recomputation included, over cuts and policies together; under the
``"memory"`` objective it minimises memory within the time slack the same way;
the ``"time"`` objective never recomputes. For a time cap, the least-storing
policy that keeps each range within the cap is the best choice for every memory
objective (the workspace grows only with what the policy stores), so the exact searches
stay exact over policies too; afterwards, stages whose memory the result does not
need switch back to faster policies (:func:`jaxpipe.cut.search.relax`).
``cut="auto"`` in ``jp.pipeline`` budgets the device's own memory limit where JAX
reports one (:func:`auto_cut`).

**Search.** Stages are contiguous, so every objective is built from min-max
(bottleneck) problems over the ``(n+1)^2`` segment ranges, solved by dynamic
programming over stages (``O(stages * segments^2)``, vectorised; 200 segments x 16
stages takes milliseconds). With one stage per device the searches are exact
(:mod:`jaxpipe.cut.search`) where the parameters pad in one class (several classes: a
heuristic bound, ``CutResult.exact`` says so); memory budgets bisect over achievable
stage times, and ties are broken by a second objective (memory for "time", time for "memory"), then
by sums of squares so non-bottleneck stages are balanced too. Devices holding
several stages are enumerated exactly when small, else searched heuristically
(:mod:`jaxpipe.cut.virtual_stages`; ``CutResult.exact`` says which).

The package: ``cost.py`` (per-segment FLOPs and bytes from the jaxpr),
``options.py`` (:class:`Cut`, :class:`CutError`), ``memory_model.py`` (the
:class:`MemoryModel` a runtime hands the cutter), ``padding.py`` (parameter padding
groups), ``problem.py`` (range matrices
per policy, views and DPs), ``search.py`` and ``virtual_stages.py`` (the searches),
``result.py`` (:class:`CutResult`, :class:`MemoryBreakdown`), ``budget.py`` (the
device budget of ``cut="auto"``), ``resolve.py`` (a pipeline's ``cut=`` argument to
stage boundaries and policies), ``flops.py`` (FLOPs of a jaxpr) and ``profiling.py``
(timed segment costs, ``Cut(profile=True)``). Imports the jaxpr, sharding, schedule and stages
layers and the foundation; the runtimes implement its memory model, and the API layer
runs it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from jaxpipe.cut.budget import AUTO_RESERVE, auto_cut, device_memory_limit
from jaxpipe.cut.cost import SegmentCost
from jaxpipe.cut.memory_model import DEVICE_MEMORY, SPMD_MEMORY, MemoryModel
from jaxpipe.cut.options import Cut, CutError
from jaxpipe.cut.problem import Problem
from jaxpipe.cut.result import CutResult, MemoryBreakdown, describe
from jaxpipe.cut.search import relax, search_single
from jaxpipe.cut.virtual_stages import search_virtual
from jaxpipe.jaxpr.avals import format_bytes
from jaxpipe.stages.remat import Remat

__all__ = [
    "Remat",
    "Cut",
    "CutError",
    "CutResult",
    "MemoryBreakdown",
    "MemoryModel",
    "SPMD_MEMORY",
    "DEVICE_MEMORY",
    "choose_cuts",
    "partition",
    "pooled_in_flight",
    "auto_cut",
    "device_memory_limit",
    "AUTO_RESERVE",
]


def _check_inputs(n: int, S: int, placement: Sequence[int], in_flight: Sequence[float]) -> None:
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


def _policies(cut: Cut, costs: Sequence[SegmentCost], S: int) -> tuple[Remat, ...]:
    """The recomputation policies the search may use (the first is the base)."""
    if isinstance(cut.remat, tuple):  # one per stage
        if cut.indices is None:
            raise CutError(
                f"Cut.remat gives one policy per stage ({[str(p.value) for p in cut.remat]}); "
                "that needs explicit Cut.indices. To let the cutter place stages, pass "
                "remat='auto' or one policy for every stage.")
        if len(cut.remat) != S:
            raise CutError(f"Cut.remat has {len(cut.remat)} policies for {S} stages")
        wanted = set(cut.remat)
    elif isinstance(cut.remat, Remat):
        wanted = {cut.remat}
    else:
        # "auto": recompute only where it can buy something the objective wants.
        if cut.memory_budget is None and (cut.objective == "time" or cut.indices is not None):
            return (Remat.NONE,)
        common = frozenset(Remat).intersection(*(c.remat_policies for c in costs))
        return tuple(p for p in Remat if p in common)
    for p in wanted:
        missing = [c.name or f"segment{k}" for k, c in enumerate(costs)
                   if p not in c.remat_policies]
        if missing:
            raise CutError(
                f"Cut.remat asks for {p.value!r} but the segment costs have no data for it "
                f"(segments {missing[:3]}{'...' if len(missing) > 3 else ''}); build them "
                f"with jaxpipe.cut.cost.segment_costs(traced, remat=...) including it")
    return tuple(p for p in Remat if p in wanted)


def _explicit(pb: Problem, bounds: list[int]) -> tuple[Remat, ...]:
    """Policies for an explicit cut: the user's, else the fastest that fit the budget."""
    cut = pb.cut
    if isinstance(cut.remat, tuple):
        policies = cut.remat
    elif cut.memory_budget is None or not pb.remat_choice:
        policies = pb.stage_policies(bounds)
    else:
        budget = float(cut.memory_budget)
        caps = [c for c in pb.cap_candidates() if pb.view(c).memory(bounds) <= budget]
        if not caps:
            policies = pb.view(math.inf).stage_policies(bounds)
        else:
            policies = relax(pb, bounds, pb.view(caps[0]).stage_policies(bounds), budget)
    need = pb.memory(bounds, policies)
    if cut.memory_budget is not None and need > cut.memory_budget:
        choice = (f" with recomputation {[str(p.value) for p in policies]}"
                  if any(p is not Remat.NONE for p in policies) else "")
        raise CutError(
            f"the explicit cut {list(cut.indices or [])}{choice} needs {format_bytes(need)} "
            f"({math.ceil(need)} bytes) per device ({pb.model.name} memory model), over the "
            f"memory budget of {format_bytes(cut.memory_budget)}"
            + ("" if pb.remat_choice or cut.remat != Remat.NONE else
               "; allow recomputation with jp.Cut(remat='auto')"))
    return tuple(policies)


def partition(
    costs: Sequence[SegmentCost],
    placement: Sequence[int],
    in_flight: Sequence[float],
    cut: Cut | None = None,
    *,
    memory_model: MemoryModel = SPMD_MEMORY,
) -> CutResult:
    """Choose contiguous stages for ``costs`` given the stage placement and in-flight counts.

    This is the schedule-independent core of :func:`choose_cuts`: ``placement[s]``
    is the device of stage ``s`` and ``in_flight[s]`` its peak number of live
    residual sets. ``len(placement)`` is the number of stages. ``memory_model`` is
    the runtime's (``cut.memory_model`` overrides it). Each stage's recomputation
    policy is chosen together with the cut (``cut.remat``; see :class:`Cut`).

    Raises:
      CutError: more stages than segments, a bad explicit cut, or an infeasible
        memory budget (the message names the smallest feasible budget, and the cut
        and recomputation that reach it).
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
    pb = Problem(costs, placement, in_flight, cut, model, _policies(cut, costs, S))
    t_opt, _ = pb.minmax(lambda k: pb.time)

    if cut.indices is not None:
        bounds = _explicit_bounds(cut.indices, n, S)
        objective, exact = "explicit", True
        policies = _explicit(pb, bounds)
    elif pb.single:
        bounds, policies, objective = search_single(pb, t_opt)
        exact = objective == "time" or not pb.padded or pb.params_exact
    else:
        bounds, policies, objective, exact = search_virtual(pb, t_opt)
    return describe(pb, costs, bounds, policies, objective, exact, t_opt)


def pooled_in_flight(peaks: Any, placement: Sequence[int]) -> list[float]:
    """Per stage, the residual sets it holds at its device's peak (what the cutter
    budgets as ``in_flight``), from ``peaks`` (a schedule's ``graph()`` or a
    ``Timeline``: ``peak_in_flight`` per device, ``stage_peak_in_flight`` per stage).

    A device's stages peak at different times (interleaved: one chunk's warm-up runs
    while another drains), and the runtimes pool a device's residual storage, so a
    device stores its own peak of live sets, not the sum of its stages' peaks
    (Interleaved1F1B p=8, m=16, v=4: 39 on device 0, not 48). Each stage's peak is
    scaled so that its device's stages add up to the device's peak: exact when a
    device's stages store sets of one size. One stage per device: the stage's peak.
    """
    stage_peaks, device_peaks = peaks.stage_peak_in_flight, peaks.peak_in_flight
    total = [0] * len(device_peaks)
    for s, d in enumerate(placement):
        total[d] += int(stage_peaks[s])
    return [int(stage_peaks[s]) * device_peaks[d] / total[d] if total[d] else 0.0
            for s, d in enumerate(placement)]


def choose_cuts(
    costs: Sequence[SegmentCost],
    schedule: Any,
    cut: Cut | None = None,
    *,
    memory_model: MemoryModel = SPMD_MEMORY,
    in_flight: Sequence[float] | None = None,
) -> CutResult:
    """Choose the stages of a pipeline for ``schedule`` (what ``cut="auto"`` runs).

    Args:
      costs: one :class:`~jaxpipe.cut.cost.SegmentCost` per segment, in program order
        (:func:`jaxpipe.cut.cost.segment_costs`).
      schedule: a ``jp.Schedule``; supplies ``num_stages``, ``placement(stage)``,
        and, through ``simulate()``, every stage's and every device's peak in-flight
        microbatches (``stage_peak_in_flight``, ``peak_in_flight``).
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
        counts = pooled_in_flight(schedule.simulate(costs=None), placement)
    else:
        counts = list(in_flight)
    result = partition(costs, placement, counts, cut, memory_model=memory_model)
    timeline = schedule.simulate(costs=result.action_cost)
    if in_flight is None:
        # In-flight counts follow from each device's action order, not from timing,
        # but a simulator is free to differ: re-cut once if the chosen costs change them.
        timed = pooled_in_flight(timeline, placement)
        if timed != counts:
            counts = timed
            result = partition(costs, placement, counts, cut, memory_model=memory_model)
            timeline = schedule.simulate(costs=result.action_cost)
    return replace(result, makespan=float(timeline.makespan),
                   bubble_fraction=float(timeline.bubble_fraction))
