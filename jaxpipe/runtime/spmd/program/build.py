"""The SPMD program: one ``jax.jit(jax.shard_map(...))`` runs a lowered schedule.

Every device runs the same program: ``lax.scan`` over the steps of the
:class:`~..lowering.types.TickTable` (as :class:`~..lowering.types.ActionFields` and
:class:`~..lowering.types.StepFields`: one array per scalar, gates as trip counts). In a step, a
device runs the branch of one (action kind, body) pair, or nothing (kind ``"FB"``: a
last stage's F and its own B in one step, the residuals passed straight from one to the
other; ``"IW"``: an I and its own W in one step, the hand-off passed straight on):

- parameters come from slots, whole arrays (a shared body whose members use different
  slots on one device picks the running stage's from a small table by ``row.stage``),
  and their gradients accumulate in place, those of such a body in a stacked *group*
  per parameter (:mod:`.param_groups`), split into slots after the last step;
- residuals and the I -> W hand-off (of a W in a step of its own) are stored in
  per-class buffers at the slots the lowering chose, and gradients accumulate in place;
- an output message goes into the outbox unit of its direction (or into an inbox slot
  when it stays on the device, the turn of a V). At the end of a tick's last step, every
  permutation someone uses runs once (``lax.ppermute`` of that direction's whole outbox)
  and the arriving units land in inbox slots. That ``ppermute`` lists only the pairs that
  carry a message at that tick (one permutation per sender set, picked by the table), so
  a device waits only for the devices it exchanges with.

Branch selection is a chain of zero-or-one-trip ``while_loop``s rather than
``lax.switch``: XLA copies every buffer that an untaken ``conditional`` branch passes
through (whole storage and gradients, every step), while a ``while_loop`` updates its
carry in place. Per-step work is thus proportional to one microbatch, and idle steps cost
a few scalar reads.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe.errors import PipelineError
from jaxpipe.runtime.spmd.lowering.types import (
    IDLE,
    PROGRAM_KINDS,
    ActionFields,
    Lowering,
    StepFields,
    branch_id,
)
from jaxpipe.runtime.spmd.program.bodies import Body
from jaxpipe.runtime.spmd.program.branches import Branches
from jaxpipe.runtime.spmd.program.gated import gated
from jaxpipe.runtime.spmd.program.layout import StageLayouts, ValueClass
from jaxpipe.runtime.spmd.program.param_groups import Groups
from jaxpipe.runtime.spmd.program.stage_ends import gated_stages
from jaxpipe.sharding import MeshAxes, constrain, manual_spec

__all__ = ["build_step", "check_stage_collectives", "place", "place_tree"]

#: ``epilogue(params_local, grads_local, loss, *extra_local)`` -> outputs of the program.
Epilogue = Callable[..., object]

Bufs = dict[ValueClass, jax.Array]


def build_step(
    bodies: Sequence[Body],
    layouts: StageLayouts,
    lowering: Lowering,
    mesh: Mesh,
    axes: MeshAxes,
    num_batch_leaves: int,
    epilogue: Epilogue | None = None,
    extra_in_specs: tuple = (),
    epilogue_out_specs: object = None,
    groups: Groups | None = None,
    grouped: bool = False,
) -> Callable:
    """Return ``step(pbuf, batch_mb, *extra) -> (gbuf, loss)`` as a shard_map'ed function.

    ``pbuf``/``gbuf``: the slot list (``layouts.slots``), each ``[devices, *shape]``
    sharded ``P(pipe, *dims)`` (its class's sharding over the other axes).
    ``batch_mb``: batch leaves reshaped to ``[m, microbatch, ...]``, split over the batch
    axes (:meth:`~jaxpipe.sharding.MeshAxes.batch_spec`).

    The program is manual over ``axes.manual_axes`` (the pipe axis and the batch axes that
    shard no parameter); every other axis keeps JAX's sharding inside the stages, which
    are traced on the global view of those axes.

    With ``epilogue``, the step instead returns ``epilogue(pbuf_local, gbuf_local, loss,
    *extra_local)`` computed on each device inside the same program (the optimizer update
    uses this), with ``extra_in_specs`` / ``epilogue_out_specs`` as the specs of its
    extra inputs and outputs outside the program (their manual part is the shard_map's).

    ``groups``: the slot groups (:mod:`.param_groups`; built from ``bodies`` when not given).
    With ``grouped=True`` parameters come in and gradients go out by group: ``pbuf`` is
    ``(pslots, parrays)`` and the step returns ``((gslots, garrays), loss)``, the slots in
    no group (a list over all positions, ``None`` at grouped ones) and every group's
    array, ``[devices, len(group), *shape]``. The public path moves the user's leaves
    into and out of groups directly (:mod:`.param_moves`); the staged parameters stay slots.
    """
    axis = axes.axis
    manual_batch = axes.manual_batch_axes
    m = lowering.num_microbatches
    L = layouts
    D = lowering.num_devices
    # per offset, one permutation per sender set: it lists only the pairs that carry a
    # message at that tick end, so no device waits for a neighbour it exchanges nothing with
    perms = [[[(d, (d + off) % D) for d in senders] for senders in patterns]
             for off, patterns in zip(lowering.perm_offsets, lowering.perm_patterns,
                                      strict=True)]
    unit = L.unit
    units = lowering.units
    num_bodies = len(bodies)

    groups = groups if groups is not None else Groups(bodies, L.slots.classes)
    branch_of = Branches(L, m, lowering.fused_stages, lowering.split_stages, groups)

    # Only (kind, body) pairs the schedule runs get a branch (e.g. no I/W for 1F1B).
    used = lowering.used_branches - {IDLE}
    branches = {branch_id(kind, b.index, num_bodies): branch_of.make(kind, b)
                for kind in PROGRAM_KINDS for b in bodies
                if branch_id(kind, b.index, num_bodies) in used}

    # W reads no message. Passing the inbox through its loops anyway made XLA copy the
    # whole inbox twice per step (+8% step time for 1F1B split into I + W, MLP p=4).
    reads_inbox = {b for b in branches
                   if b not in {branch_id("W", x.index, num_bodies) for x in bodies}}

    def write_unit(buf: Bufs, msg: Bufs, slot: Any) -> Bufs:
        return {c: lax.dynamic_update_slice_in_dim(buf[c], msg[c], slot * n, 0,
                                                   allow_negative_indices=False)
                for c, n in unit.items()}

    def per_device(pbuf, batch, fields: tuple[ActionFields, StepFields], *extra):
        pslots, parrays = pbuf if grouped else (pbuf, [])
        pbuf = [None if v is None else constrain(v[0], c.dims)
                for v, c in zip(pslots, L.slots.classes, strict=True)]
        if grouped:
            pbuf += groups.local(parrays, params=True)
        if axes.auto_batch_axes:  # split over the automatic batch axes (FSDP)
            batch = [constrain(x, ((), axes.auto_batch_axes)) for x in batch]
        fields = jax.tree.map(lambda x: x[:, 0], fields)  # this device's column
        store = {c: c.zeros(n) for c, n in lowering.slots.items()}
        inbox = {c: c.zeros((lowering.num_inbox + 1) * n) for c, n in unit.items()}
        # Only senders write an outbox (the writes are gated), so it needs no dummy unit
        # and a ppermute moves exactly the units in use.
        outbox = [{c: c.zeros(k * n) for c, n in unit.items()} for k in units]
        gbuf = groups.zero_grads()

        def step(carry, fields: tuple[ActionFields, StepFields]):
            row, at = fields
            store, inbox, outbox, gbuf, loss = carry
            mbd = [lax.dynamic_index_in_dim(x, row.microbatch, 0, keepdims=False,
                                            allow_negative_indices=False)
                   for x in batch]
            # One gated loop per branch instead of lax.switch: a conditional copies every
            # buffer its untaken branches pass through, while a loop updates its carry in
            # place.
            state = (store, gbuf, branch_of.empty_msg(), loss)
            for b in sorted(branches):
                ins = (row, pbuf, mbd, inbox) if b in reads_inbox else (row, pbuf, mbd)
                state = gated(at.runs[b],
                              lambda st, rw, pb, mb, ib=None, b=b: branches[b](rw, pb, mb, ib, st),
                              state, *ins)
            store, gbuf, msg, loss = state
            # The message goes to its inbox slot (it stays here, the turn of a V) or to
            # its outbox unit. Each write is gated: most steps send nothing in a given
            # direction, and a unit written to a dummy slot costs a full-unit copy.
            inbox = gated(at.keep, lambda box: write_unit(box, msg, at.local_slot), inbox)
            outbox = [gated(at.send[j],
                            lambda box, j=j: write_unit(box, msg, at.out_unit[j]), box)
                      for j, box in enumerate(outbox)]
            # End of a tick: every direction someone sends over runs once, over the pairs
            # that carry a message (the pattern number is the same on every device); the
            # units that arrive go to their inbox slots.
            for j, perm in enumerate(perms):
                def exchange(inbox, ob, j=j, perm=perm):
                    recv = (lax.ppermute(ob, axis, perm[0]) if len(perm) == 1 else
                            lax.switch(at.pattern[j],
                                       [functools.partial(lax.ppermute, axis_name=axis,
                                                          perm=pk) for pk in perm], ob))
                    for r in range(units[j]):
                        inbox = write_unit(inbox, {
                            c: lax.slice_in_dim(recv[c], r * n, (r + 1) * n)
                            for c, n in unit.items()}, at.recv_slot[j][r])
                    return inbox
                inbox = gated(at.exchange[j], exchange, inbox, outbox[j])
            return (store, inbox, outbox, gbuf, loss), None

        init = (store, inbox, outbox, gbuf, jnp.zeros((), jnp.float32))
        (_, _, _, gbuf, loss), _ = lax.scan(step, init, fields)
        loss = lax.psum(loss, axis) / m
        # Manual batch axes average explicitly; over the automatic ones the stages saw
        # the whole microbatch and XLA already reduced.
        if manual_batch:
            loss = lax.pmean(loss, manual_batch)
            gbuf = jax.tree.map(lambda x: lax.pmean(x, manual_batch), gbuf)
        if epilogue is not None:
            return epilogue(pbuf, groups.fold(gbuf), loss, *extra)
        if not grouped:
            return [v[None] for v in groups.fold(gbuf)], loss
        n = len(L.slots)
        return ([None if v is None else v[None] for v in gbuf[:n]],
                [v[None] for v in gbuf[n:]]), loss

    table = lowering.table
    table_arrays = jax.tree.map(jnp.asarray, (
        table.actions(gated_stages(bodies)),
        table.steps(sorted(branches), lowering.num_inbox, units)))
    table_specs = jax.tree.map(lambda _: P(None, axis), table_arrays)
    batch_specs = [axes.batch_spec(None) for _ in range(num_batch_leaves)]
    pspec = [c.spec(axis) for c in L.slots.classes]
    by_group = groups.specs(pspec, axis)
    in_specs = (groups.specs(pspec, axis, params=True) if grouped else pspec, batch_specs,
                table_specs, *extra_in_specs)
    if epilogue is not None:
        out_specs = epilogue_out_specs
    else:
        out_specs = (by_group if grouped else pspec, P())
    manual = set(axes.manual_axes)

    def inner(specs):
        return jax.tree.map(lambda s: manual_spec(s, manual), specs,
                            is_leaf=lambda x: isinstance(x, P))

    fn = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=inner(in_specs),
        out_specs=inner(out_specs),
        check_vma=False,
        **axes.shard_map_kwargs(mesh),
    )

    def run(pbuf, batch_mb, *extra):
        pbuf = tuple(map(list, pbuf)) if grouped else list(pbuf)
        args = (pbuf, list(batch_mb), table_arrays, *extra)
        out = fn(*place_tree(args, mesh, in_specs))
        return place_tree(out, mesh, out_specs) if manual != set(mesh.axis_names) else out

    return run


def check_stage_collectives(compiled: Any, what: str) -> None:
    """Refuse a compiled program whose stages hold a collective-permute XLA inserted.

    Over the automatic mesh axes XLA partitions the stages itself; to reshard a value (a
    split across a sharded dimension, say) it may emit a collective-permute. The stages
    run in branches that only the devices of one pipe position take, and the CPU
    runtime's collective-permute waits for *every* device of the program, so it would
    hang. (The program's own ``ppermute`` runs on all devices at once.)
    """
    text = compiled.as_text()
    for line in text.splitlines():
        if " collective-permute(" not in line:
            continue
        op = re.search(r'op_name="([^"]*)"', line)
        name = op.group(1) if op else ""
        if "shard_map" not in name or name.endswith("/ppermute"):
            continue  # outside the program every device runs it; ppermute: ours
        raise PipelineError(
            f"{what}: XLA partitioned a stage over the parameter-sharding mesh axes with a "
            f"collective-permute ({name.split('/')[-1] or 'resharding'} at {name}), which "
            "the CPU runtime cannot run inside a stage (it waits for every device, and "
            "only one pipe position runs the stage); the step would hang. Shard the "
            "parameters so the stage needs no resharding (e.g. no jnp.split across a "
            "sharded dimension), or constrain its activations with "
            "jax.lax.with_sharding_constraint. (Checked on the CPU backend only.)")


def place_tree(tree, mesh: Mesh, specs):
    """:func:`place` every leaf of ``tree`` on its spec (``specs``: a prefix tree)."""
    return jax.tree.map(lambda s, x: jax.tree.map(lambda y: place(y, mesh, s), x), specs, tree,
                        is_leaf=lambda x: isinstance(x, P))


def place(x, mesh: Mesh, spec: P):
    """Constrain ``x`` (inside jit) to ``spec`` on ``mesh``, for Auto and Explicit meshes."""
    sharding = NamedSharding(mesh, spec)
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        return jax.sharding.reshard(x, sharding)
    return lax.with_sharding_constraint(x, sharding)

