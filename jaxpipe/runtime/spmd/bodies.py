"""Shared stage bodies: stages whose functions are identical up to their parameters.

The middle blocks of a transformer cut evenly, or the chunks of an interleaved schedule,
give stages with the same jaxprs, the same parameter classes, residuals and messages;
only *which* parameter slots they read differs. Such stages form one :class:`Body`: the
program compiles one branch per action kind for it and picks the parameter slots of the
running stage from a small table indexed by the stage at run time. Compile time then
grows with the number of distinct bodies (typically first, middle, last), not stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jaxpipe.runtime.spmd.layout import SlotLayout, ValueClass
from jaxpipe.schedule import Schedule
from jaxpipe.stages import StageFn
from jaxpipe.structure import unprinted

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
      send_offset, recv_offset: device offsets of the forward message it sends / the
        cotangent it sends back (``None``: none; ``0``: to the same device).
    """

    index: int
    stages: tuple[int, ...]
    fn: StageFn
    param_classes: tuple[ValueClass, ...]
    param_slot: np.ndarray
    send_offset: int | None
    back_offset: int | None

    @property
    def shared(self) -> bool:
        return len(self.stages) > 1

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


def _same_consts(a: list, b: list) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if x is y:
            continue
        xa, ya = np.asarray(x), np.asarray(y)
        if xa.shape != ya.shape or xa.dtype != ya.dtype or not np.array_equal(xa, ya):
            return False
    return True


_JAXPRS = ("fwd", "bwd", "bwd_i", "bwd_w")


def _signature(st: StageFn, slots: SlotLayout, sched: Schedule) -> tuple:
    """Everything but the jaxprs two stages of one body must share (cheap to compare)."""
    D = sched.num_devices
    here = sched.placement(st.index)
    send = None if st.is_last else (sched.placement(st.index + 1) - here) % D
    back = None if st.index == 0 else (sched.placement(st.index - 1) - here) % D
    return (
        tuple(slots.slots[k][0] for k in slots.where[st.index]),
        st.batch_ids, st.is_last, st.index == 0, st.diff_param_mask, st.diff_in_mask,
        st.diff_out_mask, st.w_res_ids, send, back,
    )


def _same_jaxprs(a: StageFn, b: StageFn, text: dict[int, str]) -> bool:
    """The four jaxprs of ``a`` and ``b`` are equal. Stages that ``split`` traced once
    share the objects; others are compared by their printed form (printed once each) and
    what printing does not show (:func:`jaxpipe.structure.unprinted`)."""
    for k in _JAXPRS:
        x, y = getattr(a, k), getattr(b, k)
        if x is y:
            continue
        for f in (x, y):
            if id(f) not in text:
                text[id(f)] = str(f.jaxpr)
        if (text[id(x)] != text[id(y)] or unprinted(x) != unprinted(y)
                or not _same_consts(list(x.consts), list(y.consts))):
            return False
    return True


def group_bodies(stages: Sequence[StageFn], slots: SlotLayout, schedule: Schedule,
                 share: bool = True) -> tuple[list[Body], list[int]]:
    """Group ``stages`` into bodies; returns ``(bodies, body of every stage)``.

    With ``share=False`` every stage is its own body.
    """
    groups: list[list[int]] = []
    sigs: list[tuple] = []
    text: dict[int, str] = {}  # id(jaxpr) -> printed, while the stages keep them alive
    for st in stages:
        sig = _signature(st, slots, schedule) if share else None
        for g, gsig in zip(groups, sigs, strict=True):
            if share and sig == gsig and _same_jaxprs(stages[g[0]], st, text):
                g.append(st.index)
                break
        else:
            groups.append([st.index])
            sigs.append(sig)
    S = len(stages)
    bodies, body_of = [], [0] * S
    for b, members in enumerate(groups):
        rep = stages[members[0]]
        n = len(rep.param_ids)
        table = np.zeros((S, n), np.int32)
        for s in members:
            table[s] = slots.where[s]
            body_of[s] = b
        sig = _signature(rep, slots, schedule)
        bodies.append(Body(b, tuple(members), rep,
                           tuple(slots.slots[k][0] for k in slots.where[rep.index]),
                           table, sig[-2], sig[-1]))
    return bodies, body_of
