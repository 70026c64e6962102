"""Cost model: per-segment FLOPs and bytes, derived from the traced jaxpr alone.

A *segment* is the run of equations between two consecutive ``jaxpipe_boundary``
markers (see :func:`jaxpipe.jaxpr.trace.segments`); it is the smallest unit the cutter
(:mod:`jaxpipe.cut`) can put on a stage. For every segment this module reports

* ``flops``: forward FLOPs for one microbatch, counted per primitive by
  :mod:`jaxpipe.cut.flops` (matmuls and convolutions exact, elementwise ops one per
  output element, data movement free; its docstring has the rules).
* The backward pass is assumed to cost **2x the forward** (one matmul for the input
  gradient and one for the weight gradient per forward matmul; elementwise ops are
  similar). :attr:`SegmentCost.bwd_flops` states this assumption in one place;
  ``profile=True`` replaces both with measured times (:mod:`jaxpipe.cut.profiling`).
* ``param_leaf_bytes``: the parameter leaves the segment reads (leaf index ->
  bytes), so that a stage holding several segments that share a parameter (tied
  embeddings, a shared norm) counts it once; ``param_leaf_shapes`` gives each
  leaf's ``(shape, dtype name)`` for memory models that pad per storage class.
* ``residual_bytes``: what the segment's forward keeps per microbatch for its
  backward (parameters excluded: they are re-read), taken from
  :func:`jaxpipe.stages.split` with one stage per segment, i.e. from the same
  forward/backward split the runtime executes.
* ``out_bytes``: bytes of the (non-parameter) values live across the marker that
  ends the segment, i.e. what a stage boundary placed there has to send.
* ``remat``: per recomputation policy (:class:`jaxpipe.stages.remat.Remat`), the residual
  bytes the segment stores and the FLOPs its backward spends recomputing
  (:class:`RematCost`), measured like ``residual_bytes``: by building the one-stage-
  per-segment split *under that policy* and counting the stored residuals and the
  backward's FLOPs (recompute = backward FLOPs under the policy minus without it).
* ``input_values``: the values the segment reads that an earlier segment defined
  (an id, the defining segment, bytes); a stage recomputed as a whole
  (``Remat.FULL``) stores exactly those of its segments' inputs defined before it.
* ``user_remat``: the segment holds a user's own ``jax.checkpoint``; jaxpipe never
  wraps it again, so every policy costs what ``NONE`` costs there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from jax.extend import core as jcore

from jaxpipe.cut.flops import eqn_flops, jaxpr_flops
from jaxpipe.cut.profiling import profile_segments
from jaxpipe.jaxpr.avals import aval_bytes, shard_bytes
from jaxpipe.jaxpr.trace import segments
from jaxpipe.stages import split
from jaxpipe.stages.remat import Remat, has_user_remat

__all__ = [
    "RematCost",
    "SegmentCost",
    "segment_costs",
    "aval_bytes",  # re-exported from jaxpipe.jaxpr.avals
]


@dataclass(frozen=True)
class RematCost:
    """What one recomputation policy costs one segment (run as a stage of its own).

    Attributes:
      residual_bytes: bytes stored per microbatch between forward and backward.
      recompute_flops: extra backward FLOPs per microbatch (the forward work the
        backward redoes).
    """

    residual_bytes: int
    recompute_flops: float = 0.0

    def __post_init__(self) -> None:
        if self.residual_bytes < 0 or not self.recompute_flops >= 0:
            raise ValueError(f"RematCost needs residual_bytes >= 0 and recompute_flops >= 0, "
                             f"got {self.residual_bytes}, {self.recompute_flops}")


@dataclass(frozen=True)
class SegmentCost:
    """Cost of one segment (the code between two consecutive cut markers).

    Built by :func:`segment_costs` from a traced model, or by hand for experiments::

        SegmentCost(flops=2e9, param_bytes=4 << 20, residual_bytes=1 << 20)

    Attributes:
      flops: forward FLOPs per microbatch.
      param_bytes: bytes of all parameter leaves the segment reads.
      residual_bytes: bytes the forward keeps per microbatch for the backward.
      out_bytes: bytes live across the marker that ends this segment (what a cut
        there sends forward; the cotangent sent back has the same size).
      param_leaf_bytes: parameter leaf index -> bytes, for the leaves in
        ``param_bytes`` that other segments may share. Leaves not listed here are
        private to this segment: ``param_bytes - sum(param_leaf_bytes.values())``.
      name: label for plans (the marker's name, or ``"segment{k}"``).
      param_leaf_shapes: parameter leaf index -> ``(shape, dtype name)``, e.g.
        ``((512, 512), "float32")``, filled by :func:`segment_costs`. A runtime's
        memory model (:class:`jaxpipe.cut.MemoryModel`) may map it to a storage class
        to predict padded parameter bytes; leaves without a shape pad as one group.
      fwd_time, bwd_time: measured seconds per microbatch when profiled
        (``jp.Cut(profile=True)``); ``None`` means "use FLOPs".
      remat: recomputation policy -> its :class:`RematCost` for this segment. The
        cutter chooses among the policies every segment lists (``Remat.NONE`` is
        always available: ``residual_bytes``, no recompute). Empty for hand-built
        costs: no recomputation.
      input_values: id of a value another segment defined -> ``(defining segment,
        bytes)`` for every such value this segment reads (defining segment ``-1``:
        a constant). Used for what a whole recomputed stage stores (its inputs).
      user_remat: the segment holds the user's own ``jax.checkpoint``; jaxpipe
        applies no policy to it (all policies cost what ``NONE`` costs).
    """

    flops: float
    param_bytes: int = 0
    residual_bytes: int = 0
    out_bytes: int = 0
    param_leaf_bytes: Mapping[int, int] = field(default_factory=dict, hash=False)
    name: str = ""
    param_leaf_shapes: Mapping[int, tuple[tuple[int, ...], str]] = field(
        default_factory=dict, hash=False)
    fwd_time: float | None = None
    bwd_time: float | None = None
    remat: Mapping[Remat, RematCost] = field(default_factory=dict, hash=False)
    input_values: Mapping[int, tuple[int, int]] = field(default_factory=dict, hash=False)
    user_remat: bool = False

    def __post_init__(self) -> None:
        shared = sum(self.param_leaf_bytes.values())
        if self.param_bytes < shared:
            if self.param_bytes == 0:
                # Only leaf sizes given: param_bytes is their sum.
                object.__setattr__(self, "param_bytes", shared)
            else:
                raise ValueError(
                    f"SegmentCost {self.name!r}: param_bytes={self.param_bytes} is smaller "
                    f"than the sum of param_leaf_bytes ({shared})"
                )
        for k, what in (("flops", self.flops), ("residual_bytes", self.residual_bytes),
                        ("out_bytes", self.out_bytes)):
            if what < 0:
                raise ValueError(f"SegmentCost {self.name!r}: {k} must be >= 0, got {what}")

    def remat_cost(self, policy: Remat) -> RematCost:
        """This segment's cost under ``policy`` (``NONE``: ``residual_bytes``, no recompute)."""
        if policy is Remat.NONE or self.user_remat:
            return RematCost(self.residual_bytes, 0.0)
        if policy not in self.remat:
            raise KeyError(f"segment {self.name!r} has no cost for remat policy {policy}")
        return self.remat[policy]

    @property
    def remat_policies(self) -> frozenset[Remat]:
        """The policies this segment has costs for (always including ``NONE``; every
        policy for a segment with a user's own ``jax.checkpoint``, which none changes)."""
        if self.user_remat:
            return frozenset(Remat)
        return frozenset({Remat.NONE, *self.remat})

    @property
    def param_ids(self) -> frozenset[int]:
        """Indices (into the flat parameter leaves) of the shareable leaves read here."""
        return frozenset(self.param_leaf_bytes)

    def per_device(self, shards: Mapping[int, int]) -> SegmentCost:
        """This segment with the bytes of parameter leaf ``i`` divided by ``shards[i]``,
        the devices one pipe position splits it over (its sharding's mesh axes)."""
        if not any(shards.get(i, 1) > 1 for i in self.param_leaf_bytes):
            return self
        leaf = {i: -(-b // shards.get(i, 1)) for i, b in self.param_leaf_bytes.items()}
        return replace(self, param_leaf_bytes=leaf,
                       param_bytes=self.private_param_bytes + sum(leaf.values()))

    @property
    def private_param_bytes(self) -> int:
        """Parameter bytes no other segment can share (not listed by leaf)."""
        return self.param_bytes - sum(self.param_leaf_bytes.values())

    @property
    def bwd_flops(self) -> float:
        """Backward FLOPs, assumed 2x forward (input grad + weight grad per matmul)."""
        return 2.0 * self.flops

    @property
    def profiled(self) -> bool:
        """True when measured forward and backward times are available."""
        return self.fwd_time is not None and self.bwd_time is not None

# ---------------------------------------------------------------------------
# Segment costs


def segment_costs(traced: Any, *, profile: bool = False,
                  remat: Sequence[Remat] = tuple(Remat)) -> list[SegmentCost]:
    """Cost of every segment of a traced loss function, in program order.

    Args:
      traced: the result of :func:`jaxpipe.jaxpr.trace.trace` (flat jaxpr whose invars
        are the parameter leaves, then the microbatch leaves).
      profile: also time each segment's compiled forward and backward on the
        default device and fill ``fwd_time``/``bwd_time`` (seconds). Off by
        default: timings are noisy and cost a compile per segment.
      remat: the recomputation policies to cost (``SegmentCost.remat``); each one
        costs one more split of the model. ``(Remat.NONE,)``: none.

    Returns:
      One :class:`SegmentCost` per segment (``len(traced.markers) + 1``).
    """
    closed = traced.closed_jaxpr
    jaxpr = closed.jaxpr
    ranges = segments(traced)
    param_vars = list(jaxpr.invars[: traced.num_params])
    param_index = {v: i for i, v in enumerate(param_vars)}

    flops = [0.0] * len(ranges)
    leaf_bytes: list[dict[int, int]] = [{} for _ in ranges]
    leaf_shape = {i: (tuple(v.aval.shape), str(v.aval.dtype)) for i, v in enumerate(param_vars)}
    for k, (start, end) in enumerate(ranges):
        for eqn in jaxpr.eqns[start:end]:
            flops[k] += eqn_flops(eqn)
            for v in eqn.invars:
                if isinstance(v, jcore.Var) and v in param_index:
                    i = param_index[v]
                    leaf_bytes[k][i] = aval_bytes(v.aval)

    # Residuals: one stage per segment, exactly as the runtime would store them.
    all_cuts = list(range(len(traced.markers)))
    stage_fns = split(traced, all_cuts)
    # what one device stores: a residual's shard where its type is sharded
    residual = [sum(shard_bytes(a) for a in s.residual_avals) for s in stage_fns]
    # What crosses each boundary: what the next stage receives (its in_avals).
    outs = [sum(shard_bytes(a) for a in s.in_avals) for s in stage_fns[1:]] + [0]
    user_remat = [has_user_remat(jaxpr.eqns[a:b]) for a, b in ranges]
    remat_costs = _remat_costs(traced, all_cuts, stage_fns,
                               [p for p in remat if p is not Remat.NONE])
    inputs = _input_values(traced, ranges)

    names = list(getattr(traced, "marker_names", ()) or ())
    times: list[tuple[float, float]] | None = profile_segments(traced) if profile else None
    result = []
    for k in range(len(ranges)):
        label = names[k] if k < len(names) and names[k] else f"segment{k}"
        result.append(
            SegmentCost(
                flops=flops[k],
                param_bytes=sum(leaf_bytes[k].values()),
                residual_bytes=int(residual[k]),
                out_bytes=int(outs[k]),
                param_leaf_bytes=leaf_bytes[k],
                param_leaf_shapes={i: leaf_shape[i] for i in leaf_bytes[k]},
                name=label,
                fwd_time=times[k][0] if times else None,
                bwd_time=times[k][1] if times else None,
                remat={} if user_remat[k] else {p: c[k] for p, c in remat_costs.items()},
                input_values=inputs[k],
                user_remat=user_remat[k],
            )
        )
    return result


def _remat_costs(traced: Any, cuts: list[int], plain: list[Any], policies: Sequence[Remat]
                 ) -> dict[Remat, list[RematCost]]:
    """Per policy, every segment's stored bytes and recompute FLOPs, measured on the split
    the runtime would run (one stage per segment, built under that policy)."""
    base = [jaxpr_flops(s.bwd) for s in plain]
    out: dict[Remat, list[RematCost]] = {}
    for policy in policies:
        # With one segment per stage, the whole-stage wrap is the per-segment one.
        same = Remat.BOUNDARY if policy is Remat.FULL else policy
        if same in out:
            out[policy] = out[same]
            continue
        stages = split(traced, cuts, [policy] * len(plain))
        out[policy] = [
            RematCost(sum(shard_bytes(a) for a in s.residual_avals),
                      max(jaxpr_flops(s.bwd) - b, 0.0))
            for s, b in zip(stages, base, strict=True)]
        out[same] = out[policy]
    return {p: out[p] for p in policies}


def _input_values(traced: Any, ranges: list[tuple[int, int]]) -> list[dict[int, tuple[int, int]]]:
    """Per segment: values it reads that another segment (or a constant) defined, as
    ``id -> (defining segment, bytes)``; parameters and batch leaves are re-read, not
    stored, so they are left out."""
    jaxpr = traced.closed_jaxpr.jaxpr
    where: dict[Any, int] = {v: -1 for v in jaxpr.constvars}
    ids: dict[Any, int] = {}
    out: list[dict[int, tuple[int, int]]] = []
    for k, (a, b) in enumerate(ranges):
        mine: dict[int, tuple[int, int]] = {}
        for eqn in jaxpr.eqns[a:b]:
            for v in eqn.invars:
                if isinstance(v, jcore.Var) and v in where and where[v] != k:
                    i = ids.setdefault(v, len(ids))
                    mine[i] = (where[v], aval_bytes(v.aval))
        for eqn in jaxpr.eqns[a:b]:
            where.update((v, k) for v in eqn.outvars if not isinstance(v, jcore.DropVar))
        out.append(mine)
    return out
