"""How long the SPMD runtime's program takes for a schedule, before anything is built.

What ``schedule="auto"`` (:mod:`jaxpipe.api.auto`) ranks candidates by: the schedule lowered
the way the runtime would lower it (numpy only; no buffers are sized), its time under
the stages' costs in the program's sync model (devices meet at the end of every tick;
the lanes program runs every lane of a tick on every device), plus a fixed overhead per
tick (dispatch, the exchange's latency) and a cost per byte a device stores per tick (the
tick loop carries its residual buffers through every tick: GPipe, which stores every
microbatch's residuals, runs the same work in the same ticks as 1F1B, and measured
slower). Both constants are measured by ``jaxpipe calibrate`` (:mod:`.calibrate`), else
:data:`~.backends.TICK_OVERHEAD_FLOPS` and :data:`~.backends.STORED_BYTE_TICK_FLOPS`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxpipe.runtime.spmd.backends import TICK_OVERHEAD_FLOPS, exchange_flops
from jaxpipe.runtime.spmd.calibrate import stored_byte_flops, tick_overhead_flops
from jaxpipe.runtime.spmd.lowering import (
    CONCURRENT_CPU_EXCHANGE,
    CPU_EXCHANGE,
    lower,
    lower_accelerator,
)
from jaxpipe.runtime.spmd.lowering.lanes import lanes_makespan, lanes_refusal, lower_lanes
from jaxpipe.runtime.spmd.lowering.sync import lowered_makespan
from jaxpipe.schedule import Action, Schedule
from jaxpipe.schedule.simulate import resolve_costs

__all__ = ["carried_bytes", "cpu_lowering", "predicted_time", "program_work"]


def cpu_lowering(concurrent: bool, costed: bool) -> dict[str, Any]:
    """How the CPU program is lowered (:func:`~.lowering.lower`'s ``exchange`` and
    ``tick_cost``): lazily where devices run concurrently (several processes), and, where
    the actions have costs (the cutter's FLOPs), with a tick's fixed cost on top of the
    sync model's makespan, so that fewer meetings are not bought with more ticks. The
    default cost, not a kept calibration: every process must lower to the same table,
    and hosts may keep different calibrations."""
    return {"exchange": CONCURRENT_CPU_EXCHANGE if concurrent else CPU_EXCHANGE,
            "tick_cost": TICK_OVERHEAD_FLOPS["cpu"] if costed else 0.0}


def carried_bytes(num_devices: int, ticks: int, stored_bytes: float, concurrent: bool
                  ) -> float:
    """Bytes x ticks the tick loop carries when a device stores ``stored_bytes``: each
    device carries its own every tick, and devices that take turns (``concurrent=False``)
    add up."""
    return ticks * stored_bytes * (1 if concurrent else num_devices)


def predicted_time(schedule: Schedule, action_cost: Callable[[Action], float] | None,
                   backend: str, lanes: bool, split_backward: bool, refine: int,
                   concurrent: bool = True, message_bytes: int = 0,
                   stored_bytes: float = 0.0) -> tuple[float, int]:
    """``(time, ticks)``: :func:`program_work` plus the fixed cost of every tick and the
    cost of carrying ``stored_bytes`` (a device's residual buffers) through every tick,
    in FLOPs of compute time (calibrated on this machine where ``jaxpipe calibrate`` ran,
    :mod:`.calibrate`). Devices that take turns (``concurrent=False``) each carry theirs."""
    work, ticks = program_work(schedule, action_cost, backend, lanes, split_backward, refine,
                               concurrent, message_bytes)
    carried = carried_bytes(schedule.num_devices, ticks, stored_bytes, concurrent)
    return (work + ticks * tick_overhead_flops(backend, concurrent)
            + carried * stored_byte_flops(backend, concurrent)), ticks


def program_work(schedule: Schedule, action_cost: Callable[[Action], float] | None,
                 backend: str, lanes: bool, split_backward: bool, refine: int,
                 concurrent: bool = True, message_bytes: int = 0) -> tuple[float, int]:
    """``(time without the per-tick cost, ticks)`` of the program for ``schedule`` (in
    the units of ``action_cost``, FLOPs from the cutter): ``lanes`` where the lanes
    program would run (and can), else the ``backend``'s program, split backwards and
    ``refine`` as the runtime would lower them. ``concurrent=False`` (virtual CPU devices
    of one process, which take turns): the devices' work adds up, so the time is all the
    work the program computes (an idle lane's too), not its makespan."""
    cost = resolve_costs(action_cost)
    S = schedule.num_stages
    if lanes and lanes_refusal(schedule, [0] * S, split_backward) is None:
        low = lower_lanes(schedule, {})
        time = lanes_makespan(low, cost)
        if not concurrent:  # every device computes every lane of a tick
            time *= schedule.num_devices
    elif not concurrent or backend == "cpu":
        low = lower(schedule, {}, split_backward=split_backward, costs=action_cost,
                    refine=refine, **cpu_lowering(concurrent, action_cost is not None))
        time = (lowered_makespan(low, cost) if concurrent
                else sum(cost(a) for a in schedule.graph().actions))
    else:
        low = lower_accelerator(schedule, {}, split_backward=split_backward,
                                costs=action_cost, refine=refine, overlap=False)
        time = lowered_makespan(low, cost, exchange_flops(backend, message_bytes))
    return time, low.num_ticks
