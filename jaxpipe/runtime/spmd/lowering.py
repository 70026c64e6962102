"""Lower a validated schedule to the static tables the SPMD program scans over.

The lowering runs in small steps, each a function of its own:

1. :func:`expand` — the actions the program runs: the schedule's own, with a full
   backward ``B`` optionally run as its two halves ``I`` then ``W`` (same device, same
   order, same memory; only the work per step changes).
2. :func:`assign_ticks` — when every action runs: its tick, and its step within the
   tick (a tick may hold several actions of one device; they run one per step).
   Messages move at the end of a tick: an action reads another device's output only
   from an earlier tick, and its own device's outputs from any earlier step. Given
   per-action costs, ticks follow the simulation with those costs instead where the
   sync model (:mod:`.sync`) says that runs faster.
3. :func:`list_messages` — every value that crosses from one action to another: the
   stage carry (F -> next stage's F) and the cotangent (B/I -> previous stage's B/I).
4. :func:`allocate` (:mod:`.allocate`) — buffers sized by liveness, per value class
   (shape, dtype). A stored value lives from the step that writes it to its last
   reader's step; a message from its arrival to the step that reads it. Slots are
   assigned first-fit, so a buffer has as many slots as are live at once on the busiest
   device.
5. :func:`~.table.fill_table` (:mod:`.table`) — one row per (step, device) of the
   typed :class:`~.table.TickTable`, and each direction's sender sets (the
   permutation of a tick lists only the pairs that exchange then).

The result, :class:`Lowering`, is read by name by the program (:mod:`.program`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from jaxpipe.runtime.spmd.allocate import Allocation, Pool, allocate
from jaxpipe.runtime.spmd.fusion import (
    fused_backwards,
    fusing_saves_memory,
    joined_weights,
    w_after_own_i,
)
from jaxpipe.runtime.spmd.settle import resettle, settle, tick_constraints
from jaxpipe.runtime.spmd.table import (
    IDLE,
    PROGRAM_KINDS,
    TickTable,
    branch_id,
    fill_table,
    offset_index,
)
from jaxpipe.schedule import Action, Schedule
from jaxpipe.schedule.graph import KB, KF, KI, ScheduleGraph, paused_gc

__all__ = [
    "IDLE",
    "PROGRAM_KINDS",
    "Allocation",
    "Lowering",
    "Message",
    "Pool",
    "Messages",
    "TickTable",
    "Ticks",
    "Timing",
    "allocate",
    "assign_ticks",
    "branch_id",
    "resettle",
    "settle",
    "tick_constraints",
    "ticks_of",
    "expand",
    "fill_table",
    "list_messages",
    "lower",
]


@dataclass(frozen=True)
class Timing:
    """When an action runs: its device, tick and global step."""

    device: int
    tick: int
    step: int


@dataclass(frozen=True)
class Message:
    """A value produced by one action and read by another."""

    producer: Action
    consumer: Action
    src: int  # device of the producer
    dst: int  # device of the consumer
    sent: int  # step at whose end the value is available to the consumer's device
    read: int  # step of the consumer


@dataclass(frozen=True)
class Lowering:
    """Static tables and buffer sizes for one (schedule, stage sizes) pair.

    Attributes:
      table: the per-step fields (:class:`TickTable`).
      ticks: when every action the program runs (after :func:`expand`) runs, as arrays;
        :attr:`actions` has them as ``{action: Timing}``.
      message_arrays: every value moved between actions, as arrays; :attr:`messages`
        lists them as :class:`Message` objects.
      num_ticks, num_steps: of the lowered program (a tick spans one or more steps).
      tick_of_step: ``[steps]`` the tick of every step.
      num_devices, num_stages, num_microbatches: of the schedule.
      stages_per_device: the most stages any device holds.
      perm_offsets: each permutation sends device d to (d + offset) % devices.
      perm_patterns: per offset, the sets of devices that send over it at some tick end
        (``table.exchange`` numbers them from 1): a permutation lists only the pairs
        that carry a message then.
      units: outbox units per offset (the most messages a device sends over it in a tick).
      slots: per class, slots of stored values per device (the maximum over devices, since
        all devices run one program).
      num_inbox: message slots per device (maximum over devices); slot ``num_inbox`` is
        the dummy that idle writes go to.
      residual_peak: per device, the most residual sets live at once.
      slots_per_device: per device, slots per class it actually needs.
      split_backward: the (stage, microbatch) pairs whose B runs as I then W although the
        schedule says B.
      fused_stages: stages whose every B runs in its F's step
        (:func:`.fusion.fused_backwards`).
    """

    table: TickTable
    ticks: Ticks
    message_arrays: Messages
    num_ticks: int
    num_steps: int
    tick_of_step: np.ndarray
    num_devices: int
    num_stages: int
    num_microbatches: int
    stages_per_device: int
    perm_offsets: tuple[int, ...]
    perm_patterns: tuple[tuple[tuple[int, ...], ...], ...]
    units: tuple[int, ...]
    slots: dict[Hashable, int]
    num_inbox: int
    residual_peak: tuple[int, ...]
    slots_per_device: tuple[dict[Hashable, int], ...]
    split_backward: frozenset[tuple[int, int]]
    fused_stages: frozenset[int] = frozenset()

    @functools.cached_property
    def actions(self) -> dict[Action, Timing]:
        """Every action the program runs and when."""
        return self.ticks.timing()

    @functools.cached_property
    def messages(self) -> tuple[Message, ...]:
        """Every value moved between actions."""
        return tuple(self.message_arrays.as_list(self.ticks.graph.actions))

    @property
    def split_stages(self) -> frozenset[int]:
        """Stages that run some backward as I then W (split by the schedule or by
        ``split_backward``)."""
        g = self.ticks.graph
        return frozenset(int(s) for s in g.stages[g.kinds == KI])

    @property
    def used_branches(self) -> frozenset[int]:
        """Branch ids some device runs (the program compiles only these)."""
        return frozenset(int(b) for b in np.unique(self.table.branch))


# ----------------------------------------------------------------------------- step 1
class _Expanded(Schedule):
    """``base`` with the backward of ``split`` units run as I then W."""

    def __init__(self, base: Schedule, split: frozenset[tuple[int, int]]) -> None:
        super().__init__(base.num_devices, base.num_microbatches, base.stages_per_device)
        self._base, self._split = base, split

    def placement(self, stage: int) -> int:
        return self._base.placement(stage)

    def device_actions(self, device: int) -> list[Action]:
        out = []
        for a in self._base.graph().lists[device]:
            if a.kind == "B" and (a.stage, a.microbatch) in self._split:
                out += [Action("I", a.stage, a.microbatch), Action("W", a.stage, a.microbatch)]
            else:
                out.append(a)
        return out


def expand(schedule: Schedule, split_backward: bool) -> tuple[Schedule, frozenset]:
    """The schedule the program runs, and the units whose B it runs as I then W."""
    if not split_backward:
        return schedule, frozenset()
    units = frozenset((a.stage, a.microbatch) for a in schedule.graph().actions
                      if a.kind == "B")
    return _Expanded(schedule, units), units


# ----------------------------------------------------------------------------- step 2
@dataclass(frozen=True)
class Ticks:
    """When every action of a schedule's graph runs (arrays indexed like ``graph.actions``).

    Attributes:
      graph: the schedule's :class:`~jaxpipe.schedule.graph.ScheduleGraph`.
      device, tick, step: per action.
      tick_end: per tick, its last step (messages move at its end).
      fused: per action, True for a backward that runs in its predecessor's step: a B in
        its own F's (:func:`fused_backwards`) or a W in its own I's
        (:func:`~.fusion.joined_weights`); the two share ``tick`` and ``step``.
    """

    graph: ScheduleGraph
    device: np.ndarray
    tick: np.ndarray
    step: np.ndarray
    tick_end: np.ndarray
    fused: np.ndarray

    @property
    def num_steps(self) -> int:
        return int(self.step.max()) + 1 if len(self.step) else 0

    @property
    def num_ticks(self) -> int:
        return len(self.tick_end)

    def timing(self) -> dict[Action, Timing]:
        return {a: Timing(int(d), int(t), int(s)) for a, d, t, s in
                zip(self.graph.actions, self.device, self.tick, self.step, strict=True)}


def assign_ticks(schedule: Schedule, iw_same_tick: bool = False,
                 fuse_fb: bool = False, costs: Sequence[float] | None = None,
                 nearest: bool = False) -> Ticks:
    """One action per device per tick, ticks from the unit-cost simulation's start times
    (each device runs its actions in order, each as soon as its inputs exist).

    ``iw_same_tick``: a W that directly follows its own I on a device runs in the I's
    tick (the tick's messages, the I's cotangent among them, move after both): in the
    I's step where :func:`~.fusion.joined_weights` allows (the hand-off passed straight
    on), else as the tick's second step. Fewer ticks, and fewer steps where joined.

    ``fuse_fb``: the B actions :func:`fused_backwards` picks run in their F's step.

    ``costs`` (per action of ``schedule.graph()``): ticks from the simulation with these
    costs instead, in steps of the cheapest action: an action's tick is its start time
    over that step (rounded down, or to the nearest with ``nearest``), or later where
    its device's previous action or another device's producer needs it (then empty ticks
    are dropped). Devices with cheap actions then run ahead in ticks, as they would in
    time.
    """
    graph = schedule.graph()
    n = len(graph.actions)
    partner = np.arange(n)
    packed = np.zeros(n, bool)
    fused = fused_backwards(graph) if fuse_fb else np.zeros(n, bool)
    if fused.any():
        partner[fused] = graph.prev[fused]
    if iw_same_tick:
        # a W right after its own I: in the I's step (joined, whole stages) or the tick's
        # second step (packed)
        after_i, joined = w_after_own_i(graph), joined_weights(graph)
        fused = fused | joined
        packed = after_i & ~joined
        partner[after_i] = graph.prev[after_i]
    merged = packed | fused
    if costs is None:
        starts, _ = graph.run_costs(np.where(merged, 0, 1).tolist())
        tick = np.array(starts, np.int64)[partner]
    else:
        tick = _cost_grid(graph, np.asarray(costs, np.float64), merged, partner, nearest)
    return ticks_of(graph, tick, packed, fused)


def ticks_of(graph: ScheduleGraph, tick: np.ndarray, packed: np.ndarray,
             fused: np.ndarray) -> Ticks:
    """:class:`Ticks` from each action's tick: a tick's steps are one per action, and a
    second for a ``packed`` W after its I; a ``fused`` B shares its F's step."""
    sub = packed.astype(np.int64)
    n_ticks = int(tick.max()) + 1 if len(tick) else 0
    per_tick = np.ones(n_ticks, np.int64)
    np.maximum.at(per_tick, tick, sub + 1)
    first = np.concatenate([[0], np.cumsum(per_tick)[:-1]]).astype(np.int64)
    return Ticks(graph, graph.devices, tick, first[tick] + sub,
                 first + per_tick - 1, fused)


def _cost_grid(graph: ScheduleGraph, costs: np.ndarray, merged: np.ndarray,
               partner: np.ndarray, nearest: bool) -> np.ndarray:
    """Ticks from the simulation with ``costs`` (see :func:`assign_ticks`)."""
    costs = np.where(merged, 0.0, costs)
    starts, _ = graph.run_costs(costs.tolist())
    positive = costs[costs > 0]
    step = positive.min() if len(positive) else 1.0
    at = np.asarray(starts) / step
    grid = (np.round(at) if nearest else np.floor(at + 1e-9)).astype(np.int64).tolist()
    return settle(graph, grid, partner)


# ----------------------------------------------------------------------------- step 3
@dataclass(frozen=True)
class Messages:
    """Every value moved between actions, as arrays (one entry per message).

    ``producer``/``consumer`` index ``graph.actions``; ``sent`` is the step at whose end
    the value is available to the consumer's device (the producer's own step for a
    message to the same device); ``read`` the consumer's step.
    """

    producer: np.ndarray
    consumer: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    sent: np.ndarray
    read: np.ndarray

    def __len__(self) -> int:
        return len(self.producer)

    def as_list(self, actions: Sequence[Action]) -> list[Message]:
        return [Message(actions[p], actions[c], int(a), int(b), int(s), int(r))
                for p, c, a, b, s, r in zip(self.producer, self.consumer, self.src, self.dst,
                                            self.sent, self.read, strict=True)]


def list_messages(ticks: Ticks) -> Messages:
    """Every stage carry (F -> next stage's F) and cotangent (B/I -> previous stage's B/I),
    ordered by the producer's step and device."""
    graph = ticks.graph
    kind, data = graph.kinds, graph.data_deps
    carry = (kind == KF) & (data[:, 0] >= 0)
    cotangent = ((kind == KB) | (kind == KI)) & (data[:, 1] >= 0)
    c = np.flatnonzero(carry | cotangent)
    p = np.where(carry[c], data[c, 0], data[c, 1])
    order = np.lexsort((c, ticks.device[p], ticks.step[p]))
    p, c = p[order], c[order]
    src, dst = ticks.device[p], ticks.device[c]
    sent = np.where(src == dst, ticks.step[p], ticks.tick_end[ticks.tick[p]])
    return Messages(p, c, src, dst, sent, ticks.step[c])


def lower(schedule: Schedule, pool_counts: Mapping[Pool, Sequence[Mapping[Hashable, int]]],
          body_of_stage: Sequence[int] | None = None, *, split_backward: bool = False,
          iw_same_tick: bool = False, fuse_fb: bool | str = False,
          max_patterns: int | None = None,
          costs: Callable[[Action], float] | None = None, refine: int = 0) -> Lowering:
    """Lower ``schedule`` (validated here) given what each stage stores per microbatch.

    Args:
      schedule: the schedule.
      pool_counts: for each :class:`Pool`, per stage, slots per value class that one
        microbatch of that stage keeps there (missing pools store nothing).
      body_of_stage: the program body that runs each stage (stages with identical
        functions share one); default one body per stage.
      split_backward: run every B of the schedule as I then W (see :func:`expand`).
      iw_same_tick: a W right after its own I shares the I's tick (:func:`assign_ticks`).
      fuse_fb: a last stage's B right after its own F runs in the F's step, storing no
        residuals (:func:`.fusion.fused_backwards`). ``"auto"``: only where that does
        not raise the stored bytes (:func:`.fusion.fusing_saves_memory`).
      max_patterns: the most sender sets per direction the program holds a permutation
        for (:func:`.table.exchange_patterns`); default ``min(4 * devices + 4, 64)``,
        every sender set of every built-in and gallery schedule up to p = 8 (the fill,
        the steady state and the drain each have their own).
    """
    with paused_gc():
        return _lower(schedule, pool_counts, body_of_stage, split_backward, iw_same_tick,
                      fuse_fb, max_patterns, costs, refine)


def _lower(schedule: Schedule, pool_counts: Mapping[Pool, Sequence[Mapping[Hashable, int]]],
           body_of_stage: Sequence[int] | None, split_backward: bool,
           iw_same_tick: bool, fuse_fb: bool | str, max_patterns: int | None,
           costs: Callable[[Action], float] | None, refine: int) -> Lowering:
    schedule.graph()  # validates (once per schedule: the graph is cached)
    S, D = schedule.num_stages, schedule.num_devices
    if body_of_stage is None:
        body_of_stage = list(range(S))
    if max_patterns is None:
        max_patterns = min(4 * D + 4, 64)
    if max_patterns < 1:
        raise ValueError(f"max_patterns must be at least 1 (one permutation per direction), "
                         f"got {max_patterns}")
    counts = {pool: list(pool_counts.get(pool) or [{} for _ in range(S)]) for pool in Pool}
    run, split = expand(schedule, split_backward)
    ticks, messages, alloc = _placed(run, split, iw_same_tick, fuse_fb is True, counts, costs,
                                     refine)
    if fuse_fb == "auto" and fused_backwards(ticks.graph).any():
        fused = _placed(run, split, iw_same_tick, True, counts, costs, refine)
        if fusing_saves_memory(alloc, fused[2], fused[0], counts):
            ticks, messages, alloc = fused
    remote = messages.src != messages.dst
    offsets = tuple(sorted({int(x) for x in (messages.dst - messages.src)[remote] % D}))
    src, dst = messages.src[remote], messages.dst[remote]
    j = offset_index(offsets, (dst - src) % D)
    # per direction, the most messages one device sends that way in one tick
    send = (ticks.tick[messages.producer[remote]] * D + src) * len(offsets) + j
    sends, per_send = np.unique(send, return_counts=True)
    units = tuple(int(per_send[sends % len(offsets) == jj].max(initial=0))
                  for jj in range(len(offsets)))
    pool_classes = {pool: sorted({c for row in counts[pool] for c in row}, key=repr)
                    for pool in Pool}
    table, patterns = fill_table(ticks, messages, alloc, offsets, units, body_of_stage,
                                 max(body_of_stage) + 1, pool_classes, max_patterns)
    return Lowering(
        table=table,
        ticks=ticks,
        message_arrays=messages,
        num_ticks=ticks.num_ticks,
        num_steps=ticks.num_steps,
        tick_of_step=_tick_of_step(ticks),
        num_devices=D,
        num_stages=S,
        num_microbatches=schedule.num_microbatches,
        stages_per_device=max(len(schedule.device_stages(d)) for d in range(D)),
        perm_offsets=offsets,
        perm_patterns=patterns,
        units=units,
        slots=alloc.slots,
        num_inbox=alloc.num_inbox,
        residual_peak=alloc.residual_peak,
        slots_per_device=alloc.slots_per_device,
        split_backward=split,
        fused_stages=frozenset(int(x) for x in ticks.graph.stages[
            ticks.fused & (ticks.graph.kinds == KB)]),
    )


def _placed(run: Schedule, split: frozenset, iw_same_tick: bool, fuse_fb: bool,
            counts: Mapping[Pool, Sequence[Mapping[Hashable, int]]],
            costs: Callable[[Action], float] | None,
            refine_evals: int) -> tuple[Ticks, Messages, Allocation]:
    """Ticks, messages and buffers: the unit-cost ticks, or with ``costs`` whichever of
    them and the cost-grid ticks (:func:`assign_ticks`, both roundings) the sync model
    says runs fastest, then refined by a local search (:mod:`.refine`), among those that
    need no more buffer slots."""
    ticks = assign_ticks(run, iw_same_tick, fuse_fb)
    messages = list_messages(ticks)
    alloc = allocate(ticks, messages, counts)
    if costs is None:
        return ticks, messages, alloc
    # sync and refine import this module (for the Lowering and Ticks they read)
    from jaxpipe.runtime.spmd.refine import refine
    from jaxpipe.runtime.spmd.sync import split_cost, ticks_makespan

    def fits(cand: Allocation) -> bool:
        return (cand.num_inbox <= alloc.num_inbox
                and all(n <= alloc.slots.get(k, 0) for k, n in cand.slots.items()))

    cost = split_cost(costs, split)
    c = np.array([cost(a) for a in ticks.graph.actions], np.float64)
    best, best_time = (ticks, messages, alloc), ticks_makespan(ticks, messages, c)
    for nearest in (False, True):
        grid = assign_ticks(run, iw_same_tick, fuse_fb, c, nearest)
        grid_messages = list_messages(grid)
        time = ticks_makespan(grid, grid_messages, c)
        if time >= best_time * (1 - 1e-9):
            continue
        grid_alloc = allocate(grid, grid_messages, counts)
        if fits(grid_alloc):
            best, best_time = (grid, grid_messages, grid_alloc), time
    start = best[0]
    if refine_evals > 0 and not iw_same_tick and not start.fused.any():
        placed: dict[int, tuple[Ticks, Messages, Allocation]] = {}

        def placed_fits(t: Ticks) -> bool:
            # the search returns one of the assignments it checked: keep their buffers
            msgs = list_messages(t)
            placed[id(t)] = (t, msgs, allocate(t, msgs, counts))  # t stays alive: id unique
            return fits(placed[id(t)][2])

        refined = refine(start, c, refine_evals, placed_fits)
        if refined is not None:
            best = placed[id(refined)]
    return best


def _tick_of_step(ticks: Ticks) -> np.ndarray:
    out = np.zeros(ticks.num_steps, np.int64)
    out[ticks.step] = ticks.tick
    return out
