"""The optimizer update inside the SPMD program: per device, per stage, after the scan.

The per-stage update itself is :class:`jaxpipe.train.StageOptimizer`; this module places
it: each device updates its own stages (a ``lax.switch`` over the device index picks
the device's stage list), tied parameters get the sum of their gradients over the
stages holding them, and the global gradient norm (for clipping, skipping non-finite
steps and the metrics) is a ``psum`` over the pipe axis.

Optimizer state is stored like residuals: each stage's state leaves packed into flat
per-dtype rows, ``{dtype: [devices, stages_per_device, width]}``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxpipe.runtime.base import RuntimeSpec
from jaxpipe.runtime.spmd.layout import Layout, ParamSlots, merge_widths
from jaxpipe.train import StageOptimizer, TrainOptions, global_norm_scale, sq_norm

__all__ = ["OptimizerLayout", "make_epilogue"]


class OptimizerLayout:
    """Where each stage's optimizer-state leaves live in the flat per-dtype rows."""

    def __init__(self, stage_opt: StageOptimizer) -> None:
        self.stage_layouts = [Layout(avals) for avals in stage_opt.state_avals]
        self.width = merge_widths(self.stage_layouts)

    def pack_rows(self, spec: RuntimeSpec, rows: list[dict], stages_per_device: int) -> dict:
        """Per-stage flat rows -> ``{dtype: [devices, stages_per_device, width]}``."""
        sched = spec.schedule
        out = {}
        for dt, w in self.width.items():
            zero = jnp.zeros((w,), dt)
            out[dt] = jnp.stack([
                jnp.stack([rows[s][dt] for s in sched.device_stages(d)]
                          + [zero] * (stages_per_device - len(sched.device_stages(d))))
                for d in range(sched.num_devices)
            ])
        return out

    def specs(self, axis: str) -> dict:
        return {dt: P(axis) for dt in self.width}


def make_epilogue(spec: RuntimeSpec, slots: ParamSlots, stage_opt: StageOptimizer,
                  layout: OptimizerLayout, options: TrainOptions,
                  stages_per_device: int) -> Callable:
    """``epilogue(pbuf, gbuf, loss, obuf) -> (pbuf, obuf, metrics)``, run per device."""
    stages, sched, axis = spec.stages, spec.schedule, spec.axis
    avals = spec.param_avals
    tied = spec.tied
    owners = spec.param_owners

    def per_device(fn: Callable, *args: Any) -> Any:
        return lax.switch(lax.axis_index(axis),
                          [lambda *a, d=d: fn(d, *a) for d in range(sched.num_devices)], *args)

    def local_tied(d: int, buf: list, owner_only: bool) -> list:
        """Device d's contribution to each tied leaf (sum, or the first owner's value)."""
        out = [jnp.zeros(avals[pid].shape, avals[pid].dtype) for pid in tied]
        for s in sched.device_stages(d):
            for pid, n in zip(stages[s].param_ids, slots.stage_slots[s], strict=True):
                if pid in tied and (not owner_only or owners[pid][0] == s):
                    out[tied.index(pid)] = out[tied.index(pid)] + buf[n]
        return out

    def local_sq(d: int, gbuf: list) -> jax.Array:
        return sq_norm([gbuf[n] for s in sched.device_stages(d)
                        for pid, n in zip(stages[s].param_ids, slots.stage_slots[s],
                                          strict=True) if pid not in tied])

    def update_device(d: int, pbuf: list, gbuf: list, obuf: dict, tied_total: list,
                      scale: jax.Array) -> tuple[list, dict]:
        pbuf = list(pbuf)
        new_o = {dt: [v[k] for k in range(stages_per_device)] for dt, v in obuf.items()}
        for k, s in enumerate(sched.device_stages(d)):
            st, ns = stages[s], slots.stage_slots[s]
            grads = [tied_total[tied.index(pid)] if pid in tied else gbuf[n]
                     for pid, n in zip(st.param_ids, ns, strict=True)]
            grads = [(g * scale).astype(g.dtype) for g in grads]
            state = layout.stage_layouts[s].unpack({dt: v[k] for dt, v in obuf.items()})
            new_params, new_state = stage_opt.update(s, [pbuf[n] for n in ns], grads, state)
            for n, x in zip(ns, new_params, strict=True):
                pbuf[n] = x
            packed = layout.stage_layouts[s].pack(new_state, layout.width)
            for dt in new_o:
                new_o[dt][k] = packed[dt]
        return pbuf, {dt: jnp.stack(v) for dt, v in new_o.items()}

    def set_tied(d: int, pbuf: list, owned: list) -> list:
        pbuf = list(pbuf)
        for s in sched.device_stages(d):
            for pid, n in zip(stages[s].param_ids, slots.stage_slots[s], strict=True):
                if pid in tied:
                    pbuf[n] = owned[tied.index(pid)]
        return pbuf

    def epilogue(pbuf: list, gout: list, loss: jax.Array, obuf: dict) -> tuple:
        obuf = {k: v[0] for k, v in obuf.items()}
        tied_total = [lax.psum(x, axis) for x in per_device(
            lambda d, g: local_tied(d, g, False), gout)]
        total_sq = sq_norm(tied_total) + lax.psum(per_device(local_sq, gout), axis)
        gnorm, scale = global_norm_scale(total_sq, options)
        new_p, new_o = per_device(
            lambda d, p, g, o: update_device(d, p, g, o, tied_total, scale), pbuf, gout, obuf)
        if tied:
            # Copies got the same update, but branches may round differently: take the
            # first owner's result everywhere so tied copies stay bit-identical.
            owned = [lax.psum(x, axis) for x in per_device(
                lambda d, p: local_tied(d, p, True), new_p)]
            new_p = per_device(lambda d, p: set_tied(d, p, owned), new_p)
        finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)
        if options.skip_nonfinite:
            new_p = [jnp.where(finite, a, b) for a, b in zip(new_p, pbuf, strict=True)]
            new_o = {dt: jnp.where(finite, new_o[dt], obuf[dt]) for dt in new_o}
        metrics = {"loss": loss, "grad_norm": gnorm,
                   "skipped": jnp.logical_and(options.skip_nonfinite,
                                              ~finite).astype(jnp.int32)}
        return [x[None] for x in new_p], {dt: v[None] for dt, v in new_o.items()}, metrics

    return epilogue
