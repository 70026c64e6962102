"""What one step of the SPMD program runs: the branch of an (action kind, body) pair.

A branch maps ``(row, pbuf, mbd, inbox, state)`` to the new state (:class:`BranchState`:
``store, gbuf, msg, loss``): it reads its parameters from their slots, its input message from the
inbox, its stored values from the storage rows the lowering chose, runs the stage's
jaxpr for its kind, stores what it must, accumulates parameter gradients in place and
returns its output message (written to an inbox slot or outbox unit by the program).

A scanned layer stack's stacked values go straight between its scans and the buffers
(:mod:`.scan_buffers`): the forward scan writes each iteration's residuals into their storage
rows, the backward scans read them there and add each layer's parameter gradient into its
gradient slot row, where the stage's jaxprs allow it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
from jax import lax

from jaxpipe.runtime.spmd.lowering.types import ActionFields, Pool
from jaxpipe.runtime.spmd.program import scan_buffers as scanio
from jaxpipe.runtime.spmd.program.bodies import Body
from jaxpipe.runtime.spmd.program.layout import Packing, StageLayouts, ValueClass
from jaxpipe.runtime.spmd.program.loss_outputs import LossOutputs
from jaxpipe.runtime.spmd.program.param_groups import Groups, of_stage, pick
from jaxpipe.runtime.spmd.program.stage_ends import Ends, Fixed
from jaxpipe.runtime.spmd.program.writes import opaque, reading
from jaxpipe.sharding.constraints import stage_as_fun

__all__ = ["BranchState", "Branches"]

Bufs = dict[ValueClass, jax.Array]
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
        io = _DirectIO(self, body)
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


class _DirectIO:
    """Which of a body's stored values and gradients go straight between its scans and the
    buffers (:mod:`.scan_buffers`), and the reads, writes and evaluations that follow from it.

    Residual ``i`` lives at leaf ``k`` of its pool's packing (``leaf_of``). Per jaxpr
    (``"fwd"``, ``"bwd"``, ``"bwd_i"``, ``"bwd_w"``): ``sunk`` the residual ids its scans
    write (fwd), ``sourced`` the residual ids its scans read (the backwards), ``grads``
    the differentiated-parameter positions whose gradient its scans add into the slot.
    """

    def __init__(self, branches: Branches, body: Body) -> None:
        self.br, self.body = branches, body
        in_place = branches.direct_writes
        st = self.st = body.fn
        self.pools = ((Pool.RESIDUAL_A, st.i_only_residual_ids),
                      (Pool.RESIDUAL_B, st.w_res_ids))
        # The packings of the body's function: a member split into parts keeps the core's
        # values first, in these rows (jaxpipe.stages.shared_cores.compose).
        self.packing = {pool: Packing([st.residual_avals[i] for i in ids])
                        for pool, ids in self.pools}
        self.packing[Pool.HANDOFF] = Packing(st.w_residual_avals, buffer="handoff")
        self.leaf_of = {i: (pool, k) for pool, ids in self.pools for k, i in enumerate(ids)}
        self.n_out = len(st.out_avals)
        n_pb = self.n_pb = len(st.param_ids) + len(st.batch_ids)
        n_res = len(st.residual_avals)
        # the position of each residual id among a jaxpr's residual inputs
        self.res_pos = {"bwd": {i: n_pb + i for i in range(n_res)},
                        "bwd_i": {i: n_pb + i for i in range(n_res)},
                        "bwd_w": {i: n_pb + k for k, i in enumerate(st.w_res_ids)}}
        self.sunk = frozenset(i - self.n_out for i in scanio.direct_outputs(
            st.fwd, range(self.n_out, self.n_out + n_res))) if in_place else frozenset()
        self.sourced = {"fwd": frozenset()}
        for name, pos in self.res_pos.items():
            direct = scanio.direct_inputs(getattr(st, name), list(pos.values()))
            self.sourced[name] = frozenset(i for i, q in pos.items() if q in direct)
        self.diff = [j for j, d in enumerate(st.diff_param_mask) if d]  # q -> param
        every = range(len(self.diff))
        self.grads = {"fwd": frozenset(), "bwd_i": frozenset(),
                      "bwd": frozenset(scanio.direct_outputs(st.bwd, every)
                                       if in_place else ()),
                      "bwd_w": frozenset(scanio.direct_outputs(st.bwd_w, every)
                                         if in_place else ())}
        # parameters with several candidate slots that a scan reads layer by layer, and
        # those a jaxpr does not read: either way the branch picks no whole slot for them
        multi = [j for j in range(len(st.param_ids)) if len(body.candidates(j)) > 1]
        names = ("fwd", "bwd", "bwd_i", "bwd_w")
        self.param_src = {n: scanio.direct_inputs(getattr(st, n), multi) for n in names}
        self.no_pick = {n: self.param_src[n] | scanio.unused_inputs(getattr(st, n), multi)
                        for n in names}

    def _skip(self, ids: Sequence[int], direct: frozenset[int]) -> frozenset[int]:
        return frozenset(k for k, i in enumerate(ids) if i in direct)

    def _location(self, row: ActionFields, i: int) -> tuple[ValueClass, Any, int]:
        pool, k = self.leaf_of[i]
        return self.packing[pool].location(k, row.bases(pool))

    def load(self, row: ActionFields, store: Bufs, name: str) -> list:
        """Every residual, read from storage; ``None`` for those ``name``'s scans read."""
        out: list = [None] * len(self.st.residual_avals)
        for pool, ids in self.pools:
            vals = self.packing[pool].read(*reading(store, pool, row.bases(pool)),
                                           self._skip(ids, self.sourced[name]))
            for i, x in zip(ids, vals, strict=True):
                out[i] = x
        return out

    def load_w(self, row: ActionFields, store: Bufs) -> list:
        """The residuals W reads (``st.w_res_ids``); ``None`` for those its scans read."""
        return self.packing[Pool.RESIDUAL_B].read(
            *reading(store, Pool.RESIDUAL_B, row.bases(Pool.RESIDUAL_B)),
            self._skip(self.st.w_res_ids, self.sourced["bwd_w"]))

    def store_residuals(self, row: ActionFields, store: Bufs, stored: Sequence) -> Bufs:
        """Write the residuals the forward's scans did not write already."""
        for pool, ids in self.pools:
            store = self.packing[pool].write(store, row.bases(pool),
                                             [stored[i] for i in ids], self._skip(ids, self.sunk))
        return store

    def _grad_row(self, j: int, row: ActionFields) -> tuple[int, Any]:
        """Where parameter ``j``'s gradient goes: ``(slot, None)``, or ``(position of its
        group in the gradient list, row)``."""
        cands = self.body.candidates(j)
        if len(cands) == 1 and cands[0] not in self.br.groups.where:
            return cands[0], None
        if len(cands) == 1:
            return self.br.groups.where[cands[0]]
        pos, rows = self.br.groups.of(self.body, j)
        return pos, of_stage(rows, row.stage)

    def run(self, name: str, row: ActionFields, store: Bufs, gbuf: list, args: list,
            pbuf: list | None = None) -> tuple[list, Bufs, list]:
        """Evaluate ``st.<name>`` on ``args``; its scans write, read and add the values
        chosen above. Returns its outputs (``None`` where a scan wrote), store and gbuf."""
        closed = getattr(self.st, name)
        sunk = self.sunk if name == "fwd" else frozenset()
        sourced, grads = self.sourced[name], self.grads[name]
        if not (sunk or sourced or grads or self.param_src[name]):
            return stage_as_fun(closed)(*args), store, gbuf
        bufs: dict = {}
        sinks: dict = {}
        sources: dict = {}
        for i in sunk | sourced:
            pool, k = self.leaf_of[i]
            # a scan writes the store itself; it reads the store or the step's window
            src, bases = ((store, row.bases(pool)) if i in sunk
                          else reading(store, pool, row.bases(pool)))
            c, base, offset = self.packing[pool].location(k, bases)
            offset = opaque(offset)  # alike rows share one compiled write / read
            if i in sunk:
                bufs.setdefault(c, scanio.flatten(store[c]))
                sinks[self.n_out + i] = (c, scanio.row_sink(c.shape[0], base, offset))
            else:
                bufs.setdefault((pool, c), scanio.flatten(src[c]))
                sources[self.res_pos[name][i]] = ((pool, c), scanio.row_source(
                    c.shape[0], base, offset, c.shape[1:]))
        targets = {}
        for q in grads:  # into a slot [layers, ...], or a group's row [rows, layers, ...]
            k, base = self._grad_row(self.diff[q], row)
            flat = base is not None
            bufs[("grad", k)] = scanio.flatten(gbuf[k]) if flat else gbuf[k]
            sinks[q] = (("grad", k), scanio.row_add_sink(gbuf[k].shape[int(flat)],
                                                          base if flat else 0))
            targets[k] = gbuf[k].shape
        for j in self.param_src[name]:  # a parameter's layer, of the running stage's
            cands = self.body.candidates(j)
            if pbuf[cands[0]] is None:  # held by group: its row, read as a stored value
                pos, rows = self.br.groups.param_of(self.body, j)
                shape = self.body.param_classes[j].shape
                bufs[("param", j)] = scanio.flatten(pbuf[pos])
                sources[j] = (("param", j), scanio.row_source(
                    shape[0], of_stage(rows, row.stage), 0, shape[1:]))
            else:
                bufs[("param", j)] = tuple(pbuf[k] for k in cands)
                sources[j] = (("param", j), scanio.pick_source(pick(self.body, j, row.stage)))
        outs, bufs = scanio.evaluate(closed, args, bufs, sinks=sinks, sources=sources)
        written = {self._location(row, i)[0] for i in sunk}
        if written:  # (only where writes are direct: the store is then a dict)
            store = {c: bufs[c].reshape(x.shape) if c in written else x
                     for c, x in store.items()}
        if targets:
            gbuf = list(gbuf)
            for k, shape in targets.items():
                gbuf[k] = bufs[("grad", k)].reshape(shape)
        return outs, store, gbuf
