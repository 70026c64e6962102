"""The SPMD program: one ``jax.jit(jax.shard_map(...))`` runs a lowered schedule.

Every device runs the same program: ``lax.scan`` over the steps of the lowering's
:class:`~jaxpipe.runtime.spmd.lowering.tick_table.TickTable`, read as one ``[steps,
devices]`` int32 array per scalar. What a step does is the tick loop's, built for the
backend the program runs on:

- :class:`~.cpu_ticks.CpuTicks`: every (kind, body) branch in a gated loop, buffers
  updated in place inside them, and an exchange only on ticks that carry messages;
- :class:`~.accelerator_ticks.AcceleratorTicks`: straight-line ticks for GPUs and TPUs,
  one ``lax.switch`` over the step's variants with the buffers read-only inside it and
  written after it, and one unconditional permutation per direction.

Around the loop, this module sets up the device's parameters and batch, reduces the loss
and gradients over the batch axes, and runs the optimizer epilogue if there is one.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpipe.errors import PipelineError
from jaxpipe.jaxpr.objective import MEAN, Objective
from jaxpipe.runtime.spmd.lowering.types import Lowering
from jaxpipe.runtime.spmd.program.accelerator_ticks import AcceleratorTicks
from jaxpipe.runtime.spmd.program.bodies import Body
from jaxpipe.runtime.spmd.program.cpu_ticks import CpuTicks
from jaxpipe.runtime.spmd.program.lane_ticks import LaneTicks
from jaxpipe.runtime.spmd.program.layout import StageLayouts
from jaxpipe.runtime.spmd.program.loss_outputs import LossOutputs
from jaxpipe.runtime.spmd.program.manual import manual_shard_map
from jaxpipe.runtime.spmd.program.param_groups import Groups
from jaxpipe.sharding.mesh_axes import MeshAxes, constrain

__all__ = ["Epilogue", "ProgramKind", "ProgramMesh", "ProgramStages", "build_step",
           "check_stage_collectives"]

@dataclass(frozen=True)
class ProgramStages:
    """What the program runs: the stages' bodies, their buffer layouts, the slot groups
    (:mod:`.bodies`, :mod:`.layout`, :mod:`.param_groups`)."""

    bodies: Sequence[Body]
    layouts: StageLayouts
    groups: Groups


@dataclass(frozen=True)
class ProgramMesh:
    """Where it runs: the mesh, the roles of its axes, and how many batch leaves come in."""

    mesh: Mesh
    axes: MeshAxes
    num_batch_leaves: int


@dataclass(frozen=True)
class ProgramKind:
    """Which program: the tick loop (``accelerator``: straight-line for GPUs and TPUs;
    ``lanes``: one shared body run unconditionally), what the loss function returns
    (``objective``), whether it evaluates only (``forward_only``) and whether parameters
    come in and gradients go out by group (``grouped``); ``weight``: the weight of one
    microbatch's batch leaves (``RuntimeSpec.batch_weight``), totalled before the ticks
    to seed each loss with ``1 / total``."""

    accelerator: bool = False
    lanes: bool = False
    objective: Objective = MEAN
    forward_only: bool = False
    grouped: bool = False
    weight: Any = None


@dataclass(frozen=True)
class Epilogue:
    """What runs on each device after the ticks, inside the program (the optimizer
    update): ``fn(params_local, grads_local, loss, *extra_local)``; ``in_specs`` /
    ``out_specs``: the specs of its extra inputs and of its outputs outside the program."""

    fn: Callable[..., object]
    in_specs: tuple = ()
    out_specs: object = None


def build_step(stages: ProgramStages, lowering: Lowering, where: ProgramMesh,
               kind: ProgramKind = ProgramKind(), epilogue: Epilogue | None = None
               ) -> Callable:
    """Return ``step(pbuf, batch_mb, *extra) -> (gbuf, loss, aux)`` as a shard_map'ed
    function.

    ``pbuf``/``gbuf``: the slot list (``layouts.slots``), each ``[devices, *shape]``
    sharded ``P(pipe, *dims)`` (its class's sharding over the other axes).
    ``batch_mb``: batch leaves reshaped to ``[m, microbatch, ...]``, split over the batch
    axes (:meth:`~jaxpipe.sharding.mesh_axes.MeshAxes.batch_spec`).

    The program is manual over ``axes.manual_axes`` (the pipe axis and the batch axes that
    shard no parameter); every other axis keeps JAX's sharding inside the stages, which
    are traced on the global view of those axes.

    ``kind.objective``: what the loss function returns and how the program reduces it
    (:mod:`jaxpipe.jaxpr.objective`, :mod:`.loss_outputs`); ``aux``: its aux leaves, each
    ``[m, *shape]`` (``[m, shards, *shape]`` over manual batch axes).

    With ``epilogue``, the step instead returns ``(epilogue.fn(pbuf_local, gbuf_local,
    loss, *extra_local), aux)``, the epilogue computed on each device inside the same
    program (the optimizer update uses this). ``kind.forward_only``: the program
    evaluates the loss and returns ``(loss, aux)``; its lowering must be of a
    forward-only schedule (:class:`jaxpipe.schedule.forward.ForwardOnly`).

    ``stages.groups``: the slot groups (:mod:`.param_groups`). With ``kind.grouped``
    parameters come in and gradients go out by group: ``pbuf`` is ``(pslots, parrays)``
    and the step returns ``((gslots, garrays), loss, aux)``: the slots in no group (a
    list over all positions, ``None`` at grouped ones) and every group's array,
    ``[devices, len(group), *shape]``. The public path moves the user's leaves into and
    out of groups directly (:mod:`.param_moves`); the staged parameters stay slots.

    ``kind.accelerator``: build the straight-line tick loop for GPUs and TPUs
    (:mod:`.accelerator_ticks`; the lowering must exchange every tick); else the CPU's
    (:mod:`.cpu_ticks`). ``kind.lanes``: the lanes program instead, on any backend (one shared
    body run unconditionally, :mod:`.lane_ticks`; a lanes lowering).
    """
    bodies, L, groups = stages.bodies, stages.layouts, stages.groups
    mesh, axes = where.mesh, where.axes
    objective, forward_only, grouped = kind.objective, kind.forward_only, kind.grouped
    axis = axes.axis
    manual_batch = axes.manual_batch_axes
    last = next(st for b in bodies for st in b.members if st.is_last)
    outputs = LossOutputs(last.out_avals, objective, lowering.num_microbatches)
    if kind.lanes:
        loop = LaneTicks(bodies, L, lowering, axis, groups, outputs, forward_only,
                         packed=set(axes.manual_axes) == set(mesh.axis_names))
    elif kind.accelerator:  # a byte buffer would lose the sharding of automatic axes
        loop = AcceleratorTicks(bodies, L, lowering, axis, groups, outputs, forward_only,
                                packed=set(axes.manual_axes) == set(mesh.axis_names),
                                # XLA:GPU keeps one layout a buffer: whole buffers
                                windows=mesh.devices.flat[0].platform != "gpu")
    else:
        loop = CpuTicks(bodies, L, lowering, axis, groups, outputs, forward_only)

    def per_device(pbuf, batch, fields, *extra):
        pslots, parrays = pbuf if grouped else (pbuf, [])
        pbuf = [None if v is None else constrain(v[0], c.dims)
                for v, c in zip(pslots, L.slots.classes, strict=True)]
        if grouped:
            pbuf += groups.local(parrays, params=True)
        if axes.auto_batch_axes:  # split over the automatic batch axes (FSDP)
            batch = [constrain(x, ((), axes.auto_batch_axes)) for x in batch]
        fields = jax.tree.map(lambda x: x[:, 0], fields)  # this device's column
        if kind.weight is not None and not forward_only:
            outputs.weigh(kind.weight, batch, manual_batch)

        def step(carry, fields, lanes=None):
            state, gbuf, loss = carry
            if lanes is not None:  # each lane picks its own microbatch
                return loop.step(state, gbuf, loss, fields, pbuf, batch, lanes), None
            row = fields[0]
            mbd = [lax.dynamic_index_in_dim(x, row.microbatch, 0, keepdims=False,
                                            allow_negative_indices=False)
                   for x in batch]
            return loop.step(state, gbuf, loss, fields, pbuf, mbd), None

        carry = (loop.init(), [] if forward_only else groups.zero_grads(),
                 outputs.zero())
        if kind.lanes:
            for seg in loop.segments:
                carry, _ = lax.scan(functools.partial(step, lanes=seg.lanes), carry,
                                    jax.tree.map(lambda x, seg=seg: x[seg.start:seg.stop],
                                                 fields))
        else:
            carry, _ = lax.scan(step, carry, fields)
        (store, *_), gbuf, loss = carry
        # Manual batch axes reduce explicitly; over the automatic ones the stages saw
        # the whole microbatch and XLA already reduced.
        loss, gbuf, aux = outputs.finish(store, loss, gbuf, axis, manual_batch)
        if forward_only:
            return loss, aux
        if epilogue is not None:
            return epilogue.fn(pbuf, groups.fold(gbuf), loss, *extra), aux
        if not grouped:
            return [v[None] for v in groups.fold(gbuf)], loss, aux
        n = len(L.slots)
        return ([None if v is None else v[None] for v in gbuf[:n]],
                [v[None] for v in gbuf[n:]]), loss, aux

    # numpy until a call traces the step: a jax array made here would belong to whatever
    # trace builds the step (evaluation's program is built inside pipe.loss's jit, and
    # its tables leaked into later calls), and on an ahead-of-time target's mesh there is
    # no device to put it on
    table_arrays = jax.tree.map(np.asarray, loop.fields)
    table_specs = jax.tree.map(lambda _: P(None, axis), table_arrays)
    batch_specs = [axes.batch_spec(None) for _ in range(where.num_batch_leaves)]
    pspec = [c.spec(axis) for c in L.slots.classes]
    by_group = groups.specs(pspec, axis)
    in_specs = (groups.specs(pspec, axis, params=True) if grouped else pspec, batch_specs,
                table_specs, *(epilogue.in_specs if epilogue is not None else ()))
    # an aux leaf: [m, *shape], or [m, shards, *shape] over manual batch axes
    aux_specs = [P(None, manual_batch) if manual_batch else P()
                 for _ in outputs.classes[int(objective.weighted):]]
    if forward_only:
        out_specs = (P(), aux_specs)
    elif epilogue is not None:
        out_specs = (epilogue.out_specs, aux_specs)
    else:
        out_specs = (by_group if grouped else pspec, P(), aux_specs)
    mapped = manual_shard_map(per_device, mesh, axes, in_specs, out_specs)

    def run(pbuf, batch_mb, *extra):
        pbuf = tuple(map(list, pbuf)) if grouped else list(pbuf)
        return mapped(pbuf, list(batch_mb), jax.tree.map(jnp.asarray, table_arrays), *extra)

    run.tick_loop = loop  # what the step runs, for reports
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
