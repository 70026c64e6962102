"""Where a pipeline's first call goes: seconds per phase of building and compiling it.

``jp.pipeline(...)`` traces the loss function to a jaxpr, cuts it into stages (costing
segments, choosing remat, splitting each stage's forward and backward) and lowers the
schedule to the runtime's tables; the first call of each program then builds the
program (tracing the tick loop) and lowers it to StableHLO, and XLA compiles it.
:class:`BuildTimes` records each phase as it happens; ``pipe.plan`` prints it::

    build: trace 0.21 s, cut 0.48 s, schedule 0.05 s; first calls: pipe.value_and_grad
    program + lower 0.43 s, XLA compile 2.10 s

``benchmarks/sections/compile.py`` prints the same phases beside plain JAX's compile.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["BuildTimes"]


@dataclass
class BuildTimes:
    """Seconds of each phase: ``build`` (``trace``, ``cut``, ``schedule``: when the
    pipeline is made) and, per program compiled so far, ``(program + lower, compile)``."""

    build: dict[str, float] = field(default_factory=dict)
    programs: dict[str, tuple[float, float]] = field(default_factory=dict)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Add the time spent inside the ``with`` block to build phase ``name``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.build[name] = self.build.get(name, 0.0) + time.perf_counter() - t0

    def compiled(self, program: str, lower_s: float, compile_s: float) -> None:
        """Record the first compilation of ``program`` (later ones are the same program)."""
        self.programs.setdefault(program, (lower_s, compile_s))

    def __str__(self) -> str:
        out = "build: " + ", ".join(f"{k} {v:.2f} s" for k, v in self.build.items())
        if self.programs:
            out += "; first calls: " + ", ".join(
                f"{name} program + lower {lo:.2f} s, XLA compile {co:.2f} s"
                for name, (lo, co) in self.programs.items())
        return out
