"""jaxpipe benchmark suite: executor overhead, a MaxText-style baseline, schedules, scaling.

    python benchmarks/run.py                    # defaults, < ~10 min on a 2-core CPU
    python benchmarks/run.py --quick            # tiny model, < 1 min (the test suite runs it)
    python benchmarks/run.py --devices 8 --out results/ --layers 16 --d-model 256

Runs on whatever backend JAX finds: CPU with ``--devices`` virtual devices by default
(single-threaded XLA, so one device = one core and ratios measure work, not threading);
on GPU/TPU the real devices, where it also reports TFLOP/s per device and MFU, and sets
the XLA flags the accelerator program wants (``jaxpipe/xla_flags.py``) unless
``XLA_FLAGS`` names them. ``--program cpu|gpu|tpu`` builds that SPMD program whatever the
devices (default: the devices' platform), so both programs run on one machine. Sections
(``--sections``, comma separated, default all):

overhead     plain JAX (``value_and_grad`` over microbatches in one jit, a ``lax.scan``)
             vs ``jaxpipe`` 1F1B at p=1 and p=4 on the full GPT: step-time ratios.
baseline     jaxpipe GPipe and 1F1B vs ``baselines/spmd_gpipe`` (MaxText-style SPMD GPipe)
             at the same p and m in {p, 2p, 4p, 8p}, on the block stack: step-time ratio
             and compiled per-device memory ratio.
sweep        every built-in and gallery (``schedules/*.py``) schedule at p=4 (and p=8):
             simulated bubble, compiled memory, step time, compile time.
scaling      1F1B at p=4 as m grows: compile time (should be flat) and step time
             (should be linear in m).
concurrency  2 processes x 1 device (jax.distributed + gloo) running the p=2 pipeline vs
             one process doing the same work; speed-up against the ideal 2m/(m+1).
remat        GPT, 1F1B, budget = 60% of the no-recompute peak device: recomputation
             chosen with the cut (jp.Cut(memory_budget=B)) vs every layer recomputed
             vs one uniform selective policy (benchmarks/remat.py).
lowering     lowered efficiency (asynchronous makespan / lowered SPMD makespan under the
             sync model) of every built-in and gallery schedule, and the seconds to
             validate + simulate + lower each at p=64, m=512 (benchmarks/lowering.py).
step         p=1 executor overhead on an MLP, and 1F1B with B run as I then W vs B
             (benchmarks/step_overhead.py).
compile      compile time vs depth, unrolled and scanned layer stacks, jaxpipe vs plain
             JAX (benchmarks/compile_time.py; its own CLI runs the full grid).

Writes ``<out>/benchmarks.json`` (everything), one ``<out>/<section>.json`` per section and
PNG plots. Timings are medians of repeated runs after warm-up; on a shared machine they
are noisy, so every timing also records the process CPU time (all threads).
"""

from __future__ import annotations

import os
import sys


def _accelerator_plugin() -> bool:
    import importlib.util

    return any(importlib.util.find_spec(m) is not None
               for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "libtpu", "jax_rocm60_plugin"))


def _preparse(argv: list[str]) -> None:
    """Before jax is imported: XLA flags (virtual devices, threads) and core pinning."""
    n, threads, cores = 8, "single", 1
    for i, a in enumerate(argv):
        if a == "--cores" and i + 1 < len(argv):
            cores = int(argv[i + 1])
        elif a.startswith("--cores="):
            cores = int(a.split("=", 1)[1])
        if a == "--devices" and i + 1 < len(argv):
            n = int(argv[i + 1])
        elif a.startswith("--devices="):
            n = int(a.split("=", 1)[1])
        elif a == "--threads" and i + 1 < len(argv):
            threads = argv[i + 1]
        elif a.startswith("--threads="):
            threads = a.split("=", 1)[1]
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in flags:
        flags += f" --xla_force_host_platform_device_count={n}"
    if threads == "single" and "xla_cpu_multi_thread_eigen" not in flags:
        flags += " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    os.environ["XLA_FLAGS"] = flags.strip()
    # One core for the whole process (CPU runs): virtual devices then share it, so wall
    # time measures total work, like process CPU time, instead of how many of the
    # machine's cores p virtual devices happen to occupy.
    if cores > 0 and hasattr(os, "sched_setaffinity") and not _accelerator_plugin():
        mine = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, set(mine[:cores]))
    # on GPU/TPU, the flags the accelerator program wants (jaxpipe/xla_flags.py)
    import importlib.util

    platform = ("tpu" if importlib.util.find_spec("libtpu") is not None else "gpu"
                if _accelerator_plugin() else "cpu")
    spec = importlib.util.spec_from_file_location(
        "_jaxpipe_xla_flags", os.path.join(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))), "jaxpipe", "xla_flags.py"))
    flags_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(flags_module)  # (not via jaxpipe: that imports jax)
    flags_module.apply(platform)


if __name__ == "__main__":
    _preparse(sys.argv[1:])
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, field, replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxpipe as jp  # noqa: E402
from benchmarks import common as C  # noqa: E402
from benchmarks import remat as R  # noqa: E402
from benchmarks.baselines import spmd_gpipe as B  # noqa: E402
from jaxpipe.runtime.spmd import SpmdRuntime  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SECTIONS = ("overhead", "baseline", "sweep", "scaling", "concurrency", "remat", "lowering",
            "step", "compile", "sharded", "eval")

#: Fields every section of the JSON has (the test suite checks them).
REQUIRED_FIELDS: dict[str, tuple[str, ...]] = {
    "meta": ("backend", "device_kind", "num_devices", "jax_version", "quick", "config",
             "xla_flags", "duration_s", "note"),
    "overhead": ("p_values", "microbatches", "mb_size", "flops_per_step", "plain", "jaxpipe",
                 "ratios"),
    "baseline": ("p", "mb_size", "memory_metric", "program", "rows"),
    "sweep": ("microbatches_per_p", "mb_size", "rows"),
    "scaling": ("p", "schedule", "rows", "step_time_fit", "compile_time_spread"),
    "concurrency": ("microbatches", "ideal", "speedup", "fraction_of_ideal", "two_process",
                    "single", "per_schedule", "error"),
    "remat": R.FIELDS,
    "lowering": ("ps", "rows", "min_efficiency", "scale"),
    "step": ("p1_overhead", "split_backward"),
    "compile": ("rows", "targets"),
    "sharded": ("model", "memory", "p1_overhead"),
    "eval": ("p", "microbatches", "value_and_grad", "loss", "time_ratio", "temp_ratio"),
    "headline": ("overhead_p1", "overhead_p4", "memory_1f1b_vs_baseline_m4p",
                 "step_1f1b_vs_baseline_m4p", "concurrency_fraction_of_ideal"),
}
#: Fields of each measured jaxpipe/baseline configuration.
RUN_FIELDS = ("build_s", "lower_s", "compile_s", "median_s", "min_s", "cpu_median_s",
              "times_s", "memory", "flops_per_step", "tflops_per_device", "mfu")
BASELINE_ROW_FIELDS = ("m", "spmd_gpipe", "jaxpipe", "step_ratio", "memory_ratio",
                       "temp_ratio")
SWEEP_ROW_FIELDS = ("schedule", "p", "m", "stages_per_device", "bubble", "makespan",
                    "num_ticks", "res_peak", "memory", "compile_s", "median_s", "skipped")


# ----------------------------------------------------------------------------- settings


@dataclass
class Settings:
    """Everything a run depends on (recorded in the JSON)."""

    model: C.GPTConfig
    quick: bool = False
    p: int = 4  # main pipeline size
    p_big: int = 8  # extra sweep size (when there are devices)
    overhead_m: int = 8
    overhead_mb: int = 4  # sequences per microbatch in the overhead section
    mb: int = 2  # sequences per microbatch in baseline / sweep / scaling
    m_factors: tuple[int, ...] = (1, 2, 4, 8)  # baseline: m = factor * p
    scaling_factors: tuple[int, ...] = (1, 2, 4, 8)  # scaling: m = factor * p
    sweep_factor: int = 2  # sweep: m = 2p
    sweep_compile: bool = True  # False: only schedules already measured are compiled
    warmup: int = 2
    repeats: int = 7
    conc_m: int = 8
    conc_mb: int = 8  # bigger microbatches: per-tick compute must dwarf gloo latency
    conc_schedules: tuple[str, ...] = ("1f1b", "gpipe", "schedules/zero_bubble.py:ZeroBubbleH1")
    conc_timeout: float = 300.0
    conc_runs: int = 3  # fresh process sets; the figures are their medians
    # remat: a wider model with longer sequences, so that matmuls dominate the time
    # (recomputing one costs what it should) and activations dominate the memory
    remat_model: C.GPTConfig = field(default_factory=lambda: C.GPTConfig(
        vocab=256, d_model=256, n_heads=4, n_layers=8, seq=64))
    remat_mb: int = 4  # remat: sequences per microbatch
    remat_m_factor: int = 2  # remat: m = factor * p
    remat_budget: float = 0.6  # remat: budget as a fraction of the no-recompute peak
    plots: bool = True
    program: str = "auto"  # SpmdRuntime(backend=...): "auto", "cpu", "gpu" or "tpu"
    sections: tuple[str, ...] = SECTIONS
    extra: dict[str, Any] = field(default_factory=dict)


def default_settings(quick: bool) -> Settings:
    if quick:
        # Smoke test: few compiles (the sweep compiles nothing new, scaling reuses the
        # baseline's 1F1B runs plus one), tiny model. Its numbers mean nothing.
        model = C.GPTConfig(vocab=64, d_model=32, n_heads=2, n_layers=2, seq=8)
        return Settings(model=model, quick=True, p=2, p_big=2, overhead_m=4, overhead_mb=2,
                        mb=2, m_factors=(4,), scaling_factors=(1, 4), sweep_factor=4,
                        sweep_compile=False, warmup=1, repeats=2, conc_m=4, conc_mb=2,
                        conc_schedules=("1f1b",), conc_timeout=120.0, conc_runs=1,
                        remat_model=replace(model, seq=16), remat_mb=2, remat_budget=0.9)
    return Settings(model=C.GPTConfig())


# ----------------------------------------------------------------------------- helpers


def _mesh(p: int) -> jax.sharding.Mesh:
    return jax.make_mesh((p,), ("pipe",), devices=jax.devices()[:p])


def _flops_fields(flops: float, seconds: float, p: int) -> dict[str, Any]:
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


def _compile(jitted: Any, args: tuple) -> tuple[Any, dict[str, Any]]:
    compiled, lower_s, compile_s = C.compile_timed(jitted, *args)
    return compiled, {"lower_s": lower_s, "compile_s": compile_s,
                      "memory": C.memory_stats(compiled)}


def _time_group(group: dict[str, Prepared], s: Settings) -> dict[str, dict[str, Any]]:
    """Time the prepared programs round-robin; returns full result dicts per label."""
    timings = C.time_interleaved({k: (v.compiled, v.args) for k, v in group.items()},
                                 warmup=s.warmup, repeats=s.repeats)
    out = {}
    for k, v in group.items():
        res = {**v.info, **timings[k]}
        res.update(_flops_fields(v.flops, res["median_s"], v.p))
        out[k] = res
    return out


def _stage_fn(cfg: C.GPTConfig) -> Callable:
    """A baseline stage: its ``L/p`` blocks in order (unrolled, like a jaxpipe stage)."""

    def stage(sp: Any, x: jax.Array) -> jax.Array:
        for k in range(jax.tree.leaves(sp)[0].shape[0]):
            x = C.block(jax.tree.map(lambda a, k=k: a[k], sp), x, cfg.n_heads)
        return x

    return stage


def _mse(y: jax.Array, t: jax.Array) -> jax.Array:
    return jnp.mean(jnp.square(y - t).astype(jnp.float32))


class Runner:
    """Runs and caches measurements shared between sections."""

    def __init__(self, s: Settings):
        self.s = s
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
        pipe = jp.pipeline(C.blocks_loss(cfg), self.blocks_params, batch, mesh=_mesh(p),
                           schedule=schedule, cut="markers",
                           runtime=SpmdRuntime(backend=s.program))
        build_s = time.perf_counter() - t0
        program = "resident"
        args: tuple = (pipe.shard(self.blocks_params), batch)
        compiled, info = _compile(pipe.staged_value_and_grad_fn, args)
        tl = schedule.simulate()
        low = pipe.executor.lowering
        info.update({"build_s": build_s, "program": program,
                     "tick_program": pipe.executor.backend,
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
        mesh = B.auto_mesh(_mesh(p))
        t0 = time.perf_counter()
        stacked = jax.device_put(B.stack_stages(self.blocks_params["blocks"], p),
                                 NamedSharding(mesh, P("pipe")))
        xs = batch["x"].reshape(m, s.mb, *batch["x"].shape[1:])
        ys = batch["y"].reshape(xs.shape)
        jitted = B.spmd_gpipe_value_and_grad(_stage_fn(cfg), _mse, mesh, m)
        build_s = time.perf_counter() - t0
        compiled, info = _compile(jitted, (stacked, xs, ys))
        info.update({"build_s": build_s, "program": "stacked"})
        flops = C.model_flops(cfg, m * s.mb * cfg.seq, embed=False)
        return Prepared(compiled, (stacked, xs, ys), info, flops, p)

    def measure(self, group: dict[tuple, Callable[[], Prepared]]) -> dict[tuple, dict]:
        """Results for every key: cached ones as they are, the rest prepared and timed
        together (round-robin)."""
        todo = {k: make() for k, make in group.items() if k not in self.cache}
        if todo:
            self.cache.update(_time_group(todo, self.s))
            del todo
            gc.collect()
        return {k: self.cache[k] for k in group}

    def jaxpipe_blocks(self, name: str, schedule: jp.Schedule) -> dict[str, Any]:
        key = self.key(name, schedule)
        return self.measure({key: lambda: self.prepare_jaxpipe(name, schedule)})[key]


def _ratio(a: float | None, b: float | None) -> float | None:
    return (a / b) if (a is not None and b not in (None, 0)) else None


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- sections


def _ratios(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float | None]:
    """``a / b`` for median wall time, min wall time and median process CPU time."""
    return {"wall": _ratio(a["median_s"], b["median_s"]),
            "wall_min": _ratio(a["min_s"], b["min_s"]),
            "cpu": _ratio(a["cpu_median_s"], b["cpu_median_s"])}


def section_eval(r: Runner) -> dict[str, Any]:
    """``pipe.loss`` (forward only) against ``pipe.value_and_grad`` on the full GPT, 1F1B
    at p=P, m=2P: step time and compiled temp memory."""
    s, cfg = r.s, r.s.model
    p, m = s.p, 2 * s.p
    params = C.init_params(cfg, jax.random.key(0), embed=True)
    batch = C.make_gpt_batch(cfg, m * s.mb)
    pipe = jp.pipeline(C.gpt_loss(cfg), params, batch, mesh=_mesh(p),
                       schedule=jp.OneFOneB(p, m), runtime=SpmdRuntime(backend=s.program))
    flops = C.model_flops(cfg, m * s.mb * cfg.seq, embed=True)
    group = {}
    for name, fn in (("value_and_grad", pipe.value_and_grad_fn), ("loss", pipe.eval_fn)):
        compiled, info = _compile(fn, (params, batch))
        group[name] = Prepared(compiled, (params, batch), info, flops / 3 if name == "loss"
                               else flops, p)
    res = _time_group(group, s)
    vg, ev = res["value_and_grad"], res["loss"]
    out = {"p": p, "microbatches": m, "mb_size": s.mb, "model": "gpt", "schedule": "1F1B",
           "value_and_grad": vg, "loss": ev,
           "num_ticks": {"value_and_grad": int(pipe.executor.lowering.num_ticks),
                         "loss": int(pipe.executor.forward_lowering.num_ticks)},
           "time_ratio": _ratios(ev, vg),
           "temp_ratio": _ratio(ev["memory"]["temp_bytes"], vg["memory"]["temp_bytes"])}
    _log(f"eval: pipe.loss / value_and_grad time x{out['time_ratio']['wall']:.2f} wall, "
         f"temp memory x{out['temp_ratio']:.2f}")
    return out


def section_overhead(r: Runner) -> dict[str, Any]:
    """Plain JAX vs jaxpipe 1F1B at p=1 and p=P on the full GPT, same m and microbatch."""
    s, cfg = r.s, r.s.model
    m, mb = s.overhead_m, s.overhead_mb
    params = C.init_params(cfg, jax.random.key(0), embed=True)
    batch = C.make_gpt_batch(cfg, m * mb)
    loss_fn = C.gpt_loss(cfg)
    flops = C.model_flops(cfg, m * mb * cfg.seq, embed=True)
    compiled, info = _compile(jax.jit(C.plain_value_and_grad(loss_fn, m)), (params, batch))
    group = {"plain": Prepared(compiled, (params, batch), info, flops, 1)}
    p_values = [p for p in (1, s.p) if p <= len(jax.devices())]
    for p in p_values:
        t0 = time.perf_counter()
        pipe = jp.pipeline(loss_fn, params, batch, mesh=_mesh(p),
                           schedule=jp.OneFOneB(p, m), cut="markers")
        build_s = time.perf_counter() - t0
        compiled, info = _compile(pipe.value_and_grad_fn, (params, batch))
        info.update({"build_s": build_s, "num_ticks": int(pipe.executor.lowering.num_ticks)})
        group[f"p{p}"] = Prepared(compiled, (params, batch), info, flops, p)
        _log(f"overhead: p={p} built in {build_s:.1f}s, compiled in {info['compile_s']:.1f}s")
    res = _time_group(group, s)
    plain = res.pop("plain")
    out: dict[str, Any] = {"p_values": p_values, "microbatches": m, "mb_size": mb,
                           "model": "gpt (embedding + blocks + head)", "schedule": "1F1B",
                           "program": "public Pipeline.value_and_grad (user pytree in/out)",
                           "flops_per_step": flops, "plain": plain, "jaxpipe": res,
                           "ratios": {k: _ratios(v, plain) for k, v in res.items()}}
    for k, v in out["ratios"].items():
        _log(f"overhead: jaxpipe {k} x{v['cpu']:.2f} cpu, x{v['wall']:.2f} wall "
             f"(plain {plain['median_s'] * 1e3:.1f} ms)")
    return out


def section_baseline(r: Runner) -> dict[str, Any]:
    """jaxpipe GPipe / 1F1B vs the SPMD GPipe baseline, m in {p, 2p, 4p, 8p}."""
    s = r.s
    p = s.p
    rows = []
    for f in s.m_factors:
        m = f * p
        scheds = {"GPipe": jp.GPipe(p, m), "1F1B": jp.OneFOneB(p, m)}
        bkey = ("blocks", "spmd_gpipe", p, m, 1)
        group: dict[tuple, Callable[[], Prepared]] = {
            bkey: lambda m=m: r.prepare_baseline(p, m)}
        for name, sched in scheds.items():
            group[r.key(name, sched)] = lambda name=name, sched=sched: r.prepare_jaxpipe(
                name, sched)
        res = r.measure(group)
        base = res[bkey]
        row: dict[str, Any] = {"m": m, "spmd_gpipe": base, "jaxpipe": {}, "step_ratio": {},
                               "memory_ratio": {}, "temp_ratio": {}}
        for name, sched in scheds.items():
            run = res[r.key(name, sched)]
            row["jaxpipe"][name] = run
            row["step_ratio"][name] = _ratios(run, base)
            row["memory_ratio"][name] = _ratio(run["memory"]["total_bytes"],
                                               base["memory"]["total_bytes"])
            row["temp_ratio"][name] = _ratio(run["memory"]["temp_bytes"],
                                             base["memory"]["temp_bytes"])
        _log(f"baseline m={m}: spmd_gpipe {base['median_s'] * 1e3:.1f} ms "
             f"{base['memory']['total_bytes'] / 2**20:.1f} MiB | step (cpu) x"
             + ", ".join(f"{k} {v['cpu']:.2f}" for k, v in row["step_ratio"].items())
             + " | memory x" + ", ".join(f"{k} {v:.2f}" for k, v in row["memory_ratio"].items()))
        rows.append(row)
    return {
        "p": p, "mb_size": s.mb, "model": "block stack (float activations in, MSE loss)",
        "memory_metric": "per-device argument + output + temp - alias bytes from "
                         "compiled.memory_analysis(); temp_ratio compares temp bytes alone",
        "program": "both take stage-layout parameters sharded over pipe and return "
                   "stage-layout gradients; the batch is replicated on both",
        "rows": rows,
    }


def section_sweep(r: Runner) -> dict[str, Any]:
    """Every built-in and gallery schedule at p=P (and p=P_big when devices allow)."""
    s, cfg = r.s, r.s.model
    builtins: list[tuple[str, Callable[[int, int], jp.Schedule]]] = [
        ("GPipe", jp.GPipe), ("1F1B", jp.OneFOneB),
        ("Interleaved1F1B", lambda p, m: jp.Interleaved1F1B(p, m, stages_per_device=2)),
    ]
    scheds = builtins + C.gallery_schedules()
    ps = sorted({p for p in (s.p, s.p_big) if p <= len(jax.devices())})
    rows = []
    for p in ps:
        m = s.sweep_factor * p
        for name, make in scheds:
            row: dict[str, Any] = {k: None for k in SWEEP_ROW_FIELDS}
            row.update({"schedule": name, "p": p, "m": m, "skipped": None})
            try:
                sched = make(p, m)
                sched.validate()
            except Exception as e:  # noqa: BLE001 - report, keep going
                row["skipped"] = f"{type(e).__name__}: {e}"
                rows.append(row)
                continue
            row["stages_per_device"] = sched.stages_per_device
            if sched.num_stages > cfg.n_layers:
                tl = sched.simulate()
                row.update({"bubble": float(tl.bubble_fraction), "makespan": float(tl.makespan),
                            "skipped": f"needs {sched.num_stages} stages, the model has "
                                       f"{cfg.n_layers} blocks (use --layers)"})
                rows.append(row)
                continue
            if not s.sweep_compile and not r.has(name, sched):
                tl = sched.simulate()
                row.update({"bubble": float(tl.bubble_fraction), "makespan": float(tl.makespan),
                            "skipped": "quick mode: simulated only"})
                rows.append(row)
                continue
            try:
                res = r.jaxpipe_blocks(name, sched)
            except Exception as e:  # noqa: BLE001 - a gallery schedule may not run yet
                row["skipped"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(row)
                continue
            row.update({k: res[k] for k in ("bubble", "makespan", "num_ticks", "res_peak",
                                            "memory", "compile_s", "median_s")})
            row.update({k: res[k] for k in ("cpu_median_s", "tflops_per_device", "mfu")})
            _log(f"sweep p={p} {name}: bubble {row['bubble']:.3f}, "
                 f"{res['memory']['total_bytes'] / 2**20:.1f} MiB, "
                 f"{res['median_s'] * 1e3:.1f} ms, compile {res['compile_s']:.1f}s")
            rows.append(row)
    return {"microbatches_per_p": s.sweep_factor, "mb_size": s.mb, "p_values": ps,
            "rows": rows}


def _linear_fit(x: list[float], y: list[float]) -> dict[str, float | None]:
    if len(x) < 2:
        return {"intercept_s": None, "slope_s_per_microbatch": None, "r2": None}
    a, b = np.polyfit(np.asarray(x, float), np.asarray(y, float), 1)
    pred = a * np.asarray(x) + b
    ss_res = float(np.sum((np.asarray(y) - pred) ** 2))
    ss_tot = float(np.sum((np.asarray(y) - np.mean(y)) ** 2)) or 1.0
    return {"intercept_s": float(b), "slope_s_per_microbatch": float(a),
            "r2": 1.0 - ss_res / ss_tot}


def section_scaling(r: Runner) -> dict[str, Any]:
    """1F1B at p=P for m in factors*P: compile time vs m (flat) and step time (linear)."""
    s = r.s
    p = s.p
    rows = []
    for f in s.scaling_factors:
        m = f * p
        res = r.jaxpipe_blocks("1F1B", jp.OneFOneB(p, m))
        rows.append({"m": m, "build_s": res["build_s"], "lower_s": res["lower_s"],
                     "compile_s": res["compile_s"], "median_s": res["median_s"],
                     "cpu_median_s": res["cpu_median_s"], "num_ticks": res["num_ticks"],
                     "per_microbatch_s": res["median_s"] / m})
    comp = [row["compile_s"] for row in rows]
    return {
        "p": p, "schedule": "1F1B", "rows": rows,
        "step_time_fit": _linear_fit([row["m"] for row in rows],
                                     [row["median_s"] for row in rows]),
        "compile_time_spread": (max(comp) / min(comp)) if comp else None,
    }


def section_concurrency(r: Runner, workdir: Path) -> dict[str, Any]:
    """2 processes x 1 device (gloo) vs 1 process, via ``benchmarks/concurrency.py``."""
    from benchmarks.concurrency import run_concurrency

    s = r.s
    res = run_concurrency(s.model.asdict(), s.conc_m, s.conc_mb, schedules=s.conc_schedules,
                          warmup=s.warmup, repeats=s.repeats, timeout=s.conc_timeout,
                          workdir=workdir, runs=s.conc_runs)
    if res.get("error"):
        _log(f"concurrency: {res['error']}")
    else:
        for spec, v in res["per_schedule"].items():
            _log(f"concurrency {spec}: speedup {v['median_speedup_vs_one_core']:.2f} over the "
                 f"same program on one core, {v['median_speedup']:.2f} over p=1, vs ideal "
                 f"{res['ideal']:.2f} ({v['median_fraction_of_ideal_vs_one_core']:.2f} / "
                 f"{v['median_fraction_of_ideal']:.2f} of ideal, medians of "
                 f"{len(res['runs'])} runs; lock-step bound "
                 f"{v['lockstep_ideal']:.2f})")
    return res


def section_remat(r: Runner) -> dict[str, Any]:
    """Recomputation chosen with the cut under a budget (see :mod:`benchmarks.remat`)."""
    s = r.s
    cfg = s.remat_model

    def compile_fn(jitted: Any, args: tuple) -> tuple[Any, dict[str, Any]]:
        return _compile(jitted, args)

    def time_fn(runs: dict[str, tuple[Any, tuple]]) -> dict[str, dict[str, Any]]:
        return C.time_interleaved(runs, warmup=s.warmup, repeats=s.repeats)

    return R.run_remat(cfg, s.p, s.remat_m_factor * s.p, s.remat_mb, s.remat_budget,
                       compile_fn, time_fn, _log)


def section_lowering(r: Runner) -> dict[str, Any]:
    """Lowered efficiency and schedule work at scale (see :mod:`benchmarks.lowering`)."""
    from benchmarks import lowering as LW

    res = LW.section_lowering(ps=(2,) if r.s.quick else (2, 4, 8), gpt=not r.s.quick)
    _log(f"lowering: minimum efficiency {res['min_efficiency']}")
    res["scale"] = LW.section_scale(*((8, 32) if r.s.quick else (64, 512)))
    for row in res["scale"]["rows"]:
        _log(f"lowering at scale {row['schedule']}: {row.get('total_s', row.get('skipped'))}")
    return res


def section_step(r: Runner) -> dict[str, Any]:
    """p=1 overhead and the I/W split (see :mod:`benchmarks.step_overhead`): medians over
    three fresh processes (one with ``--quick``)."""
    from benchmarks.step_overhead import measure_processes

    return measure_processes(1 if r.s.quick else 3, r.s.quick)


def section_compile(r: Runner) -> dict[str, Any]:
    """Compile time vs depth (see :mod:`benchmarks.compile_time`; a lean grid here)."""
    from benchmarks.compile_time import measure

    if r.s.quick:
        return measure([2], [2], [1], ["scanned"])
    return measure([8, 32], [2, 4], [1, 2], ["unrolled", "scanned"])


def section_sharded(r: Runner) -> dict[str, Any]:
    """Pipe x model vs pipe memory, p=1 composed overhead (see :mod:`benchmarks.sharded`)."""
    from benchmarks.sharded import measure

    return measure(r.s.quick)


# ----------------------------------------------------------------------------- plots


def make_plots(results: dict[str, Any], out: Path) -> list[str]:
    """PNG figures for the sections present; returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)

    ov = results.get("overhead")
    if ov:
        names = ["plain JAX"] + [f"jaxpipe {k}" for k in ov["jaxpipe"]]
        runs = [ov["plain"]] + list(ov["jaxpipe"].values())
        fig, ax = plt.subplots(figsize=(6, 3.5))
        x = np.arange(len(runs))
        ax.bar(x - 0.2, [1e3 * v["median_s"] for v in runs], 0.4, label="wall (median)")
        ax.bar(x + 0.2, [1e3 * v["cpu_median_s"] for v in runs], 0.4, label="process CPU")
        ax.set_xticks(x, names)
        ax.set_ylabel("ms / step")
        ax.set_title(f"Executor overhead (GPT, 1F1B, m={ov['microbatches']})")
        ax.legend()
        save(fig, "overhead.png")

    bl = results.get("baseline")
    if bl and bl["rows"]:
        ms = [row["m"] for row in bl["rows"]]
        fig, axs = plt.subplots(1, 2, figsize=(10, 3.5))
        for name in ("GPipe", "1F1B"):
            axs[0].plot(ms, [row["step_ratio"][name]["cpu"] for row in bl["rows"]], "o-",
                        label=f"{name} (CPU time)")
            axs[0].plot(ms, [row["step_ratio"][name]["wall"] for row in bl["rows"]], "x--",
                        label=f"{name} (wall)")
            axs[1].plot(ms, [row["memory_ratio"][name] for row in bl["rows"]], "o-",
                        label=f"{name} total")
            axs[1].plot(ms, [row["temp_ratio"][name] for row in bl["rows"]], "x--",
                        label=f"{name} temp")
        for ax, t in zip(axs, ("step time / spmd_gpipe", "per-device memory / spmd_gpipe"),
                         strict=True):
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("microbatches m")
            ax.set_title(f"{t} (p={bl['p']})")
            ax.legend()
        save(fig, "baseline.png")

    sw = results.get("sweep")
    if sw and sw["rows"]:
        done = [row for row in sw["rows"] if row["median_s"] is not None]
        if done:
            labels = [f"{row['schedule']}\np={row['p']}" for row in done]
            fig, axs = plt.subplots(1, 4, figsize=(16, 4))
            metrics = [("bubble", "simulated bubble", 1.0),
                       ("memory", "compiled MiB / device", None),
                       ("cpu_median_s", "step ms (process CPU)", 1e3),
                       ("compile_s", "compile s", 1.0)]
            for ax, (k, title, scale) in zip(axs, metrics, strict=True):
                vals = [row[k]["total_bytes"] / 2**20 if k == "memory" else row[k] * scale
                        for row in done]
                ax.barh(range(len(done)), vals)
                ax.set_yticks(range(len(done)), labels, fontsize=7)
                ax.invert_yaxis()
                ax.set_title(title)
            save(fig, "sweep.png")

    sc = results.get("scaling")
    if sc and sc["rows"]:
        ms = [row["m"] for row in sc["rows"]]
        fig, axs = plt.subplots(1, 2, figsize=(10, 3.5))
        axs[0].plot(ms, [row["compile_s"] for row in sc["rows"]], "o-", label="compile")
        axs[0].plot(ms, [row["build_s"] + row["lower_s"] for row in sc["rows"]], "o-",
                    label="build + lower")
        axs[0].set_ylim(bottom=0)
        axs[0].set_title(f"Compile time vs m (1F1B, p={sc['p']})")
        axs[1].plot(ms, [1e3 * row["median_s"] for row in sc["rows"]], "o-", label="step")
        fit = sc["step_time_fit"]
        if fit["slope_s_per_microbatch"] is not None:
            xs = np.array([0, max(ms)])
            axs[1].plot(xs, 1e3 * (fit["intercept_s"] + fit["slope_s_per_microbatch"] * xs),
                        "--", color="gray", label=f"linear fit, R2={fit['r2']:.3f}")
        axs[1].set_title("Step time vs m")
        for ax, yl in zip(axs, ("s", "ms"), strict=True):
            ax.set_xlabel("microbatches m")
            ax.set_ylabel(yl)
            ax.legend()
        save(fig, "scaling.png")

    cc = results.get("concurrency")
    if cc and cc.get("speedup"):
        fig, ax = plt.subplots(figsize=(5, 3.5))
        single = cc["single"]["jaxpipe_p1"]["median_s"]
        vals = [1.0, cc["speedup"], cc["ideal"], cc["speedup_vs_plain"]]
        ax.bar(["1 process\n(jaxpipe p=1)", "2 processes\n(gloo, p=2)", "ideal\n2m/(m+1)",
                "2 proc vs\nplain JAX"], vals)
        ax.set_ylabel("speed-up")
        ax.set_title(f"Real concurrency, m={cc['microbatches']} "
                     f"(1-proc step {1e3 * single:.0f} ms)")
        save(fig, "concurrency.png")
    return written


# ----------------------------------------------------------------------------- main


def _headline(res: dict[str, Any], s: Settings) -> dict[str, Any]:
    ov = res.get("overhead") or {}
    ratios = ov.get("ratios", {})
    h: dict[str, Any] = {
        "overhead_p1": ratios.get("p1"), f"overhead_p{s.p}": ratios.get(f"p{s.p}"),
        "overhead_p4": ratios.get("p4"), "memory_1f1b_vs_baseline_m4p": None,
        "temp_1f1b_vs_baseline_m4p": None, "step_1f1b_vs_baseline_m4p": None,
        "step_gpipe_vs_baseline_m4p": None, "concurrency_speedup": None,
        "concurrency_ideal": None, "concurrency_fraction_of_ideal": None,
    }
    for row in (res.get("baseline") or {}).get("rows", []):
        if row["m"] == 4 * s.p:
            h["memory_1f1b_vs_baseline_m4p"] = row["memory_ratio"]["1F1B"]
            h["temp_1f1b_vs_baseline_m4p"] = row["temp_ratio"]["1F1B"]
            h["step_1f1b_vs_baseline_m4p"] = row["step_ratio"]["1F1B"]
            h["step_gpipe_vs_baseline_m4p"] = row["step_ratio"]["GPipe"]
    cc = res.get("concurrency") or {}
    h["concurrency_speedup"] = cc.get("speedup")
    h["concurrency_ideal"] = cc.get("ideal")
    h["concurrency_fraction_of_ideal"] = cc.get("fraction_of_ideal")
    per = cc.get("per_schedule") or {}
    if per:
        best = max(per, key=lambda k: per[k]["speedup"])
        h["concurrency_best"] = {"schedule": best, **{k: per[best][k] for k in (
            "speedup", "fraction_of_ideal", "fraction_of_ideal_vs_one_core",
            "lockstep_ideal")}}
    return h


def _f(x: Any, fmt: str = "{:.2f}") -> str:
    return "n/a" if x is None else fmt.format(x)


def markdown_summary(res: dict[str, Any]) -> str:
    """Markdown tables of a results dict (written to ``<out>/summary.md``)."""
    meta, lines = res["meta"], []
    lines.append(f"Backend {meta['backend']} ({meta['device_kind']}), {meta['num_devices']} "
                 f"devices, {meta.get('cores_used')} core(s) used of {meta['cpu_count']}; "
                 f"model {meta['config']}; suite took {_f(meta['duration_s'], '{:.0f}')} s.")
    ov = res.get("overhead")
    if ov:
        lines += ["", f"**Executor overhead** (GPT, 1F1B, m={ov['microbatches']}, "
                  f"{ov['mb_size']} seq/microbatch; ratio to plain JAX "
                  f"{ov['plain']['median_s'] * 1e3:.1f} ms)", "",
                  "| p | step ms | ratio (CPU time) | ratio (wall) | compile s |",
                  "|---|---|---|---|---|"]
        for k, v in ov["jaxpipe"].items():
            rt = ov["ratios"][k]
            lines.append(f"| {k[1:]} | {v['median_s'] * 1e3:.1f} | {_f(rt['cpu'])} | "
                         f"{_f(rt['wall'])} | {v['compile_s']:.1f} |")
    bl = res.get("baseline")
    if bl:
        lines += ["", f"**vs MaxText-style SPMD GPipe** (block stack, p={bl['p']}; ratios "
                  "jaxpipe / baseline; memory = per-device arg+out+temp-alias)", "",
                  "| m | baseline ms | baseline MiB | GPipe step | 1F1B step | GPipe mem | "
                  "1F1B mem | 1F1B temp |", "|---|---|---|---|---|---|---|---|"]
        for row in bl["rows"]:
            b = row["spmd_gpipe"]
            lines.append(
                f"| {row['m']} | {b['median_s'] * 1e3:.1f} | "
                f"{b['memory']['total_bytes'] / 2**20:.1f} | "
                f"{_f(row['step_ratio']['GPipe']['cpu'])} | "
                f"{_f(row['step_ratio']['1F1B']['cpu'])} | {_f(row['memory_ratio']['GPipe'])} | "
                f"{_f(row['memory_ratio']['1F1B'])} | {_f(row['temp_ratio']['1F1B'])} |")
    sw = res.get("sweep")
    if sw:
        lines += ["", f"**Schedule sweep** (block stack, m={sw['microbatches_per_p']}p)", "",
                  "| schedule | p | m | bubble (sim.) | MiB/device | step ms (CPU) "
                  "| step ms (wall) | compile s | note |", "|---|---|---|---|---|---|---|---|---|"]
        for row in sw["rows"]:
            mem = row["memory"]["total_bytes"] / 2**20 if row["memory"] else None
            ms = row["median_s"] * 1e3 if row["median_s"] is not None else None
            cpu = row.get("cpu_median_s")
            lines.append(f"| {row['schedule']} | {row['p']} | {row['m']} | "
                         f"{_f(row['bubble'], '{:.3f}')} | {_f(mem, '{:.1f}')} | "
                         f"{_f(cpu * 1e3 if cpu is not None else None, '{:.1f}')} | "
                         f"{_f(ms, '{:.1f}')} | {_f(row['compile_s'], '{:.1f}')} | "
                         f"{(row['skipped'] or '')[:60]} |")
    sc = res.get("scaling")
    if sc:
        lines += ["", f"**Scaling** (1F1B, p={sc['p']}): compile time spread (max/min) "
                  f"{_f(sc['compile_time_spread'])}, step-time linear fit R^2 "
                  f"{_f(sc['step_time_fit']['r2'], '{:.3f}')}", "",
                  "| m | ticks | compile s | step ms (wall) | step ms (CPU) "
                  "| wall ms / microbatch |",
                  "|---|---|---|---|---|---|"]
        for row in sc["rows"]:
            lines.append(f"| {row['m']} | {row['num_ticks']} | {row['compile_s']:.1f} | "
                         f"{row['median_s'] * 1e3:.1f} | {row['cpu_median_s'] * 1e3:.1f} | "
                         f"{row['per_microbatch_s'] * 1e3:.2f} |")
    cc = res.get("concurrency")
    if cc and cc.get("per_schedule"):
        single = cc["single"]
        lines += ["", f"**Real concurrency** (2 processes x 1 device, gloo, p=2, "
                  f"m={cc['microbatches']}, {cc['mb_size']} seq/microbatch, resident step; "
                  f"1 process: jaxpipe p=1 {single['jaxpipe_p1']['median_s'] * 1e3:.0f} ms, "
                  f"plain JAX "
                  f"{single['plain']['median_s'] * 1e3:.0f} ms; gloo ppermute "
                  f"{cc['two_process']['ppermute_latency_s'] * 1e3:.2f} ms)", "",
                  "| schedule | 2-proc ms | speed-up over the p=2 program on one core | "
                  "over p=1 | ideal 2m/(m+1) | fraction of ideal (one core / p=1) | "
                  "lock-step bound | speed-up, public value_and_grad |",
                  "|---|---|---|---|---|---|---|---|"]
        for spec, v in cc["per_schedule"].items():
            lines.append(f"| {spec.split(':')[-1]} | {v['median_s'] * 1e3:.0f} | "
                         f"{v['median_speedup_vs_one_core']:.2f} | "
                         f"{v['median_speedup']:.2f} | {cc['ideal']:.2f} | "
                         f"{v['median_fraction_of_ideal_vs_one_core']:.2f} / "
                         f"{v['median_fraction_of_ideal']:.2f} | {v['lockstep_ideal']:.2f} | "
                         f"{_f(v.get('speedup_value_and_grad'))} |")
    elif cc:
        lines += ["", f"**Real concurrency**: {cc.get('error')}"]
    rm = res.get("remat")
    if rm and rm.get("error"):
        lines += ["", f"**Recomputation under a budget**: {rm['error']}"]
    elif rm:
        lines += ["", f"**Recomputation under a budget** (GPT, 1F1B, p={rm['p']}, "
                  f"m={rm['microbatches']}, {rm['mb_size']} seq/microbatch; budget "
                  f"{rm['budget_fraction']:.0%} of the no-recompute peak = "
                  f"{rm['budget_bytes'] / 2**20:.1f} MiB; ratios to auto)", "",
                  "| config | remat per stage | blocks | predicted MiB | compiled MiB | fits | "
                  "step ms (CPU) | step (CPU) | step (wall) | fastest run | FLOPs |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in rm["rows"]:
            lines.append(
                f"| {row['name']} | {','.join(row['remat'])} | {row['blocks_per_stage']} | "
                f"{row['predicted_bytes'] / 2**20:.1f} | {row['compiled_bytes'] / 2**20:.1f} | "
                f"{'yes' if row['fits'] else 'no'} | {row['cpu_median_s'] * 1e3:.1f} | "
                f"{_f(row['step_vs_auto_cpu'], '{:.3f}')} | "
                f"{_f(row['step_vs_auto_wall'], '{:.3f}')} | "
                f"{_f(row.get('step_vs_auto_min'), '{:.3f}')} | "
                f"{_f(row['flops_vs_auto'], '{:.3f}')} |")
    lw = res.get("lowering")
    if lw:
        from benchmarks import lowering as LW

        lines += ["", "**Lowered efficiency** (asynchronous makespan / lowered SPMD makespan, "
                  f"sync model; minimum {lw['min_efficiency']})", "", LW.markdown(lw)]
    st = res.get("step")
    if st:
        o = st["p1_overhead"]
        lines += ["", f"**Step overhead**: p=1 {o['model']}: {o['ratio_cpu']:.3f} of plain JAX "
                  "(CPU time); I+W / B (1F1B), W in its I's step (the CPU default) / in a "
                  "tick of its own: " + ", ".join(
                      f"{k} {v['same_tick_ratio_cpu']:.3f} / {v['ratio_cpu']:.3f}"
                      for k, v in st["split_backward"]["rows"].items())]
    sh = res.get("sharded")
    if sh:
        mem, o = sh["memory"], sh["p1_overhead"]
        lines += ["", f"**Inside a bigger mesh**: per-device memory pipe=2 x model=2 / pipe=2 "
                  f"alone: arguments {mem['argument_ratio']:.3f} (analytic "
                  f"{mem['analytic_state_ratio']:.3f}), total {mem['total_ratio']:.3f}; p=1 "
                  f"overhead on {o['mesh']}: {o['ratio_cpu']:.3f} of plain JAX (CPU time)"]
    ct = res.get("compile")
    if ct:
        from benchmarks import compile_time as CT

        lines += ["", "**Compile time** (construction + first call - steady call)", "",
                  CT.markdown(ct)]
    return "\n".join(lines) + "\n"


def _json_default(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    return str(x)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the suite; returns the results dict (also written to ``<out>/benchmarks.json``)."""
    ap = argparse.ArgumentParser(description="jaxpipe benchmark suite",
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__)
    ap.add_argument("--quick", action="store_true", help="tiny model, < 1 minute")
    ap.add_argument("--devices", type=int, default=8,
                    help="virtual CPU devices (before jax starts) / real devices to use")
    ap.add_argument("--threads", choices=["single", "multi"], default="single",
                    help="CPU: single-threaded XLA (default) or XLA's own thread pool")
    ap.add_argument("--cores", type=int, default=1,
                    help="CPU: pin this process to this many cores (0: no pinning)")
    ap.add_argument("--out", default="results", help="directory for JSON and PNG")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma-separated subset of {','.join(SECTIONS)}")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--d-model", type=int, default=None)
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--dtype", default=None, help="parameter/activation dtype, e.g. bfloat16")
    ap.add_argument("--mb-size", type=int, default=None, help="sequences per microbatch")
    ap.add_argument("--p", type=int, default=None, help="main pipeline size (default 4)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--no-plots", dest="plots", action="store_false")
    ap.add_argument("--program", choices=("auto", "cpu", "gpu", "tpu"), default="auto",
                    help="the SPMD program to build (SpmdRuntime(backend=...)); auto: the "
                    "devices' platform. On a GPU, run once with each to compare them")
    ap.add_argument("--summarize", metavar="JSON", default=None,
                    help="only print the markdown summary of an existing benchmarks.json")
    args = ap.parse_args(argv)
    if args.summarize:
        res = json.loads(Path(args.summarize).read_text())
        print(markdown_summary(res), end="")
        return res

    s = default_settings(args.quick)
    over = {k: v for k, v in {"n_layers": args.layers, "d_model": args.d_model,
                              "n_heads": args.heads, "seq": args.seq, "vocab": args.vocab,
                              "dtype": args.dtype}.items() if v is not None}
    s.model = replace(s.model, **over)
    if args.mb_size:
        s.mb = s.overhead_mb = args.mb_size
    if args.p:
        s.p = args.p
    s.repeats = args.repeats or s.repeats
    s.warmup = s.warmup if args.warmup is None else args.warmup
    s.plots = args.plots
    s.program = args.program
    s.sections = tuple(x for x in args.sections.split(",") if x)
    bad = set(s.sections) - set(SECTIONS)
    if bad:
        ap.error(f"unknown sections {sorted(bad)}; choose from {SECTIONS}")
    ndev = min(args.devices, len(jax.devices()))
    if s.p > ndev:
        s.p = max(1, ndev)
    s.p_big = min(s.p_big, ndev)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    dev = jax.devices()[0]
    results: dict[str, Any] = {"meta": {
        "backend": jax.default_backend(), "device_kind": dev.device_kind,
        "num_devices": ndev, "jax_version": jax.__version__, "jaxpipe_version": jp.__version__,
        "python": platform.python_version(), "cpu_count": os.cpu_count(),
        "cores_used": (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                       else None),
        "machine": f"{platform.machine()} {platform.processor()}".strip(),
        "quick": s.quick, "config": s.model.asdict(),
        "settings": {k: v for k, v in s.__dict__.items() if k not in ("model", "extra")},
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "started": time.strftime("%F %T"),
        "loadavg_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "duration_s": None,
        "note": ("CPU virtual devices run one program per device on the same cores: wall "
                 "time measures executor overhead, not pipeline overlap (see concurrency). "
                 "Timings are medians after warm-up on a possibly shared machine."),
    }}
    r = Runner(s)
    _log(f"backend {jax.default_backend()} x{ndev}, model {s.model}, sections {s.sections}")
    for name in SECTIONS:
        if name not in s.sections:
            continue
        t0 = time.perf_counter()
        if name == "concurrency":
            if jax.default_backend() != "cpu":
                results[name] = {k: None for k in REQUIRED_FIELDS[name]}
                results[name]["error"] = "CPU-only section (gloo processes)"
            else:
                results[name] = section_concurrency(r, out / "concurrency_logs")
        else:
            results[name] = globals()[f"section_{name}"](r)
        results[name]["section_s"] = time.perf_counter() - t0
        results[name]["loadavg_after"] = os.getloadavg() if hasattr(os, "getloadavg") else None
        (out / f"{name}.json").write_text(json.dumps(results[name], indent=2,
                                                     default=_json_default))
        _log(f"{name} done in {results[name]['section_s']:.0f}s")
    results["headline"] = _headline(results, s)
    results["meta"]["duration_s"] = time.perf_counter() - t_start
    if s.plots:
        results["meta"]["plots"] = make_plots(results, out)
    (out / "benchmarks.json").write_text(json.dumps(results, indent=2, default=_json_default))
    (out / "summary.md").write_text(markdown_summary(results))
    _log("headline: " + json.dumps(results["headline"], default=_json_default))
    _log(f"wrote {out}/benchmarks.json in {results['meta']['duration_s']:.0f}s")
    return results


if __name__ == "__main__":
    main()
    # the concurrency subprocesses are gone; exit without waiting on XLA thread teardown
    sys.stdout.flush()
    os._exit(0)
