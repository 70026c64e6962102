"""The forward-only schedule of a schedule: what evaluating the pipeline's loss runs.

``Pipeline.loss`` runs no backward: :class:`ForwardOnly` keeps every device's F actions
of a training schedule, in that device's order, on the same placement. Dropping the
backwards only drops dependencies, so the result never deadlocks where the schedule
does not; its microbatches flow through the devices as fast as their forwards allow.
"""

from __future__ import annotations

from typing import ClassVar

from .action import Action
from .base import Schedule

__all__ = ["ForwardOnly"]


class ForwardOnly(Schedule):
    """The F actions of ``schedule``, in each device's order, on its placement."""

    forward_only: ClassVar[bool] = True

    def __init__(self, schedule: Schedule) -> None:
        super().__init__(schedule.num_devices, schedule.num_microbatches,
                         schedule.stages_per_device)
        self.schedule = schedule

    def placement(self, stage: int) -> int:
        return self.schedule.placement(stage)

    def device_actions(self, device: int) -> list[Action]:
        return [a for a in self.schedule.graph().lists[device] if a.kind == "F"]

    def __repr__(self) -> str:
        return f"ForwardOnly({self.schedule!r})"
