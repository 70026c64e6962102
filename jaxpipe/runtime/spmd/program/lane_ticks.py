"""The lanes program's tick: one shared body's forward, then its backward, on every device.

Where every stage is one body (:mod:`.bodies`; the first and last stages run the
embedding and the head as the prologue and epilogue around the shared core), a tick of
this program runs, on every device and with no conditional around it:

1. the **forward lane**: the body's F on the microbatch and stage the table names for
   the device (its parameters picked by the running stage, the prologue and epilogue run
   and counted only on their own stage's steps: :class:`~.stage_ends.Ends` with
   ``gate="mask"``); where the device's lane is idle the same computation runs on
   whatever the dummy slots hold and none of its writes is made;
2. the **backward lane** the same way, with the body's B;
3. the exchange: per lane one ``lax.ppermute`` of its output message over the lane's one
   direction (the forward lane's can run while the backward lane computes).

So every collective XLA puts inside a stage (an FSDP all-gather, a tensor-parallel
reduction, a resharding permute) runs on every device at once, unconditionally: it can
be scheduled against the rest of the tick, and the CPU runtime's collectives, which
wait for every device of the program, do not hang. The writes go through
:class:`~.writes.Ports` as in the accelerator program, gated by the lane being busy.

The ticks come from :func:`~..lowering.lanes.lower_lanes`. Runs of ticks where no device
has a backward (the fill) or a forward (the drain) are scanned as segments of one lane,
so the program computes no masked lane there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpipe.runtime.spmd.lowering.lanes import B_LANE, F_LANE, lane_offsets, lane_segments
from jaxpipe.runtime.spmd.lowering.tick_table import IDLE
from jaxpipe.runtime.spmd.lowering.types import Lowering
from jaxpipe.runtime.spmd.program.accelerator_ticks import storage_and_inbox
from jaxpipe.runtime.spmd.program.bodies import Body
from jaxpipe.runtime.spmd.program.branches import Branches, BranchState
from jaxpipe.runtime.spmd.program.layout import Bufs, StageLayouts
from jaxpipe.runtime.spmd.program.loss_outputs import LossOutputs
from jaxpipe.runtime.spmd.program.message_units import pack, unpack, write_unit
from jaxpipe.runtime.spmd.program.param_groups import Groups
from jaxpipe.runtime.spmd.program.stage_ends import gated_stages
from jaxpipe.runtime.spmd.program.writes import DeferredGrads, DeferredStore, Ports

__all__ = ["LaneFields", "LaneTicks", "lane_tables"]



@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LaneFields:
    """Per lane (forward, backward), one ``[ticks, devices]`` int32 array each.

    Attributes:
      active: 1 where the device's lane runs an action (0: its writes are dropped).
      local_slot: the inbox slot of the lane's output when it stays on the device (the
        dummy slot otherwise).
      recv_slot: the inbox slot of what arrives over the lane's permutation at the
        tick's end (the dummy slot when nothing does).
    """

    active: tuple[np.ndarray, np.ndarray]
    local_slot: tuple[np.ndarray, np.ndarray]
    recv_slot: tuple[np.ndarray, np.ndarray]


def _rows(x: np.ndarray, lane: int, num_ticks: int) -> np.ndarray:
    """A lane's rows of a ``[steps, ...]`` table field, one a tick (the backward lane of
    a table whose last tick has no backward step repeats its last row: idle)."""
    out = x[lane::2][:num_ticks]
    if len(out) < num_ticks:
        out = np.concatenate([out, np.repeat(out[-1:], num_ticks - len(out), 0)])
    return np.ascontiguousarray(out)


def lane_tables(lowering: Lowering) -> LaneFields:
    """The per-lane fields of a lanes lowering (:func:`~..lowering.lanes.lower_lanes`)."""
    table = lowering.table
    T, D = lowering.num_ticks, lowering.num_devices
    dummy = lowering.num_inbox
    msgs = lowering.message_arrays
    ticks = lowering.ticks
    recv = [np.full((T, D), dummy, np.int32) for _ in range(2)]
    # a message to another device arrives at its producer's tick's end
    slot = _message_slots(lowering)
    remote, lane = _remote_lanes(lowering)
    for k in (F_LANE, B_LANE):
        mine = remote & (lane == k)
        recv[k][ticks.tick[msgs.producer[mine]], msgs.dst[mine]] = slot[mine]
    i32 = lambda x: np.ascontiguousarray(x, np.int32)  # noqa: E731
    busy = np.zeros((table.branch.shape[0] + 1, D), bool)  # an idle step past the end
    busy[:-1] = table.branch != IDLE
    local = np.full((table.branch.shape[0] + 1, D), dummy, np.int32)
    local[:-1] = table.local_slot
    return LaneFields(
        tuple(i32(_rows(busy, k, T)) for k in (F_LANE, B_LANE)),
        tuple(i32(_rows(local, k, T)) for k in (F_LANE, B_LANE)),
        tuple(i32(r) for r in recv))


def _remote_lanes(lowering: Lowering) -> tuple[np.ndarray, np.ndarray]:
    """Per message: whether it goes to another device, and the lane that sends it."""
    msgs = lowering.message_arrays
    return msgs.src != msgs.dst, lowering.ticks.step[msgs.producer] % 2


def _message_slots(lowering: Lowering) -> np.ndarray:
    """Every message's inbox slot, as the table's readers see it (``in_slot`` of its
    consumer's step)."""
    msgs = lowering.message_arrays
    return lowering.table.in_slot[msgs.read, msgs.dst]


class LaneTicks:
    """The lanes program's tick loop for one lowering (see the module docstring): its
    table fields (host arrays), its segments, its carry and its step.

    ``bodies`` must be one body; ``outputs``: where the last stage's outputs go;
    ``forward_only``: an evaluation program; ``packed``: a message of several classes
    moves as one byte buffer (only where no mesh axis is left to JAX's sharding).
    """

    def __init__(self, bodies: Sequence[Body], layouts: StageLayouts, lowering: Lowering,
                 axis: str, groups: Groups, outputs: LossOutputs, forward_only: bool = False,
                 packed: bool = True) -> None:
        if len(bodies) != 1:
            raise ValueError(f"the lanes program runs one shared body, got {len(bodies)}")
        if lowering.num_steps not in (2 * lowering.num_ticks - 1, 2 * lowering.num_ticks):
            raise ValueError("the lanes program needs a lanes lowering (lower_lanes)")
        (body,) = bodies
        D = lowering.num_devices
        self.axis, self.unit = axis, layouts.unit
        self.packed = packed and len(self.unit) > 1
        self.outputs = outputs
        self.branch_of = Branches(layouts, outputs, frozenset(), frozenset(), groups,
                                  direct_writes=False, forward_only=forward_only)
        self.lane_fns = (self.branch_of.make("F", body, "masked"),
                         None if forward_only else self.branch_of.make("B", body, "masked"))
        msgs = lowering.message_arrays
        offsets = lane_offsets(lowering.ticks, D, msgs)
        if offsets is None:
            raise ValueError("a lane's messages go both ways (see lanes_refusal)")
        remote, lane = _remote_lanes(lowering)
        # per lane, one permutation over every pair that ever uses it
        self.perms = tuple(
            None if off is None else
            [(int(d), (int(d) + off) % D) for d in np.unique(msgs.src[remote & (lane == k)])]
            for k, off in enumerate(offsets))
        self.lowering = lowering
        self.ports = None  # no switch (what the accelerator program reports)
        self.lane_ports: dict[int, Ports] = {}  # per lane, once a step is traced
        rows = lowering.table.actions(gated_stages(bodies))
        self.segments = lane_segments(lowering.ticks)
        T = lowering.num_ticks
        self.fields = (jax.tree.map(lambda x: _rows(x, F_LANE, T), rows),
                       jax.tree.map(lambda x: _rows(x, B_LANE, T), rows),
                       lane_tables(lowering))

    def init(self) -> tuple:
        """The carry besides gradients and loss: storage (the loss function's outputs
        too) and inbox."""
        return storage_and_inbox(self.lowering, self.unit, self.outputs)

    def _lane(self, k: int, row: Any, active: jax.Array, pbuf: list, batch: list,
              inbox: Bufs, store: Bufs, gbuf: list) -> tuple:
        """One lane on every device: its writes made where it is busy."""
        mbd = [lax.dynamic_index_in_dim(x, row.microbatch, 0, keepdims=False,
                                        allow_negative_indices=False) for x in batch]
        state = BranchState(DeferredStore(store), DeferredGrads(gbuf), self.branch_of.empty_msg(),
                            self.outputs.zero())
        wrote, added, msg, loss = self.lane_fns[k](row, pbuf, mbd, inbox, state)
        ports = Ports([Ports.signature(wrote, added)])
        self.lane_ports[k] = ports
        busy = active != 0
        store, gbuf = ports.apply(store, gbuf, ports.outputs(wrote, added, busy))
        return store, gbuf, msg, jnp.where(busy, loss, jnp.zeros_like(loss))

    def step(self, carry: tuple, gbuf: list, loss: jax.Array, fields: tuple, pbuf: list,
             batch: list, lanes: Sequence[int]) -> tuple[tuple, list, jax.Array]:
        """One tick running ``lanes`` (a segment's)."""
        *rows, at = fields
        store, inbox = carry
        sent = []
        for k in lanes:
            store, gbuf, msg, dloss = self._lane(k, rows[k], at.active[k], pbuf, batch,
                                                 inbox, store, gbuf)
            loss = loss + dloss
            sent.append((k, msg))
        for k, msg in sent:
            inbox = write_unit(inbox, msg, at.local_slot[k], self.unit)
        for k, msg in sent:
            if self.perms[k] is not None:
                got = lax.ppermute(pack(msg, self.unit, self.packed), self.axis,
                                   self.perms[k])
                inbox = write_unit(inbox, unpack(got, self.unit, self.packed),
                                   at.recv_slot[k], self.unit)
        return (store, inbox), gbuf, loss
