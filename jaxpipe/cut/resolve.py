"""The user's ``cut=`` as marker indices: ``"markers"``, ``"auto"`` or a :class:`~jaxpipe.cut.Cut`.

:func:`resolve_cuts` runs every kind through the cutter (:func:`jaxpipe.cut.choose_cuts`),
which also reports the predicted per-stage costs and memory; ``"markers"`` groups the
segments evenly (:func:`even_cuts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from jaxpipe import cut as cutmod
from jaxpipe.cut.cost import segment_costs
from jaxpipe.cut.memory_model import MemoryModel
from jaxpipe.errors import PipelineError, PipelineTypeError
from jaxpipe.jaxpr.avals import aval_bytes
from jaxpipe.jaxpr.trace import Traced
from jaxpipe.schedule import Schedule

__all__ = ["even_cuts", "resolve_cuts"]


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


def resolve_cuts(traced: Traced, schedule: Schedule, cut: Any, memory_model: MemoryModel,
                 devices: tuple = (), param_shards: Sequence[int] = (),
                 in_flight: Sequence[float] | None = None,
                 costs_cache: dict | None = None, batch_shards: int = 1
                 ) -> tuple[list[int], Any]:
    """Marker positions after which a new stage starts, plus the cutter's report.

    ``cut="auto"`` budgets the memory ``devices`` report (``jaxpipe.cut.auto_cut``).
    ``param_shards``: per parameter input of ``traced``, the devices of one pipe
    position its sharding splits it over; the cutter counts the bytes one device holds.
    ``in_flight``: per stage, the live residual sets the runtime's program holds at its
    peak where that is not the schedule's own (``Runtime.in_flight``).
    ``batch_shards``: the pieces automatic batch axes split a traced microbatch into
    (what a device holds of the batch, which ``cut="auto"`` leaves out of its budget).
    ``costs_cache``: a dict shared by calls on one model, shards and profile setting
    (``schedule="auto"`` cuts one model for every candidate schedule): the segments'
    costs do not depend on the schedule, so they are measured once per policy set.
    """
    shards = dict(enumerate(param_shards))

    def costed(policies: Sequence[Any]) -> list[Any]:
        key = (cut.profile, tuple(policies))
        if costs_cache is not None and key in costs_cache:
            return costs_cache[key]
        costs = segment_costs(traced, profile=cut.profile, remat=policies)
        out = [c.per_device(shards) for c in costs]
        if costs_cache is not None:
            costs_cache[key] = out
        return out

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
        # every pipeline device also holds the whole batch (its data shard: the traced
        # microbatch is one manual batch shard, split again over automatic batch axes)
        batch = sum(aval_bytes(v.aval) for v in traced.jaxpr.invars[traced.num_params:])
        cut = cutmod.auto_cut(devices, held_bytes=batch * schedule.num_microbatches
                              // batch_shards)
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
        if in_flight is None:
            in_flight = cutmod.pooled_in_flight(
                schedule.graph(), [schedule.placement(s) for s in range(S)])
        costs = costed(policies[:1])
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
            costs = costed(policies)
        result = cutmod.choose_cuts(costs, schedule, cut, memory_model=memory_model,
                                    in_flight=in_flight)
        return list(result.cuts), result
    check_cut(cut)
    raise AssertionError("unreachable: check_cut accepted " + repr(cut))


def check_cut(cut: Any) -> None:
    """A clear error unless ``cut`` is one of the values ``jp.pipeline(cut=...)`` takes."""
    if (isinstance(cut, str) and cut in ("auto", "markers")) or isinstance(cut, cutmod.Cut):
        return
    hint = (f" (for explicit cuts: jp.Cut(indices={list(cut)!r}))"
            if isinstance(cut, list | tuple) else "")
    raise PipelineTypeError(
        f"cut must be 'auto', 'markers' or a jaxpipe.Cut, got {cut!r}{hint}."
    )
