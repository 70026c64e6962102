"""The SPMD program: one ``jax.jit(jax.shard_map(...))`` runs a lowered schedule.

Every device runs the same program: ``lax.scan`` over the steps of the
:class:`~.lowering.TickTable`; each step reads its row, runs the branch for one (action
kind, stage) pair, stores residuals and hand-offs in a flat per-dtype storage at the
lowered offsets, accumulates parameter gradients in place, and moves the action's output
to the device that needs it with ``lax.ppermute`` (one permutation per device offset the
placement uses; a permutation is skipped in steps where nobody sends over it) or a local
hand-off (V-shaped turn).

Branch selection is a chain of zero-or-one-trip ``while_loop``s rather than
``lax.switch``: XLA copies every buffer that an untaken ``conditional`` branch passes
through (whole residual storage and gradients, every step), while a ``while_loop``
updates its carry in place. Per-step work is thus proportional to one microbatch:
buffers are updated with ``dynamic_update_slice`` at table-given offsets, never
rewritten whole, and idle steps cost a few scalar comparisons.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import jaxpr_as_fun
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe.runtime.spmd.layout import Layout, StageLayouts
from jaxpipe.runtime.spmd.lowering import IDLE, Lowering, Pool, TickTable, branch_id
from jaxpipe.schedule import ACTION_KINDS
from jaxpipe.stages import StageFn

__all__ = ["build_step", "place"]

#: ``epilogue(params_local, grads_local, loss, *extra_local)`` -> outputs of the program.
Epilogue = Callable[..., object]


def _zeros(widths: dict[str, int]) -> dict:
    return {k: jnp.zeros((w,), k) for k, w in widths.items()}


def build_step(
    stages: Sequence[StageFn],
    layouts: StageLayouts,
    lowering: Lowering,
    mesh: Mesh,
    axis: str,
    batch_axes: tuple[str, ...],
    num_batch_leaves: int,
    epilogue: Epilogue | None = None,
    extra_in_specs: tuple = (),
    epilogue_out_specs: object = None,
) -> Callable:
    """Return ``step(pbuf, batch_mb, *extra) -> (gbuf, loss)`` as a shard_map'ed function.

    ``pbuf``/``gbuf``: one array ``[devices, *slot_shape]`` per parameter slot, sharded
    over ``axis``. ``batch_mb``: batch leaves reshaped to ``[m, microbatch, ...]``.

    With ``epilogue``, the step instead returns ``epilogue(pbuf_local, gbuf_local, loss,
    *extra_local)`` computed on each device inside the same program (the optimizer update
    uses this), with ``extra_in_specs`` / ``epilogue_out_specs`` as its shard_map specs.
    """
    m = lowering.num_microbatches
    L = layouts
    D = lowering.num_devices
    perms = [[(d, (d + off) % D) for d in range(D)] for off in lowering.perm_offsets]

    # Branches update the carried buffers themselves, with static sizes: residual
    # writes/reads touch exactly one stage's values, gradient accumulation touches
    # exactly one stage's parameters, and idle steps touch nothing.
    def read(layout: Layout, buf, offsets: dict) -> list:
        # one slice per leaf, straight from the storage (no intermediate flat copy)
        return [lax.dynamic_slice(buf[k], (offsets[k] + off,), (n,)).reshape(a.shape)
                for (k, off, n), a in zip(layout.slots, layout.avals, strict=True)]

    def write(layout: Layout, buf, offsets: dict, leaves) -> dict:
        # one in-place update per leaf: the producer can write straight into the storage
        buf = dict(buf)
        for (k, off, _), x in zip(layout.slots, leaves, strict=True):
            buf[k] = lax.dynamic_update_slice(buf[k], jnp.ravel(x).astype(k),
                                              (offsets[k] + off,))
        return buf

    def offsets(row: TickTable, pool: Pool, writing: bool) -> dict:
        cols = row.pool_write if writing else row.pool_read
        return {k: v for (p, k), v in cols.items() if p is pool}

    def store(st: StageFn, buf, row, stored) -> dict:
        for pool, ids in ((Pool.RESIDUAL_A, st.i_only_residual_ids),
                          (Pool.RESIDUAL_B, st.w_res_ids)):
            buf = write(L.pools[pool][st.index], buf, offsets(row, pool, True),
                        [stored[i] for i in ids])
        return buf

    def load(st: StageFn, buf, row) -> list:
        out: list = [None] * len(st.residual_avals)
        for pool, ids in ((Pool.RESIDUAL_A, st.i_only_residual_ids),
                          (Pool.RESIDUAL_B, st.w_res_ids)):
            vals = read(L.pools[pool][st.index], buf, offsets(row, pool, False))
            for i, x in zip(ids, vals, strict=True):
                out[i] = x
        return out

    def accumulate(st: StageFn, gbuf, ct_par) -> list:
        gbuf = list(gbuf)
        it = iter(ct_par)
        for n, diff in zip(L.slots.stage_slots[st.index], st.diff_param_mask, strict=True):
            if diff:
                gbuf[n] = gbuf[n] + next(it)
        return gbuf

    def stage_inputs(st: StageFn, pbuf, mbd) -> tuple[list, list]:
        params = [pbuf[n] for n in L.slots.stage_slots[st.index]]
        return params, [mbd[i] for i in st.batch_ids]

    def msg_in(layout: Layout, inbox, row: TickTable) -> list:
        return layout.unpack({k: v[row.in_slot] for k, v in inbox.items()})

    def ct_received(st: StageFn, inbox, row: TickTable) -> list:
        if st.is_last:
            return [jnp.full((), 1.0 / m, st.out_avals[0].dtype)]
        return msg_in(L.ct_out[st.index], inbox, row)

    zero_loss = jnp.zeros((), jnp.float32)

    def make_branch(kind: str, st: StageFn) -> Callable:
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
            pools = write(L.pools[Pool.HANDOFF][s], pools, offsets(row, Pool.HANDOFF, True),
                          outs[n:])
            return pools, gbuf, msg, zero_loss

        def w_branch(row, pbuf, mbd, pools, inbox, gbuf):
            params, batch = stage_inputs(st, pbuf, mbd)
            stored = read(L.pools[Pool.RESIDUAL_B][s], pools,
                          offsets(row, Pool.RESIDUAL_B, False))
            handoff = read(L.pools[Pool.HANDOFF][s], pools, offsets(row, Pool.HANDOFF, False))
            ct_par = jaxpr_as_fun(st.bwd_w)(*params, *batch, *stored, *handoff)
            return pools, accumulate(st, gbuf, ct_par), _zeros(L.msg_width), zero_loss

        return {"F": f_branch, "B": b_branch, "I": i_branch, "W": w_branch}[kind]

    # Only (kind, stage) pairs the schedule runs get a branch (e.g. no I/W for 1F1B):
    # fewer branches to compile, and pools sized for what runs.
    used = lowering.used_branches - {IDLE}
    branches = {branch_id(kind, st.index, lowering.num_stages): make_branch(kind, st)
                for kind in ACTION_KINDS for st in stages
                if branch_id(kind, st.index, lowering.num_stages) in used}

    def per_device(pbuf, batch, table: TickTable, *extra):
        pbuf = [v[0] for v in pbuf]
        table = jax.tree.map(lambda x: x[:, 0], table)  # this device's column
        # every pool (residual parts, I->W hand-off) lives in one storage per dtype
        pools = {k: jnp.zeros((n,), k) for k, n in lowering.storage.items()}
        inbox = {k: jnp.zeros((lowering.num_inbox + 1, w), k) for k, w in L.msg_width.items()}
        gbuf = [jnp.zeros(shape, dt) for shape, dt in zip(L.slots.shapes, L.slots.dtypes,
                                                           strict=True)]

        def step(carry, row: TickTable):
            pools, inbox, gbuf, loss = carry
            mbd = [lax.dynamic_index_in_dim(x, row.microbatch, 0, keepdims=False)
                   for x in batch]
            # One zero-or-one-trip while loop per branch instead of lax.switch: a
            # conditional copies every buffer its untaken branches pass through, while a
            # while loop updates its carry in place.
            state = (pools, gbuf, _zeros(L.msg_width), zero_loss)
            for b in sorted(branches):
                def body(c, b=b):
                    # The barrier ties the loop-invariant inputs to the trip counter, or
                    # XLA's loop-invariant code motion hoists the stage's compute out of
                    # the zero-trip loop and runs it on every step.
                    i, (pl, g, _, _) = c
                    i, (rw, pb, mb, ib) = lax.optimization_barrier((i, (row, pbuf, mbd, inbox)))
                    return i + 1, branches[b](rw, pb, mb, pl, ib, g)
                state = lax.while_loop(
                    lambda c, b=b: c[0] < (row.branch == b).astype(jnp.int32),
                    body, (jnp.int32(0), state))[1]
            pools, gbuf, msg, loss_t = state
            inbox = {k: inbox[k].at[row.local_dst].set(msg[k]) for k in inbox}
            for j, perm in enumerate(perms):
                recv = lax.cond(
                    row.exchange[j],
                    lambda x, perm=perm: lax.ppermute(x, axis, perm),
                    lambda x: jax.tree.map(jnp.zeros_like, x),
                    msg,
                )
                inbox = {k: inbox[k].at[row.recv_slot[j]].set(recv[k]) for k in inbox}
            return (pools, inbox, gbuf, loss + loss_t), None

        init = (pools, inbox, gbuf, jnp.zeros((), jnp.float32))
        (_, _, gbuf, loss), _ = lax.scan(step, init, table)
        loss = lax.psum(loss, axis) / m
        if batch_axes:
            loss = lax.pmean(loss, batch_axes)
            gbuf = jax.tree.map(lambda x: lax.pmean(x, batch_axes), gbuf)
        if epilogue is not None:
            return epilogue(pbuf, gbuf, loss, *extra)
        return [v[None] for v in gbuf], loss

    # The table: [steps, devices, ...] sharded over devices, except the exchange flags
    # ([steps, offsets]), which every device reads whole (replicated, then "column" 0).
    table = lowering.table
    table_arrays = TickTable(
        branch=table.branch, microbatch=table.microbatch, in_slot=table.in_slot,
        local_dst=table.local_dst, recv_slot=table.recv_slot, pool_write=table.pool_write,
        pool_read=table.pool_read, exchange=table.exchange[:, None, :].repeat(D, axis=1))
    table_arrays = jax.tree.map(jnp.asarray, table_arrays)
    table_specs = jax.tree.map(lambda _: P(None, axis), table_arrays)

    data_spec = batch_axes if batch_axes else None
    batch_specs = [P(None, data_spec) for _ in range(num_batch_leaves)]
    pspec = [P(axis)] * len(L.slots)
    in_specs = (pspec, batch_specs, table_specs, *extra_in_specs)
    fn = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=in_specs,
        out_specs=(pspec, P()) if epilogue is None else epilogue_out_specs,
        check_vma=False,
    )

    def run(pbuf, batch_mb, *extra):
        args = (pbuf, list(batch_mb), table_arrays, *extra)
        return fn(*jax.tree.map(lambda x, s: place(x, mesh, s), args, in_specs,
                                is_leaf=lambda x: x is None))

    return run


def place(x, mesh: Mesh, spec: P):
    """Constrain ``x`` (inside jit) to ``spec`` on ``mesh``, for Auto and Explicit meshes."""
    sharding = NamedSharding(mesh, spec)
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        return jax.sharding.reshard(x, sharding)
    return lax.with_sharding_constraint(x, sharding)
