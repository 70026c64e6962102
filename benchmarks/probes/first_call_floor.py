"""How fast can a one-program pipeline compile on XLA:CPU? The floor under the
first-call target, and how far jaxpipe's program is from it.

    python benchmarks/probes/first_call_floor.py              # L=16, m=8, ~1 min
    python benchmarks/probes/first_call_floor.py --layers 32 --variants scanned

The issue's model (first_call.py's tanh MLP: width 64, 8 rows a microbatch, 4 virtual
CPU devices), compiled in one process as:

- ``plain``: ``jit(value_and_grad)`` scanned over the microbatches, one device, XLA's
  default options (what the user compares against);
- ``floor/<gating>``: a pipeline written by hand, as small as one can be: the parameters
  stacked and placed one stage a device, one ``shard_map`` over ``pipe``, a ``fori_loop``
  over 2(m + p - 1) ticks (GPipe order), one forward and one backward step a tick, both
  neighbours' ``ppermute`` every tick, no tables but two columns. ``gating`` is how a
  tick skips a step it does not run: a zero-or-one-trip ``while_loop`` (as jaxpipe's CPU
  program), ``lax.cond``, or ``masked`` (run it always, keep the result with ``where``).
  The forward stores the stage's input and the backward recomputes the stage, except
  ``/stored``: every activation stored, the backward written out by hand (jaxpipe's
  default stores residuals too). ``/staged``: the tick program alone, its parameters
  already placed and its gradients left there (no stacking of the user's leaves, no
  gather of the gradients back to them);
- ``jaxpipe``: ``jp.pipeline(..., schedule=OneFOneB(4, m), cut="markers")``'s
  ``value_and_grad``.

The pipelines compile with jaxpipe's CPU options (``jaxpipe.xla_flags.compiler_options``).
For each: the Python before XLA starts (trace + lower, median of 3 rounds; jaxpipe:
``jp.pipeline`` + ``pipe.lower``), XLA's compile (median of ``--repeats``, compiled
round-robin with caches cleared), their sum against plain's ("sum x": the first call's
share a pipeline controls; ``first_call.py`` times whole first calls), and the kernels XLA
emits (``first_call.xla_trace``). The hand-written pipelines' loss and gradients are
checked against plain's. Single runs move 10-20% on 2 shared cores: compare ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def floor_pipeline(layers: int, m: int, devices: int, gating: str, scanned: bool,
                   stored: bool = False) -> Any:
    """The hand-written pipeline: ``(f, mesh, mapped, stage_inputs)``. ``f(params, batch)
    -> (mean loss, grads)`` takes and returns what ``jax.value_and_grad`` does;
    ``mapped`` is its tick program alone, on ``stage_inputs(params, batch)``: the
    parameters placed a stage a device, the gradients left there (the least any call
    compiles). ``stored``: the forward stores every layer's activation and the backward
    is written out from them (no recomputation, as jaxpipe's default stores residuals);
    otherwise it stores the stage's input and recomputes the stage under ``jax.vjp``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import PartitionSpec as P

    D, K, T = devices, layers // devices, 2 * (m + devices - 1)
    # GPipe: microbatch i's forward on device d at tick i + d, its backward after every
    # forward, last stage first
    ftab, btab = np.full((T, D), -1, np.int32), np.full((T, D), -1, np.int32)
    for d in range(D):
        for i in range(m):
            ftab[i + d, d] = i
            btab[m + D - 1 + (D - 1 - d) + i, d] = i
    mesh = jax.make_mesh((D,), ("pipe",))

    def stage(ws, h):
        if scanned:
            return lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, ws)[0]
        for w in ws:
            h = jnp.tanh(h @ w)
        return h

    def activations(ws, h):  # the stage's input and every layer's output
        if scanned:
            ys = lax.scan(lambda h, w: (jnp.tanh(h @ w), jnp.tanh(h @ w)), h, ws)[1]
            return jnp.concatenate([h[None], ys])
        acts = [h]
        for w in ws:
            acts.append(jnp.tanh(acts[-1] @ w))
        return tuple(acts)  # kept apart: slicing one stack at K offsets is K kernels

    def backward(ws, acts, g):  # tanh(x @ w) by hand, from the stored activations
        def layer(g, w, x, y):
            g = g * (1 - y * y)
            return g @ w.T, x.T @ g
        if scanned:
            g, gw = lax.scan(lambda g, wxy: layer(g, *wxy), g, (ws, acts[:-1], acts[1:]),
                             reverse=True)
            return gw, g
        gw = [None] * K
        for k in reversed(range(K)):
            g, gw[k] = layer(g, ws[k], acts[k], acts[k + 1])
        return tuple(gw), g

    def step_if(pred, fn, x, *args):
        if gating == "cond":
            return lax.cond(pred, fn, lambda x, *a: x, x, *args)
        if gating == "masked":
            return jax.tree.map(lambda a, b: jnp.where(pred, a, b), fn(x, *args), x)

        def body(c):  # "while": zero or one trip, the carry updated in place
            i, x = c
            i, a = lax.optimization_barrier((i, args))
            return i + 1, fn(x, *a)
        return lax.while_loop(lambda c: c[0] < pred.astype(jnp.int32), body,
                              (jnp.int32(0), x))[1]

    def per_device(ws, xs, ys):
        ws, d = jax.tree.map(lambda w: w[0], ws), lax.axis_index("pipe")
        last = d == D - 1
        ft, bt = jnp.asarray(ftab)[:, d], jnp.asarray(btab)[:, d]
        zeros = jnp.zeros(xs.shape[1:], xs.dtype)

        def mse(h, i):
            return jnp.mean((h - ys[i]) ** 2)

        def fwd(st, i, inbox):
            store, _, loss = st
            x = jnp.where(d == 0, xs[i], inbox)
            keep = activations(ws, x) if stored else x
            h = (keep[-1] if stored else stage(ws, x))
            loss = loss + jnp.where(last, mse(h, i), 0.0)
            store = jax.tree.map(lambda b, v: lax.dynamic_update_index_in_dim(b, v, i, 0),
                                 store, keep)
            return store, h, loss

        def bwd(st, i, inbox, store):
            gw, _ = st
            kept = jax.tree.map(lambda b: b[i], store)
            if stored:
                h = kept[-1]
                g, gx = backward(ws, kept, jnp.where(last, jax.grad(mse)(h, i), inbox))
            else:
                h, vjp = jax.vjp(stage, ws, kept)
                g, gx = vjp(jnp.where(last, jax.grad(mse)(h, i), inbox))
            return jax.tree.map(jnp.add, gw, g), gx

        def tick(t, c):
            store, in_f, in_b, gw, loss = c
            store, out_f, loss = step_if(ft[t] >= 0, fwd, (store, zeros, loss), ft[t], in_f)
            gw, out_b = step_if(bt[t] >= 0, bwd, (gw, zeros), bt[t], in_b, store)
            in_f = lax.ppermute(out_f, "pipe", [(i, i + 1) for i in range(D - 1)])
            in_b = lax.ppermute(out_b, "pipe", [(i + 1, i) for i in range(D - 1)])
            return store, in_f, in_b, gw, loss

        unit = jnp.zeros((m, *xs.shape[1:]), xs.dtype)
        store = (unit if not stored else
                 jnp.zeros((m, K + 1, *xs.shape[1:]), xs.dtype) if scanned else
                 (unit,) * (K + 1))
        init = (store, zeros, zeros,
                jax.tree.map(jnp.zeros_like, ws), jnp.float32(0))
        _, _, _, gw, loss = lax.fori_loop(0, T, tick, init)
        return lax.psum(loss, "pipe") / m, jax.tree.map(lambda g: (g / m)[None], gw)

    mapped = jax.shard_map(per_device, mesh=mesh, in_specs=(P("pipe"), P(), P()),
                           out_specs=(P(), P("pipe")), check_vma=False)

    # scanned: the [L, ...] stack as [D, K, ...], a stage's layers on each device;
    # unrolled: K arrays [D, ...], array k holding every stage's k-th layer, so a device
    # reads a layer without slicing (each slice offset would be a kernel of its own)
    def stage_inputs(params, batch):
        ws = (params.reshape(D, K, *params.shape[1:]) if scanned else
              tuple(jnp.stack(params[k::K]) for k in range(K)))
        ws = jax.sharding.reshard(ws, P("pipe"))
        return ws, *(batch[k].reshape(m, -1, batch[k].shape[-1]) for k in ("x", "y"))

    def f(params, batch):
        loss, g = mapped(*stage_inputs(params, batch))
        g = jax.sharding.reshard(g, P())
        if scanned:
            return loss, g.reshape(params.shape)
        return loss, [g[k][d] for d in range(D) for k in range(K)]

    return f, mesh, mapped, stage_inputs


#: the hand-written pipelines: how a tick skips a step, and "/stored" for the forward
#: storing every activation (jaxpipe's default keeps residuals) rather than recomputing
FLOORS = ("while", "cond", "masked", "while/stored")


def measure(layers: int, m: int, scanned: bool, repeats: int) -> dict[str, Any]:
    import jax
    import numpy as np

    import jaxpipe as jp
    import jaxpipe.api.pipeline  # noqa: F401  (imported before any clock starts)
    import jaxpipe.runtime.spmd  # noqa: F401
    from benchmarks import common as C
    from benchmarks.probes.first_call import model, xla_trace
    from jaxpipe.xla_flags import compiler_options

    params, batch, loss_fn = model(layers, m, scanned)
    opts = compiler_options("cpu") or {}
    mesh = jax.make_mesh((4,), ("pipe",))
    plain_vg = C.plain_value_and_grad(loss_fn, m)
    floors = {name: floor_pipeline(layers, m, 4, name.split("/")[0], scanned,
                                   stored=name.endswith("/stored"))
              for name in FLOORS}

    def lower_all() -> dict[str, tuple[float, Any, dict]]:
        out: dict[str, tuple[float, Any, dict]] = {}
        t0 = time.perf_counter()
        lowered = jax.jit(plain_vg).lower(params, batch)
        out["plain"] = (time.perf_counter() - t0, lowered, {})
        for name, (f, fmesh, mapped, stage_inputs) in floors.items():
            with jax.set_mesh(fmesh):
                t0 = time.perf_counter()
                lowered = jax.jit(f).lower(params, batch)
                out[f"floor/{name}"] = (time.perf_counter() - t0, lowered, opts)
                if name.startswith("while"):
                    staged = jax.jit(stage_inputs)(params, batch)
                    t0 = time.perf_counter()
                    lowered = jax.jit(mapped).lower(*staged)
                    out[f"floor/{name}/staged"] = (time.perf_counter() - t0, lowered, opts)
        t0 = time.perf_counter()
        pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=jp.OneFOneB(4, m),
                           cut="markers")
        lowered = pipe.lower("value_and_grad")
        out["jaxpipe"] = (time.perf_counter() - t0, lowered, opts)
        return out

    # every program's Python after JAX's own first-use costs (the first round), then
    # rounds that trace and lower each again (caches cleared): the median of each
    lower_all()
    rounds = []
    for _ in range(3):
        jax.clear_caches()
        rounds.append(lower_all())
    programs = rounds[-1]
    python = {name: statistics.median(r[name][0] for r in rounds) for name in programs}
    want = jax.jit(plain_vg)(params, batch)
    for name, (f, fmesh, _, _) in floors.items():
        with jax.set_mesh(fmesh):
            got = jax.jit(f)(params, batch)
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-4, atol=2e-6,
                                       err_msg=f"floor/{name}")

    # compiles round-robin, so the machine's drift spreads over every program alike
    times: dict[str, list[float]] = {name: [] for name in programs}
    for _ in range(repeats):
        for name, (_, lowered, o) in programs.items():
            jax.clear_caches()
            t0 = time.perf_counter()
            lowered.compile(o)
            times[name].append(time.perf_counter() - t0)
    rows = []
    for name, (_, lowered, o) in programs.items():
        jax.clear_caches()
        kernels = xla_trace(_with_options(lowered, o))["num_kernels"]
        rows.append({"program": name, "python_s": python[name],
                     "xla_s": statistics.median(times[name]), "kernels": kernels})
    base = rows[0]["python_s"] + rows[0]["xla_s"]
    for r in rows:
        r["ratio"] = (r["python_s"] + r["xla_s"]) / base
        r["xla_ratio"] = r["xla_s"] / rows[0]["xla_s"]
    return {"variant": "scanned" if scanned else "unrolled", "layers": layers,
            "microbatches": m, "rows": rows}


class _with_options:
    """``lowered`` whose ``compile()`` passes ``options`` (for :func:`xla_trace`)."""

    def __init__(self, lowered: Any, options: dict) -> None:
        self.lowered, self.options = lowered, options

    def compile(self) -> Any:
        return self.lowered.compile(self.options)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--variants", default="unrolled,scanned")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/first_call"))
    args = ap.parse_args()
    from jaxpipe.xla_flags import cpu_devices, cpu_unless_attached

    cpu_unless_attached()
    cpu_devices(4)
    results = [measure(args.layers, args.m, v == "scanned", args.repeats)
               for v in args.variants.split(",")]
    print(f"{'variant':9} {'program':26} {'python s':>9} {'XLA s':>7} {'kernels':>7} "
          f"{'XLA x':>6} {'sum x':>6}")
    for res in results:
        for r in res["rows"]:
            print(f"{res['variant']:9} {r['program']:26} {r['python_s']:9.3f} "
                  f"{r['xla_s']:7.3f} {r['kernels']:7d} {r['xla_ratio']:6.2f} "
                  f"{r['ratio']:6.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "first_call_floor.json").write_text(json.dumps(
        {"model": "tanh MLP width 64, p=4", "target_ratio": 1.3, "results": results},
        indent=1))
    print(f"wrote {out / 'first_call_floor.json'}")


if __name__ == "__main__":
    main()
