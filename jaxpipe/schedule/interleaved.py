"""Interleaved 1F1B (Megatron-LM, Narayanan et al., 2021): ``v`` chunks per device.

Each device holds ``v = stages_per_device`` model chunks with the loop placement:
stage ``s`` (chunk ``s // p``) lives on device ``s % p``. A microbatch therefore
crosses every device ``v`` times, and the pipeline bubble shrinks by ``v``: with
unit cost per chunk action the bubble fraction is ``(p-1) / (v*m + p-1)``.

Order on device ``d``, exactly Megatron-LM's ``forward_backward_pipelining_with_
interleaving``: the device runs ``v*m`` "virtual microbatches" ``k``. Virtual ``k``
belongs to group ``g = k // (p*v)``; within the group, chunk ``(k % (p*v)) // p``
(reversed, ``v-1-...``, for backwards) and microbatch ``g*p + k % p``. So chunks
advance in blocks of ``p`` microbatches, which is why ``m % p == 0`` is required.
The device runs ``min(2*(p-d-1) + (v-1)*p, v*m)`` warm-up forwards, then
alternates forward ``k + warmup`` / backward ``k``, then the cool-down backwards.
"""

from __future__ import annotations

from .action import Action, ScheduleError
from .base import Schedule


class Interleaved1F1B(Schedule):
    """Megatron-LM interleaved 1F1B; ``stages_per_device >= 2`` and ``m % p == 0``."""

    name = "interleaved"

    def __init__(self, num_devices: int, num_microbatches: int, stages_per_device: int = 2):
        super().__init__(num_devices, num_microbatches, stages_per_device)
        if self.stages_per_device < 2:
            raise ScheduleError(
                f"Interleaved1F1B needs stages_per_device >= 2, got {self.stages_per_device}; "
                "use OneFOneB for one stage per device"
            )
        if self.num_microbatches % self.num_devices:
            raise ScheduleError(
                f"Interleaved1F1B needs num_microbatches to be a multiple of num_devices: "
                f"m={self.num_microbatches} is not divisible by p={self.num_devices}"
            )

    def _virtual(self, device: int, k: int, forward: bool) -> Action:
        """Virtual microbatch ``k`` of ``device`` as a concrete forward/backward action."""
        p, v = self.num_devices, self.stages_per_device
        group, within = divmod(k, p * v)
        chunk = within // p
        if not forward:
            chunk = v - 1 - chunk
        return Action("F" if forward else "B", chunk * p + device, group * p + k % p)

    def device_actions(self, device: int) -> list[Action]:
        p, v, m = self.num_devices, self.stages_per_device, self.num_microbatches
        total = v * m
        warmup = min(2 * (p - device - 1) + (v - 1) * p, total)
        order = [self._virtual(device, k, True) for k in range(warmup)]
        for k in range(total - warmup):
            order += [self._virtual(device, k + warmup, True), self._virtual(device, k, False)]
        order += [self._virtual(device, k, False) for k in range(total - warmup, total)]
        return order
