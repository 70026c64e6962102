"""What benchmark sections share: the run's settings, compiled-program cache, timing.

A section (``benchmarks/sections/<name>.py``) gets a :class:`Runner` ``r``: ``r.s`` is the
:class:`Settings` the sections share (``r.s.quick`` for the smoke test; a section's own
sizes are in its module, see :func:`section_settings`), ``r.out`` the output folder,
and ``r.measure`` / ``r.jaxpipe_blocks`` compile and time programs once for every section
(the sweep and scaling sections reuse the baseline's 1F1B runs). :func:`compile_program`
and :func:`time_group` are the two steps for a section's own programs; timings are
medians of round-robin runs after warm-up, wall and process CPU time.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpipe as jp
from benchmarks import common as C
from benchmarks.baselines import spmd_gpipe as B
from jaxpipe.runtime.spmd import SpmdRuntime

#: Fields of each measured configuration (a jaxpipe program or the baseline).
RUN_FIELDS = ("build_s", "lower_s", "compile_s", "median_s", "min_s", "cpu_median_s",
              "times_s", "memory", "flops_per_step", "tflops_per_device", "mfu")


@dataclass
class Settings:
    """What several sections share (recorded in the JSON's ``meta.settings``).

    A section's own sizes are a frozen dataclass in its module (e.g. ``OverheadSettings``
    in ``sections/overhead.py``) with ``for_run(quick)``; it gets them with
    :func:`section_settings` and records them in its result under ``"settings"``.
    """

    model: C.GPTConfig
    quick: bool = False
    p: int = 4  # main pipeline size
    p_big: int = 8  # extra sweep size (when there are devices)
    mb: int = 2  # sequences per microbatch in baseline / sweep / scaling
    warmup: int = 2
    repeats: int = 7
    plots: bool = True
    program: str = "auto"  # SpmdRuntime(backend=...): "auto", "cpu", "gpu" or "tpu"
    sections: tuple[str, ...] = ()  # the sections to run (default: every one found)
    # per section, fields of its own settings to override: {"overhead": {"mb": 4}}
    extra: dict[str, Any] = field(default_factory=dict)


def default_settings(quick: bool) -> Settings:
    """The shared sizes of a full run, or of the smoke test (``--quick``)."""
    if quick:
        # Smoke test: tiny model, few repeats. Its numbers mean nothing.
        model = C.GPTConfig(vocab=64, d_model=32, n_heads=2, n_layers=2, seq=8)
        return Settings(model=model, quick=True, p=2, p_big=2, mb=2, warmup=1, repeats=2)
    return Settings(model=C.GPTConfig())


T = TypeVar("T")


def section_settings(s: Settings, section: str, for_run: Callable[[bool], T]) -> T:
    """A section's own settings: ``for_run(s.quick)`` (its full-run or ``--quick`` values)
    with the fields ``s.extra[section]`` overrides (``run.py --mb-size`` sets overhead's
    ``mb``)."""
    return replace(for_run(s.quick), **s.extra.get(section, {}))


def mesh(p: int) -> jax.sharding.Mesh:
    """A ``pipe`` mesh over the first ``p`` devices."""
    return jax.make_mesh((p,), ("pipe",), devices=jax.devices()[:p])


def flops_fields(flops: float, seconds: float, p: int) -> dict[str, Any]:
    """Achieved TFLOP/s per device and MFU (MFU only for known accelerators)."""
    per_dev = flops / seconds / p / 1e12 if seconds > 0 else None
    peak = C.peak_flops_per_device(jax.devices()[0])
    return {"flops_per_step": flops, "tflops_per_device": per_dev,
            "mfu": (per_dev * 1e12 / peak) if (peak and per_dev) else None}


@dataclass
class Prepared:
    """A compiled program, its arguments and what is known before timing it."""

    compiled: Any
    args: tuple
    info: dict[str, Any]
    flops: float
    p: int


def compile_program(jitted: Any, args: tuple) -> tuple[Any, dict[str, Any]]:
    compiled, lower_s, compile_s = C.compile_timed(jitted, *args)
    return compiled, {"lower_s": lower_s, "compile_s": compile_s,
                      "memory": C.memory_stats(compiled)}


def time_group(group: dict[str, Prepared], s: Settings) -> dict[str, dict[str, Any]]:
    """Time the prepared programs round-robin; returns full result dicts per label."""
    timings = C.time_interleaved({k: (v.compiled, v.args) for k, v in group.items()},
                                 warmup=s.warmup, repeats=s.repeats)
    out = {}
    for k, v in group.items():
        res = {**v.info, **timings[k]}
        res.update(flops_fields(v.flops, res["median_s"], v.p))
        out[k] = res
    return out


def stage_fn(cfg: C.GPTConfig) -> Callable:
    """A baseline stage: its ``L/p`` blocks in order (unrolled, like a jaxpipe stage)."""

    def stage(sp: Any, x: jax.Array) -> jax.Array:
        for k in range(jax.tree.leaves(sp)[0].shape[0]):
            x = C.block(jax.tree.map(lambda a, k=k: a[k], sp), x, cfg.n_heads)
        return x

    return stage


def mse(y: jax.Array, t: jax.Array) -> jax.Array:
    return jnp.mean(jnp.square(y - t).astype(jnp.float32))


class Runner:
    """Runs and caches measurements shared between sections; ``out`` is the run's folder
    (a section may write logs under it)."""

    def __init__(self, s: Settings, out: Path):
        self.s = s
        self.out = out
        self.cache: dict[tuple, dict[str, Any]] = {}
        self.blocks_params = C.init_params(s.model, jax.random.key(0), embed=False)

    def has(self, name: str, schedule: jp.Schedule) -> bool:
        return self.key(name, schedule) in self.cache

    @staticmethod
    def key(name: str, schedule: jp.Schedule) -> tuple:
        return ("blocks", name, schedule.num_devices, schedule.num_microbatches,
                schedule.stages_per_device)

    # ------------------------------------------------------------ jaxpipe, block stack
    def prepare_jaxpipe(self, name: str, schedule: jp.Schedule) -> Prepared:
        """Build and compile jaxpipe on the block stack with parameters resident.

        The program takes the parameters already in jaxpipe's stage layout
        (``Pipeline.shard``) and returns stage-layout gradients, as a training loop keeps
        them -- the same contract as the baseline (stacked, sharded weights in and out).
        """
        s, cfg = self.s, self.s.model
        p, m = schedule.num_devices, schedule.num_microbatches
        batch = C.make_blocks_batch(cfg, m * s.mb)
        t0 = time.perf_counter()
        pipe = jp.pipeline(C.blocks_loss(cfg), self.blocks_params, batch, mesh=mesh(p),
                           schedule=schedule, cut="markers",
                           runtime=SpmdRuntime(backend=s.program))
        build_s = time.perf_counter() - t0
        program = "resident"
        args: tuple = (pipe.shard(self.blocks_params), batch)
        compiled, info = compile_program(pipe.inspect.staged_value_and_grad_fn, args)
        tl = schedule.simulate()
        low = pipe.inspect.executor.lowering
        info.update({"build_s": build_s, "program": program,
                     "tick_program": pipe.inspect.executor.backend,
                     "overlap": low.exchange.delay == 2,
                     "bubble": float(tl.bubble_fraction), "makespan": float(tl.makespan),
                     "num_ticks": int(low.num_ticks),
                     "res_peak": [int(x) for x in low.residual_peak]})
        flops = C.model_flops(cfg, m * s.mb * cfg.seq, embed=False)
        return Prepared(compiled, args, info, flops, p)

    def prepare_baseline(self, p: int, m: int) -> Prepared:
        """Build and compile the SPMD GPipe baseline on the same block stack."""
        s, cfg = self.s, self.s.model
        batch = C.make_blocks_batch(cfg, m * s.mb)
        base_mesh = B.auto_mesh(mesh(p))
        t0 = time.perf_counter()
        stacked = jax.device_put(B.stack_stages(self.blocks_params["blocks"], p),
                                 NamedSharding(base_mesh, P("pipe")))
        xs = batch["x"].reshape(m, s.mb, *batch["x"].shape[1:])
        ys = batch["y"].reshape(xs.shape)
        jitted = B.spmd_gpipe_value_and_grad(stage_fn(cfg), mse, base_mesh, m)
        build_s = time.perf_counter() - t0
        compiled, info = compile_program(jitted, (stacked, xs, ys))
        info.update({"build_s": build_s, "program": "stacked"})
        flops = C.model_flops(cfg, m * s.mb * cfg.seq, embed=False)
        return Prepared(compiled, (stacked, xs, ys), info, flops, p)

    def measure(self, group: dict[tuple, Callable[[], Prepared]]) -> dict[tuple, dict]:
        """Results for every key: cached ones as they are, the rest prepared and timed
        together (round-robin)."""
        todo = {k: make() for k, make in group.items() if k not in self.cache}
        if todo:
            self.cache.update(time_group(todo, self.s))
            del todo
            gc.collect()
        return {k: self.cache[k] for k in group}

    def jaxpipe_blocks(self, name: str, schedule: jp.Schedule) -> dict[str, Any]:
        key = self.key(name, schedule)
        return self.measure({key: lambda: self.prepare_jaxpipe(name, schedule)})[key]


def ratio(a: float | None, b: float | None) -> float | None:
    return (a / b) if (a is not None and b not in (None, 0)) else None


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def ratios(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float | None]:
    """``a / b`` for median wall time, min wall time and median process CPU time."""
    return {"wall": ratio(a["median_s"], b["median_s"]),
            "wall_min": ratio(a["min_s"], b["min_s"]),
            "cpu": ratio(a["cpu_median_s"], b["cpu_median_s"])}


def linear_fit(x: list[float], y: list[float]) -> dict[str, float | None]:
    """Least-squares ``y = intercept + slope * x`` and its R^2 (None below 2 points)."""
    if len(x) < 2:
        return {"intercept_s": None, "slope_s_per_microbatch": None, "r2": None}
    a, b = np.polyfit(np.asarray(x, float), np.asarray(y, float), 1)
    pred = a * np.asarray(x) + b
    ss_res = float(np.sum((np.asarray(y) - pred) ** 2))
    ss_tot = float(np.sum((np.asarray(y) - np.mean(y)) ** 2)) or 1.0
    return {"intercept_s": float(b), "slope_s_per_microbatch": float(a),
            "r2": 1.0 - ss_res / ss_tot}


def fmt(x: Any, spec: str = "{:.2f}") -> str:
    """``x`` formatted for a summary table; ``n/a`` when it was not measured."""
    return "n/a" if x is None else spec.format(x)
