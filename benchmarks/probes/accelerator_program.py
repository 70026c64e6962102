"""The CPU and the accelerator program of one pipeline, side by side, on this machine.

    python benchmarks/probes/accelerator_program.py [--layers 8] [--p 4] [--m 16]

For the GPT benchmark model under 1F1B and Interleaved1F1B (v=2), builds
``SpmdRuntime(backend="cpu")`` and ``SpmdRuntime(backend="gpu")`` and prints, for each:
compile seconds, compiled temp memory, the median step on this backend, the tick loop's
census (whiles of unknown trip count, conditionals, permutes;
``jaxpipe.runtime.spmd.program.hlo_census``) and, for the accelerator program, the bytes
its switch returns per tick (``SpmdExecutor.switch_bytes``). On a CPU the step times say
what the accelerator program costs here, not what it does on a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--m", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    from benchmarks.cpu_setup import with_flags  # (imports no jax)

    os.environ.setdefault("XLA_FLAGS", with_flags(f"--xla_force_host_platform_device_count={a.p}"))
    import jax
    import numpy as np

    import jaxpipe as jp
    from benchmarks import common as C
    from jaxpipe.runtime.spmd import SpmdRuntime
    from jaxpipe.runtime.spmd.program.hlo_census import census

    cfg = C.GPTConfig(n_layers=a.layers)
    params = C.init_params(cfg, jax.random.key(0))
    mesh = jax.make_mesh((a.p,), ("pipe",), devices=jax.devices()[:a.p])
    for sched in (jp.OneFOneB(a.p, a.m), jp.Interleaved1F1B(a.p, a.m, stages_per_device=2)):
        batch = C.make_gpt_batch(cfg, 2 * a.m)
        for backend in ("cpu", "gpu"):
            pipe = jp.pipeline(C.gpt_loss(cfg), params, batch, mesh=mesh, schedule=sched,
                               runtime=SpmdRuntime(backend=backend))
            t0 = time.perf_counter()
            compiled = pipe.inspect.value_and_grad_fn.lower(params, batch).compile()
            compile_s = time.perf_counter() - t0
            found = census(compiled.as_text())
            times = []
            for _ in range(a.repeats):
                t1 = time.perf_counter()
                jax.block_until_ready(compiled(params, batch))
                times.append(time.perf_counter() - t1)
            low = pipe.inspect.executor.lowering
            print(f"{type(sched).__name__:<16} {backend}: compile {compile_s:5.2f} s, temp "
                  f"{compiled.memory_analysis().temp_size_in_bytes / 2**20:5.1f} MiB, step "
                  f"{np.median(times) * 1e3:6.1f} ms, {low.num_ticks} ticks "
                  f"(overlap {'on' if low.exchange.delay == 2 else 'off'}); tick loop: "
                  f"{found.unknown_trip_whiles} unknown-trip whiles, {found.conditionals} "
                  f"conditionals, {found.permutes} permutes "
                  f"({found.permutes_in_conditionals} in conditionals); switch bytes per "
                  f"tick {pipe.inspect.executor.switch_bytes()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
