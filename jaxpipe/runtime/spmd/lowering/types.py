"""The lowering's data types: what each step hands to the next and to the program.

It imports only the other type modules (:mod:`.pools`, :mod:`.tick_table`), so the
steps of the lowering (:mod:`.ticks`, :mod:`.messages`, :mod:`.allocate`, :mod:`.table`),
the sync model (:mod:`.sync`), the local search (:mod:`.refine`) and the program builders
all read the same types without importing each other.

- :class:`Ticks`: when every action runs (device, tick, step);
- :class:`Messages`: every value moved between actions, and when;
- :class:`Exchange`: how the program moves messages (which pairs meet at a tick's end,
  and after how many ticks a message can be read);
- :class:`Allocation`: where stored values (in the parts of :class:`.pools.Pool`)
  and messages live;
- :class:`Lowering`: all of it for one schedule, with its :class:`.tick_table.TickTable`
  (one row of integer fields per (step, device)), what the program is built from.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from jaxpipe.runtime.spmd.lowering.pools import Pool
from jaxpipe.runtime.spmd.lowering.tick_table import TickTable
from jaxpipe.schedule import Action
from jaxpipe.schedule.graph import KI, ScheduleGraph

__all__ = ["ACCELERATOR_EXCHANGE", "CONCURRENT_CPU_EXCHANGE", "CPU_EXCHANGE",
           "OVERLAPPED_EXCHANGE", "Allocation", "Exchange", "Lowering", "Message",
           "Messages", "Pool", "Ticks", "Timing"]



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

    def tick_of(self, steps: np.ndarray) -> np.ndarray:
        """The tick each of ``steps`` belongs to."""
        return np.searchsorted(self.tick_end, steps)

    def timing(self) -> dict[Action, Timing]:
        return {a: Timing(int(d), int(t), int(s)) for a, d, t, s in
                zip(self.graph.actions, self.device, self.tick, self.step, strict=True)}


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


@dataclass(frozen=True)
class Exchange:
    """How the program moves messages between devices at the end of a tick.

    Attributes:
      every_tick: at every tick's end every pair that ever exchanges a message over a
        direction meets (one unconditional permutation per direction, what the
        accelerator program runs); else only the pairs that carry a message at that tick
        (the CPU program, which skips the exchange on ticks without messages).
      delay: ticks from the tick that produces a message to the first tick that may read
        it on another device: 1 (it moves at that tick's end), or 2 (it moves during the
        next tick, overlapping that tick's compute: the accelerator program's
        double-buffered outbox).
      lazy: a message moves at the end of any tick from its producer's to the one before
        its reader's, together with the others between the same two devices: at as few
        tick ends as the readers allow (:func:`~.messages.merge_exchanges`); only where
        pairs meet when messages move (not ``every_tick``).
    """

    every_tick: bool = False
    delay: int = 1
    lazy: bool = False

    def __post_init__(self) -> None:
        if self.delay not in (1, 2):
            raise ValueError(f"Exchange.delay must be 1 or 2 ticks, got {self.delay}")
        if self.lazy and self.every_tick:
            raise ValueError("Exchange.lazy merges the tick ends where messages move; a "
                             "program that exchanges every tick meets at all of them "
                             "(pass lazy=False)")


#: The CPU program's exchange: only the pairs with a message meet, at the producing tick's
#: end.
CPU_EXCHANGE = Exchange()
#: ... and where its devices run concurrently (several processes): lazily, at as few tick
#: ends as the readers allow (2 processes, MLP 8 x 512, Interleaved1F1B p=2: 2-8% faster
#: a step). In one process, where devices take turns, nobody waits for a meeting: on the
#: same ticks it measured within 2% (Interleaved1F1B p=4 m=8, MLP).
CONCURRENT_CPU_EXCHANGE = Exchange(lazy=True)
#: The accelerator program's: every pair every tick, without or with the overlap (the
#: previous tick's outbox sent during the next tick).
ACCELERATOR_EXCHANGE = Exchange(every_tick=True)
OVERLAPPED_EXCHANGE = Exchange(every_tick=True, delay=2)


@dataclass(frozen=True)
class Allocation:
    """Where stored values and messages live (output of :func:`allocate`).

    Attributes:
      base: per (pool, class), per action (``graph.actions`` order), the first slot the
        action writes or reads that pool's part at (-1: the action does not touch it).
      slots: per class, slots per device (the maximum over devices).
      slots_per_device: per device, slots per class it needs.
      message_slot: per message, its inbox slot.
      num_inbox: inbox slots per device (the maximum over devices).
      residual_peak: per device, the most residual sets live at once.
    """

    base: dict[tuple[Pool, Hashable], np.ndarray]
    slots: dict[Hashable, int]
    slots_per_device: tuple[dict[Hashable, int], ...]
    message_slot: np.ndarray
    num_inbox: int
    residual_peak: tuple[int, ...]


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
      units: outbox units per offset (the most messages a device sends over it in one
        exchange: a tick's, or with a lazy exchange, a meeting's).
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
      exchange: how messages move between devices (:class:`Exchange`).
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
    exchange: Exchange = CPU_EXCHANGE

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

    @functools.cached_property
    def fixed_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """``(senders, receivers)``: every pair some permutation lists at some tick, what
        the accelerator program's permutations list every tick."""
        D = self.num_devices
        pairs = sorted({(s, (s + off) % D)
                        for off, patterns in zip(self.perm_offsets, self.perm_patterns,
                                                 strict=True)
                        for senders in patterns for s in senders})
        return (np.array([s for s, _ in pairs], np.int64),
                np.array([r for _, r in pairs], np.int64))

    @property
    def used_branches(self) -> frozenset[int]:
        """Branch ids some device runs (the program compiles only these)."""
        return frozenset(int(b) for b in np.unique(self.table.branch))
