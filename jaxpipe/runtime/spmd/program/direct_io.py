"""Which of a body's stored values and gradients go straight between its layer scans and
the buffers (:mod:`.scan_buffers`), and the reads, writes and evaluations that follow.

A branch (:mod:`.branches`) builds one per body and runs its stage's jaxprs through it; it
lives apart because it needs only the body, the gradient groups and whether writes are
direct (in place), not the branches' other choices.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jaxpipe.runtime.spmd.lowering.tick_table import ActionFields
from jaxpipe.runtime.spmd.lowering.types import Pool
from jaxpipe.runtime.spmd.program import scan_buffers as scanio
from jaxpipe.runtime.spmd.program.bodies import Body
from jaxpipe.runtime.spmd.program.layout import Bufs, Packing, ValueClass
from jaxpipe.runtime.spmd.program.param_groups import Groups, of_stage, pick
from jaxpipe.runtime.spmd.program.writes import opaque, reading
from jaxpipe.sharding.constraints import stage_as_fun

__all__ = ["DirectIO"]



class DirectIO:
    """Which of a body's stored values and gradients go straight between its scans and the
    buffers (:mod:`.scan_buffers`), and the reads, writes and evaluations that follow from it.

    Residual ``i`` lives at leaf ``k`` of its pool's packing (``leaf_of``). Per jaxpr
    (``"fwd"``, ``"bwd"``, ``"bwd_i"``, ``"bwd_w"``): ``sunk`` the residual ids its scans
    write (fwd), ``sourced`` the residual ids its scans read (the backwards), ``grads``
    the differentiated-parameter positions whose gradient its scans add into the slot.
    """

    def __init__(self, body: Body, groups: Groups, direct_writes: bool) -> None:
        self.body, self.groups = body, groups
        in_place = direct_writes
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
        if len(cands) == 1 and cands[0] not in self.groups.where:
            return cands[0], None
        if len(cands) == 1:
            return self.groups.where[cands[0]]
        pos, rows = self.groups.of(self.body, j)
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
                pos, rows = self.groups.param_of(self.body, j)
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
