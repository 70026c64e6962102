"""Optax training for a :class:`~jaxpipe.Pipeline`: one jitted, donated step per batch.

Forward, backward and the optimizer update run in the same ``jit(shard_map)`` program.
The update runs per stage, on that stage's real parameter pytree (the user's tree with
the leaves other stages own set to ``None``), so masks given as callables, weight decay
by name and shape-aware optimizers behave as without a pipeline. Parameters read by
several stages (tied embeddings) get the sum of their gradients on every copy, so the
copies receive identical updates and never diverge.

Optimizers whose update needs the *global* gradient (e.g. ``clip_by_global_norm``) see
only their stage's gradients; use ``Pipeline.init(..., clip_global_norm=...)`` instead,
which clips by the true global norm before the optimizer runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe.errors import PipelineError
from jaxpipe.packing import Layout, merge_widths
from jaxpipe.runtime.spmd import build_step

__all__ = ["TrainState", "init_state", "train_step"]


class TrainState(NamedTuple):
    """Train state in the per-device stage layout.

    ``params`` and ``opt_state`` are ``{dtype: array[devices, stages_per_device, width]}``
    sharded over the pipe axis; use ``Pipeline.params(state)`` for the user pytree.
    """

    params: dict
    opt_state: dict
    step: jax.Array


@dataclass
class _Trainer:
    optimizer: optax.GradientTransformation
    opt_layouts: list[Layout]
    opt_width: dict[str, int]
    step_fn: Any
    skip_nonfinite: bool
    clip_global_norm: float | None


def _stage_tree(pipe, s: int, leaves) -> Any:
    """The user's param pytree restricted to stage ``s`` (other leaves ``None``)."""
    full: list = [None] * pipe.traced.num_params
    for pid, x in zip(pipe.stages[s].param_ids, leaves, strict=True):
        full[pid] = x
    return jax.tree.unflatten(pipe.traced.params_treedef, full)


def _build(pipe, optimizer, skip_nonfinite: bool, clip_global_norm: float | None) -> _Trainer:
    stages, low, L = pipe.stages, pipe.lowered, pipe.layouts
    sched, axis = pipe.schedule, pipe.axis
    spd, D = low.stages_per_device, sched.num_devices
    slots = L.slots
    avals = pipe._param_avals
    opt_layouts, opt_treedefs = [], []
    for st in stages:
        sds = [jax.ShapeDtypeStruct(avals[i].shape, avals[i].dtype) for i in st.param_ids]
        shape = jax.eval_shape(optimizer.init, _stage_tree(pipe, st.index, sds))
        leaves, tdef = jax.tree.flatten(shape)
        opt_layouts.append(Layout(leaves))
        opt_treedefs.append(tdef)
    opt_width = merge_widths(opt_layouts)

    # Parameters read by several stages (tied): gradients summed over those stages, and
    # the first owner's updated value copied to the others.
    owners: dict[int, list[int]] = {}
    for st in stages:
        for pid in st.param_ids:
            owners.setdefault(pid, []).append(st.index)
    tied = sorted(pid for pid, o in owners.items() if len(o) > 1)

    def zeros(pid):
        return jnp.zeros(avals[pid].shape, avals[pid].dtype)

    def local_tied(d, buf, owner_only):
        """Device d's contribution to each tied leaf (sum, or the first owner's value)."""
        out = [zeros(pid) for pid in tied]
        for s in sched.device_stages(d):
            for pid, n in zip(stages[s].param_ids, slots.stage_slots[s], strict=True):
                if pid in tied and (not owner_only or owners[pid][0] == s):
                    out[tied.index(pid)] = out[tied.index(pid)] + buf[n]
        return out

    def local_sq(d, gbuf):
        out = jnp.zeros((), jnp.float32)
        for s in sched.device_stages(d):
            for pid, n in zip(stages[s].param_ids, slots.stage_slots[s], strict=True):
                if pid not in tied and jnp.issubdtype(avals[pid].dtype, jnp.inexact):
                    out = out + jnp.sum(jnp.square(gbuf[n].astype(jnp.float32)))
        return out

    def update_device(d, pbuf, gbuf, obuf, tied_total, scale):
        pbuf, new_o = list(pbuf), {dt: [v[k] for k in range(spd)] for dt, v in obuf.items()}
        for k, s in enumerate(sched.device_stages(d)):
            st, ns = stages[s], slots.stage_slots[s]
            grads = [tied_total[tied.index(pid)] if pid in tied else gbuf[n]
                     for pid, n in zip(st.param_ids, ns, strict=True)]
            grads = [(g * scale).astype(g.dtype) for g in grads]
            p_tree = _stage_tree(pipe, s, [pbuf[n] for n in ns])
            g_tree = _stage_tree(pipe, s, grads)
            o_tree = jax.tree.unflatten(opt_treedefs[s], opt_layouts[s].unpack(
                {dt: v[k] for dt, v in obuf.items()}))
            updates, o_tree = optimizer.update(g_tree, o_tree, p_tree)
            # stage param_ids are ascending, i.e. the tree's leaf order
            for n, x in zip(ns, jax.tree.leaves(optax.apply_updates(p_tree, updates)),
                            strict=True):
                pbuf[n] = x
            packed = opt_layouts[s].pack(jax.tree.leaves(o_tree), opt_width)
            for dt in new_o:
                new_o[dt][k] = packed[dt]
        return pbuf, {dt: jnp.stack(v) for dt, v in new_o.items()}

    def set_tied(d, pbuf, owned):
        pbuf = list(pbuf)
        for s in sched.device_stages(d):
            for pid, n in zip(stages[s].param_ids, slots.stage_slots[s], strict=True):
                if pid in tied:
                    pbuf[n] = owned[tied.index(pid)]
        return pbuf

    def per_device(fn, *args):
        return lax.switch(lax.axis_index(axis),
                          [lambda *a, d=d: fn(d, *a) for d in range(D)], *args)

    def epilogue(pbuf, gout, loss, obuf):
        obuf = {k: v[0] for k, v in obuf.items()}
        tied_total = [lax.psum(x, axis) for x in per_device(
            lambda d, g: local_tied(d, g, False), gout)]
        sq = sum((jnp.sum(jnp.square(x.astype(jnp.float32))) for x in tied_total),
                 jnp.zeros((), jnp.float32))
        gnorm = jnp.sqrt(sq + lax.psum(per_device(local_sq, gout), axis))
        scale = jnp.ones((), jnp.float32)
        if clip_global_norm is not None:
            scale = jnp.minimum(1.0, clip_global_norm / jnp.maximum(gnorm, 1e-12))
        new_p, new_o = per_device(
            lambda d, p, g, o: update_device(d, p, g, o, tied_total, scale), pbuf, gout, obuf)
        if tied:
            # Copies got the same update, but branches may round differently: take the
            # first owner's result everywhere so tied copies stay bit-identical.
            owned = [lax.psum(x, axis) for x in per_device(
                lambda d, p: local_tied(d, p, True), new_p)]
            new_p = per_device(lambda d, p: set_tied(d, p, owned), new_p)
        finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)
        if skip_nonfinite:
            new_p = [jnp.where(finite, a, b) for a, b in zip(new_p, pbuf, strict=True)]
            new_o = {dt: jnp.where(finite, new_o[dt], obuf[dt]) for dt in new_o}
        metrics = {"loss": loss, "grad_norm": gnorm,
                   "skipped": jnp.logical_and(skip_nonfinite, ~finite).astype(jnp.int32)}
        return [x[None] for x in new_p], {dt: v[None] for dt, v in new_o.items()}, metrics

    pspec = [P(axis)] * len(slots)
    ospec = {dt: P(axis) for dt in opt_width}
    core = build_step(
        stages, L, low, pipe.mesh, axis, pipe.data_axes, pipe.num_microbatches,
        len(pipe._batch_ndims), epilogue=epilogue, extra_in_specs=(ospec,),
        epilogue_out_specs=(pspec, ospec, {"loss": P(), "grad_norm": P(), "skipped": P()}),
    )

    def step_fn(state: TrainState, batch):
        new_p, new_o, metrics = core(state.params, pipe._microbatches(batch), state.opt_state)
        return TrainState(new_p, new_o, state.step + 1), metrics

    return _Trainer(optimizer, opt_layouts, opt_width,
                    jax.jit(step_fn, donate_argnums=0), skip_nonfinite, clip_global_norm)


def init_state(pipe, params, optimizer: optax.GradientTransformation, *,
               skip_nonfinite: bool = False, clip_global_norm: float | None = None) -> TrainState:
    """Build the optimizer state per stage and return a :class:`TrainState`."""
    if not hasattr(optimizer, "init") or not hasattr(optimizer, "update"):
        raise PipelineError(
            f"optimizer must be an optax.GradientTransformation, got {type(optimizer).__name__};"
            " e.g. optax.adamw(1e-3)."
        )
    leaves = pipe._check_params(params)
    pipe._trainer = _build(pipe, optimizer, skip_nonfinite, clip_global_norm)
    tr = pipe._trainer

    def make(leaves):
        rows = []
        for st in pipe.stages:
            o = optimizer.init(_stage_tree(pipe, st.index, [leaves[i] for i in st.param_ids]))
            rows.append(tr.opt_layouts[st.index].pack(jax.tree.leaves(o), tr.opt_width))
        return pipe._stack_rows(rows, tr.opt_width)

    opt = jax.jit(make, out_shardings=pipe._pbuf_sharding)(leaves)
    # Replicated over the mesh, as train_step returns it (else the 2nd step recompiles).
    step = jax.make_array_from_process_local_data(NamedSharding(pipe.mesh, P()),
                                                  np.zeros((), np.int32))
    return TrainState(pipe.shard(params), opt, step)


def train_step(pipe, state: TrainState, batch) -> tuple[TrainState, dict]:
    """One step: mean loss over microbatches, gradients, per-stage optax update."""
    if getattr(pipe, "_trainer", None) is None:
        raise PipelineError("call pipe.init(params, optimizer) before pipe.train_step(...).")
    if not isinstance(state, TrainState):
        raise PipelineError(
            f"train_step needs the TrainState returned by pipe.init, got {type(state).__name__}."
        )
    tr = pipe._trainer
    p, spd = pipe.schedule.num_devices, pipe.lowered.stages_per_device
    layouts = (("params", [tuple(np.shape(v)) for v in state.params]
                if isinstance(state.params, (list, tuple)) else type(state.params).__name__,
                pipe.staged_shapes()),
               ("opt_state", {dt: tuple(np.shape(v)) for dt, v in state.opt_state.items()}
                if isinstance(state.opt_state, dict) else type(state.opt_state).__name__,
                {dt: (p, spd, w) for dt, w in tr.opt_width.items()}))
    for name, got, want in layouts:
        if got != want:
            raise PipelineError(
                f"state.{name} has the layout {got} but this pipeline and optimizer expect "
                f"{want}: the state comes from another pipeline (other p, schedule, cut or "
                "model) or another optimizer. Create it with this pipe.init(params, optimizer);"
                " to move to a new layout go through the unsharded parameters "
                "(pipe.params(state), jaxpipe.checkpoint.save_params)."
            )
    return tr.step_fn(state, batch)
