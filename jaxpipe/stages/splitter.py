"""Split a traced loss at marker positions into :class:`~jaxpipe.stages.stage_fn.StageFn` s.

:func:`split` is the one entry point: it builds a stage per range of equations
(:class:`~jaxpipe.stages.fragments.Fragments`), or, with ``share_cores``, splits the first and
last stages into a prologue, a core another stage shares and an epilogue
(:mod:`jaxpipe.stages.shared_cores`).
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxpipe.errors import PipelineError
from jaxpipe.jaxpr.trace import Traced
from jaxpipe.stages.fragments import Fragments
from jaxpipe.stages.remat import Remat, parse_remat
from jaxpipe.stages.shared_cores import share_cores as share
from jaxpipe.stages.stage_fn import StageFn

__all__ = ["split"]


def split(traced: Traced, cuts: Sequence[int],
          remat: Sequence[Remat | str] | None = None, *,
          share_cores: bool = False, split_backward: bool = False) -> list[StageFn]:
    """Cut ``traced`` after the markers at positions ``cuts`` (indices into ``traced.markers``).

    ``remat`` is one :class:`~jaxpipe.stages.remat.Remat` policy per stage (``None``: no
    recomputation anywhere; ``CutResult.remat`` is what the cutter chose).
    ``share_cores``: split the first and last stages into parts where their core is
    another stage's function (:mod:`jaxpipe.stages.shared_cores`), so a runtime can compile it once,
    unless the parts store more per microbatch than the whole stage (residuals, and with
    ``split_backward`` the I -> W hand-off too).

    Returns ``len(cuts) + 1`` stages. Raises :class:`PipelineError` for cut positions that are
    out of range, unsorted or repeated, or a ``remat`` of the wrong length.
    """
    cuts = list(cuts)
    n_markers = len(traced.markers)
    if sorted(set(cuts)) != cuts or any(c < 0 or c >= n_markers for c in cuts):
        raise PipelineError(
            f"cut positions {cuts} must be strictly increasing indices into the {n_markers} "
            f"markers (0..{n_markers - 1}); each cut ends a stage right after that marker."
        )
    frags = Fragments(traced)
    bounds = [0, *(frags.segs[c][1] for c in cuts), len(frags.eqns)]
    ranges = list(zip(bounds[:-1], bounds[1:], strict=True))
    policies = _stage_policies(remat, len(ranges))
    if share_cores:
        return share(frags, ranges, policies, split_backward)
    return [frags.build(s, a, b, policies[s], is_last=s == len(ranges) - 1)
            for s, (a, b) in enumerate(ranges)]


def _stage_policies(remat: Sequence[Remat | str] | None, n_stages: int) -> list[Remat]:
    if remat is None:
        return [Remat.NONE] * n_stages
    if isinstance(remat, (str, Remat)) or len(remat) != n_stages:
        raise PipelineError(
            f"remat must give one recomputation policy per stage ({n_stages}), got "
            f"{remat!r}; e.g. remat=[Remat.NONE] * {n_stages}.")
    try:
        return [parse_remat(r, f"remat[{i}]") for i, r in enumerate(remat)]
    except ValueError as e:
        raise PipelineError(str(e)) from None
