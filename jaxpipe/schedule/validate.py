"""Schedule validation: structural rules, data dependencies, and deadlock detection.

Two layers of checks, both raising :class:`ScheduleError` with a message that names
the device, the action (``"2F0"`` form) and the rule:

1. *Structure* (:func:`check_structure`): placement in range, indices in range,
   every action on the device its stage is placed on, exactly one ``F`` and one
   backward (``B``, or ``I`` + ``W``) per (stage, microbatch), no duplicates, no
   backward before its forward and no ``W`` before its ``I`` in device order.
2. *Execution* (:func:`execute`): every device runs its list strictly in order and
   an action waits for its :func:`dependencies`. If at some point no device can
   make progress, the schedule deadlocks across devices.

:func:`execute` is also the simulator's engine (``jaxpipe.schedule.simulate``), so
"validates" and "simulates without deadlock" are the same statement.
"""

from __future__ import annotations

import numbers
from collections import defaultdict, deque
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING

from .action import Action, ScheduleError

if TYPE_CHECKING:
    from .base import Schedule

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


def dependencies(action: Action, schedule: Schedule) -> list[Action]:
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


def check_placement(schedule: Schedule) -> list[int]:
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


def check_structure(schedule: Schedule) -> tuple[dict[int, list[Action]], frozenset[Unit]]:
    """Check every rule that does not need execution.

    Returns ``(device -> action list, set of (stage, mb) that use the I/W split)``.
    """
    p, m, n = schedule.num_devices, schedule.num_microbatches, schedule.num_stages
    placement = check_placement(schedule)
    actions = schedule.actions()

    lists: dict[int, list[Action]] = {}
    where: dict[Action, tuple[int, int]] = {}  # action -> (device, position)
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
            if a in where:
                raise _fail(
                    device, a, "duplicate action",
                    f"appears twice (positions {where[a][1]} and {pos})",
                )
            where[a] = (device, pos)
        lists[device] = acts

    split: set[Unit] = set()
    for stage in range(n):
        device = placement[stage]
        for mb in range(m):
            f, b, i, w = (Action(k, stage, mb) for k in "FBIW")
            if f not in where:
                raise _fail(device, f, "missing F", "this forward never runs")
            if b in where and (i in where or w in where):
                other = i if i in where else w
                raise _fail(
                    device, other, "B mixed with I/W",
                    f"stage {stage} microbatch {mb} already has a full backward {b}; "
                    f"use either B or the I+W pair",
                )
            if i in where and w not in where:
                raise _fail(device, i, "I without W", f"{i} has no matching {w}")
            if w in where and i not in where:
                raise _fail(device, w, "W without I", f"{w} has no matching {i}")
            if b not in where and i not in where:
                raise _fail(
                    device, b, "missing backward",
                    f"stage {stage} microbatch {mb} has no backward: "
                    f"expected {b}, or {i} and {w}",
                )
            first_back = b if b in where else i
            if where[first_back][1] < where[f][1]:
                raise _fail(
                    device, first_back, "backward before forward",
                    f"runs at position {where[first_back][1]}, before its forward {f} "
                    f"at position {where[f][1]}",
                )
            if i in where:
                if where[w][1] < where[i][1]:
                    raise _fail(
                        device, w, "W before its I",
                        f"runs at position {where[w][1]}, before {i} at position {where[i][1]}",
                    )
                split.add((stage, mb))
    return lists, frozenset(split)


def execute(
    lists: Mapping[int, Sequence[Action]],
    num_stages: int,
    split: Collection[Unit],
    cost: Callable[[Action], numbers.Real],
) -> list[list[Slot]]:
    """Run every device's list in order; return ``[(action, start, end), ...]`` per device.

    An action starts at ``max(end of the device's previous action, end of each
    dependency)`` and lasts ``cost(action)``. The result is unique: it does not
    depend on the order devices are visited, only on the lists and costs. Times are
    exact when costs are ints or ``Fraction``\\ s.

    Raises :class:`ScheduleError` (rule: cross-device deadlock) when no device can
    make progress, naming each stuck device, the action it is stuck at and the
    dependency it waits for.
    """
    devices = sorted(lists)
    pos = dict.fromkeys(devices, 0)
    free: dict[int, numbers.Real] = dict.fromkeys(devices, 0)  # type: ignore[arg-type]
    end: dict[Action, numbers.Real] = {}
    out: dict[int, list[Slot]] = {d: [] for d in devices}
    waiting: dict[Action, list[int]] = defaultdict(list)  # dependency -> stuck devices
    stuck_on: dict[int, Action] = {}
    queue = deque(devices)
    while queue:
        d = queue.popleft()
        acts = lists[d]
        while pos[d] < len(acts):
            a = acts[pos[d]]
            deps = _dependencies(a, num_stages, split)
            missing = next((x for x in deps if x not in end), None)
            if missing is not None:
                waiting[missing].append(d)
                stuck_on[d] = missing
                break
            start = max([free[d], *(end[x] for x in deps)])
            finish = start + cost(a)
            end[a] = free[d] = finish
            out[d].append((a, start, finish))
            pos[d] += 1
            stuck_on.pop(d, None)
            queue.extend(waiting.pop(a, ()))

    stuck = [d for d in devices if pos[d] < len(lists[d])]
    if stuck:
        owner = {a: d for d in devices for a in lists[d]}
        parts = []
        for d in stuck:
            dep = stuck_on[d]
            src = f"device {owner[dep]}" if dep in owner else "no device (never scheduled)"
            parts.append(f"device {d} is stuck at action {lists[d][pos[d]]} waiting for {dep} "
                         f"(on {src})")
        raise ScheduleError(
            "cross-device deadlock: no device can make progress: " + "; ".join(parts)
            + " (rule: no dependency cycle between devices' action orders)"
        )
    return [out[d] for d in devices]


def validate_schedule(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` if ``schedule`` breaks any rule (see module doc)."""
    lists, split = check_structure(schedule)
    execute(lists, schedule.num_stages, split, lambda a: 1)
