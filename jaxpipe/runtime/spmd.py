"""The SPMD runtime: one ``jax.jit(jax.shard_map(...))`` program runs a lowered schedule.

Every device runs the same program: ``lax.scan`` over ticks; each tick reads its row of
the static table, runs one branch of a ``lax.switch`` over (action kind x stage), stores
residuals / hand-offs in flat per-dtype pools at the lowered offsets, accumulates
parameter gradients, and moves the action's output to the device that needs it with
``lax.ppermute`` (one permutation per device offset the placement uses; a permutation
is skipped on ticks where nobody sends over it) or a local hand-off (V-shaped turn).

Per-tick work is proportional to one microbatch: buffers are updated with
``dynamic_update_slice`` at table-given offsets, never rewritten whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import jaxpr_as_fun
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe.lower import KINDS, Lowered
from jaxpipe.packing import Layout, merge_widths
from jaxpipe.stages import StageFn

__all__ = ["StageLayouts", "build_step"]


@dataclass
class StageLayouts:
    """Flat-buffer layouts of every stage's parameters, residuals and messages."""

    params: list[Layout]
    res: list[Layout]
    wres: list[Layout]
    act_out: list[Layout]  # forward message a stage sends (its carry out)
    ct_out: list[Layout]  # cotangent message a stage receives (for its float carry out)
    act_in: list[Layout]
    ct_in: list[Layout]
    param_width: dict[str, int]
    res_width: dict[str, int]
    wres_width: dict[str, int]
    msg_width: dict[str, int]

    @classmethod
    def build(cls, stages: list[StageFn], param_avals: list) -> StageLayouts:
        params = [Layout([param_avals[i] for i in st.param_ids]) for st in stages]
        res = [Layout(st.residual_avals) for st in stages]
        wres = [Layout(st.w_residual_avals) for st in stages]
        act_out = [Layout([] if st.is_last else st.out_avals) for st in stages]
        ct_out = [Layout([] if st.is_last else st.ct_out_avals()) for st in stages]
        act_in = [Layout(st.in_avals) for st in stages]
        ct_in = [Layout(st.ct_in_avals()) for st in stages]
        return cls(
            params, res, wres, act_out, ct_out, act_in, ct_in,
            param_width=merge_widths(params), res_width=merge_widths(res),
            wres_width=merge_widths(wres), msg_width=merge_widths(act_out + ct_in),
        )


def _zeros(widths: dict[str, int]) -> dict:
    return {k: jnp.zeros((w,), k) for k, w in widths.items()}


def _masked_write(pool, vals, off, n):
    """Write the first ``n`` entries of ``vals`` at ``off``; leave the rest of the window."""
    w = vals.shape[0]
    if w == 0:
        return pool
    old = lax.dynamic_slice(pool, (off,), (w,))
    new = jnp.where(jnp.arange(w) < n, vals, old)
    return lax.dynamic_update_slice(pool, new, (off,))


def build_step(
    stages: list[StageFn],
    layouts: StageLayouts,
    low: Lowered,
    mesh,
    axis: str,
    data_axes: tuple[str, ...],
    num_microbatches: int,
    num_batch_leaves: int,
    epilogue=None,
    extra_in_specs: tuple = (),
    epilogue_out_specs=None,
):
    """Return ``step(pbuf, batch_mb, *extra) -> (gbuf, loss)`` as a shard_map'ed function.

    ``pbuf``/``gbuf``: dict dtype -> ``[devices, stages_per_device, width]`` sharded over
    ``axis``. ``batch_mb``: batch leaves reshaped to ``[m, microbatch, ...]``.

    With ``epilogue``, the step instead returns ``epilogue(pbuf_local, gbuf_local, loss,
    *extra_local)`` computed on each device inside the same program (the optimizer update
    uses this), with ``extra_in_specs`` / ``epilogue_out_specs`` as its shard_map specs.
    """
    spd, m = low.stages_per_device, num_microbatches
    L = layouts
    col = low.columns
    res_keys, wres_keys = list(low.res_pool), list(low.wres_pool)
    res_w = {k: L.res_width.get(k, 0) for k in res_keys}
    wres_w = {k: L.wres_width.get(k, 0) for k in wres_keys}
    perms = [[(d, (d + off) % low.num_devices) for d in range(low.num_devices)]
             for off in low.perm_offsets]

    def outputs(msg=None, res=None, wres=None, g=None, loss=None):
        return (
            msg if msg is not None else _zeros(L.msg_width),
            res if res is not None else _zeros(res_w),
            wres if wres is not None else _zeros(wres_w),
            g if g is not None else _zeros(L.param_width),
            jnp.zeros((), jnp.float32) if loss is None else loss.astype(jnp.float32),
        )

    def stage_inputs(st, pbuf, mbd):
        k = low.local_index[st.index]
        params = L.params[st.index].unpack({d: pbuf[d][k] for d in pbuf})
        return params, [mbd[i] for i in st.batch_ids]

    def grads_of(st, ct_par):
        it = iter(ct_par)
        full = [next(it) if d else jnp.zeros(a.shape, a.dtype)
                for d, a in zip(st.diff_param_mask, L.params[st.index].avals, strict=True)]
        return L.params[st.index].pack(full, L.param_width)

    def ct_received(st, inbox_in):
        if st.is_last:
            return [jnp.full((), 1.0 / m, st.out_avals[0].dtype)]
        return L.ct_out[st.index].unpack(inbox_in)

    def make_branch(kind: str, st: StageFn):
        s = st.index

        def f_branch(pbuf, mbd, res_in, wres_in, inbox_in):
            params, batch = stage_inputs(st, pbuf, mbd)
            carry = L.act_in[s].unpack(inbox_in) if s > 0 else []
            outs = jaxpr_as_fun(st.fwd)(*params, *batch, *carry)
            n = len(st.out_avals)
            res = L.res[s].pack(outs[n:], res_w)
            if st.is_last:
                return outputs(res=res, loss=outs[0])
            return outputs(msg=L.act_out[s].pack(outs[:n], L.msg_width), res=res)

        def b_branch(pbuf, mbd, res_in, wres_in, inbox_in):
            params, batch = stage_inputs(st, pbuf, mbd)
            stored = L.res[s].unpack(res_in)
            outs = jaxpr_as_fun(st.bwd)(*params, *batch, *stored, *ct_received(st, inbox_in))
            n = sum(st.diff_param_mask)
            msg = L.ct_in[s].pack(outs[n:], L.msg_width) if s > 0 else None
            return outputs(msg=msg, g=grads_of(st, outs[:n]))

        def i_branch(pbuf, mbd, res_in, wres_in, inbox_in):
            params, batch = stage_inputs(st, pbuf, mbd)
            stored = L.res[s].unpack(res_in)
            outs = jaxpr_as_fun(st.bwd_i)(*params, *batch, *stored, *ct_received(st, inbox_in))
            n = len(st.ct_in_avals())
            msg = L.ct_in[s].pack(outs[:n], L.msg_width) if s > 0 else None
            return outputs(msg=msg, wres=L.wres[s].pack(outs[n:], wres_w))

        def w_branch(pbuf, mbd, res_in, wres_in, inbox_in):
            params, batch = stage_inputs(st, pbuf, mbd)
            stored = L.res[s].unpack(res_in)
            handoff = L.wres[s].unpack(wres_in)
            ct_par = jaxpr_as_fun(st.bwd_w)(*params, *batch, *stored, *handoff)
            return outputs(g=grads_of(st, ct_par))

        return {"F": f_branch, "B": b_branch, "I": i_branch, "W": w_branch}[kind]

    branches = [lambda *a: outputs()]
    for kind in KINDS:
        for st in stages:
            branches.append(make_branch(kind, st))

    def per_device(pbuf, batch, table, active, *extra):
        pbuf = {k: v[0] for k, v in pbuf.items()}
        table = table[:, 0]
        res = {k: jnp.zeros((low.res_pool[k] + res_w[k],), k) for k in res_keys}
        wres = {k: jnp.zeros((low.wres_pool[k] + wres_w[k],), k) for k in wres_keys}
        inbox = {k: jnp.zeros((low.num_inbox + 1, w), k) for k, w in L.msg_width.items()}
        gbuf = {k: jnp.zeros((spd + 1, w), k) for k, w in L.param_width.items()}

        def tick(carry, xs):
            res, wres, inbox, gbuf, loss = carry
            row, act = xs
            mbd = [lax.dynamic_index_in_dim(x, row[col["mb"]], 0, keepdims=False)
                   for x in batch]
            res_in = {k: lax.dynamic_slice(res[k], (row[col[f"res_r:{k}"]],), (res_w[k],))
                      for k in res_keys}
            wres_in = {k: lax.dynamic_slice(wres[k], (row[col[f"wres_r:{k}"]],), (wres_w[k],))
                       for k in wres_keys}
            inbox_in = {k: inbox[k][row[col["in_slot"]]] for k in inbox}
            msg, r_out, w_out, g, loss_t = lax.switch(
                row[col["branch"]], branches, pbuf, mbd, res_in, wres_in, inbox_in)
            res = {k: _masked_write(res[k], r_out[k], row[col[f"res_w:{k}"]],
                                    row[col[f"res_wlen:{k}"]]) for k in res_keys}
            wres = {k: _masked_write(wres[k], w_out[k], row[col[f"wres_w:{k}"]],
                                     row[col[f"wres_wlen:{k}"]]) for k in wres_keys}
            gk = row[col["grad_k"]]
            gbuf = {k: gbuf[k].at[gk].add(g[k]) for k in gbuf}
            inbox = {k: inbox[k].at[row[col["local_dst"]]].set(msg[k]) for k in inbox}
            for j, perm in enumerate(perms):
                recv = lax.cond(
                    act[j],
                    lambda x, perm=perm: lax.ppermute(x, axis, perm),
                    lambda x: jax.tree.map(jnp.zeros_like, x),
                    msg,
                )
                dst = row[col[f"recv{j}"]]
                inbox = {k: inbox[k].at[dst].set(recv[k]) for k in inbox}
            return (res, wres, inbox, gbuf, loss + loss_t), None

        init = (res, wres, inbox, gbuf, jnp.zeros((), jnp.float32))
        (_, _, _, gbuf, loss), _ = lax.scan(tick, init, (table, active))
        loss = lax.psum(loss, axis) / m
        gout = {k: v[:spd] for k, v in gbuf.items()}
        if data_axes:
            loss = lax.pmean(loss, data_axes)
            gout = jax.tree.map(lambda x: lax.pmean(x, data_axes), gout)
        if epilogue is not None:
            return epilogue(pbuf, gout, loss, *extra)
        return {k: v[None] for k, v in gout.items()}, loss

    data_spec = data_axes if data_axes else None
    batch_specs = [P(None, data_spec) for _ in range(num_batch_leaves)]
    pspec = {k: P(axis) for k in L.param_width}
    in_specs = (pspec, batch_specs, P(None, axis), P(), *extra_in_specs)
    fn = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=(pspec, P()) if epilogue is None else epilogue_out_specs,
        check_vma=False,
    )
    table = jnp.asarray(low.table)
    active = jnp.asarray(low.perm_active)

    def step(pbuf, batch_mb, *extra):
        args = (pbuf, list(batch_mb), table, active, *extra)
        return fn(*jax.tree.map(lambda x, s: place(x, mesh, s), args, in_specs,
                                is_leaf=lambda x: x is None))

    return step


def place(x, mesh, spec):
    """Constrain ``x`` (inside jit) to ``spec`` on ``mesh``, for Auto and Explicit meshes."""
    sharding = NamedSharding(mesh, spec)
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        return jax.sharding.reshard(x, sharding)
    return lax.with_sharding_constraint(x, sharding)
