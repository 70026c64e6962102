"""Pipelines inside a bigger mesh: per-device memory and the composed program's overhead.

    python benchmarks/sections/sharded.py            # prints ratios, writes results/sharded.json
    python benchmarks/sections/sharded.py --quick    # a small model (the test suite's smoke run)

The model is the benchmark GPT (``benchmarks.common``) with Megatron-style tensor-parallel
specs over a ``model`` axis (:func:`tensor_parallel_specs`: QKV and the MLP's first
matrix split by columns, the attention output and the MLP's second matrix by rows, the
head by vocabulary). Two measurements:

* **Memory** (``compiled.memory_analysis()`` of the resident ``train_step`` with AdamW,
  per device): the same model and global batch pipelined over ``pipe=2`` alone and over
  ``pipe=2 x model=2``. The parameter + optimizer bytes per device should halve (every
  large matrix is split over ``model``); the analytic share is printed beside the
  measured one.
* **The cutter's prediction** of the busiest device's bytes (``cut_report.peak_memory``:
  parameters, gradients and AdamW moments per device shard; residuals still at full size
  over the automatic axes) against the compiled step, for each mesh above and for
  ``pipe=2 x fsdp=2 x model=2`` (FSDP on each weight's free dimension plus the
  tensor-parallel specs) where there are 8 devices. The parameters are placed with their
  shardings and passed without ``param_specs`` (the default keeps them).
* **Explicit axes, the flax way** (``explicit``): ``examples/gpt.py``'s GPT (flax nnx,
  ``out_sharding`` metadata on its weights and ``out_sharding=`` on its contractions) on
  a default ``jax.make_mesh`` (every axis Explicit), built under ``jax.set_mesh``, the
  batch placed over ``fsdp``, pipelined with no sharding argument: ``pipe=2 x fsdp=2 x
  tp=2`` against ``pipe=2`` alone (arguments per device; analytic share 1/4 of the
  state), and the cutter's predicted bytes of the busiest device against the compiled
  resident AdamW ``train_step`` (residuals count their shard: their types carry it).
* **Overhead at p=1**: the public ``Pipeline.value_and_grad`` over a ``pipe=1 x data=2 x
  model=2`` mesh against plain JAX (``jit(value_and_grad)`` scanned over the same
  microbatches) with the same parameter and batch shardings. Target <= 1.10. CPU time
  of single-threaded XLA (virtual devices run one after another, so time measures total
  work), medians of interleaved repeats.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

# block leaf -> its spec over the tensor-parallel axis (None: replicated)
_TP = {"wqkv": (None, "model"), "wo": ("model", None), "w1": (None, "model"),
       "b1": ("model",), "w2": ("model", None)}


def tensor_parallel_specs(params: dict, axis: str = "model") -> dict:
    """PartitionSpecs for the benchmark GPT's parameters, tensor parallel over ``axis``."""
    from jax.sharding import PartitionSpec as P

    def spec(name: str) -> Any:
        dims = _TP.get(name)
        return None if dims is None else P(*(axis if d == "model" else d for d in dims))

    out: dict[str, Any] = {"blocks": [{k: spec(k) for k in b} for b in params["blocks"]]}
    for k in params:
        if k != "blocks":
            out[k] = P(None, axis) if k == "head" else None
    return out


def fsdp_specs(params: dict, tp: dict, axis: str = "fsdp") -> dict:
    """``tp`` with every parameter also sharded over ``axis`` on its first dimension the
    tensor-parallel spec leaves free (FSDP + TP)."""
    import jax
    from jax.sharding import PartitionSpec as P

    def add(x: Any, spec: Any) -> Any:
        entries = list(spec or ()) + [None] * (x.ndim - len(spec or ()))
        free = [i for i, e in enumerate(entries) if e is None]
        if free:
            entries[free[0]] = axis
        return P(*entries)

    return jax.tree.map(add, params, tp, is_leaf=lambda v: v is None)


def _bytes(tree: Any) -> int:
    import jax

    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _state_share(state: Any, mesh: Any) -> int:
    """Analytic bytes per device of a TrainState: each leaf over the axes it is split on."""
    import jax

    total = 0
    for x in jax.tree.leaves((state.params, state.opt_state)):
        axes = [a for e in x.sharding.spec if e for a in ((e,) if isinstance(e, str) else e)]
        shards = 1
        for a in axes:
            shards *= mesh.shape[a]
        total += x.size * x.dtype.itemsize // shards
    return total


def measure(quick: bool = False) -> dict[str, Any]:
    import jax
    import optax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxpipe as jp
    from benchmarks import common as C

    repeats, warmup = (2, 1) if quick else (9, 2)
    cfg = (C.GPTConfig(vocab=32, d_model=16, n_heads=2, n_layers=2, seq=4) if quick
           else C.GPTConfig(n_layers=8))
    m, rows = 2 if quick else 8, 2 if quick else 8
    loss_fn = C.gpt_loss(cfg)
    params = C.init_params(cfg, jax.random.key(0))
    specs = tensor_parallel_specs(params)
    out: dict[str, Any] = {"model": cfg.asdict(), "microbatches": m, "rows_per_microbatch": rows}

    def mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
        n = 1
        for s in shape:
            n *= s
        return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names),
                             devices=jax.devices()[:n])

    # --- memory: pipe=2 vs pipe=2 x model=2 (and pipe=2 x fsdp=2 x model=2 where there
    # are 8 devices), resident train_step with AdamW; parameters placed with their
    # shardings and no param_specs (the default keeps them)
    batch = C.make_gpt_batch(cfg, m * rows)
    mem = {}
    configs = {"pipe": ((2,), ("pipe",), None, {}),
               "pipe_x_model": ((2, 2), ("pipe", "model"), specs, {})}
    # (--quick, the test suite's smoke run, leaves out the 8-device meshes:
    # tests/test_sharded.py checks FSDP x TP stages exact and their memory on its own)
    if len(jax.devices()) >= 8 and not quick:
        configs["pipe_x_fsdp_x_model"] = ((2, 2, 2), ("pipe", "fsdp", "model"),
                                          fsdp_specs(params, specs),
                                          {})
    for name, (shape, names, place, kw) in configs.items():
        mh = mesh(shape, names)
        placed = params if place is None else jax.tree.map(
            lambda x, s, mh=mh: jax.device_put(x, NamedSharding(mh, s or P())), params, place,
            is_leaf=lambda v: v is None)
        pipe = jp.pipeline(loss_fn, placed, batch, mesh=mh, schedule=jp.OneFOneB(2, m),
                           cut="markers", **kw)
        state = pipe.init(placed, optax.adamw(1e-3))
        b = jax.device_put(batch, pipe.inspect.batch_sharding)
        compiled = state.trainer.step_fn.lower(state, b).compile()
        stats = C.memory_stats(compiled)
        # the cutter's prediction of the busiest device (parameters, gradients, AdamW
        # moments, residuals, buffers) against the compiled step's arguments + temps
        predicted = float(pipe.inspect.cut_report.peak_memory)
        mem[name] = {**stats, "state_share_bytes": _state_share(state, mh),
                     "predicted_bytes": predicted,
                     "predicted_over_compiled": predicted / stats["total_bytes"]}
    out["memory"] = {
        **mem,
        "state_bytes_unsharded": 3 * _bytes(params),  # params + two AdamW moments
        "argument_ratio": mem["pipe_x_model"]["argument_bytes"] / mem["pipe"]["argument_bytes"],
        "temp_ratio": mem["pipe_x_model"]["temp_bytes"] / mem["pipe"]["temp_bytes"],
        "total_ratio": mem["pipe_x_model"]["total_bytes"] / mem["pipe"]["total_bytes"],
        "analytic_state_ratio": mem["pipe_x_model"]["state_share_bytes"]
        / mem["pipe"]["state_share_bytes"],
        "predicted_over_compiled": {k: v["predicted_over_compiled"] for k, v in mem.items()}}

    # --- overhead at p=1: pipe=1 x data=2 x model=2 against plain JAX, same shardings
    batch = C.make_gpt_batch(cfg, m * rows * 2)  # rows per microbatch on each data shard
    mh = mesh((1, 2, 2), ("pipe", "data", "model"))
    placed = jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mh, s or P())),
                          params, specs, is_leaf=lambda v: v is None)
    placed_batch = jax.device_put(batch, NamedSharding(mh, P("data")))
    pipe = jp.pipeline(loss_fn, placed, placed_batch, mesh=mh, schedule=jp.OneFOneB(1, m),
                       cut="markers", param_specs=specs)
    plain = jax.jit(C.plain_value_and_grad(loss_fn, m, NamedSharding(mh, P(None, "data"))))
    c_pipe, _, _ = C.compile_timed(pipe.inspect.value_and_grad_fn, placed, placed_batch)
    c_plain, _, _ = C.compile_timed(plain, placed, placed_batch)
    t = C.time_interleaved({"jaxpipe": (c_pipe, (placed, placed_batch)),
                            "plain": (c_plain, (placed, placed_batch))},
                           warmup=warmup, repeats=repeats)
    # (--quick leaves out the flax GPT on Explicit axes, 7 s of its 21: the test suite
    # runs that model exact, tests/test_sharded.py::test_the_gpt_example_on_pipe_fsdp_tp_is_exact)
    out["explicit"] = ({"skipped": "full run only (tests/test_sharded.py runs the model)"}
                       if quick else measure_explicit(quick, m, rows))
    out["p1_overhead"] = {
        "mesh": "pipe=1 x data=2 x model=2",
        "jaxpipe_cpu_s": t["jaxpipe"]["cpu_median_s"], "plain_cpu_s": t["plain"]["cpu_median_s"],
        "ratio_cpu": t["jaxpipe"]["cpu_median_s"] / t["plain"]["cpu_median_s"],
        "ratio_wall": t["jaxpipe"]["median_s"] / t["plain"]["median_s"]}
    return out


def measure_explicit(quick: bool, m: int, rows: int) -> dict[str, Any]:
    """The flax-style GPT on Explicit axes: per-device memory pipe=2 x fsdp=2 x tp=2 /
    pipe=2, and the cutter's prediction against the compiled train step, per mesh."""
    import dataclasses

    import jax
    import numpy as np
    import optax
    from flax import nnx

    import jaxpipe as jp
    from benchmarks import common as C

    gpt = C.load_example("gpt")
    cfg = (gpt.Config(seq=16, layers=2, width=32, heads=2) if quick
           else gpt.Config(seq=64, layers=8, width=128, heads=4))
    ids = np.random.default_rng(0).integers(0, gpt.VOCAB, 1 << 16).astype(np.int32)
    host = gpt.sample_batch(ids, np.random.default_rng(1), m * rows, cfg.seq)
    meshes = {"pipe": ((2,), ("pipe",))}
    if len(jax.devices()) >= 8 and not quick:
        meshes["pipe_x_fsdp_x_tp"] = ((2, 2, 2), ("pipe", "fsdp", "tp"))
    res: dict[str, Any] = {"model": dataclasses.asdict(cfg)}
    for name, (shape, names) in meshes.items():
        mesh = jax.make_mesh(shape, names, devices=jax.devices()[:int(np.prod(shape))])
        with jax.set_mesh(mesh):
            model = gpt.GPT(cfg, rngs=nnx.Rngs(0), sharding=gpt.Sharding.for_mesh(names))
            batch = gpt.place_batch(host, mesh)
            pipe = jp.flax.pipeline(model, gpt.loss_fn, batch, mesh=mesh,
                                    schedule=jp.OneFOneB(2, m), cut="markers", has_aux=True,
                                    reduction="weighted")
            state = pipe.init(model, optax.adamw(1e-3))
            stats = C.memory_stats(state.trainer.step_fn.lower(state, batch).compile())
        predicted = float(pipe.inspect.cut_report.peak_memory)
        res[name] = {**stats, "state_share_bytes": _state_share(state, mesh),
                     "predicted_bytes": predicted,
                     "predicted_over_compiled": predicted / stats["total_bytes"]}
    if "pipe_x_fsdp_x_tp" in res:
        res["argument_ratio"] = (res["pipe_x_fsdp_x_tp"]["argument_bytes"]
                                 / res["pipe"]["argument_bytes"])
        res["analytic_state_ratio"] = (res["pipe_x_fsdp_x_tp"]["state_share_bytes"]
                                       / res["pipe"]["state_share_bytes"])
    return res


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    res = measure(args.quick)
    mem = res["memory"]
    for name in ("pipe", "pipe_x_model", "pipe_x_fsdp_x_model"):
        if name not in mem:
            continue
        r = mem[name]
        print(f"{name:>19}: argument {r['argument_bytes'] / 2**20:.2f} MiB (analytic state "
              f"{r['state_share_bytes'] / 2**20:.2f} MiB), temp {r['temp_bytes'] / 2**20:.2f} "
              f"MiB, total {r['total_bytes'] / 2**20:.2f} MiB per device; the cutter "
              f"predicts {r['predicted_bytes'] / 2**20:.2f} MiB "
              f"(x{r['predicted_over_compiled']:.2f} of compiled)")
    print(f"pipe x model / pipe alone, per device: arguments {mem['argument_ratio']:.3f} "
          f"(analytic state {mem['analytic_state_ratio']:.3f}), temp {mem['temp_ratio']:.3f}, "
          f"total {mem['total_ratio']:.3f}")
    ex = res["explicit"]
    for name in ("pipe", "pipe_x_fsdp_x_tp"):
        if name in ex:
            r = ex[name]
            print(f"explicit {name:>16}: argument {r['argument_bytes'] / 2**20:.2f} MiB, temp "
                  f"{r['temp_bytes'] / 2**20:.2f} MiB, total {r['total_bytes'] / 2**20:.2f} "
                  f"MiB per device; the cutter predicts {r['predicted_bytes'] / 2**20:.2f} "
                  f"MiB (x{r['predicted_over_compiled']:.2f} of compiled)")
    if "argument_ratio" in ex:
        print(f"explicit pipe x fsdp x tp / pipe alone, arguments per device: "
              f"{ex['argument_ratio']:.3f} (analytic state {ex['analytic_state_ratio']:.3f})")
    o = res["p1_overhead"]
    print(f"p=1 composed overhead ({o['mesh']}, public value_and_grad / plain JAX, same "
          f"shardings, CPU time): {o['ratio_cpu']:.3f} (wall {o['ratio_wall']:.3f})")
    from benchmarks import common as C

    C.write_json(args.out, "sharded.json", res, indent=1)
    return res


# ------------------------------------------------------------ the section in benchmarks/run.py
ORDER = 100
FIELDS = ("model", "memory", "explicit", "p1_overhead")


def run(r: Any) -> dict[str, Any]:
    return measure(r.s.quick)


def summary(sh: dict[str, Any]) -> str:
    mem, o, ex = sh["memory"], sh["p1_overhead"], sh["explicit"]
    return (f"**Inside a bigger mesh**: per-device memory pipe=2 x model=2 / pipe=2 "
            f"alone: arguments {mem['argument_ratio']:.3f} (analytic "
            f"{mem['analytic_state_ratio']:.3f}), total {mem['total_ratio']:.3f}; p=1 "
            f"overhead on {o['mesh']}: {o['ratio_cpu']:.3f} of plain JAX (CPU time); the "
            "cutter's predicted bytes / compiled: " + ", ".join(
                f"{k} {v:.2f}" for k, v in mem.get("predicted_over_compiled", {}).items())
            + "; Explicit axes (the flax GPT): " + ", ".join(
                f"{k} {ex[k]['predicted_over_compiled']:.2f}"
                for k in ("pipe", "pipe_x_fsdp_x_tp") if k in ex))


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    from benchmarks.cpu_setup import single_core_cpu

    single_core_cpu(devices=8)
    main()
