"""Lower a validated schedule to the static tables the SPMD program scans over.

The lowering runs in four small steps, each a function of its own:

1. :func:`assign_ticks` — when every action runs: device and tick. Today one action per
   device per tick, ticks from simulating the schedule with unit cost per action (each
   device runs its actions in order, each as soon as its inputs exist; a value sent at
   the end of tick t can be used at tick t+1).
2. :func:`list_messages` — every value that crosses from one action to another: the
   stage carry (F -> next stage's F) and the cotangent (B/I -> previous stage's B/I),
   with the ticks and devices at both ends.
3. :func:`allocate` — buffers sized by liveness. A residual set lives from its F to its
   last reader (B, or W when the backward is split), in parts (:class:`Pool`); all parts
   share one flat storage per dtype with first-fit offsets, so a device holding few large
   residual sets and one holding many small ones both pay only what is live at once.
   A message lives from the end of the tick that sends it to the tick that reads it, in
   fixed-size inbox slots.
4. :func:`fill_table` — one row per (step, device) of the typed :class:`TickTable`.

The result, :class:`Lowering`, is read by name by the program (:mod:`.program`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
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
    "allocate",
    "assign_ticks",
    "branch_id",
    "fill_table",
    "list_messages",
    "lower",
]

#: Branch id of a step in which a device does nothing.
IDLE = 0


def branch_id(kind: str, stage: int, num_stages: int) -> int:
    """The program branch that runs ``kind`` for ``stage`` (:data:`IDLE` is 0)."""
    return 1 + ACTION_KINDS.index(kind) * num_stages + stage


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


#: (pool, dtype name): one column of storage offsets.
PoolKey = tuple[Pool, str]


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class TickTable:
    """Integer fields of every (step, device); the program scans over the steps.

    Every array's leading axes are ``[steps, devices]``. A pytree, so the program passes
    it to ``lax.scan`` whole and reads a row's fields by name.

    Attributes:
      branch: the branch to run (:func:`branch_id`, or :data:`IDLE`).
      microbatch: the action's microbatch.
      in_slot: inbox slot holding the action's input message (stage carry or cotangent).
      local_dst: inbox slot for a message the device sends to itself (the turn of a
        V-shaped placement); the dummy slot otherwise.
      recv_slot: ``[steps, devices, offsets]``: inbox slot where the message arriving over
        each permutation offset at the end of the step is stored (dummy if none).
      pool_write / pool_read: per (pool, dtype), the offset into the device's storage of
        that dtype where the action writes / reads that pool's part of its stored values.
      exchange: ``[steps, offsets]`` bool: the permutation over that offset runs at the
        end of the step (someone sends over it).
    """

    branch: np.ndarray
    microbatch: np.ndarray
    in_slot: np.ndarray
    local_dst: np.ndarray
    recv_slot: np.ndarray
    pool_write: dict[PoolKey, np.ndarray]
    pool_read: dict[PoolKey, np.ndarray]
    exchange: np.ndarray

    @property
    def num_steps(self) -> int:
        return int(self.branch.shape[0])

    def digest_bytes(self) -> bytes:
        """Every field, in a fixed order (for cross-process consistency checks)."""
        parts = [self.branch, self.microbatch, self.in_slot, self.local_dst, self.recv_slot,
                 self.exchange]
        for key in sorted(self.pool_write):
            parts += [self.pool_write[key], self.pool_read[key]]
        return b"".join(np.ascontiguousarray(p).tobytes() + str(p.shape).encode()
                        for p in parts)


@dataclass(frozen=True)
class Message:
    """A value produced by one action and read by another."""

    producer: Action
    consumer: Action
    src: int  # device of the producer
    dst: int  # device of the consumer
    sent: int  # tick of the producer (the value moves at its end)
    read: int  # tick of the consumer


@dataclass(frozen=True)
class Lowering:
    """Static tables and buffer sizes for one (schedule, stage sizes) pair.

    Attributes:
      table: the per-step fields (:class:`TickTable`).
      num_ticks: ticks of the lowered program (a tick may span several steps when
        actions are grouped; today one step per tick).
      num_devices, num_stages, num_microbatches: of the schedule.
      stages_per_device: the most stages any device holds (the SPMD buffer shape).
      perm_offsets: each permutation sends device d to (d + offset) % devices.
      storage: elements per dtype of each device's residual storage (the maximum over
        devices, since all devices run one program).
      num_inbox: message slots per device (maximum over devices); slot ``num_inbox`` is
        the dummy that idle writes go to.
      residual_peak: per device, the most residual sets live at once.
      storage_per_device: per device, elements per dtype it actually needs.
    """

    table: TickTable
    num_ticks: int
    num_devices: int
    num_stages: int
    num_microbatches: int
    stages_per_device: int
    perm_offsets: tuple[int, ...]
    storage: dict[str, int]
    num_inbox: int
    residual_peak: tuple[int, ...]
    storage_per_device: tuple[dict[str, int], ...]

    @property
    def used_branches(self) -> frozenset[int]:
        """Branch ids some device runs (the program compiles only these)."""
        return frozenset(int(b) for b in np.unique(self.table.branch))


# ----------------------------------------------------------------------------- step 1
#: Cost per action kind used to assign ticks: one tick per action.
UNIT_COSTS = {"F": 1, "B": 1, "I": 1, "W": 1}


def assign_ticks(schedule: Schedule) -> dict[Action, tuple[int, int]]:
    """``action -> (device, tick)``: the unit-cost simulation's start times."""
    timeline = schedule.simulate(costs=UNIT_COSTS)
    when = {}
    for ev in timeline.events:
        if int(ev.start) != ev.start:
            raise AssertionError(f"non-integral tick for {ev.action}")
        when[ev.action] = (ev.device, int(ev.start))
    return when


# ----------------------------------------------------------------------------- step 2
def list_messages(schedule: Schedule, when: Mapping[Action, tuple[int, int]]) -> list[Message]:
    """Every stage carry and cotangent the schedule moves, in a deterministic order."""
    S = schedule.num_stages
    split = schedule.split_units()

    def cotangent_reader(stage: int, mb: int) -> Action:
        return Action("I" if (stage, mb) in split else "B", stage, mb)

    out = []
    for a in sorted(when, key=lambda a: (when[a][1], when[a][0], str(a))):
        if a.kind == "F" and a.stage < S - 1:
            consumer = Action("F", a.stage + 1, a.microbatch)
        elif a.kind in ("B", "I") and a.stage > 0:
            consumer = cotangent_reader(a.stage - 1, a.microbatch)
        else:
            continue
        (src, sent), (dst, read) = when[a], when[consumer]
        out.append(Message(a, consumer, src, dst, sent, read))
    return out


# ----------------------------------------------------------------------------- step 3
def _first_fit(intervals: Sequence[tuple[int, int, int, object]]) -> tuple[dict, int]:
    """Offsets for ``(start, end, size, key)`` values live over ticks ``(start, end]``.

    A value is written at the end of the action of tick ``start`` (or by it) and last read
    at tick ``end``, so two values may share addresses when one is last read in the tick
    whose action writes the other: the program finishes an action's reads before its
    writes.
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

    pool_offset: dict[tuple[Pool, tuple[int, int], str], int]  # (pool, (stage, mb), dtype)
    storage: dict[str, int]
    storage_per_device: tuple[dict[str, int], ...]
    message_slot: dict[tuple[Action, Action], int]
    num_inbox: int
    residual_peak: tuple[int, ...]


def allocate(schedule: Schedule, when: Mapping[Action, tuple[int, int]],
             messages: Sequence[Message],
             pool_sizes: Mapping[Pool, Sequence[Mapping[str, int]]]) -> Allocation:
    """Liveness-sized storage offsets and inbox slots.

    ``pool_sizes[pool][stage]`` gives the elements per dtype one microbatch of ``stage``
    keeps in ``pool``. Every pool shares one storage per dtype: parts freed early
    (I-only residuals) make room for others, so the size is the peak of what is live at
    once, not a sum of per-pool peaks.
    """
    from jaxpipe.schedule.liveness import peak_overlap, unit_lifetimes

    D = schedule.num_devices
    ticks: dict[tuple[int, int], dict[str, int]] = {}  # (stage, mb) -> kind -> tick
    for a, (_, t) in when.items():
        ticks.setdefault((a.stage, a.microbatch), {})[a.kind] = t
    dtypes = sorted({k for sizes in pool_sizes.values() for row in sizes for k in row})
    pool_offset: dict = {}
    storage = dict.fromkeys(dtypes, 0)
    per_device, peaks = [], []
    for d in range(D):
        mine = sorted(((a, t) for a, (dd, t) in when.items() if dd == d), key=lambda x: x[1])
        units = [(a.stage, a.microbatch) for a, _ in mine if a.kind == "F"]
        live = []  # (first tick, last tick, pool, unit)
        for pool in Pool:
            for unit in units:
                kinds = ticks[unit]
                if pool.writer in kinds:
                    last = max((kinds[r] for r in pool.readers if r in kinds),
                               default=kinds[pool.writer])
                    live.append((kinds[pool.writer], last, pool, unit))
        need = {}
        for k in dtypes:
            off, top = _first_fit([(a, b, pool_sizes[pool][unit[0]].get(k, 0), (pool, unit))
                                   for a, b, pool, unit in live])
            pool_offset.update({(pool, unit, k): o for (pool, unit), o in off.items()})
            storage[k] = max(storage[k], top)
            need[k] = top
        per_device.append(need)
        # residual *sets* live from F to the last backward action (the simulator's count)
        peaks.append(peak_overlap(unit_lifetimes(mine).values()))
    message_slot: dict = {}
    num_inbox = 0
    for d in range(D):
        # a message arrives at the end of tick `sent` and is read at tick `read`
        off, top = _first_fit([(m.sent, m.read, 1, (m.producer, m.consumer))
                               for m in messages if m.dst == d])
        message_slot.update(off)
        num_inbox = max(num_inbox, top)
    return Allocation(pool_offset, storage, tuple(per_device), message_slot, num_inbox,
                      tuple(peaks))


# ----------------------------------------------------------------------------- step 4
def fill_table(schedule: Schedule, when: Mapping[Action, tuple[int, int]],
               messages: Sequence[Message], alloc: Allocation,
               perm_offsets: Sequence[int], dtypes_of: Mapping[Pool, Sequence[str]]
               ) -> TickTable:
    """One row per (step, device); idle rows point at the dummy inbox slot."""
    S, D = schedule.num_stages, schedule.num_devices
    T = 1 + max((t for _, t in when.values()), default=-1)
    dummy = alloc.num_inbox
    shape = (T, D)
    branch = np.full(shape, IDLE, np.int32)
    microbatch = np.zeros(shape, np.int32)
    in_slot = np.full(shape, dummy, np.int32)
    local_dst = np.full(shape, dummy, np.int32)
    recv_slot = np.full((T, D, len(perm_offsets)), dummy, np.int32)
    exchange = np.zeros((T, len(perm_offsets)), bool)
    keys = [(pool, k) for pool in Pool for k in dtypes_of[pool]]
    pool_write = {key: np.zeros(shape, np.int32) for key in keys}
    pool_read = {key: np.zeros(shape, np.int32) for key in keys}

    for a, (d, t) in when.items():
        unit = (a.stage, a.microbatch)
        branch[t, d] = branch_id(a.kind, a.stage, S)
        microbatch[t, d] = a.microbatch
        for pool, k in keys:
            off = alloc.pool_offset.get((pool, unit, k))
            if off is None:
                continue
            if a.kind == pool.writer:
                pool_write[(pool, k)][t, d] = off
            elif a.kind in pool.readers:
                pool_read[(pool, k)][t, d] = off
    for msg in messages:
        slot = alloc.message_slot[(msg.producer, msg.consumer)]
        in_slot[msg.read, msg.dst] = slot
        if msg.src == msg.dst:
            local_dst[msg.sent, msg.src] = slot
        else:
            j = list(perm_offsets).index((msg.dst - msg.src) % D)
            recv_slot[msg.sent, msg.dst, j] = slot
            exchange[msg.sent, j] = True
    return TickTable(branch, microbatch, in_slot, local_dst, recv_slot, pool_write, pool_read,
                     exchange)


def lower(schedule: Schedule, pool_sizes: Mapping[Pool, Sequence[Mapping[str, int]]]
          ) -> Lowering:
    """Lower ``schedule`` (validated here) given what each stage stores per microbatch.

    Args:
      schedule: the schedule.
      pool_sizes: for each :class:`Pool`, per stage, elements per dtype that one
        microbatch of that stage keeps there (missing pools store nothing).
    """
    schedule.validate()
    S, D = schedule.num_stages, schedule.num_devices
    sizes = {pool: list(pool_sizes.get(pool) or [{} for _ in range(S)]) for pool in Pool}
    when = assign_ticks(schedule)
    messages = list_messages(schedule, when)
    offsets = tuple(sorted({(m.dst - m.src) % D for m in messages} - {0}))
    alloc = allocate(schedule, when, messages, sizes)
    dtypes_of = {pool: sorted({k for row in sizes[pool] for k in row}) for pool in Pool}
    table = fill_table(schedule, when, messages, alloc, offsets, dtypes_of)
    return Lowering(
        table=table,
        num_ticks=table.num_steps,
        num_devices=D,
        num_stages=S,
        num_microbatches=schedule.num_microbatches,
        stages_per_device=max(len(schedule.device_stages(d)) for d in range(D)),
        perm_offsets=offsets,
        storage=alloc.storage,
        num_inbox=alloc.num_inbox,
        residual_peak=alloc.residual_peak,
        storage_per_device=alloc.storage_per_device,
    )
