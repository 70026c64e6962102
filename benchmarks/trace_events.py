"""The events ``jax.profiler`` records while a function runs (XLA's compile phases, its
CPU thunks), read back from the trace file it writes."""

from __future__ import annotations

import gzip
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def trace_events(run: Callable[[], Any]) -> list[dict[str, Any]]:
    """The complete events (``"ph": "X"``: a name, a start and a duration in
    microseconds) of one ``jax.profiler`` trace around ``run()``."""
    import jax

    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            run()
        trace, = Path(d).rglob("*.trace.json.gz")
        events = json.loads(gzip.open(trace).read())["traceEvents"]
    return [e for e in events if e.get("ph") == "X"]
