"""Eager 1F1B: 1F1B with extra warm-up forwards, so sends can overlap compute.

Order on device ``d`` (one stage per device, ``p`` devices, ``m`` microbatches):

    warm-up:   F0 .. F(w-1)                  w = min(2 * (p - 1 - d), m)
    steady:    F(w) B0  F(w+1) B1  ...       one forward, then one backward
    cool-down: the remaining backwards, in microbatch order

Plain 1F1B warms up with ``p - 1 - d`` forwards and runs *backward first* in the
steady state. Eager 1F1B warms up with about twice as many (Megatron-LM's
interleaved warm-up formula ``2 * (p - 1 - d)`` at one chunk per device; JaxPP
calls this schedule ``Eager1F1B``) and runs *forward first*. Every device then
has the next microbatch's activation in hand long before the downstream device
asks for it, so on real hardware the point-to-point sends hide behind compute.

Trade-off: with free communication (the simulator's model) the bubble equals
1F1B's, ``(p - 1) / (m + p - 1)``, while device ``d`` holds up to
``min(2 * (p - 1 - d) + 1, m)`` residual sets instead of ``p - d`` (device 0
holds ``2p - 1``, about twice 1F1B's). You pay activation memory for
communication slack.
"""

from __future__ import annotations

import jaxpipe as jp


class Eager1F1B(jp.Schedule):
    """1F1B with ``min(2 * (p - 1 - d), m)`` warm-up forwards on device ``d``.

    Works for any ``p`` and ``m``; one stage per device.
    """

    name = "eager-1f1b"

    def __init__(self, num_devices: int, num_microbatches: int, stages_per_device: int = 1):
        super().__init__(num_devices, num_microbatches, stages_per_device)
        if self.stages_per_device != 1:
            raise jp.ScheduleError(
                f"Eager1F1B needs stages_per_device=1, got {self.stages_per_device}"
            )

    def warmup(self, device: int) -> int:
        """Forwards device ``device`` runs before its first backward."""
        return min(2 * (self.num_devices - 1 - device), self.num_microbatches)

    def device_actions(self, device: int) -> list[jp.Action]:
        (stage,) = self.device_stages(device)
        m, w = self.num_microbatches, self.warmup(device)
        order = [jp.Action("F", stage, mb) for mb in range(w)]
        for mb in range(m - w):  # steady state: forward first, then backward
            order += [jp.Action("F", stage, w + mb), jp.Action("B", stage, mb)]
        order += [jp.Action("B", stage, mb) for mb in range(m - w, m)]
        return order
