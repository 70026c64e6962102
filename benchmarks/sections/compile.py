"""Compile time as a user feels it, against plain JAX, unrolled and scanned layer stacks.

    python benchmarks/sections/compile.py                    # full grid (long: tens of minutes)
    python benchmarks/sections/compile.py --layers 8,32 --ps 2,4 --vs 1
    python benchmarks/sections/compile.py --quick            # one tiny point
    python benchmarks/sections/compile.py --layers 64 --ps 8 --vs 1 --variants scanned --repeats 3

*Compile time* = (pipeline construction + first call) - a steady call, for
``Pipeline.value_and_grad`` (1F1B or Interleaved1F1B, m = 2p, ``cut="markers"``, one
``jp.boundary`` per block), and first call - steady call for plain JAX
``jit(value_and_grad)`` scanned over the same microbatches of the same model. Tiny GPT
blocks (d_model 64, seq 16) so compile time, not arithmetic, dominates.

Two ways to write the model: *unrolled* (a Python loop over a list of blocks) and
*scanned* (the blocks' parameters stacked, one ``lax.scan`` whose body holds the
boundary). A scanned point records the error when the pipeline refuses a scanned stack.

The breakdown comes from ``jax.monitoring`` duration events (tracing to jaxpr, lowering
to StableHLO, XLA backend compile) plus the Python time of ``jp.pipeline`` itself
(tracing, costing, cutting, lowering the schedule).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

_EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "xla_s",
}


class _Events:
    """Sums jax.monitoring compile-duration events between ``reset`` calls."""

    def __init__(self) -> None:
        import jax

        self.sums: dict[str, float] = defaultdict(float)
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event: str, duration: float, **_: Any) -> None:
        if event in _EVENTS:
            self.sums[_EVENTS[event]] += duration

    def take(self) -> dict[str, float]:
        out = {k: self.sums.get(k, 0.0) for k in _EVENTS.values()}
        self.sums.clear()
        return out


def _model(layers: int, scanned: bool) -> tuple[Any, Any, Any]:
    import jax

    from benchmarks import common as C

    cfg = C.GPTConfig(d_model=64, n_heads=4, n_layers=layers, seq=16, vocab=256)
    params = C.init_params(cfg, jax.random.key(0))
    if scanned:
        params = C.stack_blocks(params)
    return C.gpt_loss(cfg, scanned=scanned), params, cfg


def _opt() -> Any:
    """The optimizer of the train-step measurement."""
    import optax

    return optax.adamw(1e-3)


def _wall(fn: Any, *args: Any) -> tuple[Any, float]:
    import jax

    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - t0


def _plain(loss_fn: Any, params: Any, batch: Any, m: int, ev: _Events,
           train: bool = False) -> dict[str, Any]:
    import jax

    from benchmarks import common as C

    f = jax.jit(C.plain_value_and_grad(loss_fn, m))
    ev.take()
    _, first = _wall(f, params, batch)
    parts = ev.take()
    _, steady = _wall(f, params, batch)
    out = {"compile_s": first - steady, "steady_s": steady, **parts}
    if train:
        opt = _opt()
        step = jax.jit(C.plain_train_step(C.plain_value_and_grad(loss_fn, m), opt))
        t0 = time.perf_counter()
        state = opt.init(params)
        p1, o1, _ = jax.block_until_ready(step(params, state, batch))
        first = time.perf_counter() - t0
        _, steady = _wall(step, p1, o1, batch)
        out["train_compile_s"] = first - steady
    return out


def _jaxpipe(loss_fn: Any, params: Any, batch: Any, p: int, v: int, m: int, ev: _Events,
             layers: int = 0, remat: str = "none", fuse_fb: bool | str = "auto",
             train: bool = False) -> dict[str, Any]:
    import jax

    import jaxpipe as jp
    from jaxpipe.cut.resolve import even_cuts
    from jaxpipe.runtime.spmd import SpmdRuntime

    mesh = jax.make_mesh((p,), ("pipe",), devices=jax.devices()[:p])
    sched = (jp.OneFOneB(p, m) if v == 1
             else jp.Interleaved1F1B(p, m, stages_per_device=v))
    # one marker per block (unrolled or scanned): layers + 1 segments, grouped as
    # cut="markers" groups them, under the recomputation policy asked for
    cut = ("markers" if remat == "none"
           else jp.Cut(indices=even_cuts(layers + 1, sched.num_stages), remat=remat))
    ev.take()
    t0 = time.perf_counter()
    pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=sched, cut=cut,
                       runtime=SpmdRuntime(fuse_fb=fuse_fb))
    build = time.perf_counter() - t0
    build_parts = ev.take()
    _, first = _wall(pipe.value_and_grad, params, batch)
    parts = ev.take()
    _, steady = _wall(pipe.value_and_grad, params, batch)
    out = {"compile_s": build + first - steady, "pipeline_s": build,
           "pipeline_trace_s": build_parts["trace_s"], "steady_s": steady, **parts}
    if train:  # init + first train_step - a steady train_step (the pipeline is built)
        t0 = time.perf_counter()
        state, _ = jax.block_until_ready(pipe.train_step(pipe.init(params, _opt()), batch))
        first = time.perf_counter() - t0
        _, steady = _wall(pipe.train_step, state, batch)
        out["train_compile_s"] = first - steady
    return out


def measure(layers: list[int], ps: list[int], vs: list[int], variants: list[str],
            remat: str = "none", fuse_fb: bool | str = "auto", train: bool = False,
            repeats: int = 1) -> dict[str, Any]:
    """Compile seconds per point; ``train``: also ``pipe.init`` + the first
    ``train_step`` (adamw) against plain JAX's jitted value_and_grad + optax update.

    ``repeats`` > 1: plain JAX and jaxpipe are compiled afresh one after the other that
    many times per point; the row keeps the median sample of each and the
    median of the per-repeat ratios, so a machine whose speed drifts over minutes (5-20%
    here) moves both sides of a ratio alike."""
    import statistics

    ev = _Events()
    rows = []
    plain_cache: dict[tuple, dict] = {}
    for variant, L, p, v, m, loss_fn, params, batch in _points(layers, ps, vs, variants):
        row: dict[str, Any] = {"variant": variant, "layers": L, "p": p, "v": v, "m": m,
                               "repeats": repeats}
        key = (variant, L, m)
        plain, piped = [], []
        for _ in range(repeats):  # fresh functions each time: compiled afresh
            if repeats > 1 or key not in plain_cache:  # in turn with jaxpipe if repeated
                plain_cache[key] = _plain(loss_fn, params, batch, m, ev, train)
            plain.append(plain_cache[key])
            try:
                piped.append(_jaxpipe(loss_fn, params, batch, p, v, m, ev, L, remat,
                                      fuse_fb, train))
            except Exception as e:  # noqa: BLE001 - recorded, e.g. a refused scan
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                break
        row["plain"] = _median(plain)
        row["jaxpipe"] = None if "error" in row else _median(piped)
        row["ratios"] = [j["compile_s"] / q["compile_s"]  # (none after an error)
                         for q, j in zip(plain, piped, strict=False)]
        row["ratio"] = statistics.median(row["ratios"]) if row["jaxpipe"] else None
        if train and row["jaxpipe"]:
            row["train_ratio"] = statistics.median(
                j["train_compile_s"] / q["train_compile_s"]
                for q, j in zip(plain, piped, strict=True))
        _log(row)
        rows.append(row)
    return {"rows": rows, "remat": remat, "fuse_fb": fuse_fb, "repeats": repeats,
            "targets": {"unrolled_ratio": 1.5, "scanned_ratio": 2.0,
                        "scanned_L64_over_L8": 1.2}}


def _points(layers: list[int], ps: list[int], vs: list[int], variants: list[str]
            ) -> Iterator[tuple]:
    """``(variant, L, p, v, m, loss_fn, params, batch)`` of every point of the grid."""
    from benchmarks import common as C

    for variant in variants:
        for L in layers:
            loss_fn, params, cfg = _model(L, variant == "scanned")
            for v in vs:
                for p in ps:
                    if L >= p * v:
                        m = 2 * p
                        yield variant, L, p, v, m, loss_fn, params, C.make_gpt_batch(cfg, 4 * m)


def _median(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The sample of median compile time (an odd count: the middle one)."""
    ranked = sorted(samples, key=lambda s: s["compile_s"])
    return ranked[(len(ranked) - 1) // 2]


def _log(row: dict[str, Any]) -> None:
    jp_ = row.get("jaxpipe") or {}
    print(f"{row['variant']:8s} L={row['layers']:3d} p={row['p']} v={row['v']}: "
          f"jaxpipe {jp_.get('compile_s', float('nan')):6.1f}s "
          f"(pipeline {jp_.get('pipeline_s', float('nan')):5.1f}s, "
          f"xla {jp_.get('xla_s', float('nan')):5.1f}s) "
          f"plain {row['plain']['compile_s']:5.1f}s "
          f"ratio {row['ratio'] if row['ratio'] is None else round(row['ratio'], 2)}"
          + (f" train {jp_['train_compile_s']:5.1f}s vs {row['plain']['train_compile_s']:5.1f}s"
             if "train_compile_s" in jp_ else "")
          + (f"  [{row['error']}]" if "error" in row else ""), file=sys.stderr, flush=True)


def markdown(res: dict[str, Any]) -> str:
    lines = ["| model | L | p | v | jaxpipe s | of which jp.pipeline / XLA | plain s | ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        j = r["jaxpipe"]
        if j is None:
            lines.append(f"| {r['variant']} | {r['layers']} | {r['p']} | {r['v']} | "
                         f"refused | | {r['plain']['compile_s']:.1f} | - |")
            continue
        lines.append(f"| {r['variant']} | {r['layers']} | {r['p']} | {r['v']} | "
                     f"{j['compile_s']:.1f} | {j['pipeline_s']:.1f} / {j['xla_s']:.1f} | "
                     f"{r['plain']['compile_s']:.1f} | {r['ratio']:.2f} |"
                     + (f" train step {j['train_compile_s']:.1f} s vs "
                        f"{r['plain']['train_compile_s']:.1f} s ({r['train_ratio']:.2f}) |"
                        if "train_ratio" in r else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", default="8,16,32,64")
    ap.add_argument("--ps", default="2,4,8")
    ap.add_argument("--vs", default="1,2")
    ap.add_argument("--variants", default="unrolled,scanned")
    ap.add_argument("--quick", action="store_true", help="L=4, p=2, v=1 only")
    ap.add_argument("--remat", default="none",
                    help="recomputation policy of every stage (jp.Cut(remat=)); 'none' is "
                         "cut='markers' as users get it")
    ap.add_argument("--fuse-fb", default="auto", choices=["auto", "on", "off"],
                    help="SpmdRuntime(fuse_fb=): the last stage's F and B in one step "
                         "('auto': only where that stores no more bytes)")
    ap.add_argument("--train-step", action="store_true",
                    help="also pipe.init + the first train_step (adamw) against plain JAX's "
                         "jitted value_and_grad + optax update")
    ap.add_argument("--repeats", type=int, default=1,
                    help="compile plain JAX and jaxpipe one after the other this many times "
                         "per point and keep medians: ratios robust to a "
                         "machine whose speed drifts")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.ps, args.vs = "4", "2", "1"
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    res = measure(ints(args.layers), ints(args.ps), ints(args.vs),
                  [x for x in args.variants.split(",") if x], args.remat,
                  {"auto": "auto", "on": True, "off": False}[args.fuse_fb], args.train_step,
                  args.repeats)
    from benchmarks import common as C

    C.write_json(args.out, "compile_time.json", res)
    print(markdown(res))
    return res


# ------------------------------------------------------------ the section in benchmarks/run.py
ORDER = 90
FIELDS = ("rows", "targets")


def run(r: Any) -> dict[str, Any]:
    """A lean grid (this module's own CLI runs the full one)."""
    if r.s.quick:
        return measure([2], [2], [1], ["scanned"])
    return measure([8, 32], [2, 4], [1, 2], ["unrolled", "scanned"])


def summary(ct: dict[str, Any]) -> str:
    return "**Compile time** (construction + first call - steady call)\n\n" + markdown(ct)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    from benchmarks.cpu_setup import virtual_cpus  # (imports no jax)

    virtual_cpus(8)
    main()
