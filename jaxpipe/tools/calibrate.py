"""``jaxpipe calibrate``: measure this machine's compute rate and costs a tick.

``schedule="auto"`` ranks schedules by the program's work plus a fixed cost a tick and a
cost a stored byte a tick (:mod:`jaxpipe.runtime.spmd.predict`); the defaults are
estimates. This times small pipelines on the local devices (:data:`PIPELINES`): 1F1B on
tanh layers so small that the ticks' cost dominates and on ones whose work does, and an
attention stack as 1F1B and as GPipe (the same work in the same ticks, several times the
stored bytes), fits ``time = work / rate + ticks * cost`` to the first two and the cost of
a stored byte a tick to the difference of the last two
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

__all__ = ["PIPELINES", "add_calibrate_parser", "measure"]

#: The measured pipelines, ``(model, width, rows, schedule, microbatches per device)``:
#: tanh layers whose ticks dominate, then whose work does; an attention stack (what
#: stores many values a microbatch) as 1F1B and as GPipe, the same work in the same
#: ticks but several times the stored bytes.
PIPELINES = (("tanh", 8, 16, "1f1b", 2), ("tanh", 512, 512, "1f1b", 2),
             ("attention", 64, 32, "1f1b", 4), ("attention", 64, 32, "gpipe", 4))


def _tanh_loss(params: Any, batch: Any) -> Any:
    import jax.numpy as jnp

    from jaxpipe.jaxpr.markers import boundary

    h = batch["x"]
    for w in params:
        h = boundary(jnp.tanh(h @ w))
    return jnp.mean((h - batch["y"]) ** 2)


def _attention_loss(params: Any, batch: Any) -> Any:
    import jax
    import jax.numpy as jnp

    from jaxpipe.jaxpr.markers import boundary

    h = batch["x"]  # [rows, sequence 32, width]
    for w in params:
        q, k, v = h @ w, h @ w.T, jnp.tanh(h @ w)
        a = jax.nn.softmax(jnp.einsum("bsd,btd->bst", q, k) / h.shape[-1] ** 0.5, axis=-1)
        h = boundary(h + jnp.einsum("bst,btd->bsd", a, v))
    return jnp.mean((h - batch["y"]) ** 2)


def measure(devices: int | None = None, repeats: int = 5) -> Calibration:
    """Time the pipelines on the first ``devices`` local devices (default: up to 4) and
    fit the rate and costs a tick (see the module docstring)."""
    import jax

    from jaxpipe.api.pipeline import pipeline
    from jaxpipe.distributed import replicate
    from jaxpipe.runtime.spmd import SpmdRuntime
    from jaxpipe.runtime.spmd.backends import concurrent
    from jaxpipe.runtime.spmd.predict import carried_bytes, program_work
    from jaxpipe.schedule import GPipe, OneFOneB

    p = devices or min(len(jax.devices()), 4)
    mesh = jax.make_mesh((p,), ("pipe",), devices=jax.devices()[:p])
    runtime = SpmdRuntime()
    backend, together = runtime.resolve_backend(mesh), concurrent(mesh)
    samples, stored_pair = [], []
    for model, width, rows, family, per_device in PIPELINES:
        m = per_device * p
        keys = jax.random.split(jax.random.key(0), 2 * p + 2)
        params = [jax.random.normal(k, (width, width)) / width ** 0.5 for k in keys[:2 * p]]
        shape = (rows, width) if model == "tanh" else (rows * m, 32, width)
        batch = {"x": jax.random.normal(keys[-2], shape),
                 "y": jax.random.normal(keys[-1], shape)}
        # on the mesh once (every process holds the same values: one seed), so a timed
        # call moves nothing and a run of several processes (jaxpipe.launch) works too
        params, batch = replicate((params, batch), mesh)
        sched = (OneFOneB if family == "1f1b" else GPipe)(p, m)
        pipe = pipeline(_tanh_loss if model == "tanh" else _attention_loss, params, batch,
                        mesh=mesh, schedule=sched, cut="markers", runtime=runtime)
        seconds = _median(pipe.value_and_grad, (params, batch), repeats)
        work, _ = program_work(sched, pipe.inspect.cut_report.action_cost, backend, False,
                               runtime.resolve_split(mesh), runtime.resolve_refine(mesh),
                               together)
        ticks = pipe.inspect.executor.lowering.num_ticks
        stored = pipe.inspect.cut_report.padded_memory.residuals
        if model == "tanh":
            samples.append((seconds, work, ticks))
        else:
            stored_pair.append((seconds, carried_bytes(p, ticks, stored, together)))
    return fit(machine_key(backend, jax.devices()[0].device_kind, together), samples,
               stored=tuple(stored_pair))


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
          f"{cal.tick_overhead_s * 1e6:.1f} us a tick ({cal.tick_overhead_flops:.3g} FLOPs), "
          f"{cal.stored_byte_tick_flops:.3g} FLOPs a stored byte a tick; kept in {path}")
    return 0
