"""What one collective-permute costs between two gloo processes, pinned or not.

    python benchmarks/probes/permute_cost.py

Two processes, one CPU device each (``jax.distributed``, gloo over loopback), run a
``lax.scan`` of ``--ticks`` iterations; each iteration computes ``--work`` small
matmuls and then, or not, permutes a ``--kib`` KiB message both ways (what the CPU
program does at a tick that carries messages at p=2). The cost of a permute is the time
per iteration with it minus without it. Three placements: every thread of a process
pinned to its own core (what ``benchmarks/sections/concurrency.py`` does), nothing pinned, and
only the compute thread pinned (gloo's event-loop thread, started by
``jax.distributed.initialize``, free to run on any core), and pinned with gloo's event
loop at ``SCHED_IDLE`` (what :func:`jaxpipe.distributed.initialize` does by default: the
loop polls all the time, and at normal priority it takes part of the compute core).
Prints milliseconds per iteration, the median of ``--runs`` fresh process pairs.
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

PLACEMENTS = ("pinned", "unpinned", "compute-pinned", "pinned-idle")


def _worker(a: argparse.Namespace) -> None:
    if a.placement in ("pinned", "pinned-idle"):
        os.sched_setaffinity(0, {a.rank % os.cpu_count()})
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from benchmarks.cpu_setup import with_flags  # (imports no jax)

    os.environ["XLA_FLAGS"] = with_flags("--xla_force_host_platform_device_count=1")
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxpipe import distributed as jpd

    jpd.initialize(f"127.0.0.1:{a.port}", 2, a.rank,
                   transport_threads="idle" if a.placement == "pinned-idle" else "normal")
    if a.placement == "compute-pinned":  # threads started from now on inherit it
        os.sched_setaffinity(0, {a.rank % os.cpu_count()})
    mesh = jax.make_mesh((2,), ("pipe",), devices=jax.devices())
    rows = max(1, a.kib * 1024 // (4 * 128))
    out = {}
    for exchange in (False, True):
        @jax.jit
        @jax.shard_map(mesh=mesh, in_specs=(P("pipe"), P("pipe")), out_specs=P("pipe"))
        def run(x, w, exchange=exchange):
            def tick(y, _):
                for _ in range(a.work):
                    y = jnp.tanh(y @ w[0])
                if exchange:
                    y = lax.ppermute(y, "pipe", [(0, 1), (1, 0)])
                return y, None
            return lax.scan(tick, x, None, length=a.ticks)[0]

        x = jax.make_array_from_callback((2, rows, 128), NamedSharding(mesh, P("pipe")),
                                         lambda _: np.full((1, rows, 128), 0.01, np.float32))
        w = jax.make_array_from_callback((2, 128, 128), NamedSharding(mesh, P("pipe")),
                                         lambda _: np.eye(128, dtype=np.float32)[None])
        jax.block_until_ready(run(x, w))
        times = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(run(x, w))
            times.append((time.perf_counter() - t0) / a.ticks * 1e3)
        out["with_permute" if exchange else "compute_only"] = statistics.median(times)
    if a.rank == 0:
        print(json.dumps(out), flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=("main", "worker"), default="main")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--placement", choices=PLACEMENTS, default="pinned")
    ap.add_argument("--ticks", type=int, default=50)
    ap.add_argument("--work", type=int, default=20, help="128x128 matmuls per tick")
    ap.add_argument("--kib", type=int, default=8, help="message size")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args(argv)
    if a.role == "worker":
        _worker(a)
        return 0
    common = ["--ticks", str(a.ticks), "--work", str(a.work), "--kib", str(a.kib),
              "--repeats", str(a.repeats)]
    print(f"ms per tick ({a.work} matmuls 128x128, a {a.kib} KiB permute both ways), "
          f"median of {a.runs} process pairs")
    for placement in PLACEMENTS:
        runs = []
        for _ in range(a.runs):
            port = _free_port()
            procs = [subprocess.Popen(
                [sys.executable, __file__, "--role", "worker", "--rank", str(r), "--port",
                 str(port), "--placement", placement, *common],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                for r in range(2)]
            out = [p.communicate(timeout=600)[0] for p in procs]
            runs.append(json.loads(out[0].strip().splitlines()[-1]))
        comp = statistics.median(r["compute_only"] for r in runs)
        both = statistics.median(r["with_permute"] for r in runs)
        print(f"{placement:<15} compute only {comp:6.3f}  with permute {both:6.3f}  "
              f"permute {both - comp:6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
