"""Compiled per-device temp memory of GPipe vs 1F1B as m grows (1F1B must stay flat).

    python benchmarks/probes/schedule_memory.py [--out results/schedule_memory.json]

Prints, for m in {8, 32}, the compiled program's ``memory_analysis().temp_size_in_bytes``
and the lowered residual pool per device, and the ratio 1F1B / GPipe.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from jaxpipe.xla_flags import cpu_devices  # (imports no jax)

cpu_devices(4)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxpipe as jp  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--microbatch", type=int, default=16)
    ap.add_argument("--out", default="results/schedule_memory.json")
    args = ap.parse_args(argv)
    W, L, MB = args.width, args.layers, args.microbatch

    def loss_fn(params, b):
        h = b["x"]
        for w in params:
            h = jp.boundary(jnp.tanh(h @ w))
        return jnp.mean((h - b["y"]) ** 2)

    params = [jnp.full((W, W), 0.01) for _ in range(L)]
    mesh = jax.make_mesh((4,), ("pipe",))
    rows = []
    for m in (8, 32):
        batch = {"x": jnp.ones((MB * m, W)), "y": jnp.ones((MB * m, W))}
        for sched in (jp.GPipe(4, m), jp.OneFOneB(4, m)):
            pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=sched, cut="markers")
            ma = pipe.lower("value_and_grad").compile().memory_analysis()
            pool = sum(c.nbytes * n for c, n in pipe.inspect.executor.lowering.slots.items())
            rows.append({"m": m, "schedule": type(sched).__name__,
                         "temp_bytes": int(ma.temp_size_in_bytes), "residual_pool_bytes": pool})
            print(f"m={m:3d} {type(sched).__name__:9s} temp {ma.temp_size_in_bytes / 2**20:7.2f}"
                  f" MiB   residual pool/device {pool / 2**20:6.2f} MiB")
    by = {(r["m"], r["schedule"]): r for r in rows}
    for m in (8, 32):
        ratio = by[(m, "OneFOneB")]["temp_bytes"] / by[(m, "GPipe")]["temp_bytes"]
        print(f"m={m}: 1F1B / GPipe compiled temp bytes = {ratio:.3f}")
    out = {"config": vars(args), "rows": rows}
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
