"""What the recomputation policy does to compile time, memory and step time.

    python benchmarks/probes/remat_tradeoff.py   # prints ratios, writes results/remat_tradeoff.json

Every residual a stage stores between its forward and backward is written into a slot
buffer and read back, one kernel each way; plain JAX keeps cheap elementwise values
inside XLA's fusions instead. This measures, for the GPT benchmark model cut evenly at
its markers (1F1B, m = 2p, public ``value_and_grad``), the stored residual leaves per
stage, XLA compile seconds (AOT ``lower().compile()``), the compiled program's temp
memory and the step time (median of 7 calls, CPU) under each policy of ``jp.Cut(remat=)``,
with ratios to ``"none"`` (store every residual, the default of explicit and marker cuts).

``--fuse-fb off,on`` adds the other way to store less: the last stage running each F and
its own B in one step (``SpmdRuntime(fuse_fb=)``, which stores nothing for that stage;
``"auto"``, the default, does it only where it does not raise the stored bytes).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _point(cfg: Any, p: int, remat: str, fuse_fb: bool | str) -> dict[str, Any]:
    import jax

    import jaxpipe as jp
    from benchmarks import common as C
    from jaxpipe.cut.resolve import even_cuts
    from jaxpipe.runtime.spmd import SpmdRuntime

    params = C.init_params(cfg, jax.random.key(0))
    m = 2 * p
    batch = C.make_gpt_batch(cfg, 2 * m)
    mesh = jax.make_mesh((p,), ("pipe",), devices=jax.devices()[:p])
    # one marker per block: n_layers + 1 segments, grouped as cut="markers" does
    cut = jp.Cut(indices=even_cuts(cfg.n_layers + 1, p), remat=remat)
    pipe = jp.pipeline(C.gpt_loss(cfg), params, batch, mesh=mesh,
                       schedule=jp.OneFOneB(p, m), cut=cut,
                       runtime=SpmdRuntime(fuse_fb=fuse_fb))
    compiled, _, xla_s = C.compile_timed(pipe.inspect.value_and_grad_fn, params, batch)
    step = C.time_compiled(compiled, params, batch, warmup=1, repeats=7)
    return {"residual_leaves": [len(st.residual_avals) for st in pipe.inspect.stages],
            "xla_s": xla_s,
            "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
            "fused_stages": sorted(pipe.inspect.executor.lowering.fused_stages),
            "step_s": step["median_s"]}


def measure(ps: list[int], policies: list[str], layers: int, d_model: int,
            fuses: tuple[bool | str, ...] = ("auto",)) -> dict[str, Any]:
    from benchmarks import common as C

    cfg = C.GPTConfig(n_layers=layers, d_model=d_model)
    rows = []
    for p in ps:
        base = None
        for remat, fuse in ((pol, f) for pol in policies for f in fuses):
            r = {"p": p, "remat": remat, "fuse_fb": fuse, **_point(cfg, p, remat, fuse)}
            base = base or r
            for k in ("xla_s", "temp_bytes", "step_s"):
                r[f"{k}_ratio"] = r[k] / base[k]
            print(f"p={p} remat={remat:9s} fuse_fb={fuse!s:5s} "
                  f"residual leaves {r['residual_leaves']} "
                  f"xla {r['xla_s']:.2f}s ({r['xla_s_ratio']:.2f}) temp "
                  f"{r['temp_bytes'] / 2**20:.1f} MiB ({r['temp_bytes_ratio']:.2f}) step "
                  f"{r['step_s'] * 1e3:.1f} ms ({r['step_s_ratio']:.2f})", flush=True)
            rows.append(r)
    return {"model": f"gpt d{d_model} x {layers}, 1F1B m=2p, cut evenly at the markers",
            "rows": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ps", default="2,4")
    ap.add_argument("--policies", default="none,dots,boundary",
                    help="jp.Cut(remat=) values; the first is the baseline of the ratios")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--fuse-fb", default="auto",
                    help="SpmdRuntime(fuse_fb=) values, comma-separated: auto, on, off")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    res = measure([int(x) for x in args.ps.split(",") if x],
                  [x for x in args.policies.split(",") if x], args.layers, args.d_model,
                  tuple({"auto": "auto", "on": True, "off": False}[x]
                        for x in args.fuse_fb.split(",") if x))
    from benchmarks import common as C

    C.write_json(args.out, "remat_tradeoff.json", res)
    return res


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    from benchmarks.cpu_setup import virtual_cpus  # (imports no jax)

    virtual_cpus(8)
    main()
