"""jaxpipe against torch.distributed.pipelining on CPU: 2 pinned processes, an MLP, SGD.

    python benchmarks/baselines/torch_pipelining.py --torch-python /path/to/python

Both frameworks train the same MLP (``--layers`` Linear(width, width) layers, each
followed by ``--activation``, an MSE loss) with plain SGD, pipelined over two processes,
each pinned to its own core with one compute thread, talking gloo over loopback; a full
training step (forward, backward, optimizer) is timed, median of ``--repeats`` after
``--warmup``. jaxpipe runs ``Pipeline.train_step`` (one jitted program per step); torch
runs ``schedule.step`` and ``optimizer.step()`` on each rank's stages. Schedules: GPipe and
1F1B (one stage per process) and interleaved 1F1B (two per process). torch is not a
jaxpipe dependency: it runs under ``--torch-python`` (an interpreter that has it; skipped
without one).

Each framework also trains the whole model in one process on one core (jaxpipe's
reference is plain ``jax.jit`` accumulating the m microbatches' gradients); the speed-up of
the pipeline over it, against the ideal ``2m / (m + 1)`` of two stages, is the fraction of
ideal. The default is the issue's configuration: 8 x 512 tanh, 64 rows per microbatch.

Prints one line per (schedule, m): step times (jaxpipe's with the Python of its step, until
``train_step`` returns), jaxpipe / torch, and each framework's fraction of ideal; writes
``--out`` as JSON. ``--profile-steps N`` then profiles N more jaxpipe steps (a fresh
``jax.profiler`` trace in each process) and prints, per rank, the time inside the step's
collective-permutes and all-reduces: the exchange itself (gloo's permute alone costs ~0.19
ms, ``probes/permute_cost.py``) plus the wait for the other process.
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
SCHEDULES = ("gpipe", "1f1b", "interleaved")


# ------------------------------------------------------------------------------- torch
def _torch_worker(a: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
    )

    torch.set_num_threads(1)
    torch.manual_seed(0)
    act = {"relu": torch.nn.ReLU, "tanh": torch.nn.Tanh}[a.activation]
    layers = [torch.nn.Sequential(torch.nn.Linear(a.width, a.width), act())
              for _ in range(a.layers)]
    if a.role == "torch-single":
        return _torch_single(a, torch.nn.Sequential(*layers))
    dist.init_process_group("gloo", rank=a.rank, world_size=2)
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
            schedule = (ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn) if v == 2 else
                        {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[sched](
                            stages[0], m, loss_fn=loss_fn))
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


def _torch_single(a: argparse.Namespace, model: Any) -> dict[str, Any]:
    """The whole model on this core: m microbatches' forward and backward, one SGD step."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = torch.nn.MSELoss()
    out: dict[str, Any] = {}
    for m in a.ms:
        xs = torch.randn(m, a.mb, a.width).unbind(0)
        ys = torch.randn(m, a.mb, a.width).unbind(0)

        def step(xs=xs, ys=ys, m=m) -> None:
            opt.zero_grad()
            for x, y in zip(xs, ys, strict=True):
                (loss_fn(model(x), y) / m).backward()
            opt.step()

        out[f"m={m}"] = _median_time(step, a)
    return out


def _median_time(step: Any, a: argparse.Namespace) -> float:
    times = []
    for k in range(a.warmup + a.repeats):
        t0 = time.perf_counter()
        step()
        if k >= a.warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ----------------------------------------------------------------------------- jaxpipe
def _jaxpipe_worker(a: argparse.Namespace) -> dict[str, Any]:
    import jax

    from jaxpipe import distributed as jpd

    if a.role == "jaxpipe":
        jpd.initialize(f"127.0.0.1:{a.port}", 2, a.rank,
                       transport_threads=a.transport_threads)
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxpipe as jp

    rng = np.random.default_rng(0)
    bound = 1 / np.sqrt(a.width)  # torch.nn.Linear's default initialisation range
    host = [{"w": rng.uniform(-bound, bound, (a.width, a.width)).astype(np.float32),
             "b": rng.uniform(-bound, bound, (a.width,)).astype(np.float32)}
            for _ in range(a.layers)]

    act = {"relu": jax.nn.relu, "tanh": jnp.tanh}[a.activation]

    def loss_fn(params, mb):
        h = mb["x"]
        for layer in params:
            h = jp.boundary(act(h @ layer["w"] + layer["b"]))
        return jnp.mean((h - mb["y"]) ** 2)

    if a.role == "jaxpipe-single":
        return _jax_single(a, loss_fn, host, rng)
    mesh = jax.make_mesh((2,), ("pipe",))
    params = jpd.replicate(host, mesh)
    out: dict[str, Any] = {}
    for sched in a.schedules.split(","):
        for m in a.ms:
            schedule = (jp.Interleaved1F1B(2, m, stages_per_device=2)
                        if sched == "interleaved" else
                        {"gpipe": jp.GPipe, "1f1b": jp.OneFOneB}[sched](2, m))
            batch = jpd.global_batch(
                {"x": rng.standard_normal((m * a.mb, a.width)).astype(np.float32),
                 "y": rng.standard_normal((m * a.mb, a.width)).astype(np.float32)}, mesh)
            pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=schedule,
                               cut="auto")
            state = pipe.init(params, optax.sgd(1e-3))

            python: list[float] = []  # until train_step returns: jaxpipe's own Python

            def step(pipe=pipe, batch=batch, python=python) -> None:
                nonlocal state
                t0 = time.perf_counter()
                state, metrics = pipe.train_step(state, batch)
                python.append(time.perf_counter() - t0)
                jax.block_until_ready(metrics["loss"])

            out[f"{sched}/m={m}"] = _median_time(step, a)
            out[f"{sched}/m={m}/python_s"] = statistics.median(python[a.warmup:])
            out[f"{sched}/m={m}/ticks"] = int(pipe.inspect.executor.lowering.num_ticks)
            if a.profile_steps:
                for kind, (total, count) in _in_collectives(step, a.profile_steps).items():
                    out[f"{sched}/m={m}/{kind}_s/rank{a.rank}"] = total / a.profile_steps
                    out[f"{sched}/m={m}/{kind}_n/rank{a.rank}"] = count / a.profile_steps
    return out


#: XLA:CPU's thunk events of the step's collectives: named after their HLO instructions,
#: which JAX names after its primitive (``ppermute.3``, ``psum.7``; XLA's own, ``all-reduce``)
COLLECTIVES = {"permute": ("ppermute", "collective-permute"),
               "all_reduce": ("psum", "pmax", "pmin", "all-reduce")}


def _in_collectives(step: Any, steps: int) -> dict[str, tuple[float, int]]:
    """Per kind of :data:`COLLECTIVES`: seconds this process spent inside them over
    ``steps`` profiled steps, and how many ran (XLA:CPU's thunk events): the exchange
    itself plus the wait for the other process."""
    from benchmarks.trace_events import trace_events

    events = trace_events(lambda: [step() for _ in range(steps)])
    out = {}
    for kind, names in COLLECTIVES.items():
        durs = [e["dur"] for e in events if e["name"].startswith(names)]
        out[kind] = (sum(durs) / 1e6, len(durs))
    return out


def _jax_single(a: argparse.Namespace, loss_fn: Any, host: Any, rng: Any) -> dict[str, Any]:
    """Plain ``jax.jit`` on this core: the m microbatches' gradients summed by a scan,
    one SGD step."""
    import jax
    import numpy as np

    @jax.jit
    def step(params, batch):
        def one(acc, mb):
            return jax.tree.map(jax.numpy.add, acc, jax.grad(loss_fn)(params, mb)), None
        zero = jax.tree.map(jax.numpy.zeros_like, params)
        grads, _ = jax.lax.scan(one, zero, batch)
        return jax.tree.map(lambda p, g: p - 1e-3 * g / len(batch["x"]), params, grads)

    out: dict[str, Any] = {}
    for m in a.ms:
        batch = {k: rng.standard_normal((m, a.mb, a.width)).astype(np.float32)
                 for k in ("x", "y")}
        params = jax.device_put(host)

        def run(batch=batch) -> None:
            nonlocal params
            params = jax.block_until_ready(step(params, batch))

        out[f"m={m}"] = _median_time(run, a)
    return out


# -------------------------------------------------------------------------------- main
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(role: str, python: str, a: argparse.Namespace, processes: int) -> dict[str, Any]:
    from benchmarks.cpu_setup import with_flags  # (imports no jax)

    port = _free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), JAX_PLATFORMS="cpu",
               PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
               XLA_FLAGS=with_flags("--xla_force_host_platform_device_count=1"))
    outs = [Path(a.workdir) / f"{role}{r}.json" for r in range(processes)]
    procs = [subprocess.Popen(
        [python, __file__, "--role", role, "--rank", str(r), "--port", str(port),
         "--out", str(outs[r]), "--layers", str(a.layers), "--width", str(a.width),
         "--activation", a.activation, "--mb", str(a.mb), "--ms", ",".join(map(str, a.ms)),
         "--schedules", a.schedules, "--warmup", str(a.warmup), "--repeats", str(a.repeats),
         "--transport-threads", a.transport_threads, "--profile-steps", str(a.profile_steps)],
        env=env, cwd=REPO) for r in range(processes)]
    for p in procs:
        p.wait(timeout=a.timeout)
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{role} workers failed: {[p.returncode for p in procs]}")
    ranks = [json.loads(o.read_text()) for o in outs]
    # a step ends on both ranks; a rank's own figures (".../rank1") come from it alone
    return {k: max(r[k] for r in ranks if k in r) for k in {k for r in ranks for k in r}}


def _summary(res: dict[str, Any], ms: list[int]) -> dict[str, Any]:
    """Per (schedule, m): each framework's step time, speed-up over its one-process run
    and fraction of the ideal 2m/(m+1); jaxpipe / torch."""
    med = res["median_s"]
    out: dict[str, Any] = {}
    for key, t in med["jaxpipe"].items():
        m = int(key.split("m=")[1])
        ideal = 2 * m / (m + 1)
        row: dict[str, Any] = {"ideal": ideal}
        for f in ("jaxpipe", "torch"):
            if f in med and key in med[f]:
                row[f"{f}_s"] = med[f][key]
                single = med.get(f"{f}-single", {}).get(f"m={m}")
                if single:
                    row[f"{f}_fraction_of_ideal"] = single / med[f][key] / ideal
        if "torch_s" in row:
            row["jaxpipe_over_torch"] = t / row["torch_s"]
        out[key] = row
    assert all(f"m={m}" in med["jaxpipe-single"] for m in ms)
    return out


def _exchange_line(runs: list[dict[str, Any]], key: str, step_s: float) -> str:
    """Per rank (medians over the runs): the step's time inside its collective-permutes
    (how many, each) and its all-reduces, against the step (``--profile-steps``)."""
    def med(kind: str, r: int) -> float:
        return statistics.median(x[f"{key}/{kind}/rank{r}"] for x in runs)

    parts = []
    for r in (0, 1):
        t, n = med("permute_s", r), med("permute_n", r)
        parts.append(f"rank {r} {t * 1e3:.1f} ms in {n:.0f} permutes ({t / max(n, 1) * 1e3:.2f}"
                     f" ms each), {med('all_reduce_s', r) * 1e3:.1f} ms in all-reduces: "
                     f"{(t + med('all_reduce_s', r)) / step_s:.0%} of the step")
    return "inside collectives: " + "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", default="main", choices=(
        "main", "torch", "jaxpipe", "torch-single", "jaxpipe-single"))
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--torch-python", default=None,
                    help="a Python interpreter with torch installed (default: skip torch)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--activation", choices=("tanh", "relu"), default="tanh")
    ap.add_argument("--mb", type=int, default=64, help="rows per microbatch")
    ap.add_argument("--ms", type=lambda s: [int(x) for x in s.split(",")], default=[4, 8, 16])
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--transport-threads", choices=("idle", "normal"), default="idle",
                    help="jaxpipe.distributed.initialize's priority for gloo's threads")
    ap.add_argument("--runs", type=int, default=2, help="fresh process pairs; medians")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="after timing, profile this many jaxpipe steps: the time each "
                         "process spends inside collectives (exchange + wait)")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--workdir", default="/tmp/jaxpipe_torch_compare")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from benchmarks.cpu_setup import pin_to_core  # (imports no jax)

    if a.role != "main":
        pin_to_core(a.rank)
        res = (_torch_worker if a.role.startswith("torch") else _jaxpipe_worker)(a)
        Path(a.out).write_text(json.dumps(res))
        return 0
    Path(a.workdir).mkdir(parents=True, exist_ok=True)
    frameworks = {"jaxpipe": sys.executable}
    if a.torch_python:
        frameworks["torch"] = a.torch_python
    runs: dict[str, list[dict[str, Any]]] = {}
    for _ in range(a.runs):
        for f, python in frameworks.items():
            for role, processes in ((f, 2), (f"{f}-single", 1)):
                runs.setdefault(role, []).append(_spawn(role, python, a, processes))
    res: dict[str, Any] = {"config": {k: v for k, v in vars(a).items()
                                      if k not in ("role", "rank", "port")},
                           "runs": runs, "median_s": {}}
    for f, rs in runs.items():
        res["median_s"][f] = {k: statistics.median(r[k] for r in rs) for k in rs[0]
                              if not k.endswith(("/ticks", "/python_s")) and "/rank" not in k}
    python = {k.removesuffix("/python_s"): statistics.median(r[k] for r in runs["jaxpipe"])
              for k in runs["jaxpipe"][0] if k.endswith("/python_s")}
    res["jaxpipe_python_s"] = python  # a step's Python, until train_step returns
    res["summary"] = _summary(res, a.ms)
    for key, row in res["summary"].items():
        line = (f"{key:<18} jaxpipe {row['jaxpipe_s'] * 1e3:8.2f} ms"
                f" (Python {python[key] * 1e3:.2f})")
        if "torch_s" in row:
            line += (f"  torch {row['torch_s'] * 1e3:8.2f} ms"
                     f"  jaxpipe/torch {row['jaxpipe_over_torch']:.2f}")
        line += "  of ideal: " + "  ".join(
            f"{f} {row[f + '_fraction_of_ideal']:.2f}" for f in ("jaxpipe", "torch")
            if f + "_fraction_of_ideal" in row)
        print(line)
        if a.profile_steps:
            print(" " * 19 + _exchange_line(runs["jaxpipe"], key, row["jaxpipe_s"]))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
