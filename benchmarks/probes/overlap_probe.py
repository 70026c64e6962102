"""Does XLA:CPU overlap a ``ppermute`` with independent compute? (2 processes, gloo)

    python -m jaxpipe.launch --nproc 2 benchmarks/probes/overlap_probe.py
    # -> results/overlap_probe.json

Taking transfers off the pipeline's critical path means issuing a tick's
``ppermute`` beside the next tick's compute and reading its result a tick later. That
only pays if the runtime runs the collective concurrently with the compute. This probe
runs T ticks in which the two devices alternate a heavy and a light amount of work
(``heavy`` / ``light`` chained matmuls) and exchange a message every tick:

* ``sync``: compute, then ``ppermute`` the result (what the program does today): every
  tick lasts as long as the heavy device's work, ~T * heavy;
* ``async``: ``ppermute`` the previous tick's message beside this tick's compute, its
  result read next tick: if the collective ran concurrently, devices would drift and a
  tick pair would cost ~heavy + light;
* ``nocomm``: the compute alone (each device's own work, ~T/2 * (heavy + light)).

``async / sync`` near 1 means the collective does not overlap the compute here.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ticks", type=int, default=16)
    ap.add_argument("--heavy", type=int, default=40)
    ap.add_argument("--light", type=int, default=5)
    ap.add_argument("--message", type=int, default=32768, help="floats per message")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxpipe.distributed as jd

    jd.initialize()
    mesh = jax.make_mesh((2,), ("pipe",))
    swap = [(0, 1), (1, 0)]

    def work(w, n):
        return lax.fori_loop(0, n, lambda i, c: jnp.tanh(c @ w), w)

    def program(mode):
        def f(w, x):
            w, x = w[0], x[0]
            d = lax.axis_index("pipe")

            def tick(t, carry):
                w, x, inflight = carry
                n = jnp.where((d + t) % 2 == 0, args.heavy, args.light)
                if mode == "nocomm":
                    return work(w, n), x, inflight
                if mode == "sync":
                    w = work(w, n)
                    return w, lax.ppermute(x + w[0, 0], "pipe", swap), inflight
                recv = lax.ppermute(inflight, "pipe", swap)  # last tick's message
                w = work(w + x[0] * 0, n)
                return w, recv, x + w[0, 0]

            w, x, inflight = lax.fori_loop(0, args.ticks, tick, (w, x, x))
            return w[None], (x + inflight)[None]

        return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("pipe"), P("pipe")),
                                     out_specs=(P("pipe"), P("pipe"))))

    sh = NamedSharding(mesh, P("pipe"))
    w = jax.make_array_from_callback((2, 256, 256), sh,
                                     lambda _: 0.5 * np.eye(256, dtype=np.float32)[None])
    x = jax.make_array_from_callback((2, args.message), sh,
                                     lambda _: np.ones((1, args.message), np.float32))
    times: dict[str, list[float]] = {"nocomm": [], "sync": [], "async": []}
    for _ in range(2):  # two rounds, interleaved, against drift on a shared machine
        for mode in times:
            fn = program(mode)
            jax.block_until_ready(fn(w, x))
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(w, x))
                times[mode].append(time.perf_counter() - t0)
    med = {k: float(np.median(v)) for k, v in times.items()}
    res = {"config": vars(args), "median_s": med, "async_over_sync": med["async"] / med["sync"],
           "nocomm_over_sync": med["nocomm"] / med["sync"]}
    if jax.process_index() == 0:
        print(f"median ms: nocomm {med['nocomm'] * 1e3:.1f}, sync {med['sync'] * 1e3:.1f}, "
              f"async {med['async'] * 1e3:.1f}; async / sync {res['async_over_sync']:.3f} "
              f"(full overlap would approach nocomm / sync {res['nocomm_over_sync']:.3f})")
        from benchmarks import common as C

        C.write_json(args.out, "overlap_probe.json", res)
    return res


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
