"""1F1B (PipeDream-flush, Narayanan et al., 2021): forward and backward interleaved.

Same bubble as GPipe, but stage ``s`` never holds more than ``min(m, S - s)``
microbatches of residuals (``S`` stages), instead of ``m``.

Order for the stage ``s`` on a device (``w = min(S - s - 1, m)`` warm-up forwards):

    F0 .. F(w-1),  then  F(w) B0  F(w+1) B1 ...  (one forward, one backward),
    then the remaining backwards in microbatch order (cool-down).
"""

from __future__ import annotations

from .action import Action, ScheduleError
from .base import Schedule


class OneFOneB(Schedule):
    """Non-interleaved 1F1B; needs ``stages_per_device == 1``."""

    name = "1f1b"

    def __init__(self, num_devices: int, num_microbatches: int, stages_per_device: int = 1):
        super().__init__(num_devices, num_microbatches, stages_per_device)
        if self.stages_per_device != 1:
            raise ScheduleError(
                f"OneFOneB needs stages_per_device=1, got {self.stages_per_device}; "
                "use Interleaved1F1B for several stages per device"
            )

    def device_actions(self, device: int) -> list[Action]:
        (stage,) = self.device_stages(device)
        m = self.num_microbatches
        warmup = min(self.num_stages - stage - 1, m)
        order = [Action("F", stage, mb) for mb in range(warmup)]
        for mb in range(m - warmup):
            order += [Action("F", stage, warmup + mb), Action("B", stage, mb)]
        order += [Action("B", stage, mb) for mb in range(m - warmup, m)]
        return order
