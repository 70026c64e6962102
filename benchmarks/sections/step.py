"""Per-step costs of the SPMD program on CPU: executor overhead and the I/W split.

    python benchmarks/sections/step.py            # prints ratios, writes results/step_overhead.json

Two measurements, CPU time of the compiled programs (one core, single-threaded XLA, so
virtual devices run one after another and time measures total work):

* **p=1 overhead**: an MLP (8 layers x 512, 64 rows per microbatch, m=8), the public
  ``Pipeline.value_and_grad`` at p=1 against plain JAX (``jax.value_and_grad`` over a
  ``lax.scan`` of the same microbatches). Target <= 1.05.
* **I/W split**: 1F1B at p=4 with every full backward run as I then W
  (``SpmdRuntime(split_backward=True)``, what the runtime does where devices run
  concurrently) against plain 1F1B, on the same MLP and on the GPT block stack. Target:
  within 5%. Two ways: W in a tick of its own, its hand-off from I stored
  (``iw_same_tick=False``, the ticks devices that run concurrently get), and W in its
  I's step with the hand-off passed straight on (``iw_same_tick=True``, the default on
  CPU in one process).

Timings are medians of interleaved repeats (``benchmarks.common.time_interleaved``).
Within one process the ratios still move by up to 15% from process to process (where
the allocator put each program's buffers; the same binary run four times gave I+W / B
on the MLP of 1.025, 1.175, 1.062 and 1.025), so the script measures in ``--processes``
fresh processes (default 3) and reports the median of their ratios, with every
process's ratio beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _mlp(width: int = 512, layers: int = 8, rows: int = 64, m: int = 8) -> tuple:
    import jax
    import jax.numpy as jnp

    import jaxpipe as jp

    keys = jax.random.split(jax.random.key(0), layers + 2)
    params = [{"w": jax.random.normal(keys[i], (width, width)) / width**0.5,
               "b": jnp.zeros((width,))} for i in range(layers)]
    batch = {"x": jax.random.normal(keys[-2], (rows * m, width)),
             "y": jax.random.normal(keys[-1], (rows * m, width))}

    def loss_fn(p: Any, b: Any) -> jax.Array:
        h = b["x"]
        for layer in p:
            h = jp.boundary(jnp.tanh(h @ layer["w"] + layer["b"]))
        return jnp.mean((h - b["y"]) ** 2)

    return loss_fn, params, batch


def measure(quick: bool = False) -> dict[str, Any]:
    import jax

    import jaxpipe as jp
    from benchmarks import common as C
    from jaxpipe.runtime.spmd import SpmdRuntime

    repeats, warmup = (2, 1) if quick else (9, 2)
    out: dict[str, Any] = {}
    # --- p=1 overhead, public value_and_grad
    m = 8
    loss_fn, params, batch = _mlp(width=128 if quick else 512, rows=16 if quick else 64, m=m)
    mesh1 = jax.make_mesh((1,), ("pipe",), devices=jax.devices()[:1])
    pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh1, schedule=jp.OneFOneB(1, m),
                       cut="markers")
    # the p=1 stage runs each F and its B in one step (SpmdRuntime(fuse_fb="auto")); the
    # same pipeline with separate F and B steps, as before that, for the comparison
    unfused = jp.pipeline(loss_fn, params, batch, mesh=mesh1, schedule=jp.OneFOneB(1, m),
                          cut="markers", runtime=SpmdRuntime(fuse_fb=False))
    plain = jax.jit(C.plain_value_and_grad(loss_fn, m))
    staged = pipe.shard(params)
    c_pipe, _, _ = C.compile_timed(pipe.inspect.value_and_grad_fn, params, batch)
    c_unfused, _, _ = C.compile_timed(unfused.inspect.value_and_grad_fn, params, batch)
    c_staged, _, _ = C.compile_timed(pipe.inspect.staged_value_and_grad_fn, staged, batch)
    c_plain, _, _ = C.compile_timed(plain, params, batch)
    t = C.time_interleaved({"jaxpipe": (c_pipe, (params, batch)),
                            "unfused": (c_unfused, (params, batch)),
                            "staged": (c_staged, (staged, batch)),
                            "plain": (c_plain, (params, batch))}, warmup=warmup,
                           repeats=repeats)
    out["p1_overhead"] = {
        "model": "mlp 8x512, 64 rows/microbatch, m=8" if not quick else "quick mlp",
        "jaxpipe_cpu_s": t["jaxpipe"]["cpu_median_s"], "plain_cpu_s": t["plain"]["cpu_median_s"],
        "ratio_cpu": t["jaxpipe"]["cpu_median_s"] / t["plain"]["cpu_median_s"],
        "ratio_wall": t["jaxpipe"]["median_s"] / t["plain"]["median_s"],
        # the same program on parameters already in the stage layout: what remains is the
        # program itself; the difference to ratio_cpu is moving parameters in and
        # gradients out of the layout
        "staged_ratio_cpu": t["staged"]["cpu_median_s"] / t["plain"]["cpu_median_s"],
        "fused_stages": sorted(pipe.inspect.executor.lowering.fused_stages),
        "unfused_ratio_cpu": t["unfused"]["cpu_median_s"] / t["plain"]["cpu_median_s"]}
    # --- I/W split vs B, 1F1B p=4
    p, m = 4, 8
    rows = {}
    cfg = C.GPTConfig(n_layers=8) if not quick else C.GPTConfig(
        vocab=64, d_model=32, n_heads=2, n_layers=4, seq=8)
    models = {"mlp": (loss_fn, params, batch)}
    if not quick:  # the smoke run (tests) times one model
        models["gpt_blocks"] = (C.blocks_loss(cfg), C.init_params(cfg, jax.random.key(0),
                                                                  embed=False),
                                C.make_blocks_batch(cfg, m * 2))
    mesh = jax.make_mesh((p,), ("pipe",), devices=jax.devices()[:p])
    for name, (lf, prm, bt) in models.items():
        progs = {}
        runtimes = {"B": SpmdRuntime(split_backward=False),
                    "I+W": SpmdRuntime(split_backward=True, iw_same_tick=False),
                    "I+W same tick": SpmdRuntime(split_backward=True, iw_same_tick=True)}
        for key, rt in runtimes.items():
            pp = jp.pipeline(lf, prm, bt, mesh=mesh, schedule=jp.OneFOneB(p, m), cut="markers",
                             runtime=rt)
            staged = pp.shard(prm)
            c, _, _ = C.compile_timed(pp.inspect.staged_value_and_grad_fn, staged, bt)
            progs[key] = (c, (staged, bt))
        t = C.time_interleaved(progs, warmup=warmup, repeats=repeats)
        b = t["B"]
        rows[name] = {"B_cpu_s": b["cpu_median_s"], "IW_cpu_s": t["I+W"]["cpu_median_s"],
                      "ratio_cpu": t["I+W"]["cpu_median_s"] / b["cpu_median_s"],
                      "ratio_wall": t["I+W"]["median_s"] / b["median_s"],
                      "same_tick_ratio_cpu": t["I+W same tick"]["cpu_median_s"]
                      / b["cpu_median_s"],
                      "same_tick_ratio_wall": t["I+W same tick"]["median_s"] / b["median_s"]}
    out["split_backward"] = {"schedule": f"1F1B p={p} m={m}", "rows": rows}
    return out


#: The ratios :func:`across_processes` takes the median of, by section and row.
RATIOS = {"p1_overhead": ("ratio_cpu", "ratio_wall", "staged_ratio_cpu", "unfused_ratio_cpu"),
          "split_backward": ("ratio_cpu", "ratio_wall", "same_tick_ratio_cpu",
                             "same_tick_ratio_wall")}


def across_processes(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One result from :func:`measure`'s results in several processes: the first run's
    fields, every ratio replaced by the median over the runs and listed per run under
    ``<ratio>_runs``."""
    out = json.loads(json.dumps(runs[0]))
    for key in RATIOS["p1_overhead"]:
        vals = [r["p1_overhead"][key] for r in runs]
        out["p1_overhead"][key] = statistics.median(vals)
        out["p1_overhead"][key + "_runs"] = vals
    for name, row in out["split_backward"]["rows"].items():
        for key in RATIOS["split_backward"]:
            vals = [r["split_backward"]["rows"][name][key] for r in runs]
            row[key] = statistics.median(vals)
            row[key + "_runs"] = vals
    out["processes"] = len(runs)
    return out


def measure_processes(processes: int, quick: bool = False) -> dict[str, Any]:
    """:func:`measure` in ``processes`` fresh processes, one after another (this script
    run with ``--processes 1``), combined by :func:`across_processes`."""
    if processes <= 1:
        return measure(quick)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(processes):
            out = Path(tmp) / str(i)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--processes", "1",
                   "--out", str(out), *(["--quick"] if quick else []), "--quiet"]
            # the child sets its own XLA flags and path (see the bottom of this file)
            env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
            subprocess.run(cmd, check=True, env=env)
            runs.append(json.loads((out / "step_overhead.json").read_text()))
    return across_processes(runs)


def _runs(r: dict[str, Any], key: str) -> str:
    vals = r.get(key + "_runs")
    return f" [{', '.join(f'{v:.3f}' for v in vals)}]" if vals else ""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--processes", type=int, default=3,
                    help="measure in this many fresh processes and report median ratios")
    ap.add_argument("--quiet", action="store_true", help="write the JSON only")
    args = ap.parse_args(argv)
    res = measure_processes(args.processes, args.quick)
    from benchmarks import common as C

    C.write_json(args.out, "step_overhead.json", res, indent=1)
    if args.quiet:
        return res
    o = res["p1_overhead"]
    what = (f"median of {res['processes']} processes" if res.get("processes")
            else "one process")
    print(f"({what}; per process in brackets)")
    print(f"p=1 overhead (public value_and_grad / plain JAX, CPU time): {o['ratio_cpu']:.3f}"
          f"{_runs(o, 'ratio_cpu')} (wall {o['ratio_wall']:.3f}); on staged parameters: "
          f"{o['staged_ratio_cpu']:.3f}; F and B in separate steps (fuse_fb=False): "
          f"{o['unfused_ratio_cpu']:.3f}")
    for name, r in res["split_backward"]["rows"].items():
        print(f"I+W / B step time, {name}, W in a tick of its own: {r['ratio_cpu']:.3f}"
              f"{_runs(r, 'ratio_cpu')} (wall {r['ratio_wall']:.3f}); W in its I's step: "
              f"{r['same_tick_ratio_cpu']:.3f}{_runs(r, 'same_tick_ratio_cpu')}")
    return res


# ------------------------------------------------------------ the section in benchmarks/run.py
ORDER = 80
FIELDS = ("p1_overhead", "split_backward")


def run(r: Any) -> dict[str, Any]:
    """Medians over three fresh processes (one with ``--quick``)."""
    return measure_processes(1 if r.s.quick else 3, r.s.quick)


def summary(st: dict[str, Any]) -> str:
    o = st["p1_overhead"]
    return (f"**Step overhead**: p=1 {o['model']}: {o['ratio_cpu']:.3f} of plain JAX "
            "(CPU time); I+W / B (1F1B), W in its I's step (the CPU default) / in a "
            "tick of its own: " + ", ".join(
                f"{k} {v['same_tick_ratio_cpu']:.3f} / {v['ratio_cpu']:.3f}"
                for k, v in st["split_backward"]["rows"].items()))


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    from benchmarks.cpu_setup import single_core_cpu

    single_core_cpu(devices=4)
    main()
