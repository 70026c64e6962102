"""What the user asks of the cutter: :class:`Cut` options, and :class:`CutError`."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from jaxpipe.cut.memory_model import DEVICE_MEMORY, SPMD_MEMORY, MemoryModel
from jaxpipe.stages.remat import Remat, parse_remat

__all__ = ["Cut", "CutError", "Objective"]

Objective = Literal["time", "memory"]

# Cut.memory_model names for explicit experiments.
_NAMED_MODELS = {"spmd": SPMD_MEMORY, "device": DEVICE_MEMORY}


class CutError(ValueError):
    """The requested cut is impossible; the message says what would make it possible.
    ``smallest_budget``: for a memory budget nothing meets, the smallest one the search
    found that would be met (bytes); ``None`` otherwise."""

    def __init__(self, message: str, smallest_budget: float | None = None) -> None:
        super().__init__(message)
        self.smallest_budget = smallest_budget


def _number(name: str, value: object, what: str, allow_inf: bool = False) -> float:
    """``value`` as a float; a CutError naming the field unless it is a real number
    (not NaN; infinite only where ``allow_inf``)."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value)
            or (math.isinf(value) and not allow_inf)):
        raise CutError(f"Cut.{name} must be {what}, got {value!r}")
    return float(value)


#: ``Cut.time_slack``'s default (10%).
_DEFAULT_SLACK = 0.10


@dataclass(frozen=True)
class Cut:
    """How to cut a model into pipeline stages (``jp.pipeline(..., cut=jp.Cut(...))``).

    Examples::

        jp.Cut()                              # balance compute (min max stage time)
        jp.Cut(objective="memory")            # min peak device memory, <=10% slower
        jp.Cut(memory_budget=40 * 2**30)      # fastest cut + recomputation fitting 40 GiB
        jp.Cut(memory_budget=40 * 2**30, remat="none")  # ... by placement alone
        jp.Cut(remat="boundary")              # every stage stores only layer inputs
        jp.Cut(indices=[3, 7, 11])            # new stages begin after markers 3, 7, 11

    Attributes:
      indices: explicit cut: sorted indices into the model's markers after which a
        new stage begins (``num_stages - 1`` of them). Not with ``objective="memory"``.
      objective: ``"time"`` minimises the maximum stage time; ``"memory"``
        minimises peak device memory among cuts whose maximum stage time is within
        ``time_slack`` of the best possible.
      memory_budget: bytes per device (what the cutter predicts: parameters,
        gradients, optimizer state, residuals, transfers, workspace). When set,
        minimise the maximum stage time, recomputation included, subject to the peak
        device memory fitting the budget (not with ``objective="memory"``). An infeasible
        budget raises :class:`CutError` naming the smallest feasible one and the cut
        and recomputation that reach it.
      remat: recomputation (:class:`~jaxpipe.stages.remat.Remat`). ``"auto"`` (default):
        the cutter chooses each stage's policy together with the cut -- never under
        ``objective="time"`` (recomputation only adds time), within the time slack
        under ``"memory"``, and wherever it makes the step fastest under a
        ``memory_budget``. ``"none"``: no recomputation (placement alone). A policy
        name (``"dots"``, ``"dots_no_batch"``, ``"boundary"``, ``"full"``) for every
        stage, or one per stage (with explicit ``indices``).
      budget_source: where ``memory_budget`` came from, for plans and errors
        (``cut="auto"`` fills it from the device's memory limit).
      time_slack: allowed slow-down for ``objective="memory"`` (0.10 = 10%; only
        with that objective).
      optimizer_bytes_per_param_byte: optimizer state per parameter byte (2.0 for
        Adam's two moments in the parameter dtype; 0.0 for SGD; 1.0 for momentum).
      grad_bytes_per_param_byte: gradient bytes per parameter byte (1.0).
      memory_model: ``None`` (default): the memory model of the runtime that will
        run the pipeline (passed to the cutter by the caller). For experiments,
        ``"spmd"`` (buffers padded to one shape on every device,
        :data:`~jaxpipe.cut.SPMD_MEMORY`), ``"device"`` (each device holds only its
        own stages' bytes, :data:`~jaxpipe.cut.DEVICE_MEMORY`) or any
        :class:`~jaxpipe.cut.MemoryModel`. See :mod:`jaxpipe.cut`.
      workspace_residual_sets: transient memory while a stage runs, in full residual
        sets (per-microbatch residual bytes without recomputation) of that stage;
        ``None`` (default): the memory model's value (0.5 for jaxpipe's SPMD
        runtime); 0.0 ignores it.
      workspace_param_sets: more transient memory, in parameter bytes of the running
        stage; ``None`` (default): the memory model's (2.0 for the SPMD runtime).
      profile: time each segment's compiled forward/backward instead of counting
        FLOPs (slower to plan, noisy on shared machines).

    Memory per parameter byte is ``1 + grad_bytes_per_param_byte +
    optimizer_bytes_per_param_byte`` (4.0 by default).
    """

    indices: Sequence[int] | None = None
    objective: Objective = "time"
    memory_budget: int | None = None
    time_slack: float = _DEFAULT_SLACK
    optimizer_bytes_per_param_byte: float = 2.0
    grad_bytes_per_param_byte: float = 1.0
    memory_model: str | MemoryModel | None = None
    workspace_residual_sets: float | None = None
    profile: bool = False
    remat: str | Remat | Sequence[str | Remat] = "auto"
    workspace_param_sets: float | None = None
    budget_source: str | None = None

    def __post_init__(self) -> None:
        # Types first: every field is checked before anything compares or converts it,
        # so a wrong type gets this message, not a TypeError from deep in the cutter.
        if not (isinstance(self.objective, str) and self.objective in ("time", "memory")):
            raise CutError(
                f"Cut.objective must be 'time' or 'memory', got {self.objective!r}")
        model = self.memory_model
        if not (model is None or isinstance(model, MemoryModel)
                or (isinstance(model, str) and model in _NAMED_MODELS)):
            raise CutError(
                f"Cut.memory_model must be None (the runtime's), 'spmd', 'device' or a "
                f"jaxpipe.cut.MemoryModel, got {model!r}"
            )
        if self.memory_budget is not None:
            budget = _number("memory_budget", self.memory_budget,
                             "positive bytes per device, e.g. 40 * 2**30", allow_inf=True)
            if not budget > 0:
                raise CutError(
                    f"Cut.memory_budget must be positive bytes per device (e.g. 40 * 2**30) "
                    f"or None, got {self.memory_budget!r}")
        slack = _number("time_slack", self.time_slack, "a fraction >= 0, e.g. 0.10",
                        allow_inf=True)
        if not slack >= 0:
            raise CutError(f"Cut.time_slack must be >= 0 (e.g. 0.10 for 10%), got {slack!r}")
        for name in ("optimizer_bytes_per_param_byte", "grad_bytes_per_param_byte"):
            value = _number(name, getattr(self, name), "a number >= 0")
            if not value >= 0:
                raise CutError(f"Cut.{name} must be >= 0, got {value!r}")
        for what in ("workspace_residual_sets", "workspace_param_sets"):
            if getattr(self, what) is not None:
                ws = _number(what, getattr(self, what), "a number >= 0 or None")
                if not ws >= 0:
                    raise CutError(f"Cut.{what} must be >= 0 or None, got {ws!r}")
        if not isinstance(self.profile, bool):
            raise CutError(f"Cut.profile must be True or False, got {self.profile!r}")
        object.__setattr__(self, "remat", self._parse_remat(self.remat))
        if self.budget_source is not None and not isinstance(self.budget_source, str):
            raise CutError(f"Cut.budget_source must be a str or None, got "
                           f"{self.budget_source!r}")
        if self.memory_budget is not None and self.budget_source is None:
            object.__setattr__(self, "budget_source", "Cut.memory_budget")
        if self.indices is not None:
            if isinstance(self.indices, (str, bytes)) or not isinstance(self.indices,
                                                                          Iterable):
                raise CutError(
                    f"Cut.indices must be a sequence of marker indices (ints), e.g. "
                    f"Cut(indices=[3, 7]), got {self.indices!r}")
            idx = tuple(self.indices)
            bad = [i for i in idx if isinstance(i, bool) or not isinstance(i, numbers.Integral)]
            if bad:
                raise CutError(
                    f"Cut.indices must be ints (marker indices), got {bad[0]!r} in "
                    f"{list(idx)!r}")
            idx = tuple(int(i) for i in idx)
            if any(i < 0 for i in idx):
                raise CutError(f"Cut.indices must be >= 0 (marker indices), got {list(idx)}")
            if list(idx) != sorted(set(idx)):
                raise CutError(f"Cut.indices must be strictly increasing, got {list(idx)}")
            object.__setattr__(self, "indices", idx)
        self._refuse_overridden(slack)

    def _refuse_overridden(self, slack: float) -> None:
        """An option another one overrides would be dropped silently: refuse it."""
        if self.objective == "memory" and self.indices is not None:
            raise CutError(
                f"Cut.objective='memory' has no effect with Cut.indices (the cut is given), "
                f"got indices={list(self.indices)}: drop one of the two")
        if self.objective == "memory" and self.memory_budget is not None:
            raise CutError(
                "Cut.objective='memory' has no effect with Cut.memory_budget (the budget "
                "gets the fastest cut and recomputation that fit it), got memory_budget="
                f"{self.memory_budget!r}: drop one of the two")
        if slack != _DEFAULT_SLACK and (self.objective != "memory"):
            raise CutError(
                f"Cut.time_slack only applies to objective='memory', got time_slack={slack!r} "
                f"with objective={self.objective!r}: pass objective='memory' or leave "
                "time_slack out")

    @staticmethod
    def _parse_remat(remat: object) -> str | Remat | tuple[Remat, ...]:
        if isinstance(remat, str) and remat == "auto":
            return "auto"
        try:
            if isinstance(remat, (str, Remat)):
                return parse_remat(remat, "Cut.remat")
            if isinstance(remat, Sequence):
                return tuple(parse_remat(r, f"Cut.remat[{i}]") for i, r in enumerate(remat))
        except ValueError as e:
            raise CutError(f"{e}; or 'auto'") from None
        raise CutError(f"Cut.remat must be 'auto', a policy name or one per stage, got "
                       f"{remat!r}")

    def costed_policies(self) -> tuple[Remat, ...]:
        """The recomputation policies the segment costs need for this Cut (``NONE`` first)."""
        if isinstance(self.remat, Remat):
            return tuple(dict.fromkeys((Remat.NONE, self.remat)))
        if isinstance(self.remat, tuple):
            return tuple(dict.fromkeys((Remat.NONE, *self.remat)))
        if self.memory_budget is None and (self.objective == "time" or self.indices is not None):
            return (Remat.NONE,)  # "auto" recomputes nothing here
        return tuple(Remat)

    @property
    def bytes_per_param_byte(self) -> float:
        """Parameters + gradients + optimizer state, per parameter byte."""
        return 1.0 + self.grad_bytes_per_param_byte + self.optimizer_bytes_per_param_byte

    def resolve_memory_model(self, runtime_model: MemoryModel) -> MemoryModel:
        """The memory model to cut for: ``runtime_model`` unless this Cut names another,
        with this Cut's workspace overrides applied."""
        if self.memory_model is None:
            model = runtime_model
        elif isinstance(self.memory_model, MemoryModel):
            model = self.memory_model
        else:
            model = _NAMED_MODELS[self.memory_model]
        overrides = {k: float(v) for k, v in (
            ("workspace_residual_sets", self.workspace_residual_sets),
            ("workspace_param_sets", self.workspace_param_sets)) if v is not None}
        return replace(model, **overrides) if overrides else model
