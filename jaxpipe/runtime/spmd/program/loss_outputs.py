"""Where the last stage's outputs go, and how the program reduces them after its ticks.

The last stage outputs the microbatch's loss, then the weight and aux leaves its loss
function returns (:mod:`jaxpipe.jaxpr.objective`). The loss is summed into the loop's carry; the
weight and every aux leaf go into a buffer of its own, one row per microbatch, written at
the microbatch's row like a stored value (so the accelerator program makes the write
after its switch, :mod:`.writes`). After the tick loop, the device that ran the last
stage holds them: a ``psum`` over the pipe axis gives every device the rows (the others
hold zeros), and the reduction turns the sums into the pipeline's loss and divides the
gradients where it must (``reduction="weighted"``: by the total weight, once; where the
weight comes from the batch alone, the total is known before the ticks and each loss is
seeded with ``1 / total`` instead, as ``jax.value_and_grad`` of the quotient is).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxpipe.jaxpr.objective import Objective, sum_dtype
from jaxpipe.runtime.spmd.program.layout import ValueClass, value_class
from jaxpipe.runtime.spmd.program.writes import put_rows
from jaxpipe.sharding.constraints import stage_as_fun

__all__ = ["LossOutputs"]


class LossOutputs:
    """The last stage's outputs for one pipeline (``out_avals``: the last stage's,
    ``[loss, weight?, *aux]``) under ``objective``, with ``num_microbatches`` rows."""

    def __init__(self, out_avals: Sequence[Any], objective: Objective,
                 num_microbatches: int) -> None:
        self.objective = objective
        self.m = num_microbatches
        self.loss_dtype = out_avals[0].dtype
        #: what the losses (and weights) are summed in: float32, or float64 under x64
        self.acc_dtype = sum_dtype(self.loss_dtype)
        self.classes = [ValueClass(value_class(a).shape, value_class(a).dtype,
                                   buffer=f"output{k}")
                        for k, a in enumerate(out_avals[1:])]
        #: the total weight, when known before the ticks (:meth:`weigh`)
        self.total: jax.Array | None = None

    def weigh(self, weight: Any, batch: Sequence[jax.Array], batch_axes: tuple[str, ...]
              ) -> None:
        """Total the weight (``reduction="weighted"``) before the ticks: ``weight``, the
        weight of one microbatch's batch leaves (``RuntimeSpec.batch_weight``), over this
        device's ``batch`` (``[m, rows, ...]``) and the manual ``batch_axes``. Each loss is
        then seeded with ``1 / total`` and nothing is divided at the end."""
        per = jax.vmap(lambda *xs: stage_as_fun(weight)(*xs)[0])(*batch)
        total = jnp.sum(per.astype(self.acc_dtype))
        self.total = lax.psum(total, batch_axes) if batch_axes else total

    def zero(self) -> jax.Array:
        """A zero loss sum."""
        return jnp.zeros((), self.acc_dtype)

    def seed(self) -> jax.Array:
        """The cotangent of one microbatch's loss output."""
        if self.total is not None:
            return (1.0 / self.total).astype(self.loss_dtype)
        return jnp.full((), self.objective.seed(self.m), self.loss_dtype)

    def buffers(self) -> dict[ValueClass, jax.Array]:
        """The zero buffers the program's storage holds them in (one row a microbatch)."""
        return {c: c.zeros(self.m) for c in self.classes}

    def record(self, microbatch: Any, store: Any, loss: jax.Array, outs: Sequence
               ) -> tuple[Any, jax.Array]:
        """Add the loss ``outs[0]`` to ``loss``; write the weight and aux leaves
        (``outs[1:]``) at the microbatch's row of their buffers."""
        for c, x in zip(self.classes, outs[1:], strict=True):
            store = put_rows(store, c, microbatch, 0,
                             jnp.asarray(x, c.dtype).reshape(1, *c.row_shape))
        return store, loss + outs[0].astype(self.acc_dtype)

    def finish(self, store: dict, loss: jax.Array, gbuf: list, axis: str,
               batch_axes: tuple[str, ...]) -> tuple[jax.Array, list, list]:
        """After the tick loop, on every device: ``(loss, gradients, aux leaves)``.

        ``loss`` is this device's sum of microbatch losses, ``gbuf`` its gradients (each
        microbatch's scaled by its seed); ``batch_axes``: the manual batch axes, over
        which each device saw one shard of every microbatch. An aux leaf comes back
        ``[m, *shape]``, and ``[m, shards, *shape]`` over manual batch axes (each
        shard's value of every microbatch, in mesh order).
        """
        rows = []
        for c in self.classes:
            x = store[c]
            x = lax.psum(x.astype(jnp.int32) if x.dtype == jnp.bool_ else x, axis)
            rows.append(x.astype(c.dtype).reshape(self.m, *c.shape))
        loss = lax.psum(loss, axis)
        reduction = self.objective.reduction
        if reduction == "weighted":  # every shard's sums: the quotient of the totals
            total = jnp.sum(rows[0].astype(self.acc_dtype))
            if batch_axes:
                loss, total = lax.psum((loss, total), batch_axes)
                gbuf = jax.tree.map(lambda g: lax.psum(g, batch_axes), gbuf)
            if self.total is None:  # seeded with 1: divided once, here
                gbuf = jax.tree.map(lambda g: (g / total.astype(g.dtype)).astype(g.dtype),
                                    gbuf)
            loss, rows = loss / total, rows[1:]
        else:  # a mean (or sum) of the shards' means
            loss = loss / self.m if reduction == "mean" else loss
            if batch_axes:
                loss = lax.pmean(loss, batch_axes)
                gbuf = jax.tree.map(lambda g: lax.pmean(g, batch_axes), gbuf)
        if batch_axes:  # each shard's aux: a shard axis after the microbatch axis
            rows = [x[:, None] for x in rows]
        return loss, gbuf, rows
