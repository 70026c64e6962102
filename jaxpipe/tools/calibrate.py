"""``jaxpipe calibrate``: measure this machine's compute rate and cost a tick.

``schedule="auto"`` ranks schedules by the program's work plus a fixed cost a tick
(:mod:`jaxpipe.runtime.spmd.predict`); the defaults are estimates. This times two small
1F1B pipelines of tanh layers on the local devices, one so small that the ticks' cost
dominates and one whose work does, fits ``time = work / rate + ticks * cost``
(:func:`jaxpipe.runtime.spmd.calibrate.fit`) and keeps the result for this backend and
device kind (``$JAXPIPE_CALIBRATION``, default ``~/.cache/jaxpipe/calibration.json``),
where every later ``schedule="auto"`` reads it::

    jaxpipe calibrate                 # ~10 s on CPU
    jaxpipe calibrate --devices 2 --out calibration.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from jaxpipe.runtime.spmd.calibrate import Calibration, fit, machine_key, save

__all__ = ["add_calibrate_parser", "measure"]

#: (width, rows) of the two models: the first's ticks dominate, the second's work.
SIZES = ((8, 16), (512, 512))


def measure(devices: int | None = None, repeats: int = 5) -> Calibration:
    """Time the two pipelines on the first ``devices`` local devices (default: up to 4)
    and fit the rate and cost a tick (see the module docstring)."""
    import jax
    import jax.numpy as jnp

    from jaxpipe.api.pipeline import pipeline
    from jaxpipe.jaxpr.markers import boundary
    from jaxpipe.runtime.spmd import SpmdRuntime
    from jaxpipe.runtime.spmd.backends import concurrent
    from jaxpipe.runtime.spmd.predict import program_work
    from jaxpipe.schedule import OneFOneB

    p = devices or min(len(jax.devices()), 4)
    mesh = jax.make_mesh((p,), ("pipe",), devices=jax.devices()[:p])
    runtime = SpmdRuntime()
    backend, together = runtime.resolve_backend(mesh), concurrent(mesh)

    def loss_fn(params, batch):
        h = batch["x"]
        for w in params:
            h = boundary(jnp.tanh(h @ w))
        return jnp.mean((h - batch["y"]) ** 2)

    samples = []
    for width, rows in SIZES:
        keys = jax.random.split(jax.random.key(0), 2 * p + 2)
        params = [jax.random.normal(k, (width, width)) / width ** 0.5 for k in keys[:2 * p]]
        batch = {"x": jax.random.normal(keys[-2], (rows, width)),
                 "y": jax.random.normal(keys[-1], (rows, width))}
        sched = OneFOneB(p, 2 * p)
        pipe = pipeline(loss_fn, params, batch, mesh=mesh, schedule=sched, cut="markers",
                        runtime=runtime)
        seconds = _median(pipe.value_and_grad, (params, batch), repeats)
        work, _ = program_work(sched, pipe.inspect.cut_report.action_cost, backend, False,
                               runtime.resolve_split(mesh), runtime.resolve_refine(mesh),
                               together)
        samples.append((seconds, work, pipe.inspect.executor.lowering.num_ticks))
    return fit(machine_key(backend, jax.devices()[0].device_kind, together), samples)


def _median(fn: Any, args: tuple, repeats: int) -> float:
    import jax

    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def add_calibrate_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "calibrate", help="measure this machine's compute rate and cost a tick for "
        "schedule='auto'", description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=None,
                        help="local devices to pipeline over (default: up to 4)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per model")
    parser.add_argument("--out", type=Path, default=None,
                        help="the calibration file (default: $JAXPIPE_CALIBRATION or "
                        "~/.cache/jaxpipe/calibration.json)")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.devices is not None and args.devices < 1:
        raise ValueError(f"--devices must be at least 1, got {args.devices}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    cal = measure(args.devices, args.repeats)
    path = save(cal, args.out)
    print(f"calibrated {cal.key}: {cal.flops_per_s:.3g} FLOP/s, "
          f"{cal.tick_overhead_s * 1e6:.1f} us a tick ({cal.tick_overhead_flops:.3g} FLOPs); "
          f"kept in {path}")
    return 0
