"""From a traced loss to stage functions: choose the cut, then split the jaxpr.

Steps 2 and 3 of :func:`jaxpipe.pipeline` (see :mod:`jaxpipe.pipeline`):

- :func:`resolve_cuts` turns the user's ``cut=`` (``"auto"``, ``"markers"`` or a
  :class:`jaxpipe.Cut`) into marker indices, through the cutter, which also reports the
  predicted per-stage costs and memory;
- :func:`stage` runs it on the loss the cutter sees (a scanned layer stack rewritten with
  a cut after every iteration, :mod:`jaxpipe.stacks`) and splits the loss into
  :class:`~jaxpipe.stages.StageFn` s (a stack becomes one scan per stage over that
  stage's layers, each stage reading its own rows of the stacked weights).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from jax.sharding import Mesh

from jaxpipe.avals import boundary_aval
from jaxpipe.errors import PipelineError, PipelineTypeError
from jaxpipe.inputs import leaf_paths
from jaxpipe.runtime import RuntimeSpec
from jaxpipe.schedule import Schedule
from jaxpipe.sharding import Dims, MeshAxes, check_divisible
from jaxpipe.stacks import Stack, find_stacks, for_stages, per_layer
from jaxpipe.stages import StageFn, param_owners, split
from jaxpipe.trace import Traced
from jaxpipe.views import ParamViews

__all__ = ["Staging", "even_cuts", "resolve_cuts", "stage"]


@dataclass(frozen=True)
class Staging:
    """What :func:`stage` chose and built.

    Attributes:
      stacks: the scanned layer stacks found in the loss (each cut between iterations).
      cut_traced: the loss the cutter saw (``traced`` with a marker after every
        iteration of every stack; ``traced`` itself when there are none).
      cuts: indices into ``cut_traced.markers`` after which a new stage begins.
      cut_report: the cutter's :class:`jaxpipe.cut.CutResult`.
      views: the stages' parameter inputs over the user's leaves.
      stage_traced: the loss the stages were split from (its parameters: ``views``).
      stages: the stage functions.
    """

    stacks: tuple[Stack, ...]
    cut_traced: Traced
    cuts: list[int]
    cut_report: Any
    views: ParamViews
    stage_traced: Traced
    stages: list[StageFn]

    def runtime_spec(self, traced: Traced, schedule: Schedule, mesh: Mesh, axis: str,
                     mesh_axes: MeshAxes, param_dims: Sequence[Dims]) -> RuntimeSpec:
        """What a runtime needs to run these stages (``traced``: the user's loss as
        traced, whose parameters are the user's leaves)."""
        inner = self.stage_traced
        return RuntimeSpec(
            stages=tuple(self.stages),
            schedule=schedule,
            mesh=mesh,
            axis=axis,
            batch_axes=mesh_axes.batch_axes,
            param_avals=tuple(v.aval for v in inner.jaxpr.invars[: inner.num_params]),
            params_treedef=traced.params_treedef,
            # key-typed batch leaves reach a runtime as key data (see jaxpipe.stages)
            microbatch_avals=tuple(boundary_aval(v.aval)
                                   for v in traced.jaxpr.invars[traced.num_params:]),
            param_owners=param_owners(self.stages),
            param_views=self.views,
            param_dims=(tuple(param_dims[v.leaf] for v in self.views.views)
                        if any(any(d) for d in param_dims) else ()),
            param_axes=mesh_axes.param_axes,
            action_cost=self.cut_report.action_cost,
            objective=traced.objective,
        )


def even_cuts(n_seg: int, num_stages: int) -> list[int]:
    """Marker indices grouping ``n_seg`` segments into ``num_stages`` of sizes differing by
    at most one (``cut="markers"``).

    The larger stages are the outer ones (last, first, second to last, ...): the middle
    stages of a model with an embedding before its blocks and a head after them then
    hold equally many blocks, compute the same function and compile as one body.
    """
    size = [n_seg // num_stages] * num_stages
    ends = [s for k in range((num_stages + 1) // 2)
            for s in dict.fromkeys((num_stages - 1 - k, k))]
    for s in ends[: n_seg % num_stages]:
        size[s] += 1
    return [int(x) - 1 for x in np.cumsum(size)[:-1]]


def resolve_cuts(traced: Traced, schedule: Schedule, cut: Any, memory_model: Any,
                  devices: tuple = ()) -> tuple[list[int], Any]:
    """Marker positions after which a new stage starts, plus the cutter's report.

    ``cut="auto"`` budgets the memory ``devices`` report (``jaxpipe.cut.auto_cut``).
    """
    from jaxpipe import cut as cutmod
    from jaxpipe.avals import aval_bytes
    from jaxpipe.cost import segment_costs

    S = schedule.num_stages
    n_seg = len(traced.markers) + 1
    if S > n_seg:
        raise PipelineError(
            f"the schedule needs {S} stages but the loss has only {n_seg} cuttable segments "
            f"({len(traced.markers)} markers); add jaxpipe.boundary / @jaxpipe.layer markers "
            "or use fewer stages."
        )
    if isinstance(cut, str) and cut == "markers":
        cut = cutmod.Cut(indices=even_cuts(n_seg, S))
    if isinstance(cut, str) and cut == "auto":
        # every pipeline device also holds the whole batch (its data shard)
        batch = sum(aval_bytes(v.aval) for v in traced.jaxpr.invars[traced.num_params:])
        cut = cutmod.auto_cut(devices, held_bytes=batch * schedule.num_microbatches)
    if isinstance(cut, cutmod.Cut):
        if cut.indices is not None and len(cut.indices) != S - 1:
            raise PipelineError(
                f"Cut(indices={list(cut.indices)}) gives {len(cut.indices) + 1} stages but "
                f"the schedule has {S}; pass {S - 1} marker indices."
            )
        # Explicit cuts go through the cutter too: it reports their predicted costs.
        policies = cut.costed_policies()
        # Per-stage peak in-flight microbatches follow from each device's action order
        # alone: read them off the schedule's cached graph instead of having the cutter
        # simulate for them (it simulates once, with the chosen stage costs).
        peaks = schedule.graph().stage_peak_in_flight
        in_flight = [peaks[s] for s in range(S)]
        costs = segment_costs(traced, profile=cut.profile, remat=policies[:1])
        if len(policies) > 1 and cut.remat == "auto" and cut.memory_budget is not None:
            # Recomputation only adds time: when placement alone reaches the fastest
            # cut within the budget, measuring the other policies buys nothing.
            try:
                plain = cutmod.choose_cuts(costs, schedule, replace(cut, remat="none"),
                                           memory_model=memory_model, in_flight=in_flight)
                if plain.max_stage_time <= plain.time_optimum:
                    return list(plain.cuts), plain
            except cutmod.CutError:
                pass
        if len(policies) > 1:
            costs = segment_costs(traced, profile=cut.profile, remat=policies)
        result = cutmod.choose_cuts(costs, schedule, cut, memory_model=memory_model,
                                    in_flight=in_flight)
        return list(result.cuts), result
    hint = (f" (for explicit cuts: jp.Cut(indices={list(cut)!r}))"
            if isinstance(cut, list | tuple) else "")
    raise PipelineTypeError(
        f"cut must be 'auto', 'markers' or a jaxpipe.Cut, got {cut!r}{hint}."
    )


def stage(traced: Traced, schedule: Schedule, cut: Any, memory_model: Any, mesh: Mesh,
          param_dims: Sequence[Dims], *, share_cores: bool = False,
          split_backward: bool = False) -> Staging:
    """Cut ``traced`` for ``schedule`` (:func:`resolve_cuts`) and split it into stages.

    ``param_dims``: per parameter leaf, its sharding over the non-pipe axes; a stage's
    rows of a stacked leaf must split over them too. ``share_cores`` /
    ``split_backward``: as the runtime's :meth:`~jaxpipe.runtime.Runtime.shares_cores` and
    :meth:`~jaxpipe.runtime.Runtime.splits_backward` say (see :func:`jaxpipe.stages.split`).
    """
    param_avals = [v.aval for v in traced.jaxpr.invars[: traced.num_params]]
    stacks = tuple(find_stacks(traced.jaxpr))
    layers = per_layer(traced, stacks) if stacks else None
    cut_traced = layers.traced if layers else traced
    cuts, report = resolve_cuts(cut_traced, schedule, cut, memory_model,
                                tuple(mesh.devices.flat))
    if layers is not None:
        staged, stage_cuts = for_stages(traced, stacks, layers, cuts)
        stage_traced, views = staged.traced, staged.views
    else:
        stage_traced, stage_cuts = traced, cuts
        views = ParamViews.whole(tuple(param_avals))
    paths = leaf_paths(traced.params_treedef)
    for v in views.views:  # a stage's rows of a stacked leaf must split too
        if v.start is not None:
            check_divisible(v.aval(param_avals[v.leaf]).shape, param_dims[v.leaf], mesh,
                            f"param_specs{paths[v.leaf]}",
                            f" rows {v.start}:{v.stop} (one stage's layers)")
    stages = split(stage_traced, stage_cuts, remat=report.remat,
                   share_cores=share_cores, split_backward=split_backward)
    return Staging(stacks, cut_traced, cuts, report, views, stage_traced, stages)
