"""Lower a validated schedule to the static tables the SPMD program scans over.

The lowering runs in small steps, each a function of its own:

1. :func:`expand` — the actions the program runs: the schedule's own, with a full
   backward ``B`` optionally run as its two halves ``I`` then ``W`` (same device, same
   order, same memory; only the work per step changes).
2. :func:`assign_ticks` — when every action runs: its tick, and its step within the
   tick (a tick may hold several actions of one device; they run one per step).
   Messages move at the end of a tick: an action reads another device's output only
   from an earlier tick, and its own device's outputs from any earlier step.
3. :func:`list_messages` — every value that crosses from one action to another: the
   stage carry (F -> next stage's F) and the cotangent (B/I -> previous stage's B/I).
4. :func:`allocate` — buffers sized by liveness, per value class (shape, dtype). A
   stored value lives from the step that writes it to its last reader's step; a message
   from its arrival to the step that reads it. Slots are assigned first-fit, so a
   buffer has as many slots as are live at once on the busiest device.
5. :func:`fill_table` — one row per (step, device) of the typed :class:`TickTable`.

The result, :class:`Lowering`, is read by name by the program (:mod:`.program`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import jax
import numpy as np

from jaxpipe.schedule import ACTION_KINDS, Action, Schedule

__all__ = [
    "IDLE",
    "Lowering",
    "Message",
    "Pool",
    "TickTable",
    "Timing",
    "allocate",
    "assign_ticks",
    "branch_id",
    "expand",
    "fill_table",
    "list_messages",
    "lower",
]

#: Branch id of a step in which a device does nothing.
IDLE = 0


def branch_id(kind: str, body: int, num_bodies: int) -> int:
    """The program branch that runs ``kind`` for ``body`` (:data:`IDLE` is 0)."""
    return 1 + ACTION_KINDS.index(kind) * num_bodies + body


class Pool(enum.IntEnum):
    """The parts a stage's stored values are kept in, by who writes and who reads them.

    Residuals are stored in two parts so that what only the input-gradient needs is
    freed as soon as I has run; ``HANDOFF`` is what I hands to W.
    """

    RESIDUAL_A = 0  # written by F; read by B or I (freed there)
    RESIDUAL_B = 1  # written by F; read by B, I and W (freed at B or W)
    HANDOFF = 2  # written by I; read by W

    @property
    def writer(self) -> str:
        return "I" if self is Pool.HANDOFF else "F"

    @property
    def readers(self) -> tuple[str, ...]:
        return {Pool.RESIDUAL_A: ("B", "I"), Pool.RESIDUAL_B: ("B", "I", "W"),
                Pool.HANDOFF: ("W",)}[self]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TickTable:
    """Integer fields of every (step, device); the program scans over the steps.

    Every array's leading axes are ``[steps, devices]``. A pytree, so the program passes
    it to ``lax.scan`` whole and reads a row's fields by name.

    Attributes:
      branch: the branch to run (:func:`branch_id`, or :data:`IDLE`).
      stage: the action's stage (selects a shared body's parameters).
      microbatch: the action's microbatch.
      in_slot: inbox slot holding the action's input message (stage carry or cotangent).
      local_slot: inbox slot for the action's output message when it stays on the
        device (the turn of a V); the dummy slot otherwise.
      out_unit: ``[steps, devices, offsets]``: the unit of the outbox of each direction
        the action's output message goes to (the dummy unit ``units[j]`` otherwise).
      recv_slot: ``[steps, devices, offsets, units]``: inbox slot for each unit arriving
        over each permutation offset at the end of the step (the dummy slot if none).
      pool_base: per (pool, class), the first slot of that class where the action writes
        or reads that pool's part of its stored values.
      exchange: ``[steps, devices, offsets]`` bool (same for every device): the
        permutation over that offset runs at the end of the step.
    """

    branch: np.ndarray
    stage: np.ndarray
    microbatch: np.ndarray
    in_slot: np.ndarray
    local_slot: np.ndarray
    out_unit: np.ndarray
    recv_slot: np.ndarray
    pool_base: dict[tuple[Pool, Hashable], np.ndarray]
    exchange: np.ndarray

    @property
    def num_steps(self) -> int:
        return int(self.branch.shape[0])

    def digest_bytes(self) -> bytes:
        """Every field, in a fixed order (for cross-process consistency checks)."""
        parts = [self.branch, self.stage, self.microbatch, self.in_slot, self.local_slot,
                 self.out_unit,
                 self.recv_slot, self.exchange]
        parts += [self.pool_base[k] for k in sorted(self.pool_base, key=repr)]
        return b"".join(np.ascontiguousarray(p).tobytes() + str(p.shape).encode()
                        for p in parts)


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
      actions: every action the program runs and when (after :func:`expand`).
      messages: every value moved between actions (:class:`Message`).
      num_ticks, num_steps: of the lowered program (a tick spans one or more steps).
      tick_of_step: ``[steps]`` the tick of every step.
      num_devices, num_stages, num_microbatches: of the schedule.
      stages_per_device: the most stages any device holds.
      perm_offsets: each permutation sends device d to (d + offset) % devices.
      units: outbox units per offset (the most messages a device sends over it in a tick).
      slots: per class, slots of stored values per device (the maximum over devices, since
        all devices run one program).
      num_inbox: message slots per device (maximum over devices); slot ``num_inbox`` is
        the dummy that idle writes go to.
      residual_peak: per device, the most residual sets live at once.
      slots_per_device: per device, slots per class it actually needs.
      split_backward: the (stage, microbatch) pairs whose B runs as I then W although the
        schedule says B.
    """

    table: TickTable
    actions: Mapping[Action, Timing]
    messages: tuple[Message, ...]
    num_ticks: int
    num_steps: int
    tick_of_step: np.ndarray
    num_devices: int
    num_stages: int
    num_microbatches: int
    stages_per_device: int
    perm_offsets: tuple[int, ...]
    units: tuple[int, ...]
    slots: dict[Hashable, int]
    num_inbox: int
    residual_peak: tuple[int, ...]
    slots_per_device: tuple[dict[Hashable, int], ...]
    split_backward: frozenset[tuple[int, int]]

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
        for a in self._base.actions()[device]:
            if a.kind == "B" and (a.stage, a.microbatch) in self._split:
                out += [Action("I", a.stage, a.microbatch), Action("W", a.stage, a.microbatch)]
            else:
                out.append(a)
        return out


def expand(schedule: Schedule, split_backward: bool) -> tuple[Schedule, frozenset]:
    """The schedule the program runs, and the units whose B it runs as I then W."""
    if not split_backward:
        return schedule, frozenset()
    units = frozenset((a.stage, a.microbatch) for acts in schedule.actions().values()
                      for a in acts if a.kind == "B")
    return _Expanded(schedule, units), units


# ----------------------------------------------------------------------------- step 2
#: Cost per action kind used to assign ticks: one tick per action.
UNIT_COSTS = {"F": 1, "B": 1, "I": 1, "W": 1}


def assign_ticks(schedule: Schedule) -> dict[Action, Timing]:
    """``action -> Timing``: one action per device per tick, ticks from the unit-cost
    simulation's start times (each device runs its actions in order, each as soon as its
    inputs exist)."""
    timeline = schedule.simulate(costs=UNIT_COSTS)
    when = {}
    for ev in timeline.events:
        if int(ev.start) != ev.start:
            raise AssertionError(f"non-integral tick for {ev.action}")
        t = int(ev.start)
        when[ev.action] = Timing(ev.device, t, t)
    return when


# ----------------------------------------------------------------------------- step 3
def list_messages(schedule: Schedule, when: Mapping[Action, Timing],
                  tick_end: Callable[[int], int]) -> list[Message]:
    """Every stage carry and cotangent, in a deterministic order.

    ``tick_end(tick)`` is the last step of a tick: a message to another device arrives
    at its end; one to the same device is written by its producer's step.
    """
    S = schedule.num_stages
    split = schedule.split_units()

    def cotangent_reader(stage: int, mb: int) -> Action:
        return Action("I" if (stage, mb) in split else "B", stage, mb)

    out = []
    for a in sorted(when, key=lambda a: (when[a].step, when[a].device, str(a))):
        if a.kind == "F" and a.stage < S - 1:
            consumer = Action("F", a.stage + 1, a.microbatch)
        elif a.kind in ("B", "I") and a.stage > 0:
            consumer = cotangent_reader(a.stage - 1, a.microbatch)
        else:
            continue
        p, c = when[a], when[consumer]
        sent = p.step if p.device == c.device else tick_end(p.tick)
        out.append(Message(a, consumer, p.device, c.device, sent, c.step))
    return out


# ----------------------------------------------------------------------------- step 4
def _first_fit(intervals: Sequence[tuple[int, int, int, object]]) -> tuple[dict, int]:
    """Offsets for ``(start, end, size, key)`` values live over steps ``(start, end]``.

    A value is written by (or at the end of) step ``start`` and last read at step
    ``end``, so two values may share slots when one is last read in the step whose action
    writes the other: the program finishes an action's reads before its writes.
    """
    placed: list[tuple[int, int, int, int]] = []  # (start, end, offset, size)
    offsets = {}
    top = 0
    for start, end, size, key in sorted(intervals, key=lambda iv: (iv[0], -iv[2])):
        if size == 0:
            offsets[key] = 0
            continue
        busy = sorted((o, o + s) for (a, b, o, s) in placed if a < end and start < b)
        off = 0
        for lo, hi in busy:
            if off + size <= lo:
                break
            off = max(off, hi)
        offsets[key] = off
        placed.append((start, end, off, size))
        top = max(top, off + size)
    return offsets, top


@dataclass(frozen=True)
class Allocation:
    """Where stored values and messages live (output of :func:`allocate`)."""

    pool_base: dict[tuple[Pool, tuple[int, int], Hashable], int]  # (pool, (stage, mb), class)
    slots: dict[Hashable, int]
    slots_per_device: tuple[dict[Hashable, int], ...]
    message_slot: dict[tuple[Action, Action], int]
    num_inbox: int
    residual_peak: tuple[int, ...]


def allocate(schedule: Schedule, when: Mapping[Action, Timing], messages: Sequence[Message],
             pool_counts: Mapping[Pool, Sequence[Mapping[Hashable, int]]]) -> Allocation:
    """Liveness-sized slots for stored values (per class) and messages (per device).

    ``pool_counts[pool][stage]`` gives, per class, the slots one microbatch of ``stage``
    keeps in ``pool``. All pools of a class share one buffer: parts freed early (I-only
    residuals) make room for others, so its size is the peak of what is live at once.
    """
    from jaxpipe.schedule.liveness import peak_overlap, unit_lifetimes

    D = schedule.num_devices
    steps: dict[tuple[int, int], dict[str, int]] = {}  # (stage, mb) -> kind -> step
    for a, tm in when.items():
        steps.setdefault((a.stage, a.microbatch), {})[a.kind] = tm.step
    classes = sorted({c for counts in pool_counts.values() for row in counts for c in row},
                     key=repr)
    pool_base: dict = {}
    slots = dict.fromkeys(classes, 0)
    per_device, peaks = [], []
    for d in range(D):
        mine = sorted(((a, tm.step) for a, tm in when.items() if tm.device == d),
                      key=lambda x: x[1])
        units = [(a.stage, a.microbatch) for a, _ in mine if a.kind == "F"]
        live = []  # (first step, last step, pool, unit)
        for pool in Pool:
            for unit in units:
                kinds = steps[unit]
                if pool.writer in kinds:
                    last = max((kinds[r] for r in pool.readers if r in kinds),
                               default=kinds[pool.writer])
                    live.append((kinds[pool.writer], last, pool, unit))
        need = {}
        for c in classes:
            off, top = _first_fit([(a, b, pool_counts[pool][unit[0]].get(c, 0), (pool, unit))
                                   for a, b, pool, unit in live])
            pool_base.update({(pool, unit, c): o for (pool, unit), o in off.items()})
            slots[c] = max(slots[c], top)
            need[c] = top
        per_device.append(need)
        # residual *sets* live from F to the last backward action (the simulator's count)
        peaks.append(peak_overlap(unit_lifetimes(mine).values()))
    message_slot: dict = {}
    num_inbox = 0
    for d in range(D):
        # A message to another device arrives at the end of step `sent`; one from the same
        # device is written *during* step `sent`, so it must not share with a message read
        # in that step (start one step earlier).
        off, top = _first_fit([(m.sent - (m.src == m.dst), m.read, 1, (m.producer, m.consumer))
                               for m in messages if m.dst == d])
        message_slot.update(off)
        num_inbox = max(num_inbox, top)
    return Allocation(pool_base, slots, tuple(per_device), message_slot, num_inbox,
                      tuple(peaks))


# ----------------------------------------------------------------------------- step 5
def fill_table(schedule: Schedule, when: Mapping[Action, Timing], messages: Sequence[Message],
               alloc: Allocation, perm_offsets: Sequence[int], units: Sequence[int],
               num_steps: int, tick_end: Callable[[int], int],
               body_of_stage: Sequence[int], num_bodies: int,
               pool_classes: Mapping[Pool, Sequence[Hashable]]) -> TickTable:
    """One row per (step, device); idle rows point at the dummy inbox slot."""
    D = schedule.num_devices
    T = num_steps
    dummy = alloc.num_inbox
    shape = (T, D)
    branch = np.full(shape, IDLE, np.int32)
    stage = np.zeros(shape, np.int32)
    microbatch = np.zeros(shape, np.int32)
    in_slot = np.full(shape, dummy, np.int32)
    local_slot = np.full(shape, dummy, np.int32)
    out_unit = np.zeros((T, D, len(perm_offsets)), np.int32)
    out_unit[:] = np.asarray(units, np.int32)  # the dummy unit of each direction
    recv_slot = np.full((T, D, len(perm_offsets), max(units, default=0)), dummy, np.int32)
    exchange = np.zeros((T, D, len(perm_offsets)), bool)
    keys = [(pool, c) for pool in Pool for c in pool_classes[pool]]
    pool_base = {key: np.zeros(shape, np.int32) for key in keys}

    for a, tm in when.items():
        unit = (a.stage, a.microbatch)
        t, d = tm.step, tm.device
        branch[t, d] = branch_id(a.kind, body_of_stage[a.stage], num_bodies)
        stage[t, d] = a.stage
        microbatch[t, d] = a.microbatch
        for pool, c in keys:
            base = alloc.pool_base.get((pool, unit, c))
            if base is not None and (a.kind == pool.writer or a.kind in pool.readers):
                pool_base[(pool, c)][t, d] = base
    # Units of each (tick, sender, offset), in message order.
    used: dict[tuple[int, int, int], int] = {}
    for msg in messages:
        slot = alloc.message_slot[(msg.producer, msg.consumer)]
        in_slot[msg.read, msg.dst] = slot
        p = when[msg.producer]
        if msg.src == msg.dst:
            local_slot[p.step, p.device] = slot
            continue
        j = list(perm_offsets).index((msg.dst - msg.src) % D)
        r = used.get((p.tick, msg.src, j), 0)
        used[(p.tick, msg.src, j)] = r + 1
        out_unit[p.step, p.device, j] = r
        end = tick_end(p.tick)
        recv_slot[end, msg.dst, j, r] = slot
        exchange[end, :, j] = True
    return TickTable(branch, stage, microbatch, in_slot, local_slot, out_unit, recv_slot,
                     pool_base, exchange)


def lower(schedule: Schedule, pool_counts: Mapping[Pool, Sequence[Mapping[Hashable, int]]],
          body_of_stage: Sequence[int] | None = None, *, split_backward: bool = False
          ) -> Lowering:
    """Lower ``schedule`` (validated here) given what each stage stores per microbatch.

    Args:
      schedule: the schedule.
      pool_counts: for each :class:`Pool`, per stage, slots per value class that one
        microbatch of that stage keeps there (missing pools store nothing).
      body_of_stage: the program body that runs each stage (stages with identical
        functions share one); default one body per stage.
      split_backward: run every B of the schedule as I then W (see :func:`expand`).
    """
    schedule.validate()
    S, D = schedule.num_stages, schedule.num_devices
    if body_of_stage is None:
        body_of_stage = list(range(S))
    counts = {pool: list(pool_counts.get(pool) or [{} for _ in range(S)]) for pool in Pool}
    run, split = expand(schedule, split_backward)
    when = assign_ticks(run)
    num_steps = 1 + max((tm.step for tm in when.values()), default=-1)
    tick_of_step = np.zeros(num_steps, np.int32)
    last_step: dict[int, int] = {}
    for tm in when.values():
        tick_of_step[tm.step] = tm.tick
        last_step[tm.tick] = max(last_step.get(tm.tick, tm.step), tm.step)
    messages = list_messages(run, when, last_step.__getitem__)
    offsets = tuple(sorted({(m.dst - m.src) % D for m in messages} - {0}))
    sends: dict[tuple[int, int, int], int] = {}
    for m in messages:
        if m.src != m.dst:
            key = (when[m.producer].tick, m.src, offsets.index((m.dst - m.src) % D))
            sends[key] = sends.get(key, 0) + 1
    units = tuple(max((n for (_, _, j), n in sends.items() if j == jj), default=0)
                  for jj in range(len(offsets)))
    alloc = allocate(run, when, messages, counts)
    pool_classes = {pool: sorted({c for row in counts[pool] for c in row}, key=repr)
                    for pool in Pool}
    table = fill_table(run, when, messages, alloc, offsets, units, num_steps,
                       last_step.__getitem__, body_of_stage, max(body_of_stage) + 1,
                       pool_classes)
    return Lowering(
        table=table,
        actions=dict(when),
        messages=tuple(messages),
        num_ticks=len(last_step),
        num_steps=num_steps,
        tick_of_step=tick_of_step,
        num_devices=D,
        num_stages=S,
        num_microbatches=schedule.num_microbatches,
        stages_per_device=max(len(schedule.device_stages(d)) for d in range(D)),
        perm_offsets=offsets,
        units=units,
        slots=alloc.slots,
        num_inbox=alloc.num_inbox,
        residual_peak=alloc.residual_peak,
        slots_per_device=alloc.slots_per_device,
        split_backward=split,
    )
