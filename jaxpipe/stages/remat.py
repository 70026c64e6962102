"""Recomputation policies: what a stage stores for its backward, and what it recomputes.

A :class:`Remat` names one policy. The cutter (:mod:`jaxpipe.cut`) chooses one per
stage, the cost model (:mod:`jaxpipe.cut.cost`) measures each one's stored bytes and
recompute FLOPs, and the stage splitter (:func:`jaxpipe.stages.split`) applies it with
``jax.checkpoint`` when it builds the stage's forward and backward, so the residuals a
runtime stores (``StageFn.residual_avals``) are exactly the policy's.

Policies apply per *segment* (the code between two cut markers, usually one layer) or to
the whole stage:

==================  =======================================================  =========
policy              stored per microbatch (besides parameters and batch)      recompute
==================  =======================================================  =========
``NONE``            every residual autodiff keeps (no recomputation)          nothing
``DOTS``            matmul outputs (``jax.checkpoint_policies.dots_saveable``)  elementwise
``DOTS_NO_BATCH``   matmul outputs without batch dimensions (weight matmuls;   attention,
                    ``dots_with_no_batch_dims_saveable``)                     elementwise
``BOUNDARY``        each segment's inputs: the activations at the markers     every forward
                    (``nothing_saveable`` per segment; MaxText's per-layer
                    ``remat_policy="full"``)
``FULL``            the stage's inputs only (``nothing_saveable`` around the   every forward
                    whole stage); the backward rebuilds all of the stage's
                    activations at once
==================  =======================================================  =========

Under every policy, values computed from the parameters alone (a bf16 cast of an f32
weight, an FSDP gather) are recomputed by the backward, not stored
(:mod:`jaxpipe.stages.param_derived`).

A segment that already contains a user's own ``jax.checkpoint`` is left exactly as the
user wrote it under every policy (it is never wrapped a second time), so their choice
holds; :attr:`jaxpipe.cut.cost.SegmentCost.user_remat` marks such segments.

Applying a policy (:func:`remat_groups`, :func:`run_groups`): a stage's equations run as
groups, each evaluated as traced or wrapped in ``jax.checkpoint`` under the policy; the
stage builder (:mod:`jaxpipe.stages.fragments`) traces its forward through them.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jcore

from jaxpipe.jaxpr.interpret import eval_eqns, eval_slice
from jaxpipe.jaxpr.markers import boundary_p

__all__ = ["Group", "Remat", "RematSpec", "group_io", "has_user_remat", "parse_remat",
           "remat_groups", "run_groups"]


class Remat(enum.StrEnum):
    """One recomputation policy (see the module docstring for what each stores).

    A ``str`` enum: ``Remat("dots") is Remat.DOTS`` and ``Remat.DOTS == "dots"``.
    """

    NONE = "none"
    DOTS = "dots"
    DOTS_NO_BATCH = "dots_no_batch"
    BOUNDARY = "boundary"
    FULL = "full"

    @property
    def checkpoint_policy(self) -> Callable[..., bool] | None:
        """The ``jax.checkpoint`` policy it applies; ``None`` for :attr:`NONE` (no wrap)."""
        policies = jax.checkpoint_policies
        return {
            Remat.NONE: None,
            Remat.DOTS: policies.dots_saveable,
            Remat.DOTS_NO_BATCH: policies.dots_with_no_batch_dims_saveable,
            Remat.BOUNDARY: policies.nothing_saveable,
            Remat.FULL: policies.nothing_saveable,
        }[self]

    @property
    def whole_stage(self) -> bool:
        """True when one ``jax.checkpoint`` wraps the whole stage (else one per segment)."""
        return self is Remat.FULL


#: What ``jp.Cut(remat=...)`` accepts: ``"auto"``, one policy for every stage, or one
#: per stage.
RematSpec = str | Remat | Sequence[str | Remat]


def parse_remat(value: Any, what: str = "remat") -> Remat:
    """``value`` as a :class:`Remat`; a ``ValueError`` naming the choices otherwise."""
    if isinstance(value, Remat):
        return value
    try:
        return Remat(value)
    except ValueError:
        choices = ", ".join(repr(r.value) for r in Remat)
        raise ValueError(f"{what} must be one of {choices} (or a jaxpipe.stages.remat.Remat), "
                         f"got {value!r}") from None


# ----------------------------------------------------------------------------- applying one
def has_user_remat(eqns: Sequence[jcore.JaxprEqn]) -> bool:
    """True when some equation (at any depth) is a user's ``jax.checkpoint``."""
    for e in eqns:
        if e.primitive.name in ("checkpoint", "remat", "remat2"):
            return True
        if any(has_user_remat(_inner(sub).eqns) for sub in jcore.jaxprs_in_params(e.params)):
            return True
    return False


def _inner(j: Any) -> Any:
    return getattr(j, "jaxpr", j)


#: A run of a stage's equations ``[start, end)`` (absolute indices) and the
#: ``jax.checkpoint`` policy it runs under (``None``: evaluated as traced).
Group = tuple[int, int, object]


def remat_groups(eqns, seg_ranges: list[tuple[int, int]], policy: Remat) -> list[Group]:
    """How a stage's equations run under ``policy``: runs of equations and their wrap.

    Per-segment policies wrap each segment on its own; ``Remat.FULL`` wraps each maximal
    run of consecutive segments. Segments holding a user's ``jax.checkpoint`` run as
    traced under every policy (their recomputation is the user's choice).
    """
    wrap = policy.checkpoint_policy
    groups: list[list] = []
    for x, y in seg_ranges:
        pol = None if wrap is None or has_user_remat(eqns[x:y]) else wrap
        merge = groups and groups[-1][2] is pol and (pol is None or policy.whole_stage)
        if merge:
            groups[-1][1] = y
        else:
            groups.append([x, y, pol])
    return [tuple(g) for g in groups]


def group_io(eqns, groups: list[Group], start: int, outputs: list) -> list[tuple[list, list]]:
    """Per group: the variables it reads from outside (in order) and those it defines
    that later groups or the stage's ``outputs`` read."""
    later: set = {v for v in outputs if isinstance(v, jcore.Var)}
    io: list[tuple[list, list]] = []
    for x, y, _ in reversed(groups):
        defined: set = set()
        ins: list = []
        seen: set = set()
        for e in eqns[x - start:y - start]:
            for v in e.invars:
                if isinstance(v, jcore.Var) and v not in defined and v not in seen:
                    seen.add(v)
                    ins.append(v)
            defined.update(e.outvars)
        outs = [v for e in eqns[x - start:y - start] for v in e.outvars
                if v in later and not isinstance(v, jcore.DropVar)]
        io.append((ins, outs))
        later |= seen
    return io[::-1]


def _skip_marker(eqn, invals):
    """A cut marker's outputs are its inputs: stage functions hold no marker equations
    (markers only say where the pipeline may cut)."""
    return list(invals) if eqn.primitive is boundary_p else None


def run_groups(eqns, groups: list[Group], io: list[tuple[list, list]], start: int,
                env: dict) -> None:
    """Evaluate a stage's equations into ``env``, wrapping groups in ``jax.checkpoint``."""
    for (x, y, pol), (ins, outs) in zip(groups, io, strict=True):
        body_eqns = eqns[x - start:y - start]
        if pol is None or not outs:
            eval_eqns(body_eqns, env, override=_skip_marker)
            continue

        def body(*vals, _eqns=body_eqns, _ins=ins, _outs=outs):
            return eval_slice(_eqns, _ins, _outs, vals, override=_skip_marker)

        # prevent_cse=False: the backward that recomputes runs in a jaxpr of its own
        # (another branch, another tick), so there is no forward to merge it with, and
        # the barrier that would prevent it copies the wrapped inputs (parameters).
        results = jax.checkpoint(body, policy=pol, prevent_cse=False)(*[env[v] for v in ins])
        env.update(zip(outs, results, strict=True))
