"""A pipeline stage as closed jaxprs (:class:`StageFn`), built from a range of a loss's equations.

Stage ``k`` runs the equations between cut ``k-1`` and cut ``k`` (:func:`jaxpipe.stages.split`
chooses the ranges; :class:`~jaxpipe.stages.fragments.Fragments` builds them). Its inputs are the
parameter leaves and microbatch leaves it reads plus the *carry*: every value defined
in an earlier stage and used by this or any later stage (so a skip connection that jumps
over a stage is passed through it). Its outputs are the carry for the next stage; the
last stage outputs the scalar loss, then the weight and the aux leaves the loss function
returns (:mod:`jaxpipe.jaxpr.objective`; only the loss is differentiated).

Every stage is turned into closed jaxprs once (:mod:`jaxpipe.stages.fragments`), so the
runtimes only evaluate them:

- ``fwd``: (params, batch, carry_in) -> (carry_out, stored residuals)
- ``bwd``: (params, batch, stored residuals, ct_out) -> (ct_params, ct_carry_in)
- ``bwd_i``: same inputs -> (ct_carry_in, w_residuals)   (backward w.r.t. inputs only)
- ``bwd_w``: (params, batch, stored residuals[w_res_ids], w_residuals) -> ct_params

Residuals that are just a parameter or a microbatch leaf are not stored: the backward
re-reads them (parameters are resident on the device anyway); those computed from the
parameters alone (a bf16 copy of an f32 weight, an FSDP shard's gathered weight) are
recomputed by the backward from them (:mod:`jaxpipe.stages.param_derived`), not stored
once per microbatch in flight. Only inexact (float)
parameters and carries are differentiated; integer values (token ids, masks) flow
through as non-differentiable inputs.

PRNG keys (``jax.random.key`` values, an extended dtype) never appear at a stage's
boundary: every key-typed input, output, residual or hand-off of a stage function is
passed as its raw key data (``jax.random.key_data``, ``uint32``) and re-wrapped with
its own implementation inside the stage (:func:`jaxpipe.jaxpr.avals.boundary_aval`). Runtimes keep
messages and residuals in numeric buffers, so they only ever see plain dtypes; the
batch and parameter leaves a runtime feeds in follow the same rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from jax.extend import core as jcore

from jaxpipe.stages.remat import Remat

__all__ = ["StageFn", "StageParts", "param_owners"]


@dataclass
class StageFn:
    """One pipeline stage as closed jaxprs plus the bookkeeping the runtimes need."""

    index: int
    eqn_range: tuple[int, int]
    param_ids: tuple[int, ...]  # param leaves read (indices into the flat params)
    batch_ids: tuple[int, ...]  # microbatch leaves read
    in_avals: list  # carry received from the previous stage
    out_avals: list  # carry sent to the next stage (last stage: [loss, weight?, *aux])
    residual_avals: list  # residuals stored per microbatch between F and B/W
    w_residual_avals: list  # values the I half hands to the W half
    fwd: jcore.ClosedJaxpr
    bwd: jcore.ClosedJaxpr
    bwd_i: jcore.ClosedJaxpr
    bwd_w: jcore.ClosedJaxpr
    diff_param_mask: tuple[bool, ...] = field(default=())  # per param_ids: differentiated?
    diff_in_mask: tuple[bool, ...] = field(default=())  # per in_avals
    diff_out_mask: tuple[bool, ...] = field(default=())  # per out_avals
    names: tuple[str, ...] = ()
    is_last: bool = False
    w_res_ids: tuple[int, ...] = ()  # stored residuals the W half reads (others die at I)
    remat: Remat = Remat.NONE  # the recomputation policy the forward/backward apply
    # how the stage splits into prologue / shared core / epilogue, if it does
    parts: StageParts | None = None
    # carry inputs / outputs (positions) that are also stored residuals
    stored_in: tuple[int, ...] = ()
    stored_out: tuple[int, ...] = ()
    # residuals computed from the parameters alone, which the backward recomputes instead
    # of storing (jaxpipe.stages.param_derived): what a microbatch in flight does not hold
    derived_avals: list = field(default_factory=list)

    def ct_in_avals(self) -> list:
        """Cotangents this stage's backward sends to the previous stage."""
        return [a for a, d in zip(self.in_avals, self.diff_in_mask, strict=True) if d]

    @property
    def i_only_residual_ids(self) -> tuple[int, ...]:
        """Stored residuals only the input-gradient half reads (free once I has run)."""
        w = set(self.w_res_ids)
        return tuple(i for i in range(len(self.residual_avals)) if i not in w)

    def ct_out_avals(self) -> list:
        """Cotangents this stage's backward receives from the next stage."""
        return [a for a, d in zip(self.out_avals, self.diff_out_mask, strict=True) if d]


@dataclass(frozen=True)
class StageParts:
    """How a stage splits into parts (see the module docstring).

    Attributes:
      parts: the parts in execution order (each a :class:`StageFn` of its equations).
      core: which of them is the core.
      param_pos: per part, the position of each of its parameters in the stage's
        ``param_ids``.
      batch_pos: per part, the position of each of its microbatch leaves in the stage's
        ``batch_ids``.
      res_ids: per part, the ids of its stored residuals among the stage's.
      w_ids: per part, the ids of its I -> W hand-off values among the stage's.
    """

    parts: tuple[StageFn, ...]
    core: int
    param_pos: tuple[tuple[int, ...], ...]
    batch_pos: tuple[tuple[int, ...], ...]
    res_ids: tuple[tuple[int, ...], ...]
    w_ids: tuple[tuple[int, ...], ...]

    @property
    def core_fn(self) -> StageFn:
        return self.parts[self.core]

    @property
    def prologue(self) -> int | None:
        """The part before the core, if any."""
        return 0 if self.core > 0 else None

    @property
    def epilogue(self) -> int | None:
        """The part after the core, if any."""
        return self.core + 1 if self.core + 1 < len(self.parts) else None


def param_owners(stages: Sequence[StageFn]) -> dict[int, tuple[int, ...]]:
    """Parameter leaf -> the stages that read it, ascending (a tied leaf has several).

    Computed once per pipeline; the runtimes place, sum and update tied leaves by it.
    """
    owners: dict[int, list[int]] = {}
    for st in stages:
        for pid in st.param_ids:
            owners.setdefault(pid, []).append(st.index)
    return {pid: tuple(sorted(o)) for pid, o in sorted(owners.items())}
