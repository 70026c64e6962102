"""Ahead-of-time compiles for a TPU and a GPU target: memory, fit, overlap, compile time.

    python benchmarks/sections/aot.py                       # ~7B GPT on tpu:v5p:2x2x2, gpu:h200:8
    python benchmarks/sections/aot.py --quick               # a tiny GPT, one schedule
    python benchmarks/sections/aot.py --targets gpu:h200:8 --layers 16 --width 2048

Needs ``pip install -e '.[aot]'`` (XLA's TPU and CUDA compilers); a target whose compiler
is missing is recorded as skipped. For each target (8 devices, ``pipe`` = 8) the GPT
benchmark model (``benchmarks/common.py``, bfloat16 weights) at a size that needs a
pipeline, built from shapes only:

- every built-in schedule (GPipe, 1F1B, Interleaved1F1B v=2), m = 2p: the train step
  (AdamW) compiled for the target: per-device arguments + temporaries beside the
  cutter's prediction and the device's memory, whether it fits, how many of the tick
  loop's permutes run across the tick's compute (the census's start-to-done windows),
  and build, lower and compile seconds;
- the MaxText-style SPMD GPipe (``benchmarks/baselines/spmd_gpipe.py``) on the block
  stack, and jaxpipe GPipe on the same stack: value_and_grad compiled the same way;
- plain JAX: ``jit(value_and_grad)`` of the same model over the same microbatches on the
  target's devices (data parallel, weights replicated), and its train step with the same
  AdamW update (``plain_train``), the yardstick for the compile time of jaxpipe's train
  step (memory not compared: it does not fit by design).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

ORDER = 120
FIELDS = ("targets", "model", "rows")

#: The model of a full run: ~6.5B parameters in bfloat16.
FULL = dict(layers=32, width=4096, heads=32, seq=2048, vocab=32000, mb=1)
QUICK = dict(layers=8, width=64, heads=2, seq=16, vocab=64, mb=2)
TARGETS = ("tpu:v5p:2x2x2", "gpu:h200:8")
QUICK_TARGETS = ("gpu:h200:8",)


def _available(name: str) -> str | None:
    """Why ``name``'s compiler cannot run here, or ``None``."""
    import importlib.util

    module = "libtpu" if name.startswith("tpu") else "jax_plugins.xla_cuda12"
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed (pip install -e '.[aot]')"
    return None


def _overlapping(census: Any) -> int | None:
    return None if census is None else sum(w.overlaps_conditional for w in census.windows)


def measure(target_name: str, size: dict[str, int], schedules: list[str],
            comparisons: bool = True) -> list[dict]:
    """Every row of one target (see the module docstring); ``comparisons``: also plain
    JAX and the SPMD GPipe baseline."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxpipe as jp
    from benchmarks import common as C
    from benchmarks.baselines import spmd_gpipe as B
    from benchmarks.harness import mse, stage_fn
    from jaxpipe.aot import compile_report, target

    tgt = target(target_name)
    p = tgt.num_devices
    m = 2 * p
    mesh = tgt.mesh((p,), ("pipe",))
    cfg = C.GPTConfig(vocab=size["vocab"], d_model=size["width"], n_heads=size["heads"],
                      n_layers=size["layers"], seq=size["seq"], dtype="bfloat16")
    params = jax.eval_shape(lambda: C.init_params(cfg, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((m * size["mb"], cfg.seq), np.int32)
    batch = {"x": tokens, "y": tokens}
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    make = {"GPipe": lambda: jp.GPipe(p, m), "1F1B": lambda: jp.OneFOneB(p, m),
            "Interleaved1F1B": lambda: jp.Interleaved1F1B(p, m, stages_per_device=2),
            # schedule="auto" for the target's memory: what it chose, compiled
            "Auto": lambda: jp.Auto(microbatches=m)}
    rows = []
    for name in schedules:
        t0 = time.perf_counter()
        pipe = jp.pipeline(C.gpt_loss(cfg), params, batch, mesh=mesh, schedule=make[name](),
                           cut="auto")
        build_s = time.perf_counter() - t0
        report = compile_report(pipe, optimizer=optax.adamw(1e-4))
        chosen = type(pipe.schedule).__name__
        if name == "Auto":
            chosen += f" v={pipe.schedule.stages_per_device} (chosen by Auto)"
        rows.append({**report.to_dict(), "step": report.program, "target": target_name,
                     "program": "jaxpipe", "schedule": name if name != "Auto" else chosen,
                     "params": n_params,
                     "build_s": build_s,
                     "permutes_overlapping_compute": _overlapping(report.census)})
        used = report.total_bytes and report.total_bytes / 2**30
        print(f"{target_name} {rows[-1]['schedule']}: {used:.2f} GiB compiled, "
              f"predicted/compiled {report.predicted_ratio}, fits {report.fits}, compile "
              f"{report.compile_s:.1f} s", flush=True)

    if not comparisons:
        return rows
    # plain JAX, the same model and microbatches, data parallel on the target's devices
    auto = tgt.mesh((p,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rep, rows_sharded = NamedSharding(auto, P()), NamedSharding(auto, P("data"))
    placed = jax.tree.map(lambda a: replace_sharding(a, rep), params)
    placed_batch = jax.tree.map(lambda a: replace_sharding(a, rows_sharded), batch)
    vg = C.plain_value_and_grad(C.gpt_loss(cfg), m, NamedSharding(auto, P(None, "data")))
    rows.append({"target": target_name, "program": "plain", "schedule": None,
                 "params": n_params, **_compile(
                     lambda: jax.jit(vg).trace(placed, placed_batch).lower(),
                     tgt.compiler_options())})

    # plain JAX's train step: the same value_and_grad and AdamW's update, as jaxpipe's rows
    # compile it (the yardstick for their compile time; value_and_grad alone above)
    opt = optax.adamw(1e-4)
    train = C.plain_train_step(vg, opt)
    state = jax.tree.map(lambda a: replace_sharding(a, rep), jax.eval_shape(opt.init, placed))
    rows.append({"target": target_name, "program": "plain_train", "schedule": None,
                 "params": n_params, **_compile(
                     lambda: jax.jit(train).trace(placed, state, placed_batch).lower(),
                     tgt.compiler_options())})

    # the MaxText-style SPMD GPipe on the block stack, and jaxpipe's GPipe on it
    blocks = jax.eval_shape(lambda: C.init_params(cfg, jax.random.key(0), embed=False))
    acts = jax.ShapeDtypeStruct((m * size["mb"], cfg.seq, cfg.d_model), cfg.dtype)
    base_mesh = B.auto_mesh(mesh)
    stacked = jax.eval_shape(lambda b: B.stack_stages(b, p), blocks["blocks"])
    stacked = jax.tree.map(lambda a: replace_sharding(a, NamedSharding(base_mesh, P("pipe"))),
                           stacked)
    xs = jax.ShapeDtypeStruct((m, size["mb"], cfg.seq, cfg.d_model), cfg.dtype,
                              sharding=NamedSharding(base_mesh, P()))
    jitted = B.spmd_gpipe_value_and_grad(stage_fn(cfg), mse, base_mesh, m)
    rows.append({"target": target_name, "program": "spmd_gpipe", "schedule": "GPipe",
                 **_compile(lambda: jitted.trace(stacked, xs, xs).lower(),
                            tgt.compiler_options())})
    pipe = jp.pipeline(C.blocks_loss(cfg), blocks, {"x": acts, "y": acts}, mesh=mesh,
                       schedule=jp.GPipe(p, m), cut="markers")
    report = compile_report(pipe, "value_and_grad")
    rows.append({**report.to_dict(), "step": report.program, "target": target_name,
                 "program": "jaxpipe_blocks", "schedule": "GPipe",
                 "permutes_overlapping_compute": _overlapping(report.census)})
    return rows


def _compile(lower: Any, options: dict) -> dict[str, Any]:
    """Lower and compile; seconds and memory, or XLA:TPU's out-of-memory refusal (a
    plain JAX step of a model that needs a pipeline does not fit one device)."""
    t0 = time.perf_counter()
    lowered = lower()
    t1 = time.perf_counter()
    try:
        ma = lowered.compile(options).memory_analysis()
    except Exception as e:  # noqa: BLE001
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        return {"lower_s": t1 - t0, "compile_s": time.perf_counter() - t1,
                "error": " ".join(str(e).split())[:200]}
    return {"lower_s": t1 - t0, "compile_s": time.perf_counter() - t1,
            "argument_bytes": int(ma.argument_size_in_bytes),
            "temp_bytes": int(ma.temp_size_in_bytes)}


def replace_sharding(a: Any, sharding: Any) -> Any:
    import jax

    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)


def run_all(targets: tuple[str, ...], size: dict[str, int], schedules: list[str],
            comparisons: bool = True) -> dict[str, Any]:
    rows, skipped = [], {}
    for name in targets:
        why = _available(name)
        if why is not None:
            skipped[name] = why
            continue
        rows += measure(name, size, schedules, comparisons)
    return {"targets": list(targets), "skipped": skipped, "model": size, "rows": rows}


def run(r: Any) -> dict[str, Any]:
    """The runner's entry; ``--quick``: a tiny model, 1F1B on one GPU target, no
    comparisons."""
    quick = r.s.quick
    return run_all(QUICK_TARGETS if quick else TARGETS, QUICK if quick else FULL,
                   ["1F1B"] if quick else ["GPipe", "1F1B", "Interleaved1F1B"],
                   comparisons=not quick)


def summary(res: dict[str, Any]) -> str:
    lines = ["**Ahead-of-time compiles** (model "
             + ", ".join(f"{k} {v}" for k, v in res["model"].items()) + ")", "",
             "| target | program | schedule | args+temp GiB | predicted/compiled | fits | "
             "permutes over compute | compile s |", "|---|---|---|---|---|---|---|---|"]
    for row in res["rows"]:
        used = (row.get("argument_bytes") or 0) + (row.get("temp_bytes") or 0)
        ratio = row.get("predicted_ratio")
        lines.append(
            f"| {row['target']} | {row['program']} | {row.get('schedule') or '-'} | "
            f"{used / 2**30:.2f} | {'-' if ratio is None else f'{ratio:.2f}'} | "
            f"{row.get('fits', 'refused' if row.get('error') else '-')} | "
            f"{row.get('permutes_overlapping_compute', '-')} | "
            f"{row['compile_s']:.1f} |")
    for name, why in res["skipped"].items():
        lines.append(f"\n{name}: skipped, {why}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--targets", default=None, help="comma separated target names")
    ap.add_argument("--schedules", default=None, help="GPipe,1F1B,Interleaved1F1B,Auto")
    for key in FULL:
        ap.add_argument(f"--{key}", type=int, default=None)
    ap.add_argument("--out", default="results", help="folder for aot.json")
    a = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(REPO))
    size = dict(QUICK if a.quick else FULL)
    size.update({k: getattr(a, k) for k in FULL if getattr(a, k) is not None})
    targets = tuple(a.targets.split(",")) if a.targets else (
        QUICK_TARGETS if a.quick else TARGETS)
    schedules = (a.schedules.split(",") if a.schedules
                 else ["1F1B"] if a.quick else ["GPipe", "1F1B", "Interleaved1F1B"])
    t0 = time.perf_counter()
    res = run_all(targets, size, schedules)
    res["duration_s"] = time.perf_counter() - t0
    from benchmarks import common as C

    C.write_json(a.out, "aot.json", res, default=str)
    print(summary(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
