"""What the CPU program's steps cost beyond compute, with no communication to wait for.

    python benchmarks/probes/step_overhead.py                  # m = 8, 16 (~2 min)
    python benchmarks/probes/step_overhead.py --ms 4,8,16 --repeats 9
    python benchmarks/probes/step_overhead.py --ms 8 --rows 16 --width 1024   # weights dominate
    python benchmarks/probes/step_overhead.py --share-bodies devices  # as across processes

The peer comparison's model (``benchmarks/baselines/torch_pipelining.py``: 8 x 512 tanh
MLP, 64 rows per microbatch, p=2) as one process: two virtual CPU devices sharing one
pinned core, single-threaded XLA. The devices then take turns, so the pipeline's full
step (``train_step``, SGD, as the peer comparison runs it) is the total work of both
devices: the same arithmetic as plain JAX's ``jit`` of ``value_and_grad`` scanned over
the same microbatches plus the same SGD update, and what the pipeline's program adds
(its tick loop, gated branches, buffer reads and writes, the stage's parameters selected
per step, the exchanges between two devices in one process). The batch is placed on the
devices beforehand, and the programs are timed round-robin
(``benchmarks.common.time_interleaved``) so the machine's drift moves them alike.

Prints, per schedule, the step time over plain JAX's and the excess per lowered step:
the part of the two-process step time beyond the ideal that no gloo exchange explains
(see the issue's per-tick analysis and ``benchmarks/probes/permute_cost.py`` for the
exchange itself). ``--share-bodies``: the runtime's option (``"auto"``, in one process
every stage of a device through one shared body; ``"devices"``, what the runtime picks
across processes: one body per chunk, no stage picked per step). Writes
``--out``/step_overhead.json (``_<mode>`` before ``.json`` with ``--share-bodies``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _plain_train(vg: Any, opt: Any, params: Any, batch: Any) -> Any:
    """Plain JAX's full step (value_and_grad, then ``opt``), its state carried between calls."""
    import jax

    from benchmarks import common as C

    step = jax.jit(C.plain_train_step(vg, opt))
    state = [params, opt.init(params)]

    def run() -> Any:
        state[0], state[1], loss = step(state[0], state[1], batch)
        return loss

    return run


def _pipe_train(pipe: Any, state: Any, batch: Any) -> Any:
    """The pipeline's ``train_step``, its state carried between calls (as the peer
    comparison runs it: gradients stay with their stages)."""
    box = [state]

    def run() -> Any:
        box[0], metrics = pipe.train_step(box[0], batch)
        return metrics["loss"]

    return run


def measure(ms: list[int], repeats: int, width: int = 512, layers: int = 8,
            rows: int = 64, share_bodies: str = "auto") -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxpipe as jp
    from benchmarks import common as C
    from jaxpipe.runtime.spmd import SpmdRuntime

    rng = np.random.default_rng(0)
    bound = 1 / np.sqrt(width)  # torch.nn.Linear's default range, as the peer comparison
    host = [{"w": rng.uniform(-bound, bound, (width, width)).astype(np.float32),
             "b": rng.uniform(-bound, bound, (width,)).astype(np.float32)}
            for _ in range(layers)]

    def loss_fn(params, mb):
        h = mb["x"]
        for layer in params:
            h = jp.boundary(jnp.tanh(h @ layer["w"] + layer["b"]))
        return jnp.mean((h - mb["y"]) ** 2)

    mesh = jax.make_mesh((2,), ("pipe",), devices=jax.devices()[:2])
    rows_out = []
    for m in ms:
        batch = {k: rng.standard_normal((m * rows, width)).astype(np.float32)
                 for k in ("x", "y")}
        runs = {"plain": (_plain_train(C.plain_value_and_grad(loss_fn, m), optax.sgd(1e-3),
                                       jax.device_put(host), jax.device_put(batch)), ())}
        steps = {}
        for name, sched in (("gpipe", jp.GPipe(2, m)), ("1f1b", jp.OneFOneB(2, m)),
                            ("interleaved", jp.Interleaved1F1B(2, m, stages_per_device=2))):
            pipe = jp.pipeline(loss_fn, host, batch, mesh=mesh, schedule=sched, cut="auto",
                               runtime=SpmdRuntime(share_bodies=_share(share_bodies)))
            runs[name] = (_pipe_train(pipe, pipe.init(host, optax.sgd(1e-3)),
                                      pipe.inspect.place_batch(batch)), ())
            steps[name] = int(pipe.inspect.executor.lowering.num_steps)
        times = C.time_interleaved(runs, repeats=repeats)
        plain = times["plain"]["median_s"]
        for name, n in steps.items():
            t = times[name]["median_s"]
            row = {"m": m, "schedule": name, "steps": n, "plain_s": plain, "pipeline_s": t,
                   "over_plain": t / plain, "excess_per_step_ms": (t - plain) / n * 1e3}
            rows_out.append(row)
            print(f"m={m:2d} {name:11s} {t * 1e3:7.1f} ms  x{t / plain:.2f} of plain "
                  f"({plain * 1e3:.1f} ms)  {n} steps, {row['excess_per_step_ms']:+.3f} ms "
                  "a step", flush=True)
    return {"model": f"{layers} x {width} tanh MLP, {rows} rows a microbatch, p=2 on one core",
            "repeats": repeats, "share_bodies": share_bodies, "rows": rows_out}


def _share(value: str) -> bool | str:
    return {"true": True, "false": False}.get(value, value)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="8,16", help="microbatch counts")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--rows", type=int, default=64, help="rows a microbatch")
    ap.add_argument("--share-bodies", default="auto", choices=("auto", "devices", "true", "false"),
                    help="SpmdRuntime(share_bodies=...)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "step_overhead"))
    a = ap.parse_args(argv)
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from benchmarks.cpu_setup import single_core_cpu  # (imports no jax)

    single_core_cpu(2)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    res = measure([int(x) for x in a.ms.split(",")], a.repeats, a.width, rows=a.rows,
                  share_bodies=a.share_bodies)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    # (one file per share_bodies mode: the README cites both)
    name = "step_overhead.json" if a.share_bodies == "auto" else \
        f"step_overhead_{a.share_bodies}.json"
    (out / name).write_text(json.dumps(res, indent=1))
    print(f"wrote {out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
