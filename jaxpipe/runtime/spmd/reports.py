"""The SPMD executor's reports: memory, timing, the program it runs, its fingerprint.

:class:`ExecutorReports` reads only what :class:`~.executor.SpmdExecutor` exposes: its
lowering, layouts, bodies, backend, the lanes choice and its tick loops.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from jaxpipe.runtime.spmd.lowering.lanes import lanes_makespan
from jaxpipe.runtime.spmd.lowering.sync import sync_report
from jaxpipe.schedule.simulate import resolve_costs

__all__ = ["ExecutorReports"]


class ExecutorReports:
    """The reports of an SPMD executor (mixed into it)."""

    def switch_bytes(self) -> dict[str, int] | None:
        """In the accelerator program, the bytes every tick returns from its switch and
        writes into the buffers: stored rows (``"rows"``) and gradients (``"grad"``;
        a port a step does not use is left uninitialised and masked out after the switch:
        the price of keeping the buffers out of the conditional). Known once a
        value-and-grad step was traced; ``None`` before, and in the CPU program."""
        for loop in self.tick_loops:
            ports = loop.ports
            if ports is not None:
                return {"rows": ports.nbytes("rows"), "grad": ports.nbytes("grad")}
        return None

    def memory_report(self) -> dict[str, Any]:
        low, lay = self.lowering, self.layouts

        def held(c: Any) -> int:  # a device's shard of a value of class c (typed dims)
            return c.nbytes // self.spec.shards(c.dims)

        store_bytes = sum(held(c) * n for c, n in low.slots.items())
        msg = (sum(held(c) * n for c, n in lay.unit.items())
               * (low.num_inbox + 1 + sum(max(k, 1) for k in low.units)))
        return {
            # parameters and gradients: each device's shards
            "buffer_bytes": 2 * sum(held(c) for c in lay.slots.classes) + store_bytes + msg,
            "device_rows": [
                {"residual_peak": low.residual_peak[d],
                 "residual_bytes": sum(held(c) * n
                                       for c, n in low.slots_per_device[d].items())}
                for d in range(low.num_devices)],
            "stage_residual_bytes": [p.nbytes() for p in lay.residuals],
        }

    def timing_report(self, cost: Any, *, schedule_makespan: float | None = None) -> str:
        """The lowered program against the schedule under the sync model (see
        :mod:`.lowering.sync`), e.g. ``lowered efficiency 0.982 (...)``."""
        report = sync_report(self.spec.schedule, self.lowering, cost,
                             async_makespan=schedule_makespan)
        if self.lanes:  # every lane of a tick's segment runs on every device
            lanes = lanes_makespan(self.lowering, resolve_costs(cost))
            report = dataclasses.replace(report, lowered_makespan=lanes,
                                         efficiency=report.async_makespan / lanes)
        return "lowered program: " + report.summary()

    def program_report(self) -> str:
        """Which program runs and where the stages' compute sits, e.g. ``program: lanes
        (1 shared body, forward then backward lane every tick, no stage compute or
        collective under a conditional; 6 ticks in 3 segments)``."""
        low = self.lowering
        bodies = f"{len(self.bodies)} bod{'y' if len(self.bodies) == 1 else 'ies'}"
        if self.lanes:
            segs = self.tick_loops[0].segments
            return (f"program: lanes ({bodies}, a forward and a backward lane every tick, "
                    f"no stage compute or collective under a conditional; {low.num_ticks} "
                    f"ticks in {len(segs)} segments)")
        overlap = "on" if low.exchange.delay == 2 else "off"
        where = ("one switch a tick holds every stage's compute and its collectives; "
                 f"overlap {overlap}" if self.accelerated else
                 "every stage in a gated loop, its collectives under it")
        why = f"; lanes not used: {self.lanes_refused}" if self.lanes_refused else ""
        return (f"program: {self.backend} ({bodies}, {low.num_ticks} ticks, {where}{why})")

    def fingerprint(self) -> dict[str, str]:
        digest = hashlib.sha256(self.lowering.table.digest_bytes()).hexdigest()[:16]
        return {"table_sha256": digest, "num_steps": str(self.lowering.num_steps),
                "bodies": str(len(self.bodies))}
