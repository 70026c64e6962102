"""What recomputing parameter-derived residuals saves: bf16 compute over f32 weights.

    python benchmarks/probes/param_derived.py [--target tpu:v5e:2x2] [--width 512]

A tanh MLP of ``--layers`` blocks whose matmuls read a bf16 copy of each f32 weight
(flax's ``param_dtype=float32, dtype=bfloat16``), unrolled and scanned, 1F1B over 4
devices (virtual CPU devices, or a compile-only ``--target``). Autodiff keeps the bf16
copies for the backward; jaxpipe's stages recompute them from the weights
(:mod:`jaxpipe.stages.param_derived`) instead of storing one per microbatch in flight.
Prints, per stage, the residual bytes a microbatch stores and the bytes recomputed
instead (``StageFn.derived_avals``), their ratio (what storing them would take / what is
stored), the first device's in-flight residual bytes both ways, and the compiled
program's temp bytes. Writes JSON.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _bytes(avals: list) -> int:
    return sum(a.size * a.dtype.itemsize for a in avals)


def measure(scanned: bool, args: argparse.Namespace, mesh: Any, compile_options: Any
            ) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    import jaxpipe as jp

    L, m, W, rows = args.layers, args.microbatches, args.width, args.rows
    weight = jax.ShapeDtypeStruct((W, W), jnp.float32)
    params = jax.ShapeDtypeStruct((L, W, W), jnp.float32) if scanned else [weight] * L
    batch = {k: jax.ShapeDtypeStruct((rows * m, W), jnp.float32) for k in ("x", "y")}

    def layer(h, w):
        return jp.boundary(jnp.tanh(h @ w.astype(jnp.bfloat16)))

    def loss_fn(p, b):
        h = b["x"].astype(jnp.bfloat16)
        if scanned:
            h, _ = jax.lax.scan(lambda h, w: (layer(h, w), None), h, p)
        else:
            for w in p:
                h = layer(h, w)
        return jnp.mean((h.astype(jnp.float32) - b["y"]) ** 2)

    pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=jp.OneFOneB(4, m),
                       cut="markers")
    stored = [_bytes(st.residual_avals) for st in pipe.inspect.stages]
    derived = [_bytes(st.derived_avals) for st in pipe.inspect.stages]
    in_flight = min(m, 4)  # 1F1B's first device
    ma = pipe.lower("value_and_grad").compile(compile_options).memory_analysis()
    row = {"stack": "scanned" if scanned else "unrolled", "stored_per_microbatch": stored,
           "recomputed_per_microbatch": derived,
           "first_device_in_flight_stored": in_flight * stored[0],
           "first_device_in_flight_if_stored": in_flight * (stored[0] + derived[0]),
           "compiled_temp_bytes": int(ma.temp_size_in_bytes)}
    ratio = (stored[0] + derived[0]) / stored[0]
    print(f"{row['stack']:8s}: per microbatch, stage 0 stores {stored[0] / 2**10:.0f} KiB and "
          f"recomputes {derived[0] / 2**10:.0f} KiB (storing them: {ratio:.2f}x); first device, "
          f"{in_flight} in flight: {row['first_device_in_flight_stored'] / 2**20:.2f} MiB "
          f"instead of {row['first_device_in_flight_if_stored'] / 2**20:.2f} MiB; compiled "
          f"temp {ma.temp_size_in_bytes / 2**20:.2f} MiB", flush=True)
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="a compile-only target, e.g. tpu:v5e:2x2")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--rows", type=int, default=32, help="rows a microbatch")
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "param_derived"))
    args = ap.parse_args(argv)
    if args.target is None:
        from jaxpipe.xla_flags import cpu_devices

        cpu_devices(4)
        import jax

        mesh, options = jax.make_mesh((4,), ("pipe",)), None
    else:
        import jaxpipe.aot

        target = jaxpipe.aot.target(args.target)
        mesh, options = target.mesh((4,), ("pipe",)), target.compiler_options()
    rows = [measure(scanned, args, mesh, options) for scanned in (False, True)]
    sys.path.insert(0, str(REPO))
    from benchmarks.common import write_json

    name = f"param_derived_{args.target.replace(':', '_')}.json" if args.target else \
        "param_derived.json"
    out = {"config": vars(args), "rows": rows}
    write_json(args.out, name, out)
    return out


if __name__ == "__main__":
    main()
