"""Ahead-of-time compiles for accelerators this machine does not have.

:func:`target` names a TPU or GPU topology and gives its compile-only devices
(:mod:`.targets`); a pipeline built on a mesh over them lowers with
``Pipeline.lower`` and compiles with XLA's real TPU or CUDA compiler;
:func:`compile_report` compiles a pipeline's program and reports what one device holds,
whether it fits, the tick loop's census and the compile time (:mod:`.report`; the
``jaxpipe compile`` command prints it).

Imports nothing above :mod:`jaxpipe.api.pipeline`'s seam at import time; names load lazily.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "GPUS": "jaxpipe.aot.targets",
    "GpuSpec": "jaxpipe.aot.targets",
    "Target": "jaxpipe.aot.targets",
    "target": "jaxpipe.aot.targets",
    "CompileReport": "jaxpipe.aot.report",
    "compile_report": "jaxpipe.aot.report",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxpipe.aot' has no attribute {name!r}")
