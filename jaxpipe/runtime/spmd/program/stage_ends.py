"""The prologue and epilogue around a shared core (:mod:`jaxpipe.stages.shared_cores`).

The first stage of a transformer runs the embedding before its blocks and the last runs
the head and loss after its blocks; when those blocks compute the middle stages'
function, all of them form one body and the program compiles the blocks once. A step of
such a body runs, gated by the running stage, the member's prologue before the core and
its epilogue after it (in a backward: the epilogue's backward first, the prologue's
last). The parts' parameters sit in fixed slots of their stage; their residuals and
hand-off values are the stage's, after the core's (:func:`jaxpipe.stages.shared_cores.compose`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp

from jaxpipe.runtime.spmd.lowering.tick_table import ActionFields
from jaxpipe.runtime.spmd.lowering.types import Pool
from jaxpipe.runtime.spmd.program.bodies import Body
from jaxpipe.runtime.spmd.program.gated import gated
from jaxpipe.runtime.spmd.program.layout import StageLayouts
from jaxpipe.runtime.spmd.program.loss_outputs import LossOutputs
from jaxpipe.runtime.spmd.program.param_groups import Groups
from jaxpipe.runtime.spmd.program.writes import DeferredGrads, DeferredStore, reading
from jaxpipe.sharding.constraints import stage_as_fun
from jaxpipe.stages.stage_fn import StageFn

__all__ = ["Ends", "Fixed", "gated_stages"]


def gated_stages(bodies: Sequence[Body]) -> list[int]:
    """The stages whose prologue or epilogue :class:`Ends` runs gated (members of a
    shared body split into parts): the program gives each a trip count in its table."""
    return sorted({st.index for b in bodies if b.shared for st in b.members
                   if st.parts is not None})


class Fixed:
    """A function run from fixed parameter slots of one stage (a prologue or epilogue;
    the fused last stage): its inputs, and its gradients added into those slots."""

    def __init__(self, fn: StageFn, slots: Sequence[int], groups: Groups) -> None:
        self.fn = fn
        self.slots = list(slots)
        self.groups = groups

    def inputs(self, pbuf: list, mbd: list) -> list:
        return ([self.groups.param(pbuf, k) for k in self.slots]
                + [mbd[i] for i in self.fn.batch_ids])

    def accumulate(self, gbuf: list, cts: Sequence) -> list:
        """``cts``: the cotangents of the differentiated parameters, in order."""
        gbuf = gbuf.copy()
        diff = [k for k, d in zip(self.slots, self.fn.diff_param_mask, strict=True) if d]
        for k, ct in zip(diff, cts, strict=True):
            self.groups.add(gbuf, k, ct)
        return gbuf


class _Part(Fixed):
    """One prologue or epilogue: where its parameters, residuals and hand-off live."""

    def __init__(self, L: StageLayouts, whole: StageFn, k: int, groups: Groups) -> None:
        parts = whole.parts
        self.stage = s = whole.index
        super().__init__(parts.parts[k], [L.slots.where[s][q] for q in parts.param_pos[k]],
                         groups)
        # Where the part's values live among the stage's: per pool, its packing, this
        # part's value i -> its position there, and every other position (skipped).
        def entry(pool, order, ids):
            pos = {r: q for q, r in enumerate(order)}
            mine = {i: pos[r] for i, r in enumerate(ids) if r in pos}
            return pool, L.pools[pool][s], mine, frozenset(range(len(order))) - set(mine.values())

        res = parts.res_ids[k]
        self.residuals = [entry(Pool.RESIDUAL_A, whole.i_only_residual_ids, res),
                          entry(Pool.RESIDUAL_B, whole.w_res_ids, res)]
        self.hand = [entry(Pool.HANDOFF, range(len(whole.w_residual_avals)), parts.w_ids[k])]

    @staticmethod
    def _read(row: ActionFields, store: dict, entries: list) -> dict:
        out: dict = {}
        for pool, packing, mine, others in entries:
            vals = packing.read(*reading(store, pool, row.bases(pool)), others)
            out.update((i, vals[q]) for i, q in mine.items())
        return out

    @staticmethod
    def _write(row: ActionFields, store: dict, entries: list, values: Sequence) -> dict:
        for pool, packing, mine, others in entries:
            leaves: list = [None] * len(packing)
            for i, q in mine.items():
                leaves[q] = values[i]
            store = packing.write(store, row.bases(pool), leaves, others)
        return store

    def load(self, row: ActionFields, store: dict, ids: Sequence[int]) -> list:
        """Residuals ``ids`` of this part (its own numbering), from storage."""
        out = self._read(row, store, self.residuals)
        return [out[i] for i in ids]

    def save(self, row: ActionFields, store: dict, residuals: Sequence) -> dict:
        return self._write(row, store, self.residuals, residuals)

    def load_hand(self, row: ActionFields, store: dict) -> list:
        out = self._read(row, store, self.hand)
        return [out[i] for i in range(len(out))]

    def save_hand(self, row: ActionFields, store: dict, values: Sequence) -> dict:
        return self._write(row, store, self.hand, values)


def _masked(pred: Any, fn: Callable, part: _Part, state: tuple, *args: Any) -> tuple:
    """``fn(part, state, *args)`` run unconditionally, counting where ``pred``: deferred
    writes recorded under it, values (lists of arrays, the loss) selected by it."""
    def enter(x):
        return x.with_mask(pred if x.mask is None else x.mask & pred)

    new = fn(part, tuple(enter(x) if isinstance(x, DeferredStore | DeferredGrads) else x
                         for x in state), *args)
    out = []
    for old, x in zip(state, new, strict=True):
        if isinstance(old, DeferredStore | DeferredGrads):
            out.append(x.with_mask(old.mask))
        elif isinstance(old, list):
            out.append([jnp.where(pred, a, b) for a, b in zip(x, old, strict=True)])
        else:
            out.append(jnp.where(pred, x, old))
    return tuple(out)


class Ends:
    """The prologues and epilogues of a body's members (none: every step is the core).

    Each method runs every member's part gated by ``row.at_stage`` and returns what the
    core reads next (or the updated buffers). With ``gate=False`` (one member, in a
    branch that runs for that member alone: the accelerator program) the parts run
    unconditionally. With ``gate="mask"`` every part runs on every step, and what it
    returns and writes counts only where ``row.at_stage`` says it is its stage's (the
    lanes program, :mod:`.lane_ticks`: nothing runs under a conditional, and a device
    waits for the slowest anyway; the writes must be deferred ones). ``outputs``: where
    the epilogue's loss and other outputs go;
    ``store_residuals=False``: a forward-only program, which keeps none.
    """

    def __init__(self, L: StageLayouts, members: Sequence[StageFn], outputs: LossOutputs,
                 groups: Groups, gate: bool | str = True, store_residuals: bool = True) -> None:
        self.pre: list[_Part] = []
        self.post: list[_Part] = []
        self.outputs = outputs
        self.gate = gate
        self.store_residuals = store_residuals
        for whole in members:
            parts = whole.parts
            if parts is None:
                continue
            if parts.prologue is not None:
                self.pre.append(_Part(L, whole, parts.prologue, groups))
            if parts.epilogue is not None:
                self.post.append(_Part(L, whole, parts.epilogue, groups))

    def _save(self, part: _Part, row: ActionFields, store: Any, residuals: Sequence) -> Any:
        # a forward-only program keeps no residuals (XLA drops what computes them)
        return part.save(row, store, residuals) if self.store_residuals else store

    def _each(self, parts: list[_Part], row: ActionFields, fn: Callable, state: Any,
              *args: Any) -> Any:
        for part in parts:
            if not self.gate:  # the branch runs for this member only
                state = fn(part, state, *args)
                continue
            if self.gate == "mask":
                state = _masked(row.at_stage[part.stage] != 0, fn, part, state, *args)
                continue
            state = gated(row.at_stage[part.stage],
                          lambda st, *a, part=part: fn(part, st, *a), state, *args)
        return state

    # -- forward ------------------------------------------------------------------------
    def before_core(self, row, pbuf, mbd, store, core_in: list) -> tuple[list, dict]:
        """The prologue's forward: the core's input and the prologue's residuals."""
        def run(part, state, row, pbuf, mbd):
            _, store = state
            outs = stage_as_fun(part.fn.fwd)(*part.inputs(pbuf, mbd))
            n = len(part.fn.out_avals)
            return list(outs[:n]), self._save(part, row, store, outs[n:])

        return self._each(self.pre, row, run, (list(core_in), store), row, pbuf, mbd)

    def after_core(self, row, pbuf, mbd, store, loss, core_out: list) -> tuple[dict, Any]:
        """The epilogue's forward: the loss (and the loss function's other outputs,
        :mod:`.loss_outputs`) and the epilogue's residuals."""
        def run(part, state, row, pbuf, mbd, core_out):
            store, loss = state
            outs = stage_as_fun(part.fn.fwd)(*part.inputs(pbuf, mbd), *core_out)
            n = len(part.fn.out_avals)
            return self.outputs.record(row.microbatch, self._save(part, row, store, outs[n:]),
                                       loss, outs[:n])

        return self._each(self.post, row, run, (store, loss), row, pbuf, mbd, list(core_out))

    # -- backward (whole, or its input half) ----------------------------------------------
    def ct_into_core(self, half: str, row, pbuf, mbd, store, gbuf, ct: list
                     ) -> tuple[list, dict, list]:
        """The epilogue's backward (``half``: ``"bwd"`` or ``"bwd_i"``): the cotangent of
        the core's output; its parameter gradients (whole) or hand-off (input half)."""
        def run(part, state, row, pbuf, mbd):
            _, store, gbuf = state
            fn = part.fn
            seed = [self.outputs.seed()]
            outs = stage_as_fun(getattr(fn, half))(
                *part.inputs(pbuf, mbd), *part.load(row, store, range(len(fn.residual_avals))),
                *seed)
            if half == "bwd":
                n = sum(fn.diff_param_mask)
                return list(outs[n:]), store, part.accumulate(gbuf, outs[:n])
            n = len(fn.ct_in_avals())
            return list(outs[:n]), part.save_hand(row, store, outs[n:]), gbuf

        return self._each(self.post, row, run, (list(ct), store, gbuf), row, pbuf, mbd)

    def ct_out_of_core(self, half: str, row, pbuf, mbd, store, gbuf, ct: list
                       ) -> tuple[dict, list]:
        """The prologue's backward of the core's input cotangent ``ct`` (it has no input
        of its own to send a cotangent to)."""
        def run(part, state, row, pbuf, mbd, ct):
            store, gbuf = state
            fn = part.fn
            outs = stage_as_fun(getattr(fn, half))(
                *part.inputs(pbuf, mbd), *part.load(row, store, range(len(fn.residual_avals))),
                *ct)
            if half == "bwd":
                return store, part.accumulate(gbuf, outs[:sum(fn.diff_param_mask)])
            return part.save_hand(row, store, outs[len(fn.ct_in_avals()):]), gbuf

        return self._each(self.pre, row, run, (store, gbuf), row, pbuf, mbd, list(ct))

    # -- weight half --------------------------------------------------------------------
    def weights(self, row, pbuf, mbd, store, gbuf) -> tuple[dict, list]:
        """The weight-gradient halves of the prologue and epilogue. (The storage rides in
        the loops' carry, unchanged: passed as a loop input, XLA would copy it.)"""
        def run(part, state, row, pbuf, mbd):
            store, gbuf = state
            fn = part.fn
            outs = stage_as_fun(fn.bwd_w)(*part.inputs(pbuf, mbd),
                                          *part.load(row, store, fn.w_res_ids),
                                          *part.load_hand(row, store))
            return store, part.accumulate(gbuf, outs)

        state = (store, gbuf)
        for parts in (self.pre, self.post):
            state = self._each(parts, row, run, state, row, pbuf, mbd)
        return state
