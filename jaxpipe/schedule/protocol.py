"""What the schedule engines read of a schedule, as a ``Protocol``.

:class:`~jaxpipe.schedule.base.Schedule` is the class users subclass; it calls the
engines (:mod:`~jaxpipe.schedule.graph`, :mod:`~jaxpipe.schedule.validate`,
:mod:`~jaxpipe.schedule.simulate`) on itself. The engines take any object with the
members below, so they import nothing of ``base`` and the layer has no import cycle.
"""

from __future__ import annotations

from typing import Protocol

from .action import Action

__all__ = ["ScheduleLike"]


class ScheduleLike(Protocol):
    """A schedule as the engines see it: sizes, placement and per-device action lists."""

    num_devices: int
    num_microbatches: int
    forward_only: bool

    @property
    def num_stages(self) -> int: ...

    def placement(self, stage: int) -> int: ...

    def actions(self) -> dict[int, list[Action]]: ...

    def uses_split_backward(self, stage: int, microbatch: int) -> bool: ...
