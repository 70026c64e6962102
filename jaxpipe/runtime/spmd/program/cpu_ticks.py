"""The CPU program's tick: gated loops, and an exchange only where messages move.

A step runs the branch of one (action kind, body) pair, or nothing (kind ``"FB"``: a
last stage's F and its own B in one step, the residuals passed straight from one to the
other; ``"IW"``: an I and its own W in one step, the hand-off passed straight on):

- parameters come from slots, whole arrays (a shared body whose members use different
  slots on one device picks the running stage's from a small table by ``row.stage``),
  and their gradients accumulate in place, those of such a body in a stacked *group*
  per parameter (:mod:`.param_groups`);
- residuals and the I -> W hand-off (of a W in a step of its own) are stored in
  per-class buffers at the slots the lowering chose, and a layer scan writes and reads
  its stacked values there itself (:mod:`.scan_buffers`);
- an output message goes into the outbox unit of its direction (or into an inbox slot
  when it stays on the device, the turn of a V), where it waits for the tick end the
  lowering moves it at: its producer's, or where devices run concurrently, lazily with
  the pair's other messages, at as few tick ends as their readers allow
  (``Exchange.lazy``). At the end of such a tick's last
  step, every permutation someone uses runs once (``lax.ppermute`` of that direction's
  whole outbox) and the arriving units land in inbox slots. That ``ppermute`` lists only
  the pairs that carry a message at that tick (one permutation per sender set, picked by
  the table), so a device waits only for the devices it exchanges with, and a tick
  without messages runs no collective (between virtual CPU devices one costs ~75 us).

Branch selection is a chain of zero-or-one-trip ``while_loop``\\ s rather than
``lax.switch``: XLA copies every buffer that an untaken ``conditional`` branch passes
through (whole storage and gradients, every step), while a ``while_loop`` updates its
carry in place. Per-step work is thus proportional to one microbatch, and idle steps cost
a few scalar reads. On XLA:CPU a loop's trip count is read on the host anyway; on GPUs
each would stop the host (:mod:`.accelerator_ticks` is the program for them).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
from jax import lax

from jaxpipe.runtime.spmd.lowering.tick_table import IDLE, PROGRAM_KINDS, branch_id
from jaxpipe.runtime.spmd.lowering.types import Lowering
from jaxpipe.runtime.spmd.program.bodies import Body
from jaxpipe.runtime.spmd.program.branches import Branches, BranchState
from jaxpipe.runtime.spmd.program.gated import gated
from jaxpipe.runtime.spmd.program.layout import Bufs, StageLayouts
from jaxpipe.runtime.spmd.program.loss_outputs import LossOutputs
from jaxpipe.runtime.spmd.program.message_units import write_unit
from jaxpipe.runtime.spmd.program.param_groups import Groups
from jaxpipe.runtime.spmd.program.stage_ends import gated_stages

__all__ = ["CpuTicks"]



class CpuTicks:
    """The CPU program's tick loop for one lowering: its table fields (host arrays, one
    ``[steps, devices]`` int32 array per scalar), its carry and its step."""

    def __init__(self, bodies: Sequence[Body], layouts: StageLayouts, lowering: Lowering,
                 axis: str, groups: Groups, outputs: LossOutputs,
                 forward_only: bool = False) -> None:
        D = lowering.num_devices
        self.axis, self.lowering, self.unit = axis, lowering, layouts.unit
        self.ports = None  # its branches write in place: nothing goes through ports
        # per offset, one permutation per sender set: it lists only the pairs that carry a
        # message at that tick end, so no device waits for a neighbour it exchanges
        # nothing with
        self.perms = [[[(d, (d + off) % D) for d in senders] for senders in patterns]
                      for off, patterns in zip(lowering.perm_offsets, lowering.perm_patterns,
                                               strict=True)]
        self.outputs = outputs
        self.branch_of = Branches(layouts, outputs, lowering.fused_stages,
                                  lowering.split_stages, groups, forward_only=forward_only)
        num_bodies = len(bodies)
        # Only (kind, body) pairs the schedule runs get a branch (e.g. no I/W for 1F1B).
        used = lowering.used_branches - {IDLE}
        self.branches = {branch_id(kind, b.index, num_bodies): self.branch_of.make(kind, b)
                         for kind in PROGRAM_KINDS for b in bodies
                         if branch_id(kind, b.index, num_bodies) in used}
        # W reads no message. Passing the inbox through its loops anyway made XLA copy the
        # whole inbox twice per step (+8% step time for 1F1B split into I + W, MLP p=4).
        self.reads_inbox = {b for b in self.branches
                            if b not in {branch_id("W", x.index, num_bodies) for x in bodies}}
        table = lowering.table
        # only V placements keep a message on its device: elsewhere no step writes one,
        # and the program runs no loop for it
        self.keeps = bool((table.local_slot != lowering.num_inbox).any())
        self.fields = (table.actions(gated_stages(bodies)),
                       table.steps(sorted(self.branches), lowering.num_inbox, lowering.units))

    def init(self) -> tuple:
        """The carry besides gradients and loss: storage (the loss function's outputs
        too, :mod:`.loss_outputs`), inbox, one outbox a direction."""
        low, unit = self.lowering, self.unit
        store = {c: c.zeros(n) for c, n in low.slots.items()} | self.outputs.buffers()
        inbox = {c: c.zeros((low.num_inbox + 1) * n) for c, n in unit.items()}
        # Only senders write an outbox (the writes are gated), so it needs no dummy unit
        # and a ppermute moves exactly the units in use.
        outbox = [{c: c.zeros(k * n) for c, n in unit.items()} for k in low.units]
        return store, inbox, outbox

    def _write_unit(self, buf: Bufs, msg: Bufs, slot: Any) -> Bufs:
        return write_unit(buf, msg, slot, self.unit)

    def step(self, carry: tuple, gbuf: list, loss: jax.Array, fields: tuple, pbuf: list,
             mbd: list) -> tuple[tuple, list, jax.Array]:
        """One step: the gated branches, the message writes, the gated exchange."""
        row, at = fields
        store, inbox, outbox = carry
        # One gated loop per branch instead of lax.switch: a conditional copies every
        # buffer its untaken branches pass through, while a loop updates its carry in
        # place.
        state = BranchState(store, gbuf, self.branch_of.empty_msg(), loss)
        for b in sorted(self.branches):
            ins = (row, pbuf, mbd, inbox) if b in self.reads_inbox else (row, pbuf, mbd)
            state = gated(at.runs[b],
                          lambda st, rw, pb, mb, ib=None, b=b: self.branches[b](rw, pb, mb,
                                                                                ib, st),
                          state, *ins)
        store, gbuf, msg, loss = state
        # The message goes to its inbox slot (it stays here, the turn of a V) or to its
        # outbox unit. Each write is gated: most steps send nothing in a given direction,
        # and a unit written to a dummy slot costs a full-unit copy.
        if self.keeps:
            inbox = gated(at.keep, lambda box: self._write_unit(box, msg, at.local_slot),
                          inbox)
        outbox = [gated(at.send[j],
                        lambda box, j=j: self._write_unit(box, msg, at.out_unit[j]), box)
                  for j, box in enumerate(outbox)]
        # End of a tick: every direction someone sends over runs once, over the pairs that
        # carry a message (the pattern number is the same on every device); the units that
        # arrive go to their inbox slots.
        units, axis = self.lowering.units, self.axis
        for j, perm in enumerate(self.perms):
            def exchange(inbox, ob, j=j, perm=perm):
                recv = (lax.ppermute(ob, axis, perm[0]) if len(perm) == 1 else
                        lax.switch(at.pattern[j],
                                   [functools.partial(lax.ppermute, axis_name=axis,
                                                      perm=pk) for pk in perm], ob))
                for r in range(units[j]):
                    inbox = self._write_unit(inbox, {
                        c: lax.slice_in_dim(recv[c], r * n, (r + 1) * n)
                        for c, n in self.unit.items()}, at.recv_slot[j][r])
                return inbox
            inbox = gated(at.exchange[j], exchange, inbox, outbox[j])
        return (store, inbox, outbox), gbuf, loss
