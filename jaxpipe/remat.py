"""Recomputation policies: what a stage stores for its backward, and what it recomputes.

A :class:`Remat` names one policy. The cutter (:mod:`jaxpipe.cut`) chooses one per
stage, the cost model (:mod:`jaxpipe.cost`) measures each one's stored bytes and
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

A segment that already contains a user's own ``jax.checkpoint`` is left exactly as the
user wrote it under every policy (it is never wrapped a second time), so their choice
holds; :attr:`jaxpipe.cost.SegmentCost.user_remat` marks such segments.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import jax

__all__ = ["Remat", "RematSpec", "parse_remat"]


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
        raise ValueError(f"{what} must be one of {choices} (or a jaxpipe.remat.Remat), "
                         f"got {value!r}") from None
