"""Where a stage's stored values live: the parts (:class:`Pool`) they are kept in.

A leaf of the lowering's types: :mod:`.tick_table` and :mod:`.types` key their slot
tables by it.
"""

from __future__ import annotations

import enum

__all__ = ["Pool"]


class Pool(enum.IntEnum):
    """The parts a stage's stored values are kept in, by who writes and who reads them.

    Residuals are stored in two parts so that what only the input-gradient needs is
    freed as soon as I has run; ``HANDOFF`` is what I hands to W.
    """

    RESIDUAL_A = 0  # written by F; read by B or I (freed there)
    RESIDUAL_B = 1  # written by F; read by B, I and W (freed at B or W)
    HANDOFF = 2  # written by I; read by W

    @property
    def writer(self) -> str:
        return "I" if self is Pool.HANDOFF else "F"

    @property
    def readers(self) -> tuple[str, ...]:
        return {Pool.RESIDUAL_A: ("B", "I"), Pool.RESIDUAL_B: ("B", "I", "W"),
                Pool.HANDOFF: ("W",)}[self]
