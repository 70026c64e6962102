"""The accelerator program's tick: straight-line, one switch, one permutation a direction.

XLA:GPU runs a ``conditional`` by copying its predicate to the host and waiting for it,
and a ``while`` loop whose trip count it does not know the same way on every iteration;
a collective inside a conditional cannot overlap compute (and hangs if two peers take
different branches). So a tick of this program is, in order:

1. with the overlap on (the lowering's ``Exchange.delay == 2``), one
   ``lax.ppermute`` per direction of the message the previous tick produced, from the
   loop's carry: nothing in the tick depends on it until its end, so XLA can run it
   alongside the compute (XLA:GPU only with :data:`jaxpipe.xla_flags.COMPILER_OPTIONS`);
2. one ``lax.switch`` over the step's *variants* (the (kind, body) branches, a shared
   body's once per member with a prologue or epilogue, and idle): the storage, inbox and
   parameters go in read-only (with ``windows``, only the rows of storage and inbox the
   step may read, :mod:`.windows`: XLA:TPU relaid whole buffers inside the branch every
   tick), and the branch returns its output message, its loss and its writes
   (:class:`~.writes.Ports`: stored rows with where they go, gradients with their row)
   -- XLA copies every buffer a conditional updates;
3. the writes: ``dynamic_update_slice`` of the rows (an unused port writes back what is
   there), the gradients added in place, the message into its inbox slot when it stays
   on the device;
4. without the overlap, one ``lax.ppermute`` per direction of this tick's message; the
   arriving message goes to its inbox slot (the dummy slot when nothing arrives).

Every device sends every tick over the fixed pairs of each direction (every pair some
message ever uses); a device with nothing to send sends its last output anyway and the
receiver writes it to the dummy slot. A message of several value classes travels packed
into one byte buffer (unless the mesh has automatic axes, whose sharding a byte buffer
would lose: then one permutation per class).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax import lax

from jaxpipe.runtime.spmd.lowering.tick_table import IDLE, PROGRAM_KINDS
from jaxpipe.runtime.spmd.lowering.types import Lowering
from jaxpipe.runtime.spmd.program.bodies import Body
from jaxpipe.runtime.spmd.program.branches import Branches, BranchState
from jaxpipe.runtime.spmd.program.layout import Bufs, StageLayouts
from jaxpipe.runtime.spmd.program.loss_outputs import LossOutputs
from jaxpipe.runtime.spmd.program.message_units import pack, unpack, write_unit
from jaxpipe.runtime.spmd.program.param_groups import Groups
from jaxpipe.runtime.spmd.program.windows import Windows
from jaxpipe.runtime.spmd.program.writes import DeferredGrads, DeferredStore, Ports

__all__ = ["AcceleratorFields", "AcceleratorTicks", "storage_and_inbox"]



@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AcceleratorFields:
    """What a tick reads around its switch, one ``[steps, devices]`` int32 array each.

    Attributes:
      variant: the switch's branch (0: idle).
      local_slot: the inbox slot of the output message when it stays on the device (the
        dummy slot otherwise).
      recv_slot: per direction, the inbox slot of what arrives at the tick's end (the
        dummy slot when nothing does).
    """

    variant: np.ndarray
    local_slot: np.ndarray
    recv_slot: tuple[np.ndarray, ...]


class AcceleratorTicks:
    """The accelerator program's tick loop for one lowering (see the module docstring):
    its table fields (host arrays), its carry and its step.

    ``outputs``: where the last stage's outputs go (:mod:`.loss_outputs`);
    ``forward_only``: an evaluation program (F steps storing nothing). ``packed``: move a
    message of several classes as one byte buffer (only where no mesh axis is left to
    JAX's sharding inside the program). ``windows``: the switch reads windows of the
    buffers, kept row-major (:mod:`.windows`; XLA:GPU needs none: it keeps one layout a
    buffer, and a window would only cost memory).
    """

    def __init__(self, bodies: Sequence[Body], layouts: StageLayouts, lowering: Lowering,
                 axis: str, groups: Groups, outputs: LossOutputs, forward_only: bool = False,
                 packed: bool = True, windows: bool = True) -> None:
        if not lowering.exchange.every_tick or lowering.num_steps != lowering.num_ticks:
            raise ValueError("the accelerator program needs a lowering with one step per "
                             "tick that exchanges every tick (lower_accelerator)")
        if any(k > 1 for k in lowering.units):
            raise ValueError(f"the accelerator program sends one message per device and "
                             f"direction a tick; this lowering needs {lowering.units}")
        D = lowering.num_devices
        self.axis, self.lowering, self.unit = axis, lowering, layouts.unit
        self.overlap = lowering.exchange.delay == 2
        self.packed = packed and len(self.unit) > 1
        senders = [sorted({d for s in patterns for d in s}) for patterns in
                   lowering.perm_patterns]
        # one permutation per direction, over every pair that ever uses it
        self.perms = [[(d, (d + off) % D) for d in mine]
                      for off, mine in zip(lowering.perm_offsets, senders, strict=True)]
        self.outputs = outputs
        self.windows = Windows(layouts, lowering) if windows else None
        self.branch_of = Branches(layouts, outputs, lowering.fused_stages,
                                  lowering.split_stages, groups, direct_writes=False,
                                  forward_only=forward_only)
        table = lowering.table
        variant = np.zeros(table.branch.shape, np.int32)
        self.ports: Ports | None = None  # known once a step is traced
        self.variant_fns: list[Callable] = []
        self.variant_names: list[str] = []
        num_bodies = len(bodies)
        for b in sorted(lowering.used_branches - {IDLE}):
            kind, body = PROGRAM_KINDS[(b - 1) // num_bodies], bodies[(b - 1) % num_bodies]
            of_stage = ({s: None for s in body.stages} if kind == "FB"
                        else self.branch_of.variants(kind, body))
            runs = table.branch == b
            for v in sorted({of_stage[int(s)] for s in np.unique(table.stage[runs])},
                            key=lambda v: -1 if v is None else v):
                mine = [s for s, x in of_stage.items() if x == v]
                variant[runs & np.isin(table.stage, mine)] = len(self.variant_fns) + 1
                self.variant_fns.append(self.branch_of.make(kind, body, v))
                self.variant_names.append(f"{kind}{body.index}" + ("" if v is None
                                                                    else f"@{v}"))
        i32 = lambda x: np.ascontiguousarray(x, np.int32)  # noqa: E731
        self.fields = (table.actions(()), AcceleratorFields(
            i32(variant), i32(table.local_slot),
            tuple(i32(table.recv_slot[..., j, 0]) for j in range(len(self.perms)))))

    # -- carry and messages ------------------------------------------------------------
    def init(self) -> tuple:
        """The carry besides gradients and loss: storage (the loss function's outputs
        too), inbox, and (with the overlap) the message the previous tick produced, as it
        travels."""
        store, inbox = storage_and_inbox(self.lowering, self.unit, self.outputs)
        pending = self._pack(self.branch_of.empty_msg()) if self.overlap else ()
        return store, inbox, pending

    def _pack(self, msg: Bufs) -> Any:
        return pack(msg, self.unit, self.packed)

    def _unpack(self, payload: Any) -> Bufs:
        return unpack(payload, self.unit, self.packed)

    def _write_unit(self, buf: Bufs, msg: Bufs, slot: Any) -> Bufs:
        return write_unit(buf, msg, slot, self.unit)

    def _exchange(self, payload: Any) -> list[Any]:
        return [lax.ppermute(payload, self.axis, perm) for perm in self.perms]

    # -- the switch --------------------------------------------------------------------
    def _switch(self, index: jax.Array, gbuf: list, *operands: Any) -> tuple:
        """``(message, loss, port outputs, ports)`` of the variant ``index`` picks."""
        grads = [None if g is None else jax.ShapeDtypeStruct(g.shape, g.dtype) for g in gbuf]
        empty = self.branch_of.empty_msg

        def run(fn: Callable, row, pbuf, mbd, inbox, store) -> tuple:
            store = (DeferredStore(store) if self.windows is None
                     else DeferredStore({}, windows=store))
            state = BranchState(store, DeferredGrads(grads), empty(), self.outputs.zero())
            return fn(row, pbuf, mbd, inbox, state)

        signatures = []
        for fn in self.variant_fns:  # what each variant writes, to size the ports
            def probe(*args, fn=fn):
                store, g, _, loss = run(fn, *args)
                signatures.append(Ports.signature(store, g))
                return loss
            jax.eval_shape(probe, *operands)
        ports = self.ports = Ports(signatures)  # (kept for reports: Ports.nbytes)

        def idle(*args):
            return (empty(), self.outputs.zero(),
                    ports.outputs(DeferredStore({}), DeferredGrads(grads)))

        def branch(fn: Callable) -> Callable:
            def go(*args):
                store, g, msg, loss = run(fn, *args)
                return msg, loss, ports.outputs(store, g)
            return go

        msg, loss, outs = lax.switch(index, [idle, *map(branch, self.variant_fns)],
                                     *operands)
        return msg, loss, outs, ports

    # -- one tick ----------------------------------------------------------------------
    def step(self, carry: tuple, gbuf: list, loss: jax.Array, fields: tuple, pbuf: list,
             mbd: list) -> tuple[tuple, list, jax.Array]:
        row, at = fields
        store, inbox, pending = carry
        # the previous tick's message moves while this tick computes
        arrived = self._exchange(pending) if self.overlap else None
        reads = ((row, inbox, store) if self.windows is None
                 else self.windows.cut(store, inbox, row))
        msg, dloss, outs, ports = self._switch(at.variant, gbuf, reads[0], pbuf, mbd,
                                               *reads[1:])
        store, gbuf = ports.apply(store, gbuf, outs)
        if self.windows is not None:
            store = self.windows.laid_out(store)
        inbox = self._write_unit(inbox, msg, at.local_slot)
        if self.overlap:
            # pack the next message only once the permutes are done reading the carried
            # one: then XLA:GPU and TPU write it into the carry's buffer; else, to keep
            # the permutes' operand apart, they copy the carried message every tick
            msg, arrived = lax.optimization_barrier((msg, arrived))
        payload = self._pack(msg)
        if not self.overlap:
            arrived = self._exchange(payload)
        for j, got in enumerate(arrived):
            inbox = self._write_unit(inbox, self._unpack(got), at.recv_slot[j])
        return (store, inbox, payload if self.overlap else ()), gbuf, loss + dloss


def storage_and_inbox(lowering: Lowering, unit: dict, outputs: LossOutputs
                      ) -> tuple[Bufs, Bufs]:
    """A device's zero storage (the loss function's outputs too) and inbox (a dummy slot
    past the lowering's) for a program whose steps write after their compute."""
    store = {c: c.zeros(n) for c, n in lowering.slots.items()} | outputs.buffers()
    inbox = {c: c.zeros((lowering.num_inbox + 1) * n) for c, n in unit.items()}
    return store, inbox
