"""Memory balance by placement: uniform vs compute-balanced vs memory-balanced cuts.

    python benchmarks/probes/memory_balance.py                 # p=4, 1F1B, m=16 (~80 s on CPU)
    python benchmarks/probes/memory_balance.py --layers 24 --slack 0.25 --out /tmp/mb

Under 1F1B, stage ``i`` of ``p`` keeps up to ``min(m, p - i)`` microbatches of
residuals alive, so the first device holds ``p`` times the activations of the last.
A GPT-like model makes it worse in another way: the first stage carries the token
embedding and the last the output head, so a *compute*-balanced cut gives the last
stage few blocks (the head is expensive) and piles blocks, and their in-flight
residuals, onto the early stages. BPipe (ICML'23) answers this by evicting
activations between paired stages; jaxpipe's cutter instead moves the stage
boundaries (``jp.Cut(objective="memory", remat="none")``), with no extra transfers.

For each cut this script prints, per device, the cutter's predicted bytes (params,
grads, Adam state, residuals in flight, transfer buffers, workspace), the padded
bytes the cutter predicts the SPMD runtime allocates (every device gets buffers of
one shape), the lowered program's own buffers (``Pipeline.plan.buffer_bytes``), the
compiled train step's ``memory_analysis()`` (one SPMD program, so the same on every
device) and the predicted step time from simulating the schedule with the stage
costs. It writes
``memory_balance.json`` and ``memory_balance.png`` to ``--out``.

Cuts compared (stage boundaries count whole blocks; the embedding rides with the
first block, the head with the last):

* ``uniform``: the same number of blocks on every stage.
* ``time``: ``jp.Cut()`` -- minimise the slowest stage.
* ``memory``: ``jp.Cut(objective="memory", time_slack=s, remat="none")`` -- minimise
  peak memory by placement alone among cuts at most ``s`` slower than the fastest
  (``--slack``, default 10%; ``--slack2 0.25`` adds a second one).
* ``memory+remat``: the same with ``remat="auto"`` (the default): recomputation chosen
  per stage together with the cut, within the same slack.
"""

from __future__ import annotations

import os
import sys


def _force_cpu_devices(argv: list[str]) -> None:
    """Ask XLA for enough virtual CPU devices; must run before jax is imported."""
    n = 4
    for i, a in enumerate(argv):
        if a == "--devices" and i + 1 < len(argv):
            n = int(argv[i + 1])
        elif a.startswith("--devices="):
            n = int(a.split("=", 1)[1])
    from jaxpipe.xla_flags import cpu_devices  # (imports no jax)

    cpu_devices(n)


if __name__ == "__main__":
    _force_cpu_devices(sys.argv[1:])

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jaxpipe as jp  # noqa: E402
from jaxpipe.cut import Cut, CutResult, choose_cuts  # noqa: E402
from jaxpipe.cut.cost import segment_costs  # noqa: E402
from jaxpipe.jaxpr.trace import microbatch_like, trace  # noqa: E402

MiB = 2**20

# ----------------------------------------------------------------------------- model


def _layernorm(x: jax.Array) -> jax.Array:
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), -1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5)


def _block(p: dict[str, jax.Array], h: jax.Array, n_heads: int) -> jax.Array:
    """Pre-LN decoder block: causal self-attention + GELU MLP."""
    b, s, d = h.shape
    dh = d // n_heads
    q, k, v = jnp.split(_layernorm(h) @ p["wqkv"], 3, axis=-1)
    q, k, v = (t.reshape(b, s, n_heads, dh) for t in (q, k, v))
    att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(dh)
    att = jnp.where(jnp.tril(jnp.ones((s, s), bool)), att, jnp.finfo(att.dtype).min)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att, axis=-1), v).reshape(b, s, d)
    h = h + out @ p["wo"]
    return h + jax.nn.gelu(_layernorm(h) @ p["w1"]) @ p["w2"]


def make_loss(n_heads: int):
    """GPT-like next-token loss: embedding, blocks (a cut marker after each), head."""

    def loss_fn(params: dict[str, Any], batch: dict[str, jax.Array]) -> jax.Array:
        h = params["embed"][batch["x"]] + params["pos"]
        blocks = params["blocks"]
        for i, bp in enumerate(blocks):
            h = _block(bp, h, n_heads)
            if i < len(blocks) - 1:
                h = jp.boundary(h, name=f"block{i}")
        logits = _layernorm(h) @ params["head"]
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, batch["y"][..., None], axis=-1))

    return loss_fn


def make_params(args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    d, f = args.d_model, 4 * args.d_model

    def w(*shape: int) -> jax.Array:
        return jnp.asarray(rng.normal(size=shape) / math.sqrt(shape[0]), jnp.float32)

    return {
        "embed": w(args.vocab, d) * 0.02 * math.sqrt(args.vocab),
        "pos": w(args.seq, d) * 0.02 * math.sqrt(args.seq),
        "head": w(d, args.vocab),
        "blocks": [{"wqkv": w(d, 3 * d), "wo": w(d, d), "w1": w(d, f), "w2": w(f, d)}
                   for _ in range(args.layers)],
    }


# ----------------------------------------------------------------------------- measure


def compiled_memory(pipe: jp.Pipeline, params: Any, batch: Any) -> dict[str, int]:
    """Per-device bytes of the compiled optax (Adam) train step, from memory_analysis()."""
    state = pipe.init(params, optax.adam(1e-3))
    compiled = jax.jit(pipe.train_step, donate_argnums=0).lower(state, batch).compile()
    ma = compiled.memory_analysis()
    arg, out = int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes)
    temp, alias = int(ma.temp_size_in_bytes), int(ma.alias_size_in_bytes)
    return {"argument_bytes": arg, "output_bytes": out, "temp_bytes": temp,
            "alias_bytes": alias, "total_bytes": arg + out + temp - alias}


def summarize(name: str, res: CutResult) -> dict[str, Any]:
    blocks = []
    for a, b in res.stage_segments:
        blocks.append(b - a)
    return {
        "name": name,
        "cuts": list(res.cuts),
        "blocks_per_stage": blocks,
        "remat": [str(p.value) for p in res.remat],
        "in_flight": list(res.in_flight),
        "stage_time_flops": list(res.stage_time),
        "predicted_makespan_flops": res.makespan,
        "predicted_bubble": res.bubble_fraction,
        "predicted_device_bytes": [asdict(m) | {"total": m.total} for m in res.device_memory],
        "predicted_max_device_bytes": res.max_device_memory,
        "predicted_padded_bytes": asdict(res.padded_memory) | {
            "total": res.padded_memory.total},
    }


def plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = ["params", "grads", "optimizer", "residuals", "transfers", "workspace"]
    colors = ["#4C72B0", "#8172B2", "#64B5CD", "#DD8452", "#937860", "#CCB974"]
    p = len(results[0]["predicted_device_bytes"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8),
                                   gridspec_kw={"width_ratios": [2.2, 1]})
    width = 0.8 / p
    for c, r in enumerate(results):
        for d, dev in enumerate(r["predicted_device_bytes"]):
            x = c + (d - (p - 1) / 2) * width
            bottom = 0.0
            for kind, color in zip(kinds, colors, strict=True):
                ax1.bar(x, dev[kind] / MiB, width * 0.9, bottom=bottom, color=color,
                        label=kind if c == 0 and d == 0 else None)
                bottom += dev[kind] / MiB
            ax1.text(x, bottom, str(d), ha="center", va="bottom", fontsize=7)
    ax1.set_xticks(range(len(results)),
                   [f"{r['name']}\n{r['blocks_per_stage']}" for r in results], fontsize=8)
    ax1.set_ylabel("MiB per device (predicted, own stages)")
    ax1.set_title("Predicted bytes each device needs (bars = devices 0..p-1)", fontsize=10)
    ax1.legend(fontsize=8)

    x = np.arange(len(results))
    pad = [r["predicted_padded_bytes"]["total"] / MiB for r in results]
    bufs = [r["runtime_buffer_bytes"] / MiB for r in results]
    comp = [r["compiled"]["total_bytes"] / MiB for r in results]
    ax2.bar(x - 0.27, pad, 0.27, label="predicted (SPMD padded)", color="#4C72B0")
    ax2.bar(x, bufs, 0.27, label="lowered buffers (plan)", color="#55A868")
    ax2.bar(x + 0.27, comp, 0.27, label="compiled memory_analysis", color="#DD8452")
    for i, r in enumerate(results):
        ax2.text(i, max(pad[i], comp[i], bufs[i]) * 1.02,
                 f"t={r['predicted_makespan_flops'] / results[0]['predicted_makespan_flops']:.2f}x",
                 ha="center", fontsize=8)
    ax2.set_xticks(x, [r["name"] for r in results], fontsize=8)
    ax2.set_ylabel("MiB per device")
    ax2.set_title("Per device; t = step time vs uniform", fontsize=10)
    ax2.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=4, help="pipeline devices p")
    ap.add_argument("--microbatches", type=int, default=16, help="m")
    ap.add_argument("--microbatch-size", type=int, default=2)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--slack", type=float, default=0.10)
    ap.add_argument("--slack2", type=float, default=-1.0,
                    help="also run a second memory cut with this slack (<0: skip)")
    ap.add_argument("--no-compile", action="store_true", help="predictions only")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    p, m = args.devices, args.microbatches
    if args.layers % p:
        ap.error(f"--layers {args.layers} must be divisible by --devices {p} for the uniform cut")

    params = make_params(args)
    n = m * args.microbatch_size
    ids = np.random.default_rng(1).integers(0, args.vocab, size=(n, args.seq + 1))
    batch = {"x": jnp.asarray(ids[:, :-1], jnp.int32), "y": jnp.asarray(ids[:, 1:], jnp.int32)}
    loss_fn = make_loss(args.heads)
    schedule = jp.OneFOneB(p, m)
    mesh = jax.make_mesh((p,), ("pipe",))

    t0 = time.perf_counter()
    costs = segment_costs(trace(loss_fn, params, microbatch_like(batch, m)))
    print(f"cost model: {len(costs)} segments in {time.perf_counter() - t0:.1f}s; "
          f"block fwd {costs[1].flops / 1e6:.0f} MFLOP, head segment "
          f"{costs[-1].flops / 1e6:.0f} MFLOP; residuals/block/mb "
          f"{costs[1].residual_bytes / MiB:.2f} MiB; params/block "
          f"{costs[1].param_bytes / MiB:.2f} MiB, embedding {costs[0].param_bytes / MiB:.2f} MiB")

    per = args.layers // p
    cuts = {
        "uniform": Cut(indices=[per * i - 1 for i in range(1, p)]),
        "time": Cut(),
        f"memory ({args.slack:.0%})": Cut(objective="memory", time_slack=args.slack,
                                          remat="none"),
    }
    if args.slack2 >= 0:
        cuts[f"memory ({args.slack2:.0%})"] = Cut(objective="memory", time_slack=args.slack2,
                                                  remat="none")
    cuts[f"mem+remat ({args.slack:.0%})"] = Cut(objective="memory", time_slack=args.slack)

    results = []
    for name, cut in cuts.items():
        res = choose_cuts(costs, schedule, cut)
        row = summarize(name, res)
        if not args.no_compile:
            t0 = time.perf_counter()
            pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=schedule,
                               cut=Cut(indices=res.cuts, remat=res.remat))
            row["compiled"] = compiled_memory(pipe, params, batch)
            # what the lowered program's own buffers add up to (Pipeline.plan)
            row["runtime_buffer_bytes"] = pipe.plan.buffer_bytes
            row["compile_s"] = time.perf_counter() - t0
        results.append(row)

    base = results[0]
    header = (f"{'cut':<16} {'blocks/stage':<16} {'pred. own per device (MiB)':<30} "
              f"{'pred max':>8} {'pred pad':>8} {'buffers':>8} {'compiled':>8} {'step t':>7}"
              f"  remat")
    print(f"\np={p} 1F1B m={m}, {args.layers} blocks, d={args.d_model}, seq={args.seq}, "
          f"vocab={args.vocab}, Adam; bytes per device")
    print(header)
    print("-" * len(header))
    for r in results:
        own = " ".join(f"{d['total'] / MiB:6.1f}" for d in r["predicted_device_bytes"])
        comp = r.get("compiled", {}).get("total_bytes", float("nan")) / MiB
        bufs = r.get("runtime_buffer_bytes", float("nan")) / MiB
        t_rel = r["predicted_makespan_flops"] / base["predicted_makespan_flops"]
        print(f"{r['name']:<16} {str(r['blocks_per_stage']):<16} {own:<30} "
              f"{r['predicted_max_device_bytes'] / MiB:8.1f} "
              f"{r['predicted_padded_bytes']['total'] / MiB:8.1f} {bufs:8.1f} {comp:8.1f} "
              f"{t_rel:6.2f}x  {','.join(r['remat'])}")

    summary: dict[str, Any] = {}
    for r in results[1:]:
        key = r["name"]
        summary[key] = {
            "max_device_memory_vs_uniform": r["predicted_max_device_bytes"]
            / base["predicted_max_device_bytes"],
            "padded_memory_vs_uniform": r["predicted_padded_bytes"]["total"]
            / base["predicted_padded_bytes"]["total"],
            "step_time_vs_uniform": r["predicted_makespan_flops"]
            / base["predicted_makespan_flops"],
        }
        if "compiled" in r:
            summary[key]["compiled_vs_uniform"] = (
                r["compiled"]["total_bytes"] / base["compiled"]["total_bytes"])
    print("\nratios vs uniform (memory: <1 is better; step time: <1 is faster)")
    for key, s in summary.items():
        print(f"  {key:<16} " + "  ".join(f"{k}={v:.3f}" for k, v in s.items()))
    if "compiled" in base:
        print("\ncompiled vs predicted (SPMD padded): "
              + ", ".join(f"{r['name']}: {r['compiled']['total_bytes'] / r['predicted_padded_bytes']['total']:.2f}x"  # noqa: E501
                          for r in results)
              + "\n(compiled includes XLA temporaries and pool padding beyond the modelled"
              " buffers; see runtime_buffer_bytes)")

    os.makedirs(args.out, exist_ok=True)
    report = {"config": vars(args), "devices": p, "microbatches": m, "results": results,
              "summary": summary, "command": "python benchmarks/probes/memory_balance.py "
              + " ".join(argv if argv is not None else sys.argv[1:])}
    json_path = os.path.join(args.out, "memory_balance.json")
    with open(json_path, "w") as f:
        json.dump(report, f, indent=2)
    if not args.no_compile:
        plot(results, os.path.join(args.out, "memory_balance.png"))
    print(f"\nwrote {json_path}" + ("" if args.no_compile else " and memory_balance.png"))
    return report


if __name__ == "__main__":
    main()
