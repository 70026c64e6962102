"""jaxpipe: pipeline parallelism with user-defined schedules for JAX.

One ``jax.jit(jax.shard_map(...))`` program runs any validated schedule (GPipe,
1F1B, interleaved 1F1B, zero-bubble, DualPipeV, or your own ``Schedule`` subclass)
over a ``pipe`` mesh axis; loss and gradients equal ``jax.value_and_grad`` of the
unpipelined model. See README.md and docs/architecture.md.

Public names are imported lazily so that ``import jaxpipe`` stays cheap and each
layer of the package can be used on its own. No public name is also a submodule's name
(``jp.pipeline`` is a function, its module is :mod:`jaxpipe.api.pipeline`), so importing a
submodule never rebinds a public name.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "boundary": "jaxpipe.jaxpr.markers",
    "layer": "jaxpipe.jaxpr.markers",
    "Action": "jaxpipe.schedule",
    "Schedule": "jaxpipe.schedule",
    "ScheduleError": "jaxpipe.schedule",
    "GPipe": "jaxpipe.schedule",
    "OneFOneB": "jaxpipe.schedule",
    "Interleaved1F1B": "jaxpipe.schedule",
    "Timeline": "jaxpipe.schedule",
    "load_schedule": "jaxpipe.schedule",
    "Auto": "jaxpipe.api.auto",
    "pipeline": "jaxpipe.api.pipeline",
    "Pipeline": "jaxpipe.api.pipeline",
    "PipelineError": "jaxpipe.errors",
    "Cut": "jaxpipe.cut",
    "CutError": "jaxpipe.cut",
}
# public submodules (``jp.flax.pipeline``, ``jp.schedule.forward``, ...)
_SUBMODULES = {
    "flax", "schedule", "train", "cut", "stages", "runtime", "checkpoint", "distributed",
    "launch", "aot",
}
__all__ = sorted(_EXPORTS) + sorted(_SUBMODULES)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        module = importlib.import_module(f"jaxpipe.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'jaxpipe' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
