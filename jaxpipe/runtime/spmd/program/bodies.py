"""Shared stage bodies: stages whose functions are identical up to their parameters.

The middle blocks of a transformer cut evenly, or the chunks of an interleaved schedule,
give stages with the same jaxprs, the same parameter classes, residuals and messages;
only *which* parameter slots they read differs. Such stages form one :class:`Body`: the
program compiles one branch per action kind for it and picks the parameter slots of the
running stage from a small table indexed by the stage at run time.

A first or last stage split into parts (:mod:`jaxpipe.stages.shared_cores`) joins the body of
the stages its *core* matches: the body's branches run that member's prologue or
epilogue around the core, gated by the running stage (:mod:`.stage_ends`). Compile time then
grows with the number of distinct cores (typically one), not stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxpipe.jaxpr.identity import same_function
from jaxpipe.runtime.spmd.program.layout import SlotLayout, ValueClass
from jaxpipe.stages.stage_fn import StageFn

__all__ = ["Body", "group_bodies"]


@dataclass(frozen=True)
class Body:
    """Stages that run through one compiled branch per action kind.

    Attributes:
      index: the body's number (branch ids are built from it).
      stages: its stages, ascending.
      fn: the stage function all of them run (the first stage's).
      param_classes: the class of every parameter input of ``fn``.
      param_slot: ``[num_stages, len(param_classes)]`` slot (position in the device's
        slot list) of every parameter input of each member stage (rows of other stages
        are unused).
      members: the whole function of every member stage (a member split into parts runs
        its prologue or epilogue around ``fn``, the core, when the body is shared).
      in_stage, out_stage: members whose messages are the core's: one without a prologue
        (what the core receives and sends back) and one without an epilogue (what it
        sends on and receives back).
    """

    index: int
    stages: tuple[int, ...]
    fn: StageFn
    param_classes: tuple[ValueClass, ...]
    param_slot: np.ndarray
    members: tuple[StageFn, ...]
    in_stage: int
    out_stage: int

    @property
    def shared(self) -> bool:
        return len(self.stages) > 1

    @property
    def last(self) -> StageFn | None:
        """The member that computes the loss, if any."""
        return next((st for st in self.members if st.is_last), None)

    def candidates(self, j: int) -> tuple[int, ...]:
        """The slots parameter input ``j`` comes from, over the members (one when every
        member uses the same slot: then it is static)."""
        return tuple(sorted({int(self.param_slot[s, j]) for s in self.stages}))

    def choice(self, j: int) -> np.ndarray:
        """``[num_stages]``: for each member stage, the position of its slot for input
        ``j`` in :meth:`candidates`."""
        cands = self.candidates(j)
        return np.array([cands.index(int(x)) if int(x) in cands else 0
                         for x in self.param_slot[:, j]], np.int32)


_JAXPRS = ("fwd", "bwd", "bwd_i", "bwd_w")


def _core(st: StageFn, share: bool) -> tuple[StageFn, tuple[int, ...]]:
    """What of ``st`` a body shares, and the positions of its parameters among the
    stage's: the core of a stage split into parts, else the whole stage."""
    if share and st.parts is not None:
        return st.parts.core_fn, st.parts.param_pos[st.parts.core]
    return st, tuple(range(len(st.param_ids)))


def _signature(core: StageFn, pos: tuple[int, ...], s: int, slots: SlotLayout) -> tuple:
    """Everything but the jaxprs two stages of one body must share (cheap to compare)."""
    return (
        tuple(slots.slots[slots.where[s][q]][0] for q in pos),
        core.batch_ids, core.is_last, bool(core.in_avals), core.diff_param_mask,
        core.diff_in_mask, core.diff_out_mask, core.w_res_ids,
    )


def _same_jaxprs(a: StageFn, b: StageFn, text: dict[int, str]) -> bool:
    """The four jaxprs of ``a`` and ``b`` are equal. Stages that ``split`` traced once
    share the objects; others are compared by their printed form (printed once each) and
    what printing does not show (:func:`jaxpipe.jaxpr.identity.unprinted`)."""
    return all(same_function(getattr(a, k), getattr(b, k), text) for k in _JAXPRS)


def group_bodies(stages: Sequence[StageFn], slots: SlotLayout, share: bool | str = True
                 ) -> tuple[list[Body], list[int]]:
    """Group ``stages`` into bodies by their cores; returns ``(bodies, body of every
    stage)``. With ``share=False`` every stage is its own body; with ``"devices"`` a body
    holds only stages that read the same parameter slots (one chunk of an interleaved
    schedule over the devices), so no branch picks its parameters at run time."""
    groups: list[list[int]] = []
    sigs: list[tuple] = []
    text: dict[int, str] = {}  # id(jaxpr) -> printed, while the stages keep them alive
    share_any = share is not False
    cores = [_core(st, share_any) for st in stages]
    for st, (core, pos) in zip(stages, cores, strict=True):
        sig = _signature(core, pos, st.index, slots)
        if share == "devices":
            sig += (tuple(slots.where[st.index][q] for q in pos),)
        for g, gsig in zip(groups, sigs, strict=True):
            if share_any and sig == gsig and _same_jaxprs(cores[g[0]][0], core, text):
                g.append(st.index)
                break
        else:
            groups.append([st.index])
            sigs.append(sig)
    S = len(stages)
    bodies, body_of = [], [0] * S
    for b, members in enumerate(groups):
        whole = tuple(stages[s] for s in members)
        # a stage split into parts runs them in a shared body; alone, it runs whole
        run = {s: cores[s] if len(members) > 1 else _core(stages[s], False) for s in members}
        fn = run[members[0]][0]
        table = np.zeros((S, len(run[members[0]][1])), np.int32)
        for s in members:
            table[s] = [slots.where[s][q] for q in run[s][1]]
            body_of[s] = b
        # members whose core's messages are their own: no prologue / epilogue around it
        plain_in, plain_out = (
            next(st.index for st in whole
                 if run[st.index][0] is st or getattr(st.parts, end) is None)
            for end in ("prologue", "epilogue"))
        bodies.append(Body(b, tuple(members), fn,
                           tuple(slots.slots[k][0] for k in table[members[0]]),
                           table, whole, plain_in, plain_out))
    return bodies, body_of
