"""Schedules: the action IR, the ``Schedule`` base class, built-ins, validation, simulator.

- :class:`Action` — one unit of work (``"2F0"``); kinds F, B, I, W.
- :class:`Schedule` — subclass it and implement ``device_actions(device)``.
- :class:`GPipe`, :class:`OneFOneB`, :class:`Interleaved1F1B` — built-ins.
- :func:`dependencies` — what must finish before an action starts.
- :class:`Timeline` — ``Schedule.simulate(costs)``: makespan, bubble, memory, plots.
- :func:`load_schedule` — ``"1f1b"`` or ``"file.py:Class"`` -> class.

Imports nothing else of jaxpipe: a schedule is written, validated and simulated without
a model, and every layer after it may use it.
"""

from .action import ACTION_KINDS, KIND_NAMES, Action, ScheduleError
from .base import Schedule
from .gpipe import GPipe
from .interleaved import Interleaved1F1B
from .load import BUILTIN_SCHEDULES, load_schedule
from .one_f_one_b import OneFOneB
from .simulate import DEFAULT_COSTS, Costs, Timeline, TimelineEvent, resolve_costs
from .validate import dependencies

__all__ = [
    "ACTION_KINDS",
    "BUILTIN_SCHEDULES",
    "DEFAULT_COSTS",
    "KIND_NAMES",
    "Action",
    "Costs",
    "GPipe",
    "Interleaved1F1B",
    "OneFOneB",
    "Schedule",
    "ScheduleError",
    "Timeline",
    "TimelineEvent",
    "dependencies",
    "load_schedule",
    "resolve_costs",
]
