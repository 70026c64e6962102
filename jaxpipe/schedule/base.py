"""The ``Schedule`` base class: what a pipeline schedule is, and what you implement.

A schedule splits the model into ``num_stages = num_devices * stages_per_device``
stages, places each stage on a device (:meth:`Schedule.placement`), and says, for
every device, the order in which it runs its actions
(:meth:`Schedule.device_actions`). Everything else (validation, simulation,
lowering to one SPMD program) is derived from those two methods.

A minimal custom schedule::

    class AllForwardThenBackward(Schedule):
        name = "afab"

        def device_actions(self, device):
            (stage,) = self.device_stages(device)
            mbs = range(self.num_microbatches)
            return [Action("F", stage, mb) for mb in mbs] + [
                Action("B", stage, mb) for mb in mbs
            ]

``device_actions`` must return the same list every time it is called: jaxpipe reads it
twice and keeps the first (see :meth:`Schedule.actions`).
"""

from __future__ import annotations

import abc
import inspect
import numbers
from collections.abc import Iterable
from typing import ClassVar

from .action import Action, ScheduleError
from .graph import ScheduleGraph, build_graph, paused_gc
from .simulate import Costs, Timeline, simulate_graph


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ScheduleError(f"{name} must be a positive int, got {value!r}")
    return int(value)


_SIZES = ("num_devices", "num_microbatches", "stages_per_device")


class _NotInitialized(ScheduleError, AttributeError):
    """A Schedule subclass skipped ``Schedule.__init__`` (also an AttributeError, so
    ``hasattr`` keeps working)."""


def _action_list(schedule: Schedule, device: int) -> tuple[Action, ...]:
    """``schedule.device_actions(device)`` as a tuple, checked to be a repeatable list."""
    name = f"{type(schedule).__name__}.device_actions({device})"

    def once() -> tuple[tuple, bool]:
        got = schedule.device_actions(device)
        if got is None:
            raise ScheduleError(
                f"{name} returned None, not a list of Actions (a missing `return`?)")
        if isinstance(got, str | bytes | dict) or not isinstance(got, Iterable):
            raise ScheduleError(
                f"{name} returned a {type(got).__name__} ({got!r:.80}), not a list of "
                "Actions; return e.g. [Action('F', stage, mb), ...]")
        return tuple(got), iter(got) is got

    first, is_iterator = once()
    if not is_iterator:  # a list or tuple: nothing a second call could reveal
        return first
    # An iterator may be one-shot (stored on the schedule and empty the second time):
    # read the method twice and compare.
    second, _ = once()
    if first != second:
        raise ScheduleError(
            f"{name} returned a different list on its second call ({len(first)} actions, "
            f"then {len(second)}); it must return the same list every time (build a new "
            "list in the method: an iterator or generator stored on the schedule is empty "
            "the second time)")
    return first


class Schedule(abc.ABC):
    """Base class of every pipeline schedule (built-in or user-defined).

    Args:
        num_devices: devices on the ``pipe`` mesh axis (``p``).
        num_microbatches: microbatches per step (``m``).
        stages_per_device: model chunks per device (``v``); ``num_stages = p * v``.

    Subclasses implement :meth:`device_actions` and may override :meth:`placement`
    (default: the "loop" placement ``stage % num_devices``). They may set a class
    attribute ``name`` (e.g. ``"1f1b"``) used by the CLI and in reports.
    """

    name: ClassVar[str | None] = None
    #: A schedule of forward actions only (evaluating a loss: :class:`.forward.ForwardOnly`);
    #: every other schedule lists one backward per forward.
    forward_only: ClassVar[bool] = False

    def __init__(self, num_devices: int, num_microbatches: int, stages_per_device: int = 1):
        self.num_devices = _positive_int("num_devices", num_devices)
        self.num_microbatches = _positive_int("num_microbatches", num_microbatches)
        self.stages_per_device = _positive_int("stages_per_device", stages_per_device)

    @property
    def num_stages(self) -> int:
        """Total number of pipeline stages, ``num_devices * stages_per_device``."""
        return self.num_devices * self.stages_per_device

    def placement(self, stage: int) -> int:
        """The device that holds ``stage``. Default: loop placement ``stage % num_devices``
        (device ``d`` holds stages ``d, d+p, d+2p, ...``). V-shaped schedules override it."""
        return stage % self.num_devices

    def device_stages(self, device: int) -> list[int]:
        """The stages placed on ``device``, ascending."""
        if not 0 <= device < self.num_devices:
            raise ScheduleError(
                f"device {device} out of range: there are {self.num_devices} devices"
            )
        return [s for s in range(self.num_stages) if self.placement(s) == device]

    @abc.abstractmethod
    def device_actions(self, device: int) -> list[Action]:
        """The actions ``device`` runs, in the order it runs them."""

    def actions(self) -> dict[int, list[Action]]:
        """``{device: device_actions(device)}`` for every device, checked and cached.

        Each list is read twice on first use and must come out the same: a schedule is a
        fixed plan, and validation, simulation and lowering must all see one plan. Raises
        :class:`ScheduleError` naming the method and what it returned if ``device_actions``
        returns something that is not a list of actions (``None``: a forgotten
        ``return``) or a different list on its second call (a one-shot iterator).
        """
        cached = self.__dict__.get("_jaxpipe_actions")
        if cached is None:
            cached = {d: _action_list(self, d) for d in range(self.num_devices)}
            self.__dict__["_jaxpipe_actions"] = cached
        return {d: list(acts) for d, acts in cached.items()}

    def split_units(self) -> frozenset[tuple[int, int]]:
        """The (stage, microbatch) pairs whose backward runs as ``I`` + ``W`` instead of ``B``.

        From :meth:`graph` (so an invalid schedule raises :class:`ScheduleError`).
        """
        return self.graph().split

    def uses_split_backward(self, stage: int, microbatch: int) -> bool:
        """True if (stage, microbatch) runs its backward as ``I`` + ``W`` instead of ``B``
        (see :meth:`split_units`)."""
        return (stage, microbatch) in self.split_units()

    def validate(self) -> None:
        """Raise :class:`ScheduleError` naming device, action and rule if the schedule is
        invalid: wrong placement, index out of range, missing/duplicate actions, B mixed
        with I/W, backward before forward, W before I, or a cross-device deadlock."""
        self.graph()

    def graph(self) -> ScheduleGraph:
        """The schedule checked and compiled to integers (cached on the instance).

        Validation runs once per schedule object; simulations and the lowering reuse the
        result. Raises :class:`ScheduleError` like :meth:`validate`.
        """
        graph = self.__dict__.get("_jaxpipe_graph")
        if graph is None:
            with paused_gc():
                graph = build_graph(self)
            self.__dict__["_jaxpipe_graph"] = graph
        return graph

    def simulate(self, costs: Costs = None) -> Timeline:
        """Validate, then simulate with ``costs`` and return the :class:`Timeline`.

        ``costs``: ``None`` (F=1, B=2, I=1, W=1), a dict ``{kind: cost}`` (missing kinds
        take the defaults), or a callable ``action -> cost`` (e.g. per-stage costs).
        """
        with paused_gc():
            return simulate_graph(self.graph(), costs, repr(self))

    def __getattr__(self, name: str) -> object:
        # Only reached when normal lookup fails: a subclass __init__ that never called
        # Schedule.__init__ has none of the sizes every method needs.
        if name in _SIZES:
            raise _NotInitialized(
                f"{type(self).__name__} has no {name}: its __init__ did not call "
                "super().__init__(num_devices, num_microbatches, stages_per_device); add "
                "that call (before anything that uses the sizes)."
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        # stages_per_device where it is > 1 or not the class's default (LoopedBFS's is 2)
        v = self.stages_per_device
        param = inspect.signature(type(self).__init__).parameters.get("stages_per_device")
        default = 1 if param is None or param.default is param.empty else param.default
        extra = f", stages_per_device={v}" if v > 1 or v != default else ""
        return (
            f"{type(self).__name__}(num_devices={self.num_devices}, "
            f"num_microbatches={self.num_microbatches}{extra})"
        )
