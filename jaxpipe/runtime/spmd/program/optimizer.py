"""The optimizer update inside the SPMD program: per device, per stage, after the scan.

The per-stage update itself is :class:`jaxpipe.train.state.StageOptimizer`; this module places
it: each device updates its own stages (a ``lax.switch`` over the device index picks
the device's stage list; devices whose updates trace to the same computation on their
own slots share one branch), tied parameters get the sum of their gradients over the
stages holding them, and the global gradient norm (for clipping, skipping non-finite
steps and the metrics) is a ``psum`` over the pipe axis.

Optimizer state is stored like parameters: a list of slots ``[devices, *shape]``
(:class:`~.layout.SlotLayout`), so a moment estimate of a parameter has its own array
of the parameter's shape and sharding (:func:`state_dims`). Over the mesh axes that
shard parameters the update runs on the global view, so norms and sums over sharded
leaves are JAX's to reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxpipe.jaxpr.identity import same_function
from jaxpipe.runtime.base import RuntimeSpec
from jaxpipe.runtime.spmd.program.gated import by_device
from jaxpipe.runtime.spmd.program.layout import SlotLayout
from jaxpipe.sharding.mesh_axes import Dims, constrain
from jaxpipe.train.options import TrainOptions, global_norm_scale, sq_norm
from jaxpipe.train.state import StageOptimizer

__all__ = ["InitOptState", "make_epilogue", "opt_slots"]


def opt_slots(spec: RuntimeSpec, stage_opt: StageOptimizer) -> SlotLayout:
    """Slots of every stage's optimizer-state leaves, sharded like their parameters."""
    sched = spec.schedule
    return SlotLayout(stage_opt.state_avals,
                      [sched.device_stages(d) for d in range(sched.num_devices)],
                      state_dims(spec, stage_opt) if spec.param_dims else None)


class InitOptState:
    """``init_opt_state(param_leaves)``: every stage's optimizer state in its device's
    slots (``ostate``), and ``specs``, the partition specs of the slot arrays returned."""

    def __init__(self, spec: RuntimeSpec, stage_opt: StageOptimizer, ostate: SlotLayout,
                 specs: list) -> None:
        self.spec, self.stage_opt, self.ostate, self.specs = spec, stage_opt, ostate, specs

    def __call__(self, param_leaves: list) -> list:
        spec, ostate = self.spec, self.ostate
        D = spec.schedule.num_devices
        bufs = [ostate.zeros() for _ in range(D)]
        held: list[set[int]] = [set() for _ in range(D)]
        inputs = spec.views.take(param_leaves)
        for st in spec.stages:
            d = spec.schedule.placement(st.index)
            leaves = self.stage_opt.init(st.index, [inputs[i] for i in st.param_ids])
            bufs[d] = ostate.scatter(bufs[d], st.index, leaves)
            held[d].update(ostate.where[st.index])

        def column(k: int) -> jax.Array:
            # A device no stage of which holds slot k keeps zeros of the held value's type
            # (Explicit axes: its sharding is part of the type, and stacking needs one).
            like = next((bufs[d][k] for d in range(D) if k in held[d]), None)
            return jnp.stack([bufs[d][k] if like is None or k in held[d]
                              else jnp.zeros_like(like) for d in range(D)])

        return [column(k) for k in range(len(ostate))]


def _keys(path: Any) -> list[str]:
    return [jax.tree_util.keystr((k,)) for k in path]


def state_dims(spec: RuntimeSpec, stage_opt: StageOptimizer) -> list[list[Dims]]:
    """Per stage, the sharding of each optimizer-state leaf: that of the parameter it
    belongs to (optax keeps per-parameter state as copies of the parameter tree, so the
    leaf's path ends with the parameter's path and it has the parameter's shape), and
    replicated for anything else (step counts, scalars)."""
    treedef = spec.params_treedef
    leaf_paths = [_keys(p) for p, _ in jax.tree.flatten_with_path(
        jax.tree.unflatten(treedef, list(range(treedef.num_leaves))))[0]]
    out = []
    for st, avals, tdef in zip(spec.stages, stage_opt.state_avals, stage_opt.state_treedefs,
                               strict=True):
        paths = [_keys(p) for p, _ in jax.tree.flatten_with_path(
            jax.tree.unflatten(tdef, list(range(len(avals)))))[0]]
        dims = []
        for path, a in zip(paths, avals, strict=True):
            match = [pid for pid in st.param_ids
                     if tuple(spec.param_avals[pid].shape) == tuple(a.shape)
                     and path[-len(leaf_paths[spec.tree_leaf(pid)]):]
                     == leaf_paths[spec.tree_leaf(pid)]]
            dims.append(spec.dims(match[0]) if match else ((),) * len(a.shape))
        out.append(dims)
    return out


def make_epilogue(spec: RuntimeSpec, slots: SlotLayout, stage_opt: StageOptimizer,
                  ostate: SlotLayout, options: TrainOptions) -> Callable:
    """``epilogue(pbuf, gbuf, loss, obuf) -> (pbuf, obuf, metrics)``, run per device;
    parameters, gradients and optimizer state are slot lists."""
    stages, sched, axis = spec.stages, spec.schedule, spec.axis
    avals = spec.param_avals
    tied = spec.tied
    owners = spec.param_owners

    def per_device(fn: Callable, *args: Any) -> Any:
        """``fn(d, *args)`` on device ``d``: a switch over the devices whose computations
        differ (the middle devices of a model usually compute the same thing on their own
        slots: one branch, not one per device, to compile)."""
        branches, pick = _distinct(
            [lambda *a, d=d: fn(d, *a) for d in range(sched.num_devices)], args)
        return by_device(branches, pick, axis, *args)

    def leaves(s: int) -> list[tuple[int, int]]:
        """(leaf id, slot) of every parameter leaf of stage ``s``."""
        return list(zip(stages[s].param_ids, slots.where[s], strict=True))

    # Per-device functions take and return slot *lists* of whole arrays: a lax.switch
    # branch returning arrays it replaced costs their size, never a copy of a buffer.
    # Every branch constrains what it returns to the values' shardings (XLA refuses a
    # conditional whose branches return one value sharded differently).
    def local_tied(d: int, bufs: list, owner_only: bool) -> list:
        """Device d's contribution to each tied leaf (sum, or the first owner's value)."""
        out = [constrain(jnp.zeros(avals[pid].shape, avals[pid].dtype), spec.dims(pid))
               for pid in tied]
        for s in sched.device_stages(d):
            for pid, k in leaves(s):
                if pid in tied and (not owner_only or owners[pid][0] == s):
                    out[tied.index(pid)] = out[tied.index(pid)] + bufs[k]
        return [constrain(x, spec.dims(pid)) for x, pid in zip(out, tied, strict=True)]

    def local_sq(d: int, gbuf: list) -> jax.Array:
        return sq_norm([gbuf[k] for s in sched.device_stages(d)
                        for pid, k in leaves(s) if pid not in tied])

    def update_device(d: int, pbuf: list, gbuf: list, obuf: list, tied_total: list,
                      scale: jax.Array) -> tuple[list, list]:
        for s in sched.device_stages(d):
            grads = [tied_total[tied.index(pid)] if pid in tied else gbuf[k]
                     for pid, k in leaves(s)]
            grads = [(g * scale).astype(g.dtype) for g in grads]
            new_params, new_state = stage_opt.update(
                s, slots.gather(pbuf, s), grads, ostate.gather(obuf, s))
            pbuf = slots.scatter(pbuf, s, new_params)
            obuf = ostate.scatter(obuf, s, new_state)
        return slots.constrain(pbuf), ostate.constrain(obuf)

    def set_tied(d: int, pbuf: list, owned: list) -> list:
        pbuf = list(pbuf)
        for s in sched.device_stages(d):
            for pid, k in leaves(s):
                if pid in tied:
                    pbuf[k] = owned[tied.index(pid)]
        return slots.constrain(pbuf)

    def epilogue(pbuf: list, gout: list, loss: jax.Array, obuf: list) -> tuple:
        obuf = [v[0] for v in obuf]
        # psum promotes bool/small ints: every tied leaf keeps its own dtype
        tied_total = [lax.psum(x, axis).astype(x.dtype) for x in per_device(
            lambda d, g: local_tied(d, g, False), gout)]
        total_sq = sq_norm(tied_total) + lax.psum(per_device(local_sq, gout), axis)
        gnorm, scale = global_norm_scale(total_sq, options)
        new_p, new_o = per_device(
            lambda d, p, g, o: update_device(d, p, g, o, tied_total, scale), pbuf, gout, obuf)
        if tied:
            # Copies got the same update, but branches may round differently: take the
            # first owner's result everywhere so tied copies stay bit-identical.
            owned = [lax.psum(x, axis).astype(x.dtype) for x in per_device(
                lambda d, p: local_tied(d, p, True), new_p)]
            new_p = per_device(lambda d, p: set_tied(d, p, owned), new_p)
        finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)
        if options.skip_nonfinite:
            new_p = [jnp.where(finite, a, b) for a, b in zip(new_p, pbuf, strict=True)]
            new_o = [jnp.where(finite, a, b) for a, b in zip(new_o, obuf, strict=True)]
        metrics = {"loss": loss, "grad_norm": gnorm,
                   "skipped": jnp.logical_and(options.skip_nonfinite,
                                              ~finite).astype(jnp.int32)}
        return [x[None] for x in new_p], [x[None] for x in new_o], metrics

    return epilogue


def _distinct(fns: list[Callable], args: tuple) -> tuple[list[Callable], list[int]]:
    """The functions of ``fns`` that compute different things on ``args`` (traced and
    compared, :func:`jaxpipe.jaxpr.identity.same_function`), and for each function the
    position of its representative."""
    traced = [jax.make_jaxpr(f)(*args) for f in fns]  # alive while ``text`` holds ids
    text: dict[int, str] = {}
    reps: list[int] = []  # positions in ``fns`` of the functions kept
    pick: list[int] = []
    for i, closed in enumerate(traced):
        same = next((j for j, r in enumerate(reps)
                     if same_function(traced[r], closed, text)), None)
        if same is None:
            reps.append(i)
            same = len(reps) - 1
        pick.append(same)
    return [fns[r] for r in reps], pick
