"""The rows a tick reads, cut out of the carried buffers before the accelerator's switch.

XLA:TPU lays a carried storage buffer out as its writes want it, and a branch's
``dynamic_slice`` of its rows may want another layout (GPT at width 128: the attention
pool ``f32[36,4,128,128]`` carried ``{2,3,1,0}``, read ``{3,2,1,0}``). Handed the whole
buffer, a conditional's branch relaid *all of it* before slicing, every tick: 80 MB a
tick in an 88 MB temp. So the switch gets *windows* instead: per (pool, class) read,
the rows from the step's base on, as many as any stage's part of that pool holds, and
the inbox slot the step reads. Buffer and window are both held row-major
(``with_layout_constraint``): a ``dynamic_slice`` keeps its operand's layout, so a free
window took the branch's and XLA:TPU relaid the whole buffer before the cut, outside the
switch. Fixed, the relayout the reads want is the window's: one microbatch's rows.

``dynamic_slice`` clamps a start that would run past the buffer, which would shift the
rows: a window starts at ``min(base, slots - size)`` and the branch reads at ``base -
start`` (every read of a part that fits its buffer stays inside the window; no padding).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.layout import Layout, with_layout_constraint

from jaxpipe.runtime.spmd.lowering.tick_table import ActionFields
from jaxpipe.runtime.spmd.lowering.types import Lowering, Pool
from jaxpipe.runtime.spmd.program.layout import StageLayouts

__all__ = ["Windows", "row_major"]

Key = tuple[Pool, Hashable]


class Windows:
    """Which rows of the storage and inbox a tick reads, and :meth:`cut` to read them.

    ``size``: per (pool, class) of the table, the most rows any stage's part of that pool
    holds (at most the buffer's slots: a part that does not fit is never stored)."""

    def __init__(self, layouts: StageLayouts, lowering: Lowering) -> None:
        slots, self.unit = lowering.slots, layouts.unit
        keys = lowering.table.pool_base
        self.size: dict[Key, int] = {}
        for pool, packings in layouts.pools.items():
            for p in packings:
                for c, n in p.counts.items():
                    if (pool, c) in keys and slots.get(c, 0) > 0:
                        self.size[pool, c] = min(slots[c], max(n, self.size.get((pool, c), 0)))

    def nbytes(self) -> int:
        """Bytes of one tick's storage windows (their temp, on top of the buffers)."""
        return sum(c.nbytes * n for (_, c), n in self.size.items())

    def cut(self, store: dict, inbox: dict, row: ActionFields
            ) -> tuple[ActionFields, dict, dict[Key, tuple[jax.Array, jax.Array]]]:
        """``(row, inbox window, windows)``: ``row`` reading its inbox slot at 0; that
        slot (``row.in_slot``); per (pool, class), ``(rows, where the part starts in
        them)``."""
        out = {}
        for (pool, c), n in self.size.items():
            base = row.bases(pool)[c]
            start = jnp.clip(base, 0, store[c].shape[0] - n)
            # buffer and window alike row-major: the relayout the reads want is then
            # the window's, inside the branch
            out[pool, c] = (row_major(lax.dynamic_slice_in_dim(
                row_major(store[c]), start, n, 0, allow_negative_indices=False)),
                            base - start)
        box = {c: lax.dynamic_slice_in_dim(inbox[c], row.in_slot * n, n, 0,
                                           allow_negative_indices=False)
               for c, n in self.unit.items()}
        return dataclasses.replace(row, in_slot=jnp.zeros_like(row.in_slot)), box, out

    def laid_out(self, store: dict) -> dict:
        """The storage after the tick's writes, the windowed buffers row-major: as a
        window is cut (a ``dynamic_slice`` keeps its operand's layout, and XLA:TPU laid
        the whole buffer out as the branch's reads wanted before cutting the window)."""
        windowed = {c for _, c in self.size}
        return {c: row_major(x) if c in windowed else x for c, x in store.items()}


def row_major(x: jax.Array) -> jax.Array:
    """``x`` laid out row-major (XLA picks the tiling)."""
    return with_layout_constraint(x, Layout(tuple(range(x.ndim))))
