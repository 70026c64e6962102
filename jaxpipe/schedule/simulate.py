"""Simulator: run a schedule with per-action costs and report time and memory.

Model (exact and deterministic, so the SPMD lowering can reuse it with unit costs
to assign ticks): every device executes its action list strictly in order; an
action starts at ``max(end of the device's previous action, latest end of its
dependencies)``; communication is free. Costs default to ``F=1, B=2, I=1, W=1``.

Memory is counted in *residual sets*: the residuals of (stage, mb) are live from
its ``F`` until its ``B`` ends (or its ``W``, when the backward is split). Peaks are
counted along each device's action order, which is exactly what a device's buffers
must hold no matter how the times fall.

Use ints or :class:`fractions.Fraction` costs for exact times: the makespan and
``bubble_fraction`` are then computed without rounding.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Callable, Collection, Mapping, Sequence
from fractions import Fraction
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Union

from .action import ACTION_KINDS, KIND_NAMES, Action, ScheduleError
from .liveness import peak_overlap, unit_lifetimes

if TYPE_CHECKING:
    from .graph import ScheduleGraph

#: Default cost of each action kind (a full backward costs two forwards).
DEFAULT_COSTS: dict[str, int] = {"F": 1, "B": 2, "I": 1, "W": 1}

#: What ``simulate(costs=...)`` accepts.
Costs = Union[None, Mapping[str, numbers.Real], Callable[[Action], numbers.Real]]  # noqa: UP007

#: Colour of each kind in plots (colour-blind friendly).
KIND_COLORS: dict[str, str] = {"F": "#4C72B0", "B": "#DD8452", "I": "#55A868", "W": "#C44E52"}


def _number(value: object, what: str) -> numbers.Real:
    """Check a cost is a finite number >= 0; keep ints/Fractions exact."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ScheduleError(f"cost of {what} must be a number, got {value!r}")
    if isinstance(value, numbers.Integral):
        value = int(value)
    elif not isinstance(value, Fraction):
        value = float(value)
    if not (math.isfinite(value) and value >= 0):
        raise ScheduleError(f"cost of {what} must be finite and >= 0, got {value!r}")
    return value


def resolve_costs(costs: Costs) -> Callable[[Action], numbers.Real]:
    """Turn ``None``, a ``{kind: cost}`` dict, or a callable into ``action -> cost``.

    Missing kinds in a dict take :data:`DEFAULT_COSTS`. A callable receives the
    :class:`Action` (so per-stage costs are ``lambda a: stage_cost[a.kind][a.stage]``).
    """
    if costs is None:
        return lambda a: DEFAULT_COSTS[a.kind]
    if isinstance(costs, Mapping):
        unknown = sorted(set(costs) - set(ACTION_KINDS))
        if unknown:
            raise ScheduleError(
                f"unknown action kind(s) in costs: {', '.join(map(repr, unknown))}; "
                f"valid kinds are {', '.join(ACTION_KINDS)}"
            )
        table = {k: _number(costs.get(k, DEFAULT_COSTS[k]), f"kind {k!r}") for k in ACTION_KINDS}
        return lambda a: table[a.kind]
    if callable(costs):
        return lambda a: _number(costs(a), f"action {a}")
    raise ScheduleError(
        f"costs must be None, a dict kind->cost, or a callable(action)->cost; got {costs!r}"
    )


class TimelineEvent(NamedTuple):
    """One executed action: ``device`` ran ``action`` from ``start`` to ``end``."""

    device: int
    action: Action
    start: numbers.Real
    end: numbers.Real

    @property
    def duration(self) -> numbers.Real:
        return self.end - self.start


def _fmt(x: numbers.Real) -> str:
    """Short exact-looking number: ints as ints, other values to 4 significant digits."""
    if isinstance(x, Fraction) and x.denominator == 1:
        x = x.numerator
    if isinstance(x, int):
        return str(x)
    return f"{float(x):.4g}"


class Timeline:
    """The result of simulating a schedule: when every action ran, and derived metrics.

    Attributes:
        events: every :class:`TimelineEvent`, sorted by ``(start, device)``; filtered
            to one device they are in that device's execution order.
        num_devices: number of devices (rows).
        makespan: end of the last action (0 for an empty timeline).
        busy_time: per device, total time spent running actions.
        idle_time: total idle time over all devices, ``makespan * num_devices - busy``.
        bubble_fraction: ``idle_time / (makespan * num_devices)`` (0 if makespan is 0).
        peak_in_flight: per device, the most residual sets live at once.
        stage_peak_in_flight: per stage, the most residual sets of that stage live.
        split_units: the (stage, microbatch) pairs whose backward is split into I + W
            (:meth:`Schedule.split_units`; read off the events when not given).
    """

    def __init__(
        self,
        events: Sequence[TimelineEvent],
        num_devices: int,
        title: str | None = None,
        split_units: Collection[tuple[int, int]] | None = None,
    ) -> None:
        self._set_times(events, num_devices, title, split_units)
        # Residual sets live from F to the last backward action, along each device's
        # action order (positions, not times: what the buffers hold however times fall).
        self.peak_in_flight: list[int] = []
        stage_intervals: dict[int, list[tuple[int, int]]] = {e.action.stage: [] for e in events}
        for evs in self._per_device:
            lifetimes = unit_lifetimes((e.action, pos) for pos, e in enumerate(evs))
            self.peak_in_flight.append(peak_overlap(lifetimes.values()))
            for (stage, _), interval in lifetimes.items():
                stage_intervals.setdefault(stage, []).append(interval)
        self.stage_peak_in_flight: dict[int, int] = {
            s: peak_overlap(stage_intervals[s]) for s in sorted(stage_intervals)}

    @classmethod
    def _simulated(cls, events: Sequence[TimelineEvent], graph: ScheduleGraph,
                   title: str) -> Timeline:
        """A timeline of ``graph``'s actions, whose peaks the graph already knows (they
        depend only on each device's order, so they are counted once per schedule)."""
        self = cls.__new__(cls)
        self._set_times(events, len(graph.lists), title, graph.split)
        self.peak_in_flight = graph.peak_in_flight
        self.stage_peak_in_flight = graph.stage_peak_in_flight
        return self

    def _set_times(self, events: Sequence[TimelineEvent], num_devices: int, title: str | None,
                   split_units: Collection[tuple[int, int]] | None) -> None:
        self.num_devices = num_devices
        self.title = title
        # Stable sort: ties on one device keep execution order (zero-cost actions).
        self.events: list[TimelineEvent] = sorted(events, key=attrgetter("start", "device"))
        per_device: list[list[TimelineEvent]] = [[] for _ in range(num_devices)]
        for e in self.events:
            per_device[e.device].append(e)
        self._per_device = per_device

        self.makespan: numbers.Real = max(map(attrgetter("end"), self.events), default=0)
        self.busy_time: list[numbers.Real] = [sum(e.duration for e in evs) for evs in per_device]
        self.idle_time: numbers.Real = self.makespan * num_devices - sum(self.busy_time)
        if self.makespan:
            # Exact via Fraction, then one rounding: equals p/q computed in floats.
            total = Fraction(self.makespan) * num_devices
            self.bubble_fraction = float(1 - Fraction(sum(self.busy_time)) / total)
        else:
            self.bubble_fraction = 0.0

        if split_units is None:  # a hand-built timeline: read the split off its events
            split_units = frozenset((e.action.stage, e.action.microbatch)
                                    for e in self.events if e.action.kind == "I")
        self.split_units: frozenset[tuple[int, int]] = frozenset(split_units)

    def device_events(self, device: int) -> list[TimelineEvent]:
        """The events of one device, in its execution order."""
        return list(self._per_device[device])

    def __repr__(self) -> str:
        return (
            f"Timeline(num_devices={self.num_devices}, makespan={_fmt(self.makespan)}, "
            f"bubble_fraction={self.bubble_fraction:.4f}, peak_in_flight={self.peak_in_flight})"
        )

    def summary(self) -> str:
        """One line: makespan, bubble fraction and peak in-flight per device."""
        return (
            f"makespan {_fmt(self.makespan)} | bubble {self.bubble_fraction:.2%} "
            f"(idle {_fmt(self.idle_time)}) | peak in-flight per device {self.peak_in_flight}"
        )

    def to_ascii(self, width: int | None = None) -> str:
        """Render one row per device, e.g. ``dev 0 |0F0 0F1 ....0B0     |``.

        Each action is drawn as its label (``0F0``) padded to its duration; ``.`` is
        idle time. By default the shortest action gets room for its label, so the
        picture is exact; ``width`` caps the total line width (labels of short
        actions then shrink to their kind letter).
        """
        prefix_w = len(f"dev {self.num_devices - 1} |")
        lines = []
        if self.title:
            lines.append(self.title)
        durations = [e.duration for e in self.events if e.duration > 0]
        if durations:
            label_w = max(len(str(e.action)) for e in self.events) + 1
            unit = Fraction(min(durations))
            full_cols = math.ceil(Fraction(self.makespan) / unit * label_w)
            cols = full_cols if width is None else max(1, min(full_cols, width - prefix_w - 1))
            scale = Fraction(cols) / Fraction(self.makespan)
            for d in range(self.num_devices):
                row = ["."] * cols
                for e in self._per_device[d]:
                    if e.duration <= 0:
                        continue
                    a = round(Fraction(e.start) * scale)
                    b = max(round(Fraction(e.end) * scale), a + 1)
                    n = min(b, cols) - a
                    if n <= 0:
                        continue
                    label = str(e.action)
                    text = label.ljust(n) if n > len(label) else e.action.kind * n
                    row[a : a + n] = text
                lines.append(f"dev {d:<{prefix_w - 6}} |{''.join(row)}|")
            per_col = Fraction(self.makespan) / cols
            lines.append(
                f"one column = {_fmt(per_col)} time units; '.' idle; "
                + ", ".join(f"{k} {KIND_NAMES[k]}" for k in ACTION_KINDS)
            )
        else:
            lines.append("(empty timeline)")
        lines.append(self.summary())
        return "\n".join(lines)

    def to_chrome_trace(self, path: str | Path, time_unit_us: float = 1000.0) -> Path:
        """Write a Chrome/Perfetto trace (``traceEvents`` JSON), one track per device.

        One simulated time unit becomes ``time_unit_us`` microseconds (1 ms by
        default, so the Perfetto ruler reads in cost units). Open it at
        https://ui.perfetto.dev or chrome://tracing. Returns the path written.
        """
        path = Path(path)
        trace: list[dict] = [
            {"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
             "args": {"name": self.title or "jaxpipe schedule"}},
        ]
        for d in range(self.num_devices):
            trace.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": d,
                          "args": {"name": f"device {d}"}})
            trace.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": d,
                          "args": {"sort_index": d}})
        for e in self.events:
            a = e.action
            trace.append({
                "name": str(a),
                "cat": KIND_NAMES[a.kind],
                "ph": "X",
                "pid": 0,
                "tid": e.device,
                "ts": float(e.start) * time_unit_us,
                "dur": float(e.duration) * time_unit_us,
                "args": {"kind": a.kind, "stage": a.stage, "microbatch": a.microbatch},
            })
        doc = {
            "traceEvents": trace,
            "displayTimeUnit": "ms",
            "otherData": {
                "makespan": float(self.makespan),
                "bubble_fraction": self.bubble_fraction,
                "peak_in_flight": self.peak_in_flight,
            },
        }
        path.write_text(json.dumps(doc, indent=1))
        return path

    def plot(self, path: str | Path, dpi: int = 120) -> Path:
        """Save a Gantt chart (PNG, SVG, PDF: by file extension); colour per kind,
        microbatch number inside each box. Uses matplotlib's Agg canvas directly, so
        it never touches pyplot's global backend. Returns the path written."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch

        path = Path(path)
        span = float(self.makespan) or 1.0
        fig = Figure(figsize=(min(max(6.0, span * 0.35), 40.0), 0.45 * self.num_devices + 1.4))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        # Only label boxes wide enough to hold a digit or two.
        min_label = span / 60
        for e in self.events:
            dur = float(e.duration)
            if dur <= 0:
                continue
            ax.barh(e.device, dur, left=float(e.start), height=0.8,
                    color=KIND_COLORS[e.action.kind], edgecolor="black", linewidth=0.4)
            if dur >= min_label:
                ax.text(float(e.start) + dur / 2, e.device, str(e.action.microbatch),
                        ha="center", va="center", fontsize=7, color="white")
        kinds = [k for k in ACTION_KINDS if any(e.action.kind == k for e in self.events)]
        ax.legend(handles=[Patch(color=KIND_COLORS[k], label=f"{k}: {KIND_NAMES[k]}")
                           for k in kinds],
                  loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
        ax.set_yticks(range(self.num_devices), [f"device {d}" for d in range(self.num_devices)])
        ax.set_ylim(self.num_devices - 0.5, -0.5)
        ax.set_xlim(0, span)
        ax.set_xlabel("time (cost units)")
        ax.set_title(self.title or self.summary(), fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
        return path


def simulate_graph(graph: ScheduleGraph, costs: Costs, title: str) -> Timeline:
    """Run a checked schedule's ``graph`` with ``costs`` (see :func:`resolve_costs`)."""
    cost = resolve_costs(costs)
    starts, ends = graph.run_costs([cost(a) for a in graph.actions])
    events = list(map(TimelineEvent, graph.device, graph.actions, starts, ends))
    return Timeline._simulated(events, graph, title)
