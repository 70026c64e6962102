"""What one step of the SPMD program runs: the branch of an (action kind, body) pair.

A branch maps ``(row, pbuf, mbd, inbox, state)`` to the new state (:class:`BranchState`:
``store, gbuf, msg, loss``): it reads its parameters from their slots, its input message from the
inbox, its stored values from the storage rows the lowering chose, runs the stage's
jaxpr for its kind, stores what it must, accumulates parameter gradients in place and
returns its output message (written to an inbox slot or outbox unit by the program).

A scanned layer stack's stacked values go straight between its scans and the buffers
(:mod:`.scan_buffers`; which ones, per body: :mod:`.direct_io`): the forward scan writes
each iteration's residuals into their storage rows, the backward scans read them there and
add each layer's parameter gradient into its gradient slot row, where the stage's jaxprs
allow it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from jax import lax

from jaxpipe.runtime.spmd.lowering.tick_table import ActionFields
from jaxpipe.runtime.spmd.lowering.types import Pool
from jaxpipe.runtime.spmd.program.bodies import Body
from jaxpipe.runtime.spmd.program.direct_io import DirectIO
from jaxpipe.runtime.spmd.program.layout import Bufs, Packing, StageLayouts
from jaxpipe.runtime.spmd.program.loss_outputs import LossOutputs
from jaxpipe.runtime.spmd.program.param_groups import Groups, of_stage, pick
from jaxpipe.runtime.spmd.program.stage_ends import Ends, Fixed
from jaxpipe.runtime.spmd.program.writes import reading
from jaxpipe.sharding.constraints import stage_as_fun

__all__ = ["BranchState", "Branches"]

class BranchState(NamedTuple):
    """What a branch reads and returns besides its row, parameters, batch and inbox."""

    store: Any  #: the buffers (residuals, hand-offs, the last stage's outputs)
    gbuf: Any  #: the gradient accumulators
    msg: Any  #: the message this step sends (empty where it sends none)
    loss: Any  #: the loss accumulated so far


#: ``branch(row, pbuf, mbd, inbox, state: BranchState) -> BranchState``
Branch = Callable[..., BranchState]


class Branches:
    """Builds the program's branches for one layout (``layouts``) and ``m`` microbatches;
    ``fused``: the stages that run every F with its B in one step (only their FB
    branch runs them); ``split``: the stages that run some backward as I then W (only
    their parts run in the I, W and IW branches: another member's hand-off may have no
    storage at all); ``groups``: the gradient groups (:mod:`.param_groups`): branches
    take and return the gradient list with them. ``outputs``: where the last stage's
    loss and other outputs go (:mod:`.loss_outputs`). ``forward_only``: F branches store
    no residuals (an evaluation program, which runs no backward). ``direct_writes``: a
    layer scan writes its residuals into storage and adds its gradients into their slots
    itself
    (:mod:`.scan_buffers`), which needs buffers updated in place (the CPU program); off,
    a branch's writes go through :mod:`.writes` only (the accelerator program records
    them)."""

    def __init__(self, layouts: StageLayouts, outputs: LossOutputs,
                 fused: frozenset[int], split: frozenset[int], groups: Groups,
                 direct_writes: bool = True, forward_only: bool = False) -> None:
        self.L = layouts
        self.groups = groups
        self.outputs = outputs
        self.fused = fused
        self.split = split
        self.direct_writes = direct_writes and not forward_only
        self.forward_only = forward_only

    # -- reading and writing the buffers ----------------------------------------------
    def unit_base(self, packing: Packing, slot: Any) -> dict:
        return {c: slot * self.L.unit[c] for c in packing.counts}

    def empty_msg(self) -> Bufs:
        return {c: c.zeros(n) for c, n in self.L.unit.items()}

    def as_msg(self, packing: Packing, leaves: Sequence) -> Bufs:
        """Leaves -> one message unit (rows beyond the packing's are zero)."""
        return packing.write(self.empty_msg(), {c: 0 for c in packing.counts}, leaves)

    def body_params(self, body: Body, pbuf: list, row: ActionFields,
                    skip: frozenset[int] = frozenset()) -> list:
        """The running stage's parameters (``None`` for those in ``skip``)."""
        out = []
        for j in range(len(body.param_classes)):
            cands = body.candidates(j)
            if j in skip:
                out.append(None)
            elif len(cands) == 1:
                out.append(self.groups.param(pbuf, cands[0]))
            elif pbuf[cands[0]] is None:  # held by group: the running stage's row
                pos, rows = self.groups.param_of(body, j)
                out.append(lax.dynamic_index_in_dim(pbuf[pos], of_stage(rows, row.stage),
                                                    0, keepdims=False,
                                                    allow_negative_indices=False))
            else:  # a shared body whose members use different slots on one device
                out.append(lax.select_n(pick(body, j, row.stage), *[pbuf[k] for k in cands]))
        return out

    def accumulate(self, body: Body, gbuf: list, row: ActionFields, ct_par: Sequence) -> list:
        """Add each differentiated parameter's cotangent into its slot (``None``: added
        already, by the scan that produced it)."""
        gbuf = gbuf.copy()
        it = iter(ct_par)
        for j, diff in enumerate(body.fn.diff_param_mask):
            if not diff:
                continue
            ct = next(it)
            if ct is None:
                continue
            cands = body.candidates(j)
            if len(cands) == 1:
                self.groups.add(gbuf, cands[0], ct)
            else:  # a row of the group, picked by the running stage
                _, rows = self.groups.of(body, j)
                self.groups.add(gbuf, cands[0], ct, of_stage(rows, row.stage))
        return gbuf

    # -- the branches -------------------------------------------------------------------
    def variants(self, kind: str, body: Body) -> dict[int, int | None]:
        """Per member stage of ``body``, the variant of the ``kind`` branch it runs when
        every branch runs for one variant (:meth:`make`): its own stage where it runs a
        prologue or epilogue around the core, else ``None`` (the core alone)."""
        ends = {st.index for st in self._end_members(kind, body)}
        return {s: s if s in ends else None for s in body.stages}

    def _end_members(self, kind: str, body: Body) -> list:
        """The members of ``body`` whose ``kind`` branch runs their prologue / epilogue
        around the core (none: every member is the core; a fused stage runs whole, in
        FB; I, W and IW run the parts of members that split some backward only)."""
        if not body.shared:
            return []
        return [st for st in body.members if st.parts is not None
                and st.index not in self.fused
                and (kind not in ("I", "W", "IW") or st.index in self.split)]

    def make(self, kind: str, body: Body, variant: int | str | None = "gated") -> Branch:
        """The branch running ``kind`` (one of ``lowering.PROGRAM_KINDS``) for ``body``.

        ``variant``: ``"gated"``, one branch for every member, each member's prologue
        and epilogue run gated by the running stage (the CPU program); ``"masked"``, the
        same with every part run unconditionally and counted only on its own stage
        (the lanes program, :mod:`.lane_ticks`); or one member's
        (:meth:`variants`): its stage, whose parts run unconditionally, or ``None``, the
        core alone (the accelerator program, whose one conditional picks the variant)."""
        if kind == "FB":
            return self._fused(body)
        L = self.L
        st = body.fn
        io = DirectIO(body, self.groups, self.direct_writes)
        keep = not self.forward_only
        if variant in ("gated", "masked"):
            ends = Ends(L, self._end_members(kind, body), self.outputs, self.groups,
                        gate=True if variant == "gated" else "mask", store_residuals=keep)
        else:
            ends = Ends(L, [x for x in self._end_members(kind, body) if x.index == variant],
                        self.outputs, self.groups, gate=False, store_residuals=keep)
        a_in, c_back = L.act_in[body.in_stage], L.ct_in[body.in_stage]
        a_out, c_on = L.act_out[body.out_stage], L.ct_out[body.out_stage]

        def inputs(name, row, pbuf, mbd):
            """``st.<name>``'s parameters (``None`` where its scan picks them itself)
            and batch leaves."""
            return (self.body_params(body, pbuf, row, io.no_pick[name]),
                    [mbd[i] for i in st.batch_ids])

        def received_ct(row, inbox):
            if st.is_last:
                return [self.outputs.seed()]
            return c_on.read(inbox, self.unit_base(c_on, row.in_slot))

        def f_branch(row, pbuf, mbd, inbox, state: BranchState) -> BranchState:
            store, gbuf, msg, loss = state
            params, batch = inputs("fwd", row, pbuf, mbd)
            core_in = a_in.read(inbox, self.unit_base(a_in, row.in_slot))
            core_in, store = ends.before_core(row, pbuf, mbd, store, core_in)
            outs, store, gbuf = io.run("fwd", row, store, gbuf, [*params, *batch, *core_in],
                                       pbuf)
            if keep:
                store = io.store_residuals(row, store, outs[io.n_out:])
            if st.is_last:
                store, loss = self.outputs.record(row.microbatch, store, loss,
                                                  outs[:io.n_out])
                return BranchState(store, gbuf, msg, loss)
            store, loss = ends.after_core(row, pbuf, mbd, store, loss, outs[:io.n_out])
            return BranchState(store, gbuf, self.as_msg(a_out, outs[:io.n_out]), loss)

        def backward(half, row, pbuf, mbd, inbox, store, gbuf):
            """The epilogue's, the core's and the prologue's ``half`` (``"bwd"`` or
            ``"bwd_i"``): the core's outputs, the store and the gradients."""
            params, batch = inputs(half, row, pbuf, mbd)
            ct, store, gbuf = ends.ct_into_core(half, row, pbuf, mbd, store, gbuf,
                                                received_ct(row, inbox))
            outs, store, gbuf = io.run(half, row, store, gbuf,
                                       [*params, *batch, *io.load(row, store, half), *ct],
                                       pbuf)
            n = sum(st.diff_param_mask) if half == "bwd" else len(st.ct_in_avals())
            ct_in = outs[n:] if half == "bwd" else outs[:n]
            store, gbuf = ends.ct_out_of_core(half, row, pbuf, mbd, store, gbuf, ct_in)
            return outs, store, gbuf

        def b_branch(row, pbuf, mbd, inbox, state: BranchState) -> BranchState:
            store, gbuf, msg, loss = state
            outs, store, gbuf = backward("bwd", row, pbuf, mbd, inbox, store, gbuf)
            n = sum(st.diff_param_mask)
            gbuf = self.accumulate(body, gbuf, row, outs[:n])
            return BranchState(store, gbuf, self.as_msg(c_back, outs[n:]), loss)

        def i_branch(row, pbuf, mbd, inbox, state: BranchState) -> BranchState:
            store, gbuf, msg, loss = state
            outs, store, gbuf = backward("bwd_i", row, pbuf, mbd, inbox, store, gbuf)
            n = len(st.ct_in_avals())
            # The hand-off has buffers of its own (ValueClass.buffer), so writing it here
            # never aliases the residual rows just read.
            store = io.packing[Pool.HANDOFF].write(store, row.bases(Pool.HANDOFF),
                                                   outs[n:])
            return BranchState(store, gbuf, self.as_msg(c_back, outs[:n]), loss)

        def weights(row, pbuf, mbd, store, gbuf, handoff):
            params, batch = inputs("bwd_w", row, pbuf, mbd)
            ct_par, store, gbuf = io.run("bwd_w", row, store, gbuf,
                                         [*params, *batch, *io.load_w(row, store), *handoff],
                                         pbuf)
            store, gbuf = ends.weights(row, pbuf, mbd, store, gbuf)
            return store, self.accumulate(body, gbuf, row, ct_par)

        def w_branch(row, pbuf, mbd, inbox, state: BranchState) -> BranchState:
            store, gbuf, msg, loss = state
            handoff = io.packing[Pool.HANDOFF].read(*reading(store, Pool.HANDOFF,
                                                             row.bases(Pool.HANDOFF)))
            store, gbuf = weights(row, pbuf, mbd, store, gbuf, handoff)
            return BranchState(store, gbuf, msg, loss)

        def iw_branch(row, pbuf, mbd, inbox, state: BranchState) -> BranchState:
            """I then its own W (fusion.joined_weights): the hand-off goes straight from
            one to the other, never to storage."""
            store, gbuf, msg, loss = state
            outs, store, gbuf = backward("bwd_i", row, pbuf, mbd, inbox, store, gbuf)
            n = len(st.ct_in_avals())
            store, gbuf = weights(row, pbuf, mbd, store, gbuf, outs[n:])
            return BranchState(store, gbuf, self.as_msg(c_back, outs[:n]), loss)

        return {"F": f_branch, "B": b_branch, "I": i_branch, "W": w_branch,
                "IW": iw_branch}[kind]

    def _fused(self, body: Body) -> Branch | None:
        """F and its own B in one step (the last stage, fusion.fused_backwards): the
        residuals go straight from the forward to the backward, never to storage. Runs
        the body's last member whole, from its own parameter slots."""
        L = self.L
        st = body.last
        if st is None:
            return None
        s = st.index
        fixed = Fixed(st, L.slots.where[s], self.groups)
        a_in, c_back = L.act_in[s], L.ct_in[s]
        n_diff = sum(st.diff_param_mask)

        def fb_branch(row, pbuf, mbd, inbox, state: BranchState) -> BranchState:
            store, gbuf, msg, loss = state
            ins = fixed.inputs(pbuf, mbd)
            outs = stage_as_fun(st.fwd)(*ins, *a_in.read(inbox, self.unit_base(a_in,
                                                                            row.in_slot)))
            n = len(st.out_avals)
            store, loss = self.outputs.record(row.microbatch, store, loss, outs[:n])
            outs = stage_as_fun(st.bwd)(*ins, *outs[n:], self.outputs.seed())
            gbuf = fixed.accumulate(gbuf, outs[:n_diff])
            return BranchState(store, gbuf, self.as_msg(c_back, outs[n_diff:]), loss)

        return fb_branch
