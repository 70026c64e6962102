"""The optimizer update inside the SPMD program: per device, per stage, after the scan.

The per-stage update itself is :class:`jaxpipe.train.StageOptimizer`; this module places
it: each device updates its own stages (a ``lax.switch`` over the device index picks
the device's stage list), tied parameters get the sum of their gradients over the
stages holding them, and the global gradient norm (for clipping, skipping non-finite
steps and the metrics) is a ``psum`` over the pipe axis.

Optimizer state is stored like parameters: per-class slot buffers ``{class: [devices,
slots, *shape]}`` (:class:`~.layout.SlotLayout`), so a moment estimate of a parameter
lives in a buffer of the parameter's own class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from jaxpipe.runtime.base import RuntimeSpec
from jaxpipe.runtime.spmd.layout import SlotLayout, ValueClass
from jaxpipe.train import StageOptimizer, TrainOptions, global_norm_scale, sq_norm

__all__ = ["make_epilogue", "opt_slots"]


def opt_slots(spec: RuntimeSpec, stage_opt: StageOptimizer) -> SlotLayout:
    """Slots of every stage's optimizer-state leaves."""
    sched = spec.schedule
    return SlotLayout(stage_opt.state_avals,
                      [sched.device_stages(d) for d in range(sched.num_devices)])


def make_epilogue(spec: RuntimeSpec, slots: SlotLayout, stage_opt: StageOptimizer,
                  ostate: SlotLayout, options: TrainOptions) -> Callable:
    """``epilogue(pbuf, gbuf, loss, obuf) -> (pbuf, obuf, metrics)``, run per device;
    parameters, gradients and optimizer state are per-class slot buffers."""
    stages, sched, axis = spec.stages, spec.schedule, spec.axis
    avals = spec.param_avals
    tied = spec.tied
    owners = spec.param_owners

    def per_device(fn: Callable, *args: Any) -> Any:
        return lax.switch(lax.axis_index(axis),
                          [lambda *a, d=d: fn(d, *a) for d in range(sched.num_devices)], *args)

    def leaves(s: int) -> list[tuple[int, ValueClass, int]]:
        """(leaf id, class, slot) of every parameter leaf of stage ``s``."""
        return [(pid, c, i) for pid, (c, i) in zip(stages[s].param_ids, slots.where[s],
                                                     strict=True)]

    def local_tied(d: int, rows: dict, owner_only: bool) -> list:
        """Device d's contribution to each tied leaf (sum, or the first owner's value)."""
        out = [jnp.zeros(avals[pid].shape, avals[pid].dtype) for pid in tied]
        for s in sched.device_stages(d):
            for pid, c, i in leaves(s):
                if pid in tied and (not owner_only or owners[pid][0] == s):
                    out[tied.index(pid)] = out[tied.index(pid)] + rows[c][i]
        return out

    def local_sq(d: int, grows: dict) -> jax.Array:
        return sq_norm([grows[c][i] for s in sched.device_stages(d)
                        for pid, c, i in leaves(s) if pid not in tied])

    # Every per-device function works on rows (lists of slot values), never on whole
    # buffers: see SlotLayout.unstack.
    def update_device(d: int, prow: dict, grow: dict, orow: dict, tied_total: list,
                      scale: jax.Array) -> tuple[dict, dict]:
        for s in sched.device_stages(d):
            mine = leaves(s)
            grads = [tied_total[tied.index(pid)] if pid in tied else grow[c][i]
                     for pid, c, i in mine]
            grads = [(g * scale).astype(g.dtype) for g in grads]
            new_params, new_state = stage_opt.update(
                s, slots.gather(prow, s), grads, ostate.gather(orow, s))
            prow = slots.scatter(prow, s, new_params)
            orow = ostate.scatter(orow, s, new_state)
        return prow, orow

    def set_tied(d: int, prow: dict, owned: list) -> dict:
        prow = {c: list(r) for c, r in prow.items()}
        for s in sched.device_stages(d):
            for pid, c, i in leaves(s):
                if pid in tied:
                    prow[c][i] = owned[tied.index(pid)]
        return prow

    def epilogue(pbuf: dict, gbuf: dict, loss: jax.Array, obuf: dict) -> tuple:
        obuf = {c: v[0] for c, v in obuf.items()}
        pbuf, gout, obuf = slots.unstack(pbuf), slots.unstack(gbuf), ostate.unstack(obuf)
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
        new_p, new_o = slots.stack(new_p), ostate.stack(new_o)
        if options.skip_nonfinite:
            pbuf, obuf = slots.stack(pbuf), ostate.stack(obuf)
            new_p = {c: jnp.where(finite, new_p[c], pbuf[c]) for c in new_p}
            new_o = {c: jnp.where(finite, new_o[c], obuf[c]) for c in new_o}
        metrics = {"loss": loss, "grad_norm": gnorm,
                   "skipped": jnp.logical_and(options.skip_nonfinite,
                                              ~finite).astype(jnp.int32)}
        return ({c: x[None] for c, x in new_p.items()}, {c: x[None] for c, x in new_o.items()},
                metrics)

    return epilogue


def opt_specs(ostate: SlotLayout, axis: str) -> dict[ValueClass, P]:
    return {c: P(axis) for c in ostate.counts}
