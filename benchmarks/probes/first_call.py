"""A pipeline's first call against plain JAX's, in a fresh process, cold and from the
persistent compilation cache.

    python benchmarks/probes/first_call.py                # L=16, both stacks, ~40 s
    python benchmarks/probes/first_call.py --repeats 5    # medians and ranges
    python benchmarks/probes/first_call.py --layers 8,16,32,64 --ms 4,8,16,32,64

The issue's model: a tanh MLP of ``L`` blocks (width 64, 8 rows a microbatch), 1F1B over
4 virtual CPU devices, m microbatches (default 8; ``--ms`` sweeps m at L=16),
``cut="markers"``; written unrolled (a Python loop) and scanned (one ``lax.scan`` over
stacked weights). Each point runs in fresh processes (imports done
before the clock starts): plain ``jit(value_and_grad)`` accumulating the same
microbatches, first call minus a steady call; jaxpipe ``jp.pipeline(...)`` + first
``value_and_grad`` minus a steady call, with ``pipe.plan``'s phases (build: trace, cut,
schedule; program + lower; XLA compile). Then the same in a second process whose
``jax_compilation_cache_dir`` the first one filled (both programs load from it).

``--xla-phases`` then times the Python before XLA starts (plain's trace + lower against
jaxpipe's build + lower) and splits XLA's compile of both programs at L=16 by its own trace
(``jax.profiler``; event names of jaxlib 0.10), beside plain JAX on one device and data
parallel over the same 4 devices: HLO passes, SPMD partitioning (Shardy inside the
partitioner, which a one-device program skips), emitting thunks and kernels
(how many kernels the fusion emitters build, their thread-seconds), LLVM's machine code
for them, and the pipeline's kernels by name.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

WORKER = r"""
import json, sys, time
from jaxpipe.xla_flags import cpu_devices
cpu_devices(4)
import jax, jax.numpy as jnp
import jaxpipe as jp
# imports before the clock starts; the runtime is imported at the first pipeline (it
# was ~0.05 s of the figure where Python writes no bytecode, PYTHONDONTWRITEBYTECODE)
import jaxpipe.api.pipeline  # noqa: F401
import jaxpipe.runtime.spmd  # noqa: F401
from benchmarks import common as C

L, scanned, cache, m = int(sys.argv[1]), sys.argv[2] == "scanned", sys.argv[3], int(sys.argv[4])
jax.config.update("jax_compilation_cache_dir", cache)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
from benchmarks.probes.first_call import model
params, batch, loss_fn = model(L, m, scanned)

def wall(f, *a):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*a))
    return time.perf_counter() - t0


vg = C.plain_value_and_grad(loss_fn, m)
plain = jax.jit(vg)
mesh = jax.make_mesh((4,), ("pipe",))
if sys.argv[5] == "phases":
    from benchmarks.probes.first_call import xla_trace
    # the Python before XLA starts: plain JAX's trace + lower against jaxpipe's build
    # (trace, cut, schedule) + program + lower, on warm imports
    t0 = time.perf_counter()
    plain_low = plain.lower(params, batch)
    t1 = time.perf_counter()
    pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=jp.OneFOneB(4, m),
                       cut="markers")
    pipe_low = pipe.lower("value_and_grad")
    t2 = time.perf_counter()
    # plain JAX again, data parallel over the same 4 devices: what a multi-device program
    # pays in SPMD partitioning without a pipeline
    from jax.sharding import NamedSharding, PartitionSpec as P
    dp = jax.jit(vg, in_shardings=(
        NamedSharding(mesh, P()), {"x": NamedSharding(mesh, P("pipe")),
                                   "y": NamedSharding(mesh, P("pipe"))}))
    print(json.dumps({"plain": xla_trace(plain_low) | {"python": t1 - t0},
                      "plain_4_devices": xla_trace(dp.lower(params, batch)),
                      "jaxpipe": xla_trace(pipe_low) | {"python": t2 - t1}}))
    sys.exit()
first = wall(plain, params, batch)
plain_s = first - wall(plain, params, batch)
t0 = time.perf_counter()
pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=jp.OneFOneB(4, m),
                   cut="markers")
build = time.perf_counter() - t0
first = wall(pipe.value_and_grad, params, batch)
jaxpipe_s = build + first - wall(pipe.value_and_grad, params, batch)
times = pipe.inspect.build_times
(lower_s, xla_s), = times.programs.values()
print(json.dumps({"plain_s": plain_s, "jaxpipe_s": jaxpipe_s, "build_s": build,
                  "phases": times.build, "program_lower_s": lower_s, "xla_s": xla_s}))
"""


#: XLA:CPU's trace events (jaxlib 0.10) -> the phase they time
XLA_EVENTS = {"PjRtCpuClient::Compile": "xla", "HLO passes through layout assignment":
              "hlo_passes", "HLO passes after layout assignment": "hlo_passes",
              "spmd-partitioner": "spmd",  # Shardy's propagation runs inside it
              # emitting thunks and kernels' IR (the fusion emitters run inside it, so
              # "kernels", their thread-seconds, is part of "emit"); then LLVM's machine
              # code for every kernel, on a thread pool
              "ThunkEmitter::EmitEntryComputation": "emit",
              "ThunkEmitter::ConsumeKernels": "emit",
              "FusionCompiler::Compile": "kernels", "JitCompiler::Compile": "llvm"}


def model(layers: int, m: int, scanned: bool, width: int = 64, rows: int = 8
          ) -> tuple[Any, dict, Any]:
    """The issue's model: ``(params, batch, loss_fn)`` of a tanh MLP of ``layers`` blocks
    (``width`` wide, ``rows`` rows a microbatch, ``m`` microbatches), a
    ``jaxpipe.boundary`` after every block; written unrolled (a Python loop over a list
    of weights) or scanned (one ``lax.scan`` over them stacked)."""
    import jax
    import jax.numpy as jnp

    import jaxpipe as jp

    keys = jax.random.split(jax.random.key(0), layers + 2)
    params = [jax.random.normal(k, (width, width)) / 8 for k in keys[:layers]]
    batch = {"x": jax.random.normal(keys[-2], (rows * m, width)),
             "y": jax.random.normal(keys[-1], (rows * m, width))}
    if scanned:
        def loss_fn(params, batch):
            h, _ = jax.lax.scan(lambda h, w: (jp.boundary(jnp.tanh(h @ w)), None),
                                batch["x"], params)
            return jnp.mean((h - batch["y"]) ** 2)
        return jnp.stack(params), batch, loss_fn

    def loss_fn(params, batch):
        h = batch["x"]
        for w in params:
            h = jp.boundary(jnp.tanh(h @ w))
        return jnp.mean((h - batch["y"]) ** 2)
    return params, batch, loss_fn


def xla_trace(lowered: Any) -> dict[str, Any]:
    """Seconds of each phase in :data:`XLA_EVENTS` while XLA compiles ``lowered``, the
    number of kernels the fusion emitters built, and their names (XLA's default flags:
    the elemental emitter of ``jaxpipe.xla_flags.FAST_CPU_COMPILE`` emits no such event)."""
    from benchmarks.trace_events import trace_events

    events = trace_events(lowered.compile)
    out: dict[str, Any] = dict.fromkeys(XLA_EVENTS.values(), 0.0) | {"kernel_names": []}
    for e in events:
        phase = next((v for k, v in XLA_EVENTS.items() if e["name"].startswith(k)), None)
        if phase:
            out[phase] += e["dur"] / 1e6
        if phase == "kernels":
            out["kernel_names"].append(e.get("args", {}).get("module", "?")
                                       .replace("_kernel_module", "")
                                       .replace("__compute_module_", ""))
    out["num_kernels"] = len(out["kernel_names"])
    return out


def xla_phases(variants: list[str]) -> list[dict[str, Any]]:
    """:func:`xla_trace` of both programs at L=16, m=8, a fresh process a variant."""
    rows = []
    for variant in variants:
        with tempfile.TemporaryDirectory() as cache:
            r = _run(16, variant, cache, 8, "phases")
        for who in ("plain", "plain_4_devices", "jaxpipe"):
            x = r[who]
            rows.append({"variant": variant, "program": who, **x})
            py = f"Python {x['python']:.3f} s, " if "python" in x else ""
            print(f"{variant:8s} {who:15s}: {py}XLA {x['xla']:.3f} s: HLO passes "
                  f"{x['hlo_passes']:.3f}, SPMD {x['spmd']:.3f}, emit {x['emit']:.3f} "
                  f"({x['num_kernels']} kernels, {x['kernels']:.3f} thread-s), LLVM "
                  f"{x['llvm']:.3f}", flush=True)
        print("  jaxpipe's kernels:", " ".join(sorted(r["jaxpipe"]["kernel_names"])))
    return rows


def _run(layers: int, variant: str, cache: str, m: int, mode: str = "time"
         ) -> dict[str, Any]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(x for x in (os.environ.get("PYTHONPATH"),
                                                      str(REPO)) if x)}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", WORKER, str(layers), variant, cache, str(m),
                           mode],
                          capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(layers: list[int], variants: list[str], ms: list[int], repeats: int = 1
            ) -> dict[str, Any]:
    """Each point ``repeats`` times (fresh processes, a fresh cache each time): one run
    moves 10-30% on a shared 2-core machine, so with repeats the medians and ranges are
    printed too."""
    rows = []
    points = [(v, L, 8) for v in variants for L in layers]
    points += [(v, 16, m) for v in variants for m in ms if (v, 16, m) not in points]
    for variant, L, m in points:
        for rep in range(repeats):
            with tempfile.TemporaryDirectory() as cache:
                for run in ("cold", "cached"):
                    r = _run(L, variant, cache, m)
                    rows.append({"variant": variant, "layers": L, "microbatches": m,
                                 "run": run, "repeat": rep, **r,
                                 "ratio": r["jaxpipe_s"] / r["plain_s"]})
                    print(f"{variant:8s} L={L:3d} m={m:2d} {run:6s}: jaxpipe "
                          f"{r['jaxpipe_s']:.2f} s (build {r['build_s']:.2f}, program + "
                          f"lower {r['program_lower_s']:.2f}, XLA {r['xla_s']:.2f}) plain "
                          f"{r['plain_s']:.2f} s, ratio {rows[-1]['ratio']:.2f}", flush=True)
    medians = []
    if repeats > 1:
        for variant, L, m in points:
            for run in ("cold", "cached"):
                ratios = sorted(x["ratio"] for x in rows if (x["variant"], x["layers"],
                                x["microbatches"], x["run"]) == (variant, L, m, run))
                med = ratios[len(ratios) // 2]
                medians.append({"variant": variant, "layers": L, "microbatches": m,
                                "run": run, "median_ratio": med, "min_ratio": ratios[0],
                                "max_ratio": ratios[-1]})
                print(f"{variant:8s} L={L:3d} m={m:2d} {run:6s}: median ratio {med:.2f} "
                      f"({ratios[0]:.2f}-{ratios[-1]:.2f}, {repeats} runs)", flush=True)
    return {"model": "tanh MLP width 64, 1F1B p=4", "rows": rows, "medians": medians,
            "repeats": repeats, "target_ratio": 1.3}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="16")
    ap.add_argument("--variants", default="unrolled,scanned")
    ap.add_argument("--ms", default="8", help="microbatch counts (at L=16)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs a point (then medians and ranges are printed too)")
    ap.add_argument("--xla-phases", action="store_true",
                    help="also split XLA's compile of both programs at L=16 by phase")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "first_call"))
    a = ap.parse_args(argv)
    res = measure([int(x) for x in a.layers.split(",")], a.variants.split(","),
                  [int(x) for x in a.ms.split(",")], a.repeats)
    if a.xla_phases:
        res["xla_phases"] = xla_phases(a.variants.split(","))
    sys.path.insert(0, str(REPO))
    from benchmarks.common import write_json

    write_json(a.out, "first_call.json", res)


if __name__ == "__main__":
    main()
