"""ZB-H1: zero-bubble pipeline schedule with 1F1B's peak memory (Qi, Wan, Huang, Lin,
"Zero Bubble Pipeline Parallelism", ICLR 2024, section 3.1 / figure 3).

The backward of a stage splits into ``I`` (gradient w.r.t. the stage *input*,
which the previous stage is waiting for) and ``W`` (gradient w.r.t. the stage
*weights*, which nobody waits for). Run ``I`` as early as possible so the
cotangent races up the pipeline, and push ``W`` later, into time that would
otherwise be idle.

Order on device ``d`` (one stage per device, ``p`` devices, ``m`` microbatches):

    warm-up:  F0 .. F(w-1)                 w = min(p - d, m)  (1F1B's count)
    steady:   for k = 0 .. m-1:  I(k), then W(k - d) if k >= d, then the next F
    tail:     the W's still owed, oldest first

Device ``d`` runs its W's ``d`` microbatches late. In the warm-up/cool-down
phases where 1F1B idles waiting for a cotangent, ZB-H1 runs those W's instead.

Trade-off, with ``F = I = W`` (a full ``B`` costing ``2F``): 1F1B idles
``(p - 1)(F + B)`` per device, ZB-H1 ``(p - 1)(F + I - W)``: one third. The W lag
keeps ``d`` extra residual sets alive on device ``d``, so every device peaks at
``min(p, m)`` in-flight microbatches: exactly 1F1B's peak on device 0, which is
the device that sets the memory budget. (ZB-H2 removes the rest of the bubble by
also raising that peak; ZB-V does it with a V placement, see ``dualpipe_v.py``.)
"""

from __future__ import annotations

import jaxpipe as jp


class ZeroBubbleH1(jp.Schedule):
    """ZB-H1: 1F1B order with every backward split into I + W and W's lagged ``d``
    microbatches on device ``d``. Any ``p`` and ``m``; one stage per device."""

    name = "zb-h1"

    def __init__(self, num_devices: int, num_microbatches: int, stages_per_device: int = 1):
        super().__init__(num_devices, num_microbatches, stages_per_device)
        if self.stages_per_device != 1:
            raise jp.ScheduleError(
                f"ZeroBubbleH1 needs stages_per_device=1, got {self.stages_per_device}; "
                "for two stages per device use DualPipeV (schedules/dualpipe_v.py)"
            )

    def device_actions(self, device: int) -> list[jp.Action]:
        (stage,) = self.device_stages(device)
        p, m = self.num_devices, self.num_microbatches
        warmup = min(p - device, m)
        order = [jp.Action("F", stage, mb) for mb in range(warmup)]
        next_f = warmup
        next_w = 0
        for k in range(m):
            order.append(jp.Action("I", stage, k))
            if k >= device:  # W lags I by `device` microbatches
                order.append(jp.Action("W", stage, next_w))
                next_w += 1
            if next_f < m:
                order.append(jp.Action("F", stage, next_f))
                next_f += 1
        order += [jp.Action("W", stage, mb) for mb in range(next_w, m)]
        return order
