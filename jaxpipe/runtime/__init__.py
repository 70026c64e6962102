"""Runtimes: the ways jaxpipe executes stage functions under a schedule.

- :mod:`jaxpipe.runtime.base` — the seam: :class:`Runtime` (what you pass to
  ``jp.pipeline(..., runtime=...)``), :class:`Executor` (a runtime bound to one
  pipeline) and :class:`RuntimeSpec` (what it is built from).
- :mod:`jaxpipe.runtime.spmd` — one ``jit(shard_map)`` program over the pipe axis (the
  default, ``"spmd"``).
- :mod:`jaxpipe.runtime.reference` — sequential, one action at a time (``"reference"``;
  the ground truth in tests).

:func:`resolve` turns a name or an instance into a :class:`Runtime`; :func:`register`
adds a name. Imports every layer before it (jaxpr, sharding, schedule, stages, cut's
memory model, train's per-stage optimizer), never the API layer that calls it.
"""

from __future__ import annotations

from collections.abc import Callable

from jaxpipe.errors import PipelineError
from jaxpipe.runtime.base import Executor, Runtime, RuntimeSpec

__all__ = ["Executor", "Runtime", "RuntimeSpec", "register", "resolve"]

_REGISTRY: dict[str, Callable[[], Runtime]] = {}


def register(name: str, factory: Callable[[], Runtime]) -> None:
    """Make ``jp.pipeline(..., runtime=name)`` build ``factory()``."""
    _REGISTRY[name] = factory


def _builtins() -> None:
    if "spmd" not in _REGISTRY:
        from jaxpipe.runtime.reference import ReferenceRuntime
        from jaxpipe.runtime.spmd import SpmdRuntime

        register("spmd", SpmdRuntime)
        register("reference", ReferenceRuntime)


def resolve(runtime: str | Runtime) -> Runtime:
    """A :class:`Runtime` from a registered name (``"spmd"``, ``"reference"``) or itself."""
    if isinstance(runtime, Runtime):
        return runtime
    _builtins()
    if isinstance(runtime, str) and runtime in _REGISTRY:
        return _REGISTRY[runtime]()
    raise PipelineError(
        f"runtime must be one of {sorted(_REGISTRY)} or a jaxpipe.runtime.Runtime instance, "
        f"got {runtime!r}."
    )
