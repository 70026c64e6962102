"""``schedule="auto"``: choose the schedule family and its virtual stages with the cut.

A user of :func:`jaxpipe.pipeline` would otherwise pick GPipe, 1F1B or interleaved 1F1B
and its number of chunks by trial and error. :class:`Auto` lists the candidates the
mesh's pipe size and the model allow, cuts the model for each with the memory-aware
cutter (which chooses recomputation under the memory budget: ``jp.Cut(memory_budget=)``,
or the device's memory), and takes the fastest whose predicted per-device memory fits
(``objective="memory"``: the smallest). A candidate's time is the runtime's program
for it, lowered and simulated with the stages' costs, plus its costs a tick: a fixed one
and one per byte a device stores (``Runtime.predicted_time``; the SPMD runtime's,
:mod:`jaxpipe.runtime.spmd.predict`, uses what ``jaxpipe calibrate`` measured on this
machine, else per-backend estimates). ``Auto(microbatches="auto")`` also chooses ``m``
(:func:`choose_microbatches`).

``pipe.plan`` lists every candidate: family, chunks, microbatches, predicted time and
memory, and why each one not chosen was not (slower, more memory, does not fit, cannot
run). The choice is deterministic: ties go to the earlier candidate in :data:`FAMILIES`
order.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from jaxpipe.cut import CutError
from jaxpipe.errors import PipelineError
from jaxpipe.jaxpr.avals import format_bytes
from jaxpipe.schedule import GPipe, Interleaved1F1B, OneFOneB, Schedule

__all__ = ["FAMILIES", "Auto", "AutoChoice", "Candidate", "batch_rows", "choose",
           "choose_microbatches", "placeholder", "resolve_auto"]

#: The built-in families :class:`Auto` chooses among by default, in tie-break order:
#: name -> ``(schedule class, chunk counts it tries)``.
FAMILIES: dict[str, tuple[type[Schedule], tuple[int, ...]]] = {
    "1f1b": (OneFOneB, (1,)),
    "gpipe": (GPipe, (1,)),
    "interleaved": (Interleaved1F1B, (2, 4)),
}

_OBJECTIVES = ("time", "memory")


def _order(objective: str, time: float | None, memory: float | None) -> tuple:
    """What ``objective`` ranks by: time then memory, or memory then time."""
    return (time, memory) if objective == "time" else (memory, time)


@dataclass(frozen=True)
class Auto:
    """``jp.pipeline(..., schedule=jp.Auto(...))``: let jaxpipe choose the schedule.

    Args:
      num_devices: the pipe size ``p``; ``None`` (default): the mesh's pipe axis (given,
        it must equal it).
      microbatches: the number of microbatches ``m`` (the batch splits into ``m`` along
        axis 0). ``None``: the largest divisor of the batch that is at most ``4 * p``
        (``p`` the mesh's pipe size): more microbatches shrink the bubble, and the
        per-microbatch work stays large enough to use a device. ``"auto"``: try every
        divisor of the batch from ``p`` to ``4 * p`` (the pipeline is traced and cut for
        each) and choose ``m`` with the schedule.
      families: which of :data:`FAMILIES` to try (names), and any schedule classes of
        your own, constructed as ``cls(p, m)``.
      objective: ``"time"`` (the fastest that fits) or ``"memory"`` (the smallest peak).

    ``schedule="auto"`` is ``Auto()``. Example::

        pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule="auto")
        print(pipe.plan)      # the candidates, their predicted time and memory, the choice
        pipe.schedule         # the chosen schedule
    """

    num_devices: int | None = None
    microbatches: int | str | None = None
    families: tuple[str | type[Schedule], ...] = tuple(FAMILIES)
    objective: str = "time"

    def __post_init__(self) -> None:
        for name in ("num_devices", "microbatches"):  # numpy integers are integers
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                object.__setattr__(self, name, int(value))
        if self.objective not in _OBJECTIVES:
            raise PipelineError(f"Auto(objective=...) must be one of {_OBJECTIVES}, got "
                                f"{self.objective!r}.")
        if isinstance(self.families, str) or isinstance(self.families, type):
            raise PipelineError(f"Auto(families=...) takes a tuple of family names or "
                                f"Schedule subclasses, got {self.families!r}; write "
                                f"families=({self.families!r},).")
        if not self.families:
            raise PipelineError("Auto(families=...) is empty; name at least one of "
                                f"{sorted(FAMILIES)} or pass a Schedule subclass.")
        for f in self.families:
            if isinstance(f, str) and f not in FAMILIES:
                raise PipelineError(f"Auto(families=...) names {f!r}, which is not one of "
                                    f"{sorted(FAMILIES)}; pass a Schedule subclass for your "
                                    "own family.")
            if not isinstance(f, str) and not (isinstance(f, type)
                                               and issubclass(f, Schedule)):
                raise PipelineError(f"Auto(families=...) holds {f!r}: give family names or "
                                    "Schedule subclasses constructible as cls(p, m).")
        classes = [FAMILIES[f][0] if isinstance(f, str) else f for f in self.families]
        if len(set(classes)) != len(classes):
            raise PipelineError(f"Auto(families=...) names a family twice (by name or by "
                                f"class): {self.families!r}; name each once.")
        if self.num_devices is not None and (
                isinstance(self.num_devices, bool) or not isinstance(self.num_devices, int)
                or self.num_devices < 1):
            raise PipelineError(f"Auto(num_devices=...) must be a positive int (the pipe "
                                f"size) or None (the mesh's), got {self.num_devices!r}.")
        if self.microbatches not in (None, "auto") and (
                isinstance(self.microbatches, bool) or not isinstance(self.microbatches, int)
                or self.microbatches < 1):
            raise PipelineError(f"Auto(microbatches=...) must be a positive int, 'auto' or "
                                f"None, got {self.microbatches!r}.")

    def microbatch_options(self, num_devices: int, batch_size: int) -> list[int]:
        """The ``m`` to try: the one :meth:`num_microbatches` gives, or with ``"auto"``
        every divisor of the batch from ``num_devices`` to ``4 * num_devices`` (the
        largest divisor below ``num_devices`` where none is)."""
        if self.microbatches != "auto":
            return [self.num_microbatches(num_devices, batch_size)]
        found = [d for d in range(num_devices, min(batch_size, 4 * num_devices) + 1)
                 if batch_size % d == 0]
        return found or [max(d for d in range(1, num_devices) if batch_size % d == 0)]

    def num_microbatches(self, num_devices: int, batch_size: int, shards: int = 1) -> int:
        """``m`` for a pipe of ``num_devices`` and a batch of ``batch_size`` rows (with
        ``"auto"``: the largest of :meth:`microbatch_options`); by default the largest
        ``m <= 4 * num_devices`` whose microbatches split into the ``shards`` pieces of
        the data axes."""
        if self.microbatches == "auto":
            return max(self.microbatch_options(num_devices, batch_size))
        if self.microbatches is not None:
            if batch_size % self.microbatches:
                raise PipelineError(
                    f"Auto(microbatches={self.microbatches}) does not divide the batch's "
                    f"{batch_size} rows; pass a divisor of {batch_size}.")
            return self.microbatches
        ms = range(1, min(batch_size, 4 * num_devices) + 1)
        # none where the data axes do not divide the batch: the input check names that
        return max([d for d in ms if batch_size % (d * shards) == 0]
                   or [d for d in ms if batch_size % d == 0])

    def candidates(self, num_devices: int, num_microbatches: int, max_stages: int
                   ) -> list[tuple[str, int, Schedule | str]]:
        """``(family, chunks, schedule or why it cannot be built)`` of every candidate
        (chunks ``None``: a class of the user's that could not be built);
        ``max_stages``: the most stages the model can be cut into."""
        out: list[tuple[str, int, Schedule | str]] = []
        for f in self.families:
            # a class of the user's: how many chunks it places is known once it is built
            name, (cls, chunks) = ((f, FAMILIES[f]) if isinstance(f, str)
                                   else (f.__name__, (f, (None,))))
            for v in chunks:
                if v is not None and num_devices * v > max_stages:
                    out.append((name, v, f"needs {num_devices * v} stages; the model has "
                                         f"{max_stages} cuttable segments"))
                    continue
                try:
                    sched = cls(num_devices, num_microbatches, v) if (v or 1) > 1 else cls(
                        num_devices, num_microbatches)
                    sched.validate()
                # a family's own rule (e.g. m a multiple of p: a ScheduleError); a bug in
                # a user's class (a TypeError, an AttributeError) propagates
                except ValueError as err:
                    out.append((name, v, f"cannot be built: {err}"))
                    continue
                out.append((name, sched.stages_per_device, sched))
        return out


def _advice(verdicts: Sequence[str]) -> str:
    """What to change, for the reasons no candidate could run (each says which rule)."""
    fixes = []
    if any(v.startswith("does not fit") for v in verdicts):
        # more microbatches of a batch are smaller ones: 1F1B-like schedules hold at most
        # about p of them, so their peak falls as m grows
        fixes.append("a memory budget that fits (jp.Cut(memory_budget=...)), recomputation "
                     "(jp.Cut(remat='auto')) or more, smaller microbatches "
                     "(jp.Auto(microbatches=...))")
    if any(v.startswith("cannot be built") for v in verdicts):
        fixes.append("a microbatch count the families accept (each reason above says "
                     "which)")
    if any(v.startswith("needs") for v in verdicts):
        fixes.append("more cut markers in the model (jp.boundary, @jp.layer)")
    return f"Give {', or '.join(fixes)}; or pass a schedule." if fixes else "Pass a schedule."


@dataclass(frozen=True)
class Candidate:
    """One schedule :class:`Auto` considered (a row of ``pipe.plan``'s table)."""

    family: str
    chunks: int | None  # None: a class of the user's that could not be built
    microbatches: int
    time: float | None  # predicted step time (the cut's simulated makespan)
    memory: float | None  # predicted peak bytes per device
    verdict: str  # "chosen", or why not
    schedule: Schedule | None = None  # the candidate (None where it could not be built)
    note: str = ""  # what else the plan should say of it (the program it was priced for)


@dataclass(frozen=True)
class AutoChoice:
    """What :func:`choose` decided: the schedule, and every candidate with its verdict."""

    schedule: Schedule
    candidates: tuple[Candidate, ...]
    objective: str
    time_unit: str
    cut_report: Any = None  # the cutter's report for the chosen schedule (cut once)

    def noted(self, notes: dict[int, str]) -> AutoChoice:
        """This choice with ``notes[id(candidate.schedule)]`` on those candidates' rows."""
        return replace(self, candidates=tuple(
            replace(c, note=notes[id(c.schedule)]) if id(c.schedule) in notes else c
            for c in self.candidates))

    def __str__(self) -> str:
        w = max(12, *(len(c.family) for c in self.candidates))
        lines = [f"schedule chosen by Auto (objective '{self.objective}'):",
                 f"{'family':>{w}} {'v':>2} {'m':>4} {'time':>10} {'memory':>11}  verdict"]
        for c in self.candidates:
            t = "-" if c.time is None else f"{c.time:.4g}"
            mem = "-" if c.memory is None else format_bytes(c.memory)
            v = "-" if c.chunks is None else c.chunks
            note = f" ({c.note})" if c.note else ""
            lines.append(f"{c.family:>{w}} {v:>2} {c.microbatches:>4} {t:>10} "
                         f"{mem:>11}  {c.verdict}{note}")
        lines.append(f"(time: the runtime's program simulated with the stages' costs, a "
                     f"cost a tick and a cost a stored byte a tick, in {self.time_unit}; "
                     "memory: the cutter's prediction per device, the batch not included)")
        return "\n".join(lines)


def choose(auto: Auto, num_devices: int, num_microbatches: int,
           cut_report: Callable[[Schedule], Any],
           time_of: Callable[[Schedule, Any], float | None] = lambda s, r: None,
           max_stages: int = 1 << 30) -> AutoChoice:
    """Cut for every candidate (``cut_report(schedule)``: the cutter's report, raising
    ``PipelineError`` where the model cannot be cut for it or does not fit) and take the
    best that fits. ``time_of(schedule, report)``: the runtime's predicted time
    (``Runtime.predicted_time``); ``None``: the report's simulated makespan."""
    rows: list[tuple[str, int, Schedule | None, float | None, float | None, str,
                     Schedule | None]] = []
    reports: dict[int, Any] = {}  # id(schedule) -> its cut report
    smallest: list[tuple[float, str]] = []  # (the smallest budget it would fit, candidate)
    unit = "flops"
    for name, v, sched in auto.candidates(num_devices, num_microbatches, max_stages):
        if isinstance(sched, str):
            rows.append((name, v, None, None, None, sched, None))
            continue
        try:
            report = cut_report(sched)
        except (PipelineError, CutError) as err:
            least = getattr(err, "smallest_budget", None)
            why = (f"does not fit: the smallest budget it fits is {format_bytes(least)} "
                   f"({int(least)} bytes)" if least is not None
                   else f"does not fit or cut: {_first(err)}")
            rows.append((name, v, None, None, None, why, sched))
            if least is not None:
                smallest.append((least, f"{name} v={v}"))
            continue
        unit = report.time_unit
        memory = float(report.peak_memory)
        budget = report.memory_budget
        time = time_of(sched, report)
        time = float(report.makespan if time is None else time)
        if budget is not None and memory > budget:
            rows.append((name, v, None, time, memory,
                         f"does not fit: {memory / 2**20:.2f} MiB > budget "
                         f"{budget / 2**20:.2f} MiB", sched))
            continue
        rows.append((name, v, sched, time, memory, "", sched))
        reports[id(sched)] = report
    fitting = [r for r in rows if r[2] is not None]
    if not fitting:
        why = "; ".join(f"{r[0]}{'' if r[1] is None else f' v={r[1]}'}: {r[5]}"
                        for r in rows)
        least = ""
        if smallest:
            nbytes, which = min(smallest)
            least = (f" The smallest budget a candidate fits: {format_bytes(nbytes)} "
                     f"({int(nbytes)} bytes), {which}.")
        raise PipelineError(f"schedule='auto' found no candidate that can run: {why}."
                            f"{least} {_advice([r[5] for r in rows])}")

    # (min keeps the first of equals: FAMILIES order)
    best = min(fitting, key=lambda r: _order(auto.objective, r[3], r[4]))
    candidates = []
    for r in rows:
        verdict = r[5]
        if r is best:
            verdict = "chosen"
        elif r[2] is not None:
            verdict = ("slower" if auto.objective == "time" and r[3] > best[3]
                       else "more memory" if r[4] > best[4]
                       else "slower" if r[3] > best[3] else "equal; an earlier family won")
        candidates.append(Candidate(r[0], r[1], num_microbatches, r[3], r[4], verdict, r[6]))
    return AutoChoice(best[2], tuple(candidates), auto.objective, unit, reports[id(best[2])])


def choose_microbatches(auto: Auto, num_devices: int, batch_size: int,
                        build: Callable[[Auto], Any]) -> Any:
    """With ``Auto(microbatches="auto")``: ``build(Auto(microbatches=m, ...))`` (a built
    pipeline's parts, with its ``auto_choice``) for every ``m`` of
    :meth:`Auto.microbatch_options`, and the one whose choice is best by the objective,
    its ``auto_choice`` listing every ``m``'s candidates. A ``m`` that cannot be built
    (e.g. its microbatch does not split over the data shards) is listed with the reason."""
    import dataclasses

    built, refused = [], []
    for m in auto.microbatch_options(num_devices, batch_size):
        try:
            built.append((m, build(dataclasses.replace(auto, microbatches=m))))
        except PipelineError as err:
            refused.append(Candidate("-", 0, m, None, None, f"m={m}: {_first(err)}"))
    if not built:
        raise PipelineError("schedule='auto' found no number of microbatches that can run: "
                            + "; ".join(c.verdict for c in refused))

    def rank(parts: Any) -> tuple:
        c = next(c for c in parts.auto_choice.candidates if c.verdict == "chosen")
        return _order(auto.objective, c.time, c.memory)

    m, parts = min(built, key=lambda b: rank(b[1]))
    lost = f"{'slower' if auto.objective == 'time' else 'more memory'} than m={m}"
    rows = []
    for other, p in built:
        rows += [c if other == m or c.verdict != "chosen" else
                 dataclasses.replace(c, verdict=lost) for c in p.auto_choice.candidates]
    parts.auto_choice = dataclasses.replace(parts.auto_choice,
                                            candidates=tuple(rows + refused))
    return parts


def _first(err: Exception) -> str:
    """An error's first clause: what went wrong and its figure (an infeasible budget's
    message names the smallest feasible budget before its first ';')."""
    text = str(err).split(". ")[0].split("; ")[0]
    return text if len(text) <= 320 else text[:317] + "..."


def placeholder(auto: Auto, mesh: Any, axis: str, batch: Any, shards: int = 1) -> Schedule:
    """The schedule a pipeline checks its arguments and traces with before it chooses:
    1F1B over the mesh's pipe size and :meth:`Auto.num_microbatches` (the choice keeps
    ``m``; only the family and chunks change); ``shards``: the pieces the data axes
    split each microbatch into."""
    if not hasattr(mesh, "axis_names") or axis not in mesh.axis_names:
        raise PipelineError(f"schedule='auto' takes the pipe size from the mesh's '{axis}' "
                            f"axis; the mesh has {tuple(getattr(mesh, 'axis_names', ()))}. "
                            f"Build it with jax.make_mesh((p,), ('{axis}',)) or pass axis=.")
    rows = batch_rows(batch)
    p = int(mesh.shape[axis])
    if auto.num_devices is not None and auto.num_devices != p:
        raise PipelineError(f"Auto(num_devices={auto.num_devices}) but the mesh's '{axis}' "
                            f"axis has {p} devices; drop num_devices or match the mesh.")
    return OneFOneB(p, auto.num_microbatches(p, rows, shards))


def batch_rows(batch: Any) -> int:
    """The rows of ``batch`` that ``schedule='auto'`` splits into microbatches (axis 0)."""
    import jax

    leaves = jax.tree.leaves(batch)
    if not leaves or not getattr(leaves[0], "shape", ()):
        raise PipelineError("schedule='auto' splits the batch along axis 0; give a batch "
                            "of arrays with a leading batch axis.")
    return int(leaves[0].shape[0])


def resolve_auto(schedule: Any) -> Auto | None:
    """The :class:`Auto` that ``schedule`` asks for (``"auto"`` or an instance), else
    ``None``."""
    if isinstance(schedule, Auto):
        return schedule
    if isinstance(schedule, str) and schedule == "auto":
        return Auto()
    return None
