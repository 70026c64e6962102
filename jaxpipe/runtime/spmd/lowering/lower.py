"""Lower a validated schedule to the static tables the SPMD program scans over.

The lowering runs in small steps, each a module of its own:

1. :func:`~.ticks.expand` -- the actions the program runs (a full backward optionally
   run as I then W).
2. :func:`~.ticks.assign_ticks` -- when every action runs: its tick and its step within
   the tick. Given per-action costs, ticks follow the simulation with those costs
   instead where the sync model (:mod:`.sync`) says that runs faster (``tick_cost`` a
   tick on top), and a local search (:mod:`.refine`) moves actions between ticks from
   there.
3. :func:`~.messages.list_messages` -- every value that crosses from one action to
   another, and where the exchange is lazy, the tick end each moves at
   (:func:`~.messages.merge_exchanges`).
4. :func:`~.allocate.allocate` -- buffers sized by liveness, per value class. A stored
   value lives from the step that writes it to its last reader's step; a message from
   its arrival to the step that reads it. Slots are assigned first-fit, so a buffer has
   as many slots as are live at once on the busiest device.
5. :func:`~.table.fill_table` -- one row per (step, device) of the typed
   :class:`~.tick_table.TickTable`, and each direction's sender sets (the permutation of a
   tick lists only the pairs that exchange then).

The result, :class:`~.types.Lowering`, is what the program (:mod:`..program`) is built
from.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxpipe.runtime.spmd.lowering.allocate import allocate
from jaxpipe.runtime.spmd.lowering.fusion import fused_backwards, fusing_saves_memory
from jaxpipe.runtime.spmd.lowering.messages import list_messages, merge_exchanges
from jaxpipe.runtime.spmd.lowering.refine import refine
from jaxpipe.runtime.spmd.lowering.sync import lowered_makespan, split_cost, ticks_makespan
from jaxpipe.runtime.spmd.lowering.table import fill_table, offset_index
from jaxpipe.runtime.spmd.lowering.ticks import assign_ticks, expand
from jaxpipe.runtime.spmd.lowering.types import (
    ACCELERATOR_EXCHANGE,
    CPU_EXCHANGE,
    OVERLAPPED_EXCHANGE,
    Allocation,
    Exchange,
    Lowering,
    Messages,
    Pool,
    Ticks,
)
from jaxpipe.schedule import Action, Schedule
from jaxpipe.schedule.graph import KB, paused_gc
from jaxpipe.schedule.simulate import resolve_costs

__all__ = ["lower", "lower_accelerator", "lowering_of"]


def lower(schedule: Schedule, pool_counts: Mapping[Pool, Sequence[Mapping[Hashable, int]]],
          body_of_stage: Sequence[int] | None = None, *, split_backward: bool = False,
          iw_same_tick: bool = False, fuse_fb: bool | str = False,
          max_patterns: int | None = None,
          costs: Callable[[Action], float] | None = None, refine: int = 0,
          exchange: Exchange = CPU_EXCHANGE, tick_cost: float = 0.0) -> Lowering:
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
      costs: per-action costs; ticks then follow them where the sync model says that
        runs faster (:mod:`.sync`).
      refine: evaluations of the local search over ticks (:mod:`.refine`; needs
        ``costs``).
      exchange: how the program moves messages (:class:`~.types.Exchange`): which pairs
        meet at a tick's end, and after how many ticks another device can read a message.
      tick_cost: the program's fixed cost of a tick (dispatch, the step's gated loops),
        in the units of ``costs``: ticks are chosen by the sync model's makespan plus this
        per tick (where waiting less would take more ticks).
    """
    if tick_cost < 0:
        raise ValueError(f"tick_cost must be >= 0, got {tick_cost}")
    if exchange.every_tick and iw_same_tick:
        raise ValueError("iw_same_tick packs a W into its I's tick as a second step; a "
                         "program that exchanges every tick runs one step per tick "
                         "(pass iw_same_tick=False)")
    with paused_gc():
        return _lower(schedule, pool_counts, body_of_stage, split_backward, iw_same_tick,
                      fuse_fb, max_patterns, costs, refine, exchange, tick_cost)


def lower_accelerator(schedule: Schedule,
                      pool_counts: Mapping[Pool, Sequence[Mapping[Hashable, int]]],
                      body_of_stage: Sequence[int] | None = None, *,
                      overlap: bool | str = "auto", transfer: float = 0.0,
                      costs: Callable[[Action], float] | None = None,
                      **options: Any) -> Lowering:
    """:func:`lower` for the accelerator program: one step per tick, every pair meets at
    every tick's end, and with ``overlap`` a message moves during the tick after the one
    that produced it (the program sends the previous tick's outbox, so the transfer
    overlaps the compute) at the price of one more tick before another device can read
    it.

    ``overlap="auto"`` lowers both ways and keeps the one the sync model says runs
    faster with ``transfer`` (a permutation's time, in the units of ``costs``; default
    costs F=1, B=2, I=W=1): without a transfer time the extra tick only costs, so it is
    off. ``options``: the other arguments of :func:`lower`.
    """
    if overlap not in (True, False, "auto"):
        raise ValueError(f"overlap must be True, False or 'auto', got {overlap!r}")
    ways = [False, True] if overlap == "auto" else [bool(overlap)]
    lowered = [lower(schedule, pool_counts, body_of_stage, costs=costs,
                     exchange=OVERLAPPED_EXCHANGE if way else ACCELERATOR_EXCHANGE, **options)
               for way in ways]
    if len(lowered) == 1:
        return lowered[0]
    cost = resolve_costs(costs)
    times = [lowered_makespan(low, cost, transfer) for low in lowered]
    return lowered[int(times[1] < times[0] * (1 - 1e-9))]


def _lower(schedule: Schedule, pool_counts: Mapping[Pool, Sequence[Mapping[Hashable, int]]],
           body_of_stage: Sequence[int] | None, split_backward: bool,
           iw_same_tick: bool, fuse_fb: bool | str, max_patterns: int | None,
           costs: Callable[[Action], float] | None, refine: int,
           exchange: Exchange, tick_cost: float) -> Lowering:
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
                                     refine, exchange, tick_cost)
    if fuse_fb == "auto" and fused_backwards(ticks.graph).any():
        fused = _placed(run, split, iw_same_tick, True, counts, costs, refine, exchange,
                        tick_cost)
        if fusing_saves_memory(alloc, fused[2], fused[0], counts):
            ticks, messages, alloc = fused
    return lowering_of(schedule, ticks, messages, alloc, counts, body_of_stage, max_patterns,
                       split, exchange)


def lowering_of(schedule: Schedule, ticks: Ticks, messages: Messages, alloc: Allocation,
                counts: Mapping[Pool, Sequence[Mapping[Hashable, int]]],
                body_of_stage: Sequence[int], max_patterns: int, split: frozenset,
                exchange: Exchange) -> Lowering:
    """The :class:`Lowering` of placed ticks, their messages and buffers (step 5)."""
    S, D = schedule.num_stages, schedule.num_devices
    remote = messages.src != messages.dst
    offsets = tuple(sorted({int(x) for x in (messages.dst - messages.src)[remote] % D}))
    src, dst = messages.src[remote], messages.dst[remote]
    j = offset_index(offsets, (dst - src) % D)
    # per direction, the most messages one device sends that way in one exchange
    send = (messages.sent[remote] * D + src) * len(offsets) + j
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
        tick_of_step=ticks.tick_of(np.arange(ticks.num_steps)),
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
        exchange=exchange,
    )


def _placed(run: Schedule, split: frozenset, iw_same_tick: bool, fuse_fb: bool,
            counts: Mapping[Pool, Sequence[Mapping[Hashable, int]]],
            costs: Callable[[Action], float] | None, refine_evals: int,
            exchange: Exchange, tick_cost: float) -> tuple[Ticks, Messages, Allocation]:
    """Ticks, messages and buffers: the unit-cost ticks, or with ``costs`` whichever of
    them and the cost-grid ticks (:func:`assign_ticks`, both roundings) the sync model
    says runs fastest (``tick_cost`` a tick on top), then refined by a local search
    (:mod:`.refine`), among those that need no more buffer slots."""
    delay = exchange.delay
    ticks = assign_ticks(run, iw_same_tick, fuse_fb, delay=delay)
    messages = _messages(ticks, exchange)
    alloc = allocate(ticks, messages, counts)
    if costs is None:
        return ticks, messages, alloc
    def fits(cand: Allocation) -> bool:
        return (cand.num_inbox <= alloc.num_inbox
                and all(n <= alloc.slots.get(k, 0) for k, n in cand.slots.items()))

    cost = split_cost(costs, split)
    c = np.array([cost(a) for a in ticks.graph.actions], np.float64)

    def time_of(t: Ticks, msgs: Messages) -> float:
        return ticks_makespan(t, msgs, c, exchange) + tick_cost * t.num_ticks

    best, best_time = (ticks, messages, alloc), time_of(ticks, messages)
    for nearest in (False, True):
        grid = assign_ticks(run, iw_same_tick, fuse_fb, c, nearest, delay)
        grid_messages = _messages(grid, exchange)
        time = time_of(grid, grid_messages)
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
            msgs = _messages(t, exchange)
            placed[id(t)] = (t, msgs, allocate(t, msgs, counts))  # t stays alive: id unique
            return fits(placed[id(t)][2])

        refined = refine(start, c, refine_evals, placed_fits, exchange=exchange,
                         tick_cost=tick_cost)
        if refined is not None:  # faster under time_of's model: the search times it too
            best = placed[id(refined)]
    return best


def _messages(ticks: Ticks, exchange: Exchange) -> Messages:
    messages = list_messages(ticks, exchange.delay)
    return merge_exchanges(ticks, messages) if exchange.lazy else messages


