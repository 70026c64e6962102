"""Schedule validation: structural rules, data dependencies, and deadlock detection.

Two layers of checks, both raising :class:`ScheduleError` with a message that names
the device, the action (``"2F0"`` form) and the rule:

1. *Structure* (:func:`check_structure`): placement in range, indices in range,
   every action on the device its stage is placed on, exactly one ``F`` and one
   backward (``B``, or ``I`` + ``W``) per (stage, microbatch), no duplicates, no
   backward before its forward and no ``W`` before its ``I`` in device order.
2. *Execution* (:func:`.graph.build_graph`): every device runs its list strictly in order and
   an action waits for its :func:`dependencies`. If at some point no device can
   make progress, the schedule deadlocks across devices. Otherwise the schedule is
   compiled to a :class:`ScheduleGraph` (integers, an execution order), which is the
   simulator's engine (``jaxpipe.schedule.simulate``), so "validates" and "simulates
   without deadlock" are the same statement.
"""

from __future__ import annotations

import numbers
from collections.abc import Collection
from typing import TYPE_CHECKING

from .action import Action, ScheduleError

if TYPE_CHECKING:
    from .protocol import ScheduleLike

#: A (stage, microbatch) pair.
Unit = tuple[int, int]

#: One executed action: (action, start, end).
Slot = tuple[Action, numbers.Real, numbers.Real]


def _dependencies(action: Action, num_stages: int, split: Collection[Unit]) -> list[Action]:
    """Dependencies of ``action`` given which (stage, mb) pairs use the I/W split."""
    s, mb = action.stage, action.microbatch
    if action.kind == "F":
        return [Action("F", s - 1, mb)] if s > 0 else []
    if action.kind == "W":
        return [Action("I", s, mb)]
    # B or I: own forward, and the input-cotangent of the next stage.
    deps = [Action("F", s, mb)]
    if s < num_stages - 1:
        deps.append(Action("I" if (s + 1, mb) in split else "B", s + 1, mb))
    return deps


def dependencies(action: Action, schedule: ScheduleLike) -> list[Action]:
    """The actions that must *finish* before ``action`` can start.

    - ``F(s, mb)`` needs ``F(s-1, mb)`` (for ``s > 0``): the stage input.
    - ``B(s, mb)`` / ``I(s, mb)`` need ``F(s, mb)`` (residuals) and, unless ``s`` is
      the last stage, the input-cotangent producer of ``(s+1, mb)``: its ``B``, or
      its ``I`` if the schedule splits that backward.
    - ``W(s, mb)`` needs ``I(s, mb)``.

    Communication is free in this model: a dependency on another device counts as
    met the moment it finishes.
    """

    s, mb = action.stage, action.microbatch
    next_is_split = (
        action.kind in ("B", "I")
        and s < schedule.num_stages - 1
        and schedule.uses_split_backward(s + 1, mb)
    )
    return _dependencies(action, schedule.num_stages, {(s + 1, mb)} if next_is_split else ())


def _fail(device: int, action: Action | str, rule: str, detail: str) -> ScheduleError:
    return ScheduleError(f"device {device}: action {action}: {detail} (rule: {rule})")


def check_placement(schedule: ScheduleLike) -> list[int]:
    """Return ``placement(stage)`` for every stage, checking each is a valid device."""
    placement = []
    for stage in range(schedule.num_stages):
        device = schedule.placement(stage)
        if isinstance(device, bool) or not isinstance(device, numbers.Integral):
            raise ScheduleError(
                f"placement({stage}) returned {device!r}, not a device index "
                f"(rule: placement must map every stage to a device 0..{schedule.num_devices - 1})"
            )
        device = int(device)
        if not 0 <= device < schedule.num_devices:
            raise ScheduleError(
                f"placement({stage}) = device {device}, which is out of range: "
                f"there are {schedule.num_devices} devices (0..{schedule.num_devices - 1}) "
                f"(rule: placement out of range)"
            )
        placement.append(device)
    return placement


def check_structure(schedule: ScheduleLike) -> tuple[dict[int, list[Action]], frozenset[Unit]]:
    """Check every rule that does not need execution.

    Returns ``(device -> action list, set of (stage, mb) that use the I/W split)``.
    """
    p, m, n = schedule.num_devices, schedule.num_microbatches, schedule.num_stages
    placement = check_placement(schedule)
    actions = schedule.actions()

    lists: dict[int, list[Action]] = {}
    # (kind, stage, mb) -> (device, position): tuple keys hash far faster than Actions
    where: dict[tuple[str, int, int], tuple[int, int]] = {}
    for device in range(p):
        acts = actions[device]
        for pos, a in enumerate(acts):
            if not isinstance(a, Action):
                raise _fail(
                    device, repr(a), "actions must be Action objects",
                    f"device_actions({device})[{pos}] is a {type(a).__name__}; "
                    f"build it with Action(kind, stage, microbatch) or Action.parse",
                )
            if a.stage >= n:
                raise _fail(
                    device, a, "stage index out of range",
                    f"stage {a.stage} does not exist (stages are 0..{n - 1})",
                )
            if a.microbatch >= m:
                raise _fail(
                    device, a, "microbatch index out of range",
                    f"microbatch {a.microbatch} does not exist (microbatches are 0..{m - 1})",
                )
            if placement[a.stage] != device:
                raise _fail(
                    device, a, "stage not placed on this device",
                    f"stage {a.stage} is placed on device {placement[a.stage]}, "
                    f"not on device {device}",
                )
            key = (a.kind, a.stage, a.microbatch)
            if key in where:
                raise _fail(
                    device, a, "duplicate action",
                    f"appears twice (positions {where[key][1]} and {pos})",
                )
            where[key] = (device, pos)
        lists[device] = acts

    split: set[Unit] = set()
    for stage in range(n):
        device = placement[stage]
        for mb in range(m):
            f, b, i, w = (where.get((k, stage, mb)) for k in "FBIW")

            def act(kind: str, stage: int = stage, mb: int = mb) -> Action:
                return Action(kind, stage, mb)

            if f is None:
                raise _fail(device, act("F"), "missing F", "this forward never runs")
            if schedule.forward_only:
                back = next((k for k, x in zip("BIW", (b, i, w), strict=True)
                             if x is not None), None)
                if back is not None:
                    raise _fail(device, act(back), "backward in a forward-only schedule",
                                "a forward-only schedule lists F actions only")
                continue
            if b is not None and (i is not None or w is not None):
                other = act("I") if i is not None else act("W")
                raise _fail(
                    device, other, "B mixed with I/W",
                    f"stage {stage} microbatch {mb} already has a full backward {act('B')}; "
                    f"use either B or the I+W pair",
                )
            if i is not None and w is None:
                raise _fail(device, act("I"), "I without W",
                            f"{act('I')} has no matching {act('W')}")
            if w is not None and i is None:
                raise _fail(device, act("W"), "W without I",
                            f"{act('W')} has no matching {act('I')}")
            if b is None and i is None:
                raise _fail(
                    device, act("B"), "missing backward",
                    f"stage {stage} microbatch {mb} has no backward: "
                    f"expected {act('B')}, or {act('I')} and {act('W')}",
                )
            first_back, first_kind = (b, "B") if b is not None else (i, "I")
            if first_back[1] < f[1]:
                raise _fail(
                    device, act(first_kind), "backward before forward",
                    f"runs at position {first_back[1]}, before its forward {act('F')} "
                    f"at position {f[1]}",
                )
            if i is not None:
                if w[1] < i[1]:
                    raise _fail(
                        device, act("W"), "W before its I",
                        f"runs at position {w[1]}, before {act('I')} at position {i[1]}",
                    )
                split.add((stage, mb))
    return lists, frozenset(split)

