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
    opt_treedefs: list[Any]
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
    spd = low.stages_per_device
    opt_layouts, opt_treedefs = [], []
    for st in stages:
        avals = [jax.ShapeDtypeStruct(pipe._param_avals[i].shape, pipe._param_avals[i].dtype)
                 for i in st.param_ids]
        shape = jax.eval_shape(optimizer.init, _stage_tree(pipe, st.index, avals))
        leaves, tdef = jax.tree.flatten(shape)
        opt_layouts.append(Layout(leaves))
        opt_treedefs.append(tdef)
    opt_width = merge_widths(opt_layouts)

    # Parameters read by several stages: their gradients are summed over those stages.
    owners: dict[int, list[int]] = {}
    for st in stages:
        for pid in st.param_ids:
            owners.setdefault(pid, []).append(st.index)
    tied = sorted(pid for pid, o in owners.items() if len(o) > 1)
    tied_layout = Layout([pipe._param_avals[i] for i in tied])
    tied_width = dict(tied_layout.sizes)
    # stages_at[k]: the stages that sit in local slot k on some device.
    stages_at = [[s for s in range(sched.num_stages) if low.local_index[s] == k]
                 for k in range(spd)]
    pos = np.zeros((sched.num_devices, spd), np.int32)
    for d in range(sched.num_devices):
        mine = sched.device_stages(d)
        for k in range(spd):
            pos[d, k] = stages_at[k].index(mine[k]) if k < len(mine) else len(stages_at[k])
    pos = jnp.asarray(pos)

    def tied_part(s, row, owner_only=False):
        # This stage's values of the tied leaves, in the (device-independent) tied layout.
        vals = [jnp.zeros(pipe._param_avals[pid].shape, pipe._param_avals[pid].dtype)
                for pid in tied]
        for pid, x in zip(stages[s].param_ids, L.params[s].unpack(row), strict=True):
            if pid in tied and (not owner_only or owners[pid][0] == s):
                vals[tied.index(pid)] = x
        return tied_layout.pack(vals, tied_width)

    def set_tied(s, row, total):
        tvals = tied_layout.unpack(total)
        vals = [tvals[tied.index(pid)] if pid in tied else x
                for pid, x in zip(stages[s].param_ids, L.params[s].unpack(row), strict=True)]
        return L.params[s].pack(vals, L.param_width)

    def tied_sum(buf, owner_only=False):
        total = {dt: jnp.zeros((w,), dt) for dt, w in tied_width.items()}
        for k in range(spd):
            part = lax.switch(
                pos_local_ref[0][k],
                [lambda r, s=s: tied_part(s, r, owner_only) for s in stages_at[k]]
                + [lambda r: {dt: jnp.zeros((w,), dt) for dt, w in tied_width.items()}],
                {dt: v[k] for dt, v in buf.items()},
            )
            total = {dt: total[dt] + part[dt] for dt in total}
        return {dt: lax.psum(v, axis) for dt, v in total.items()}

    pos_local_ref: list = [None]

    def sq_norm(s, g_row):
        # Each tied leaf is counted once (from the total), every other leaf from its stage.
        grads = L.params[s].unpack(g_row)
        out = jnp.zeros((), jnp.float32)
        for pid, g in zip(stages[s].param_ids, grads, strict=True):
            if pid not in tied and jnp.issubdtype(g.dtype, jnp.inexact):
                out = out + jnp.sum(jnp.square(g.astype(jnp.float32)))
        return out

    def update(s, p_row, g_row, o_row, tied_total, scale):
        st = stages[s]
        params = L.params[s].unpack(p_row)
        grads = L.params[s].unpack(g_row)
        tvals = tied_layout.unpack(tied_total)
        grads = [tvals[tied.index(pid)] if pid in tied else g
                 for pid, g in zip(st.param_ids, grads, strict=True)]
        grads = [(g * scale).astype(g.dtype) for g in grads]
        p_tree = _stage_tree(pipe, s, params)
        g_tree = _stage_tree(pipe, s, grads)
        o_tree = jax.tree.unflatten(opt_treedefs[s], opt_layouts[s].unpack(o_row))
        updates, o_new = optimizer.update(g_tree, o_tree, p_tree)
        p_new = optax.apply_updates(p_tree, updates)
        # stage param_ids are ascending, i.e. the tree's leaf order
        new_p = L.params[s].pack(jax.tree.leaves(p_new), L.param_width)
        new_o = opt_layouts[s].pack(jax.tree.leaves(o_new), opt_width)
        return new_p, new_o

    def epilogue(pbuf, gout, loss, obuf, pos_local):
        obuf = {k: v[0] for k, v in obuf.items()}
        pos_local = pos_local[0]
        pos_local_ref[0] = pos_local
        rows = lambda buf, k: {dt: v[k] for dt, v in buf.items()}  # noqa: E731
        tied_total = tied_sum(gout)
        sq = sum(jnp.sum(jnp.square(v.astype(jnp.float32))) for v in tied_total.values())
        local_sq = jnp.zeros((), jnp.float32)
        for k in range(spd):
            local_sq = local_sq + lax.switch(
                pos_local[k],
                [lambda g, s=s: sq_norm(s, g) for s in stages_at[k]]
                + [lambda g: jnp.zeros((), jnp.float32)],
                rows(gout, k),
            )
        gnorm = jnp.sqrt(sq + lax.psum(local_sq, axis))
        scale = jnp.ones((), jnp.float32)
        if clip_global_norm is not None:
            scale = jnp.minimum(1.0, clip_global_norm / jnp.maximum(gnorm, 1e-12))
        new_p, new_o = {dt: [] for dt in pbuf}, {dt: [] for dt in obuf}
        for k in range(spd):
            np_k, no_k = lax.switch(
                pos_local[k],
                [lambda p, g, o, s=s: update(s, p, g, o, tied_total, scale)
                 for s in stages_at[k]] + [lambda p, g, o: (p, o)],
                rows(pbuf, k), rows(gout, k), rows(obuf, k),
            )
            for dt in new_p:
                new_p[dt].append(np_k[dt])
            for dt in new_o:
                new_o[dt].append(no_k[dt])
        new_p = {dt: jnp.stack(v) for dt, v in new_p.items()}
        new_o = {dt: jnp.stack(v) for dt, v in new_o.items()}
        if tied:
            # Copies get the same update, but branches may round differently: take the
            # first owner's result everywhere so tied copies stay bit-identical.
            owned = tied_sum(new_p, owner_only=True)
            fixed = [lax.switch(pos_local[k],
                                [lambda r, s=s: set_tied(s, r, owned) for s in stages_at[k]]
                                + [lambda r: r],
                                rows(new_p, k)) for k in range(spd)]
            new_p = {dt: jnp.stack([f[dt] for f in fixed]) for dt in new_p}
        finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)
        if skip_nonfinite:
            new_p = {dt: jnp.where(finite, new_p[dt], pbuf[dt]) for dt in new_p}
            new_o = {dt: jnp.where(finite, new_o[dt], obuf[dt]) for dt in new_o}
        metrics = {"loss": loss, "grad_norm": gnorm,
                   "skipped": jnp.logical_and(skip_nonfinite, ~finite).astype(jnp.int32)}
        return ({dt: v[None] for dt, v in new_p.items()},
                {dt: v[None] for dt, v in new_o.items()}, metrics)

    pspec = {dt: P(axis) for dt in L.param_width}
    ospec = {dt: P(axis) for dt in opt_width}
    core = build_step(
        stages, L, low, pipe.mesh, axis, pipe.data_axes, pipe.num_microbatches,
        len(pipe._batch_ndims), epilogue=epilogue, extra_in_specs=(ospec, P(axis)),
        epilogue_out_specs=(pspec, ospec, {"loss": P(), "grad_norm": P(), "skipped": P()}),
    )

    def step_fn(state: TrainState, batch):
        new_p, new_o, metrics = core(state.params, pipe._microbatches(batch),
                                     state.opt_state, pos)
        return TrainState(new_p, new_o, state.step + 1), metrics

    return _Trainer(optimizer, opt_layouts, opt_treedefs, opt_width,
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
    for name, widths in (("params", pipe.layouts.param_width), ("opt_state", tr.opt_width)):
        part = getattr(state, name)
        got = ({dt: tuple(np.shape(v)) for dt, v in part.items()}
               if isinstance(part, dict) else type(part).__name__)
        want = {dt: (p, spd, w) for dt, w in widths.items()}
        if got != want:
            raise PipelineError(
                f"state.{name} has the layout {got} but this pipeline and optimizer expect "
                f"{want}: the state comes from another pipeline (other p, schedule, cut or "
                "model) or another optimizer. Create it with this pipe.init(params, optimizer);"
                " to move to a new layout go through the unsharded parameters "
                "(pipe.params(state), jaxpipe.checkpoint.save_params)."
            )
    return tr.step_fn(state, batch)
