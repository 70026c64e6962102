"""The SPMD runtime: one ``jax.jit(jax.shard_map(...))`` program runs a lowered schedule.

Every device runs the same program: ``lax.scan`` over ticks; each tick reads its row of
the static table, runs the branch for one (action kind, stage) pair, stores residuals
and hand-offs in a flat per-dtype storage at the lowered offsets, accumulates parameter
gradients in place, and moves the action's output to the device that needs it with
``lax.ppermute`` (one permutation per device offset the placement uses; a permutation
is skipped on ticks where nobody sends over it) or a local hand-off (V-shaped turn).

Branch selection is a chain of zero-or-one-trip ``while_loop``s rather than
``lax.switch``: XLA copies every buffer that an untaken ``conditional`` branch passes
through (whole residual storage and gradients, every tick), while a ``while_loop``
updates its carry in place. Per-tick work is thus proportional to one microbatch:
buffers are updated with ``dynamic_update_slice`` at table-given offsets, never
rewritten whole, and idle ticks cost a few scalar comparisons.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import jaxpr_as_fun
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe.lower import KINDS, Lowered
from jaxpipe.packing import Layout, ParamSlots, merge_widths
from jaxpipe.stages import StageFn

__all__ = ["StageLayouts", "build_step"]


@dataclass
class StageLayouts:
    """Flat-buffer layouts of every stage's parameters, residuals and messages."""

    slots: ParamSlots
    res: list[Layout]  # all stored residuals (for sizes)
    resa: list[Layout]  # the part only the input-gradient reads (freed at B or I)
    resb: list[Layout]  # the part W reads too (freed at B or W); stage.w_res_ids
    wres: list[Layout]
    act_out: list[Layout]  # forward message a stage sends (its carry out)
    ct_out: list[Layout]  # cotangent message a stage receives (for its float carry out)
    act_in: list[Layout]
    ct_in: list[Layout]
    msg_width: dict[str, int]

    @classmethod
    def build(cls, stages: list[StageFn], param_avals: list, device_stages) -> StageLayouts:
        slots = ParamSlots(stages, param_avals, device_stages)
        res = [Layout(st.residual_avals) for st in stages]
        resa = [Layout([a for i, a in enumerate(st.residual_avals) if i not in st.w_res_ids])
                for st in stages]
        resb = [Layout([st.residual_avals[i] for i in st.w_res_ids]) for st in stages]
        wres = [Layout(st.w_residual_avals) for st in stages]
        act_out = [Layout([] if st.is_last else st.out_avals) for st in stages]
        ct_out = [Layout([] if st.is_last else st.ct_out_avals()) for st in stages]
        act_in = [Layout(st.in_avals) for st in stages]
        ct_in = [Layout(st.ct_in_avals()) for st in stages]
        return cls(
            slots, res, resa, resb, wres, act_out, ct_out, act_in, ct_in,
            msg_width=merge_widths(act_out + ct_in),
        )


def _zeros(widths: dict[str, int]) -> dict:
    return {k: jnp.zeros((w,), k) for k, w in widths.items()}


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

    ``pbuf``/``gbuf``: one array ``[devices, *slot_shape]`` per parameter slot, sharded
    over ``axis``. ``batch_mb``: batch leaves reshaped to ``[m, microbatch, ...]``.

    With ``epilogue``, the step instead returns ``epilogue(pbuf_local, gbuf_local, loss,
    *extra_local)`` computed on each device inside the same program (the optimizer update
    uses this), with ``extra_in_specs`` / ``epilogue_out_specs`` as its shard_map specs.
    """
    m = num_microbatches
    L = layouts
    col = low.columns
    perms = [[(d, (d + off) % low.num_devices) for d in range(low.num_devices)]
             for off in low.perm_offsets]

    # Branches update the carried buffers themselves, with static sizes: residual
    # writes/reads touch exactly one stage's residuals, gradient accumulation touches
    # exactly one stage's parameters, and idle ticks touch nothing.
    def read(layout, buf, row, prefix):
        # one slice per leaf, straight from the storage (no intermediate flat copy)
        return [lax.dynamic_slice(buf[k], (row[col[f"{prefix}:{k}"]] + off,), (n,)).reshape(a.shape)
                for (k, off, n), a in zip(layout.slots, layout.avals, strict=True)]

    def write(layout, buf, row, prefix, leaves):
        # one in-place update per leaf: the producer can write straight into the storage
        buf = dict(buf)
        for (k, off, _), x in zip(layout.slots, leaves, strict=True):
            buf[k] = lax.dynamic_update_slice(buf[k], jnp.ravel(x).astype(k),
                                              (row[col[f"{prefix}:{k}"]] + off,))
        return buf

    def split_ids(st):
        b_ids = set(st.w_res_ids)
        return [i for i in range(len(st.residual_avals)) if i not in b_ids], list(st.w_res_ids)

    def store(st, buf, row, stored):
        a_ids, b_ids = split_ids(st)
        buf = write(L.resa[st.index], buf, row, "resa_w", [stored[i] for i in a_ids])
        return write(L.resb[st.index], buf, row, "resb_w", [stored[i] for i in b_ids])

    def load(st, pools, row):
        a_ids, b_ids = split_ids(st)
        out = [None] * len(st.residual_avals)
        for i, x in zip(a_ids, read(L.resa[st.index], pools, row, "resa_r"),
                        strict=True):
            out[i] = x
        for i, x in zip(b_ids, read(L.resb[st.index], pools, row, "resb_r"),
                        strict=True):
            out[i] = x
        return out

    def accumulate(st, gbuf, ct_par):
        gbuf = list(gbuf)
        it = iter(ct_par)
        for n, diff in zip(L.slots.stage_slots[st.index], st.diff_param_mask, strict=True):
            if diff:
                gbuf[n] = gbuf[n] + next(it)
        return gbuf

    def stage_inputs(st, pbuf, mbd):
        params = [pbuf[n] for n in L.slots.stage_slots[st.index]]
        return params, [mbd[i] for i in st.batch_ids]

    def msg_in(layout, inbox, row):
        return layout.unpack({k: v[row[col["in_slot"]]] for k, v in inbox.items()})

    def ct_received(st, inbox, row):
        if st.is_last:
            return [jnp.full((), 1.0 / m, st.out_avals[0].dtype)]
        return msg_in(L.ct_out[st.index], inbox, row)

    zero_loss = jnp.zeros((), jnp.float32)

    def make_branch(kind: str, st: StageFn):
        s = st.index

        def f_branch(row, pbuf, mbd, pools, inbox, gbuf):
            params, batch = stage_inputs(st, pbuf, mbd)
            carry = msg_in(L.act_in[s], inbox, row) if s > 0 else []
            outs = jaxpr_as_fun(st.fwd)(*params, *batch, *carry)
            n = len(st.out_avals)
            pools = store(st, pools, row, outs[n:])
            if st.is_last:
                return pools, gbuf, _zeros(L.msg_width), outs[0].astype(jnp.float32)
            return pools, gbuf, L.act_out[s].pack(outs[:n], L.msg_width), zero_loss

        def b_branch(row, pbuf, mbd, pools, inbox, gbuf):
            params, batch = stage_inputs(st, pbuf, mbd)
            outs = jaxpr_as_fun(st.bwd)(*params, *batch, *load(st, pools, row),
                                        *ct_received(st, inbox, row))
            n = sum(st.diff_param_mask)
            msg = L.ct_in[s].pack(outs[n:], L.msg_width) if s > 0 else _zeros(L.msg_width)
            return pools, accumulate(st, gbuf, outs[:n]), msg, zero_loss

        def i_branch(row, pbuf, mbd, pools, inbox, gbuf):
            params, batch = stage_inputs(st, pbuf, mbd)
            outs = jaxpr_as_fun(st.bwd_i)(*params, *batch, *load(st, pools, row),
                                          *ct_received(st, inbox, row))
            n = len(st.ct_in_avals())
            # Finish every read of the storage before writing into it, or XLA copies the
            # whole storage to keep a late read valid.
            outs, pools = lax.optimization_barrier((outs, pools))
            msg = L.ct_in[s].pack(outs[:n], L.msg_width) if s > 0 else _zeros(L.msg_width)
            pools = write(L.wres[s], pools, row, "wres_w", outs[n:])
            return pools, gbuf, msg, zero_loss

        def w_branch(row, pbuf, mbd, pools, inbox, gbuf):
            params, batch = stage_inputs(st, pbuf, mbd)
            stored = read(L.resb[s], pools, row, "resb_r")
            handoff = read(L.wres[s], pools, row, "wres_r")
            ct_par = jaxpr_as_fun(st.bwd_w)(*params, *batch, *stored, *handoff)
            return pools, accumulate(st, gbuf, ct_par), _zeros(L.msg_width), zero_loss

        return {"F": f_branch, "B": b_branch, "I": i_branch, "W": w_branch}[kind]

    def idle(row, pbuf, mbd, pools, inbox, gbuf):
        return pools, gbuf, _zeros(L.msg_width), zero_loss

    # Only (kind, stage) pairs the schedule runs get a branch (e.g. no I/W for 1F1B):
    # fewer branches to compile, and pools sized for what runs.
    used = set(np.unique(low.table[..., col["branch"]]).tolist())
    branches = [idle]
    for kind in KINDS:
        for st in stages:
            b = len(branches)
            branches.append(make_branch(kind, st) if b in used else idle)

    def per_device(pbuf, batch, table, active, *extra):
        pbuf = [v[0] for v in pbuf]
        table = table[:, 0]
        # every pool (residual parts, I->W hand-off) lives in one storage per dtype
        pools = {k: jnp.zeros((n,), k) for k, n in low.store.items()}
        inbox = {k: jnp.zeros((low.num_inbox + 1, w), k) for k, w in L.msg_width.items()}
        gbuf = [jnp.zeros(shape, dt) for shape, dt in zip(L.slots.shapes, L.slots.dtypes,
                                                           strict=True)]

        def tick(carry, xs):
            pools, inbox, gbuf, loss = carry
            row, act = xs
            mbd = [lax.dynamic_index_in_dim(x, row[col["mb"]], 0, keepdims=False)
                   for x in batch]
            # One zero-or-one-trip while loop per branch instead of lax.switch: a
            # conditional copies every buffer its untaken branches pass through, while a
            # while loop updates its carry in place.
            state = (pools, gbuf, _zeros(L.msg_width), zero_loss)
            br = row[col["branch"]]
            for b in sorted(used - {0}):
                def body(c, b=b):
                    # The barrier ties the loop-invariant inputs to the trip counter, or
                    # XLA's loop-invariant code motion hoists the stage's compute out of
                    # the zero-trip loop and runs it on every tick.
                    i, (pl, g, _, _) = c
                    i, (rw, pb, mb, ib) = lax.optimization_barrier((i, (row, pbuf, mbd, inbox)))
                    return i + 1, branches[b](rw, pb, mb, pl, ib, g)
                state = lax.while_loop(lambda c, b=b: c[0] < (br == b).astype(jnp.int32),
                                       body, (jnp.int32(0), state))[1]
            pools, gbuf, msg, loss_t = state
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
            return (pools, inbox, gbuf, loss + loss_t), None

        init = (pools, inbox, gbuf, jnp.zeros((), jnp.float32))
        (_, _, gbuf, loss), _ = lax.scan(tick, init, (table, active))
        loss = lax.psum(loss, axis) / m
        gout = gbuf
        if data_axes:
            loss = lax.pmean(loss, data_axes)
            gout = jax.tree.map(lambda x: lax.pmean(x, data_axes), gout)
        if epilogue is not None:
            return epilogue(pbuf, gout, loss, *extra)
        return [v[None] for v in gout], loss

    data_spec = data_axes if data_axes else None
    batch_specs = [P(None, data_spec) for _ in range(num_batch_leaves)]
    pspec = [P(axis)] * len(L.slots)
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
