"""A schedule compiled to integer arrays: the engine of validation, simulation and lowering.

:func:`build_graph` checks a schedule (every rule of :mod:`.validate`) and compiles it to
a :class:`ScheduleGraph`: every action in an execution order, with its device, kind,
stage, microbatch and the indices of what it waits for, as numpy arrays. It is built once
per schedule (:meth:`Schedule.graph` caches it), so a 64-device, 512-microbatch schedule
(hundreds of thousands of actions) is checked once and every simulation and lowering
afterwards reads arrays instead of hashing :class:`Action` objects.

The checks run vectorised; only when one fails does :func:`.validate.check_structure`
walk the actions one by one, to name the first broken rule exactly as it always has.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import numbers
from collections import defaultdict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING

import numpy as np

from .action import ACTION_KINDS, Action, ScheduleError
from .validate import Unit, check_placement, check_structure

if TYPE_CHECKING:
    from .protocol import ScheduleLike

__all__ = ["ScheduleGraph", "build_graph", "grouped_peaks", "paused_gc"]

KF, KB, KI, KW = range(4)  # kind codes: indices into ACTION_KINDS ("FBIW")


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause Python's cyclic garbage collector for a bulk build of acyclic objects.

    A schedule at scale makes hundreds of thousands of actions, events and tuples at
    once; every few thousand allocations the collector would walk all live objects
    (jax's among them), which took about half of ``simulate()`` at p=64, m=512. Nothing
    built here forms a cycle, so nothing is left for the collector; it resumes after.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def grouped_peaks(group: np.ndarray, start: np.ndarray, end: np.ndarray,
                  num_groups: int) -> list[int]:
    """Per group, the most closed intervals ``[start, end]`` containing one point.

    :func:`.liveness.peak_overlap` for many groups at once (touching intervals overlap;
    a group without intervals peaks at 0).
    """
    times = np.concatenate([start, end])
    closes = np.concatenate([np.zeros(len(start), np.int64), np.ones(len(end), np.int64)])
    groups = np.concatenate([group, group])
    order = np.lexsort((closes, times, groups))  # per group; opens before closes
    # every interval closes in its own group, so the running count is 0 between groups
    live = np.cumsum(1 - 2 * closes[order])
    counts = np.bincount(group, minlength=num_groups) * 2
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])
    peaks = np.zeros(num_groups, np.int64)
    some = counts > 0
    if len(live):
        peaks[some] = np.maximum.reduceat(live, first[some])
    return [int(x) for x in peaks]


@dataclass(frozen=True, eq=False)
class ScheduleGraph:
    """A valid schedule compiled to integers: what validation, simulation and lowering read.

    Attributes:
      lists: every device's action list.
      split: the (stage, microbatch) pairs whose backward is split into I + W.
      actions: every action, in an execution order (each after its dependencies and after
        its device's previous action): the order every simulation evaluates them in.
      devices, kinds, stages, microbatches: per action (same order), as int arrays; a kind
        is its index in ``ACTION_KINDS``.
      data_deps: ``[actions, 2]`` indices (into ``actions``) of the data dependencies of
        each action (:func:`.validate.dependencies`, in that order), ``-1``-padded.
      prev: index of the device's previous action (``-1`` for a device's first).
      positions: each action's position in its device's list.

    :attr:`device`, :attr:`deps` and :attr:`data` give the same as tuples.
    """

    lists: dict[int, tuple[Action, ...]]
    split: frozenset[Unit]
    actions: tuple[Action, ...]
    devices: np.ndarray
    kinds: np.ndarray
    stages: np.ndarray
    microbatches: np.ndarray
    data_deps: np.ndarray
    prev: np.ndarray
    positions: np.ndarray

    def __post_init__(self) -> None:
        # cached on the schedule and shared with every lowering: nobody may write to them
        for arr in (self.devices, self.kinds, self.stages, self.microbatches, self.data_deps,
                    self.prev, self.positions):
            arr.flags.writeable = False

    @functools.cached_property
    def device(self) -> tuple[int, ...]:
        """The device of each action."""
        return tuple(self.devices.tolist())

    @functools.cached_property
    def data(self) -> tuple[tuple[int, ...], ...]:
        """The data dependencies of each action (same order as :func:`dependencies`)."""
        return tuple(tuple(x for x in row if x >= 0) for row in self.data_deps.tolist())

    @functools.cached_property
    def deps(self) -> tuple[tuple[int, ...], ...]:
        """What each action waits for: its data dependencies, then its device's previous
        action."""
        return tuple(d + (q,) if q >= 0 else d for d, q in zip(self.data, self.prev.tolist(),
                                                               strict=True))

    @functools.cached_property
    def _wait_lists(self) -> tuple[list[int], list[int], list[int]]:
        return (self.data_deps[:, 0].tolist(), self.data_deps[:, 1].tolist(),
                self.prev.tolist())

    def run_costs(self, costs: Sequence[numbers.Real]) -> tuple[list, list]:
        """``(starts, ends)`` (in :attr:`actions` order) given each action's cost, when each
        starts as soon as its dependencies and its device's previous action have finished."""
        d0, d1, prev = self._wait_lists
        n = len(costs)
        end: list = [0] * (n + 1)  # end[-1] stays 0: what a missing (-1) dependency reads
        starts: list = [0] * n
        for k in range(n):  # a hot loop at scale: plain lists and no generator
            start = 0
            x = end[d0[k]]
            if x > start:
                start = x
            x = end[d1[k]]
            if x > start:
                start = x
            x = end[prev[k]]
            if x > start:
                start = x
            starts[k] = start
            end[k] = start + costs[k]
        del end[n]
        return starts, end

    def run(self, cost: Callable[[Action], numbers.Real]) -> list[tuple[numbers.Real,
                                                                      numbers.Real]]:
        """``(start, end)`` of every action (in :attr:`actions` order) when each starts as
        soon as its dependencies and its device's previous action have finished."""
        starts, ends = self.run_costs([cost(a) for a in self.actions])
        return list(zip(starts, ends, strict=True))

    @functools.cached_property
    def unit_ends(self) -> tuple[np.ndarray, np.ndarray]:
        """Per unit ``stage * m + microbatch``: index of its ``F`` and of its last backward
        action (``B``, or ``W`` when split)."""
        m = int(self.microbatches.max()) + 1 if len(self.actions) else 0
        unit = self.stages * m + self.microbatches
        n_units = len(unit) and int(unit.max()) + 1
        first = np.zeros(n_units, np.int64)
        last = np.zeros(n_units, np.int64)
        idx = np.arange(len(unit))
        is_f, ends = self.kinds == KF, (self.kinds == KB) | (self.kinds == KW)
        first[unit[is_f]] = idx[is_f]
        last[unit[ends]] = idx[ends]
        return first, last

    @functools.cached_property
    def _peaks(self) -> tuple[list[int], dict[int, int]]:
        first, last = self.unit_ends
        start, end = self.positions[first], self.positions[last]
        per_device = grouped_peaks(self.devices[first], start, end, len(self.lists))
        stages = self.stages[first]
        num_stages = int(stages.max()) + 1 if len(stages) else 0
        return per_device, dict(enumerate(grouped_peaks(stages, start, end, num_stages)))

    @property
    def peak_in_flight(self) -> list[int]:
        """Per device, the most residual sets live at once along its action order (what
        :attr:`Timeline.peak_in_flight` reports under any costs)."""
        return list(self._peaks[0])

    @property
    def stage_peak_in_flight(self) -> dict[int, int]:
        """Per stage, the most residual sets of that stage live at once (what
        :attr:`Timeline.stage_peak_in_flight` reports under any costs)."""
        return dict(self._peaks[1])


def _compile_structure(schedule: ScheduleLike) -> tuple[dict, np.ndarray, np.ndarray] | None:
    """Vectorised :func:`.validate.check_structure`: ``(lists, columns, split mask)`` or
    None if any rule is broken (then the slow check names it)."""
    p, m, n = schedule.num_devices, schedule.num_microbatches, schedule.num_stages
    placement = np.asarray(check_placement(schedule), np.int64)
    lists = schedule.actions()
    flat = [a for d in range(p) for a in lists[d]]
    if not all(isinstance(a, Action) for a in flat):
        return None
    code_of_kind = {k: i for i, k in enumerate(ACTION_KINDS)}
    try:
        kind = np.fromiter(map(code_of_kind.__getitem__, map(attrgetter("kind"), flat)),
                           np.int64, len(flat))
        stage = np.fromiter(map(attrgetter("stage"), flat), np.int64, len(flat))
        mb = np.fromiter(map(attrgetter("microbatch"), flat), np.int64, len(flat))
    except OverflowError:  # an index beyond int64 is out of range anyway
        return None
    lens = [len(lists[d]) for d in range(p)]
    dev = np.repeat(np.arange(p, dtype=np.int64), lens)
    pos = np.arange(len(flat), dtype=np.int64) - np.repeat(
        np.cumsum([0] + lens[:-1]).astype(np.int64), lens)
    if (stage >= n).any() or (mb >= m).any() or (placement[stage] != dev).any():
        return None
    code = (kind * n + stage) * m + mb
    where = np.full(4 * n * m, -1, np.int64)
    where[code] = pos
    if np.count_nonzero(where >= 0) != len(code):  # duplicates
        return None
    f, b, i, w = where.reshape(4, n * m)
    has_b, has_i, has_w = b >= 0, i >= 0, w >= 0
    first_back = np.where(has_b, b, i)
    if schedule.forward_only:  # forwards only, every one of them
        return None if (f < 0).any() or (has_b | has_i | has_w).any() else (
            lists, np.stack([dev, pos, kind, stage, mb]), has_i)
    if ((f < 0).any() or (has_b & (has_i | has_w)).any() or (has_i != has_w).any()
            or (~has_b & ~has_i).any() or (first_back < f).any() or (w < i).any()):
        return None
    return lists, np.stack([dev, pos, kind, stage, mb]), has_i


def build_graph(schedule: ScheduleLike) -> ScheduleGraph:
    """Check ``schedule`` (structure, then deadlock) and compile it to a :class:`ScheduleGraph`.

    Raises :class:`ScheduleError` (rule: cross-device deadlock) when no device can make
    progress, naming each stuck device, the action it is stuck at and the dependency it
    waits for; for a structural rule, what :func:`.validate.check_structure` raises.
    """
    compiled = _compile_structure(schedule)
    if compiled is None:
        check_structure(schedule)  # raises, naming the first broken rule
        raise AssertionError("the vectorised structure check failed where the slow one passed")
    lists, columns, split_mask = compiled
    dev, pos, kind, stage, mb = columns
    S, m = schedule.num_stages, schedule.num_microbatches
    devices = sorted(lists)
    # 1. Every action as an integer code (kind * S + stage) * m + mb, and the codes of its
    #    data dependencies (-1: none), as in validate.dependencies.
    rest = stage * m + mb
    code = kind * (S * m) + rest
    backward = (kind == KB) | (kind == KI)
    dep0 = np.where(kind == KF, np.where(stage > 0, rest - m, -1),
                    np.where(kind == KW, KI * S * m + rest, rest))
    nxt = np.minimum(rest + m, S * m - 1)  # the next stage's unit (clipped for the last)
    dep1 = np.where(backward & (stage < S - 1),
                    np.where(split_mask[nxt], KI, KB) * (S * m) + rest + m, -1)
    starts = np.cumsum([0] + [len(lists[d]) for d in devices[:-1]])
    codes = {d: code[s:s + len(lists[d])].tolist() for d, s in zip(devices, starts,
                                                                   strict=True)}
    need0 = {d: dep0[s:s + len(lists[d])].tolist() for d, s in zip(devices, starts,
                                                                    strict=True)}
    need1 = {d: dep1[s:s + len(lists[d])].tolist() for d, s in zip(devices, starts,
                                                                    strict=True)}

    # 2. Kahn's algorithm along each device's order (the order devices are visited in does
    #    not change any simulated time, only the order actions are listed in).
    done = [False] * (4 * S * m)
    at = dict.fromkeys(devices, 0)
    order: list[int] = []  # positions in the flat (device-major) action list
    waiting: dict[int, list[int]] = defaultdict(list)
    stuck_on: dict[int, int] = {}
    queue = deque(devices)
    while queue:
        d = queue.popleft()
        mine, n0, n1, p_, base = codes[d], need0[d], need1[d], at[d], int(starts[d])
        while p_ < len(mine):
            x = n0[p_]
            if x < 0 or done[x]:
                x = n1[p_]
                if x < 0 or done[x]:
                    x = -1
            if x >= 0:
                waiting[x].append(d)
                stuck_on[d] = x
                break
            c = mine[p_]
            done[c] = True
            order.append(base + p_)
            p_ += 1
            if c in waiting:
                queue.extend(waiting.pop(c))
        at[d] = p_

    stuck = [d for d in devices if at[d] < len(lists[d])]
    if stuck:
        parts = []
        owner = {c: d for d in devices for c in codes[d]}
        for d in stuck:
            kind_i, r = divmod(stuck_on[d], S * m)
            dep = Action(ACTION_KINDS[kind_i], *divmod(r, m))
            src = (f"device {owner[stuck_on[d]]}" if stuck_on[d] in owner
                   else "no device (never scheduled)")
            parts.append(f"device {d} is stuck at action {lists[d][at[d]]} waiting for {dep} "
                         f"(on {src})")
        raise ScheduleError(
            "cross-device deadlock: no device can make progress: " + "; ".join(parts)
            + " (rule: no dependency cycle between devices' action orders)"
        )

    # 3. Re-index everything by execution order.
    order_a = np.asarray(order, np.int64)
    index = np.empty(len(order_a), np.int64)
    index[order_a] = np.arange(len(order_a))
    flat_of_code = np.zeros(4 * S * m, np.int64)
    flat_of_code[code] = np.arange(len(code))

    def by_order(deps: np.ndarray) -> np.ndarray:
        return np.where(deps >= 0, index[flat_of_code[np.maximum(deps, 0)]], -1)[order_a]

    data_deps = np.stack([by_order(dep0), by_order(dep1)], axis=1)
    flat_prev = np.where(pos > 0, np.arange(len(pos)) - 1, -1)
    prev = np.where(flat_prev >= 0, index[np.maximum(flat_prev, 0)], -1)[order_a]
    flat = [a for d in devices for a in lists[d]]
    units = np.flatnonzero(split_mask)
    split = frozenset(zip((units // m).tolist(), (units % m).tolist(), strict=True))
    return ScheduleGraph(
        {d: tuple(lists[d]) for d in devices}, split, tuple([flat[k] for k in order]),
        dev[order_a], kind[order_a], stage[order_a], mb[order_a], data_deps, prev,
        pos[order_a])
