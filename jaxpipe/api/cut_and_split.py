"""From a traced loss to the stage functions a runtime runs: cut it for a schedule and split it.

Steps 2 and 3 of :func:`jaxpipe.pipeline` (see :mod:`jaxpipe.api.pipeline`):
:func:`cut_and_split` resolves the user's ``cut=`` (:func:`jaxpipe.cut.resolve.resolve_cuts`)
on the loss the cutter sees (a scanned layer stack rewritten with a cut after every
iteration, :mod:`jaxpipe.stages.stacks`) and splits the loss into
:class:`~jaxpipe.stages.stage_fn.StageFn` s (:func:`jaxpipe.stages.split`; a stack becomes one
scan per stage over that stage's layers, each stage reading its own rows of the stacked
weights). :meth:`StagedLoss.runtime_spec` is what a runtime is built from.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jax.sharding import Mesh

from jaxpipe.api.inputs import leaf_paths
from jaxpipe.cut.memory_model import MemoryModel
from jaxpipe.cut.resolve import resolve_cuts
from jaxpipe.jaxpr.avals import boundary_aval
from jaxpipe.jaxpr.trace import Traced
from jaxpipe.jaxpr.weight import batch_weight
from jaxpipe.runtime import RuntimeSpec
from jaxpipe.schedule import Schedule
from jaxpipe.sharding.mesh_axes import Dims, MeshAxes, check_divisible
from jaxpipe.sharding.param_views import ParamViews
from jaxpipe.stages import split
from jaxpipe.stages.stacks import Stack, find_stacks, for_stages, per_layer
from jaxpipe.stages.stage_fn import StageFn, param_owners

__all__ = ["StagedLoss", "cut_and_split", "cut_only", "num_segments"]


@dataclass(frozen=True)
class StagedLoss:
    """What :func:`cut_and_split` chose and built.

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
            # key-typed batch leaves reach a runtime as key data (see jaxpipe.stages.stage_fn)
            microbatch_avals=tuple(boundary_aval(v.aval)
                                   for v in traced.jaxpr.invars[traced.num_params:]),
            param_owners=param_owners(self.stages),
            param_views=self.views,
            param_dims=(tuple(param_dims[v.leaf] for v in self.views.views)
                        if any(any(d) for d in param_dims) else ()),
            param_axes=mesh_axes.param_axes,
            action_cost=self.cut_report.action_cost,
            objective=traced.objective,
            batch_weight=batch_weight(traced),
        )


def _cut_view(traced: Traced, mesh: Mesh, param_dims: Sequence[Dims]) -> tuple:
    """``(stacks, per-layer view or None, the loss the cutter sees, per parameter input of
    it the devices of one pipe position its sharding splits it over)``."""
    stacks = tuple(find_stacks(traced.jaxpr))
    layers = per_layer(traced, stacks) if stacks else None
    cut_traced = layers.traced if layers else traced
    leaf_of = ([v.leaf for v in layers.views.views] if layers
               else range(traced.num_params))
    shards = [math.prod(mesh.shape[a] for d in param_dims[leaf] for a in d) if param_dims
              else 1 for leaf in leaf_of]
    return stacks, layers, cut_traced, shards


def num_segments(traced: Traced, mesh: Mesh, param_dims: Sequence[Dims]) -> int:
    """How many stages ``traced`` can be cut into at most (its cuttable segments, a
    scanned stack's layers each one)."""
    return len(_cut_view(traced, mesh, param_dims)[2].markers) + 1


def cut_only(traced: Traced, schedule: Schedule, cut: Any, memory_model: MemoryModel,
             mesh: Mesh, param_dims: Sequence[Dims], in_flight: Sequence[float] | None = None,
             costs_cache: dict | None = None, batch_shards: int = 1) -> Any:
    """The cutter's report (:class:`jaxpipe.cut.CutResult`) of ``traced`` under
    ``schedule``, without splitting it into stages: what choosing among schedules costs
    (:mod:`jaxpipe.api.auto`). ``costs_cache``: one dict for every call on ``traced``
    with these ``mesh`` and ``param_dims`` (segment costs measured once);
    ``batch_shards``: as :func:`~jaxpipe.cut.resolve.resolve_cuts` takes it."""
    _, _, cut_traced, shards = _cut_view(traced, mesh, param_dims)
    return resolve_cuts(cut_traced, schedule, cut, memory_model, tuple(mesh.devices.flat),
                        shards, in_flight, costs_cache, batch_shards)[1]


def cut_and_split(traced: Traced, schedule: Schedule, cut: Any, memory_model: MemoryModel,
                  mesh: Mesh, param_dims: Sequence[Dims], *, share_cores: bool = False,
                  split_backward: bool = False, in_flight: Sequence[int] | None = None,
                  cut_report: Any = None, batch_shards: int = 1) -> StagedLoss:
    """Cut ``traced`` for ``schedule`` (:func:`~jaxpipe.cut.resolve.resolve_cuts`), then split it.

    ``param_dims``: per parameter leaf, its sharding over the non-pipe axes; a stage's
    rows of a stacked leaf must split over them too. ``share_cores`` /
    ``split_backward``: as the runtime's :meth:`~jaxpipe.runtime.Runtime.shares_cores` and
    :meth:`~jaxpipe.runtime.Runtime.splits_backward` say (see :func:`jaxpipe.stages.split`);
    ``in_flight``: as its :meth:`~jaxpipe.runtime.Runtime.in_flight` says.
    ``cut_report``: :func:`cut_only`'s report for this schedule and ``cut``, when the
    caller cut already (``schedule="auto"``): the cut is not searched again.
    ``batch_shards``: the pieces automatic batch axes split a traced microbatch into.
    """
    param_avals = [v.aval for v in traced.jaxpr.invars[: traced.num_params]]
    stacks, layers, cut_traced, shards = _cut_view(traced, mesh, param_dims)
    cuts, report = ((list(cut_report.cuts), cut_report) if cut_report is not None else
                    resolve_cuts(cut_traced, schedule, cut, memory_model,
                                 tuple(mesh.devices.flat), shards, in_flight,
                                 batch_shards=batch_shards))
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
    return StagedLoss(stacks, cut_traced, cuts, report, views, stage_traced, stages)
