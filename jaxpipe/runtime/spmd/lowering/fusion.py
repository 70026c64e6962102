"""Which backwards the program runs in their own forward's step ("FB"), and when that pays;
which W it runs in its own I's step ("IW").

In 1F1B (and at p = 1) the last stage runs every F directly followed by its own B, and
that B needs no message: its cotangent is the loss's. Run as one step, the stage's
residuals go straight from the forward to the backward, as in plain
``jax.value_and_grad``: nothing is stored for that stage, the pair takes one step, and F
and B compile as one branch. But buffers are as large as the busiest device needs, and
the FB step holds the stage's residuals in its scratch while it runs, so fusing saves
memory only where the fused stage's device sized the buffers (p = 1, or classes only that
stage stores); :func:`fusing_saves_memory` makes that call for ``fuse_fb="auto"``.

A split backward's W that directly follows its own I can run in the I's step too
(:func:`joined_weights`, with ``iw_same_tick``): the hand-off goes straight from I to W
instead of through storage, and the pair takes one step. Its I's cotangent message then
leaves after W, which is why it comes only with ``iw_same_tick`` (W in its I's tick, the
tick's messages moving after both anyway).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import numpy as np

from jaxpipe.runtime.spmd.lowering.types import Allocation, Pool, Ticks
from jaxpipe.schedule.graph import KB, KF, KI, KW, ScheduleGraph

__all__ = ["fused_backwards", "fusing_saves_memory", "joined_weights", "w_after_own_i"]


def _after_own(graph: ScheduleGraph, first: int, second: int) -> np.ndarray:
    """Per action, True for a ``second``-kind action its device runs directly after its own
    (same stage and microbatch) ``first``-kind action."""
    kinds, prev = graph.kinds, graph.prev
    p = np.maximum(prev, 0)
    return ((kinds == second) & (prev >= 0) & (kinds[p] == first)
            & (graph.stages[p] == graph.stages) & (graph.microbatches[p] == graph.microbatches))


def _whole_stages(graph: ScheduleGraph, ok: np.ndarray, others: np.ndarray) -> np.ndarray:
    """``ok``, but only in stages where every action ``others`` marks is ``ok`` too."""
    num_stages = int(graph.stages.max()) + 1 if len(ok) else 0
    mixed = np.zeros(num_stages, bool)
    mixed[graph.stages[others & ~ok]] = True
    return ok & ~mixed[graph.stages]


def fused_backwards(graph: ScheduleGraph) -> np.ndarray:
    """Per action (``graph.actions`` order), True for a B the program runs in its own F's
    step, as one forward and backward.

    A B qualifies when it directly follows its own F on the device and reads no
    cotangent message (the last stage). Whole stages only: a stage with some backward not
    fused (a B elsewhere, or a backward split into I and W) would compile F, B and FB
    branches, and still store residuals for the rest.
    """
    ok = _after_own(graph, KF, KB) & (graph.data_deps[:, 1] < 0)
    return _whole_stages(graph, ok, graph.kinds != KF)  # against any other backward


def w_after_own_i(graph: ScheduleGraph) -> np.ndarray:
    """Per action (``graph.actions`` order), True for a W whose device runs it directly
    after its own I."""
    return _after_own(graph, KI, KW)


def joined_weights(graph: ScheduleGraph) -> np.ndarray:
    """Per action (``graph.actions`` order), True for a W the program runs in its own I's
    step, as one input-gradient and weight-gradient step (``"IW"``).

    A W qualifies when it directly follows its own I on the device
    (:func:`w_after_own_i`). Whole stages only, as for FB: a stage with a W elsewhere
    would compile I, W and IW branches.
    """
    return _whole_stages(graph, w_after_own_i(graph), graph.kinds == KW)


def _class_bytes(c: Hashable) -> int:
    return int(getattr(c, "nbytes", 1))  # a ValueClass; the lowering's tests use names


def fusing_saves_memory(plain: Allocation, fused: Allocation, fused_ticks: Ticks,
                        counts: Mapping[Pool, Sequence[Mapping[Hashable, int]]]) -> bool:
    """Whether fusing needs no more bytes: its stored slots plus the residual set an FB
    step holds while it runs, against the slots without fusing.

    Measured on the GPT benchmark model (1F1B, m = 2p, compiled memory of the fused
    program against the unfused): -28% at p = 1, +4% at p = 2.
    """
    def stored(alloc: Allocation) -> int:
        return sum(n * _class_bytes(c) for c, n in alloc.slots.items())

    stages = {int(x) for x in fused_ticks.graph.stages[fused_ticks.fused]}
    scratch = max(sum(n * _class_bytes(c) for pool in (Pool.RESIDUAL_A, Pool.RESIDUAL_B)
                      for c, n in counts[pool][s].items()) for s in stages)
    return stored(fused) + scratch <= stored(plain)
