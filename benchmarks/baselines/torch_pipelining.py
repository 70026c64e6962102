"""jaxpipe against torch.distributed.pipelining on CPU: 2 pinned processes, an MLP, SGD.

    python benchmarks/baselines/torch_pipelining.py --torch-python /path/to/python

Both frameworks train the same MLP (``--layers`` Linear(width, width) + ReLU layers, an MSE
loss) with plain SGD, pipelined over two processes, each pinned to its own core with one
compute thread, talking gloo over loopback; a full training step (forward, backward,
optimizer) is timed, median of ``--repeats`` after ``--warmup``. jaxpipe runs
``Pipeline.train_step`` (one jitted program per step); torch runs ``schedule.step`` and
``optimizer.step()`` on each rank's stages. Schedules: 1F1B (one stage per process) and
interleaved 1F1B (two per process). torch is not a jaxpipe dependency: it runs under
``--torch-python`` (an interpreter that has it; skipped without one).

Prints one line per (framework, schedule, m) and the ratio jaxpipe / torch, and writes
``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
SCHEDULES = ("1f1b", "interleaved")


def _pin(rank: int) -> None:
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) >= 2:
        os.sched_setaffinity(0, {cores[rank % len(cores)]})


# ------------------------------------------------------------------------------- torch
def _torch_worker(a: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleInterleaved1F1B,
    )

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=a.rank, world_size=2)
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(a.width, a.width), torch.nn.ReLU())
              for _ in range(a.layers)]
    out: dict[str, Any] = {}
    for sched in a.schedules.split(","):
        v = 2 if sched == "interleaved" else 1
        S = 2 * v
        per = a.layers // S
        mine = [s for s in range(S) if s % 2 == a.rank]  # loop placement
        mods = [torch.nn.Sequential(*layers[s * per:(s + 1) * per]) for s in mine]
        stages = [PipelineStage(mod, s, S, torch.device("cpu")) for mod, s in
                  zip(mods, mine, strict=True)]
        params = [p for mod in mods for p in mod.parameters()]
        opt = torch.optim.SGD(params, lr=1e-3)
        for m in a.ms:
            loss_fn = torch.nn.MSELoss()
            schedule = (Schedule1F1B(stages[0], m, loss_fn=loss_fn) if v == 1 else
                        ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn))
            x = torch.randn(m * a.mb, a.width)
            y = torch.randn(m * a.mb, a.width)
            times = []
            for k in range(a.warmup + a.repeats):
                dist.barrier()
                t0 = time.perf_counter()
                opt.zero_grad()
                if a.rank == 0:
                    schedule.step(x)
                else:
                    schedule.step(target=y, losses=[])
                opt.step()
                dist.barrier()
                if k >= a.warmup:
                    times.append(time.perf_counter() - t0)
            out[f"{sched}/m={m}"] = statistics.median(times)
    dist.destroy_process_group()
    return out


# ----------------------------------------------------------------------------- jaxpipe
def _jaxpipe_worker(a: argparse.Namespace) -> dict[str, Any]:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{a.port}", num_processes=2,
                               process_id=a.rank)
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxpipe as jp
    from jaxpipe import distributed as jpd

    rng = np.random.default_rng(0)
    bound = 1 / np.sqrt(a.width)  # torch.nn.Linear's default initialisation range
    host = [{"w": rng.uniform(-bound, bound, (a.width, a.width)).astype(np.float32),
             "b": rng.uniform(-bound, bound, (a.width,)).astype(np.float32)}
            for _ in range(a.layers)]

    def loss_fn(params, mb):
        h = mb["x"]
        for layer in params:
            h = jp.boundary(jax.nn.relu(h @ layer["w"] + layer["b"]))
        return jnp.mean((h - mb["y"]) ** 2)

    mesh = jax.make_mesh((2,), ("pipe",))
    params = jpd.replicate(host, mesh)
    out: dict[str, Any] = {}
    for sched in a.schedules.split(","):
        for m in a.ms:
            schedule = (jp.OneFOneB(2, m) if sched == "1f1b" else
                        jp.Interleaved1F1B(2, m, stages_per_device=2))
            batch = jpd.global_batch(
                {"x": rng.standard_normal((m * a.mb, a.width)).astype(np.float32),
                 "y": rng.standard_normal((m * a.mb, a.width)).astype(np.float32)}, mesh)
            pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=schedule,
                               cut="auto")
            state = pipe.init(params, optax.sgd(1e-3))
            times = []
            for k in range(a.warmup + a.repeats):
                t0 = time.perf_counter()
                state, metrics = pipe.train_step(state, batch)
                jax.block_until_ready(metrics["loss"])
                if k >= a.warmup:
                    times.append(time.perf_counter() - t0)
            out[f"{sched}/m={m}"] = statistics.median(times)
            out[f"{sched}/m={m}/ticks"] = int(pipe.inspect.executor.lowering.num_ticks)
    return out


# -------------------------------------------------------------------------------- main
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(framework: str, python: str, a: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(REPO))
    from benchmarks.cpu_setup import with_flags  # (imports no jax)

    port = _free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), JAX_PLATFORMS="cpu",
               PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
               XLA_FLAGS=with_flags("--xla_force_host_platform_device_count=1"))
    outs = [Path(a.workdir) / f"{framework}{r}.json" for r in range(2)]
    procs = [subprocess.Popen(
        [python, __file__, "--role", framework, "--rank", str(r), "--port", str(port),
         "--out", str(outs[r]), "--layers", str(a.layers), "--width", str(a.width),
         "--mb", str(a.mb), "--ms", ",".join(map(str, a.ms)), "--schedules", a.schedules,
         "--warmup", str(a.warmup), "--repeats", str(a.repeats)],
        env=env, cwd=REPO) for r in range(2)]
    for p in procs:
        p.wait(timeout=a.timeout)
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{framework} workers failed: {[p.returncode for p in procs]}")
    ranks = [json.loads(o.read_text()) for o in outs]
    return {k: max(r[k] for r in ranks) for k in ranks[0]}  # a step ends on both ranks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=("main", "torch", "jaxpipe"), default="main")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--torch-python", default=None,
                    help="a Python interpreter with torch installed (default: skip torch)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--mb", type=int, default=32, help="rows per microbatch")
    ap.add_argument("--ms", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8, 16])
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--runs", type=int, default=2, help="fresh process pairs; medians")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--workdir", default="/tmp/jaxpipe_torch_compare")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.role != "main":
        _pin(a.rank)
        res = (_torch_worker if a.role == "torch" else _jaxpipe_worker)(a)
        Path(a.out).write_text(json.dumps(res))
        return 0
    Path(a.workdir).mkdir(parents=True, exist_ok=True)
    frameworks = {"jaxpipe": sys.executable}
    if a.torch_python:
        frameworks["torch"] = a.torch_python
    runs: dict[str, list[dict[str, Any]]] = {f: [] for f in frameworks}
    for _ in range(a.runs):
        for f, python in frameworks.items():
            runs[f].append(_spawn(f, python, a))
    res: dict[str, Any] = {"config": {k: v for k, v in vars(a).items()
                                      if k not in ("role", "rank", "port")},
                           "runs": runs, "median_s": {}}
    for f, rs in runs.items():
        res["median_s"][f] = {k: statistics.median(r[k] for r in rs) for k in rs[0]
                              if not k.endswith("/ticks")}
    for key, t in res["median_s"]["jaxpipe"].items():
        torch_t = res["median_s"].get("torch", {}).get(key)
        ratio = f"  jaxpipe/torch {t / torch_t:.2f}" if torch_t else ""
        print(f"{key:<18} jaxpipe {t * 1e3:8.2f} ms"
              + (f"  torch {torch_t * 1e3:8.2f} ms" if torch_t else "") + ratio)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
