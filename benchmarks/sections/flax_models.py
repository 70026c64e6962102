"""flax's own models as their authors shard them, pipelined: memory and step time.

    python benchmarks/sections/flax_models.py    # prints the rows, writes results/flax_models/

Gemma (flax ``examples/gemma``, nnx, its ``ShardingConfig.fsdp_tp_sharding()``), pinned
under ``tests/flax_examples``, on a default ``jax.make_mesh((2, 2, 2), ("pipe", "fsdp",
"tp"))`` (every axis Explicit, 8 virtual CPU devices), 1F1B over m = 8:

- per-device bytes of the resident AdamW ``train_step`` (``memory_analysis``: arguments
  + temporaries + outputs - aliased) beside the cutter's prediction of the busiest
  device (``cut_report.peak_memory``), and the staged parameters' bytes per device over
  their total (the fsdp x tp x pipe share: 1/8 at best);
- ``pipe.value_and_grad`` against ``nnx.jit(nnx.value_and_grad)`` of the unpipelined
  model on the same mesh and batch (CPU time of single-threaded XLA: virtual devices run
  one after another, so this measures total work and the program's overhead, not the
  pipeline's overlap), medians of interleaved repeats.

Gemma runs as lanes by default (its stages share one body; ``SpmdRuntime(lanes=...)``),
and once more under the switch program (``lanes=False``) for comparison. flax's lm1b
(linen, its logical rules: mlp, vocab, heads -> tensor, embed -> fsdp; 8 blocks, width
32) runs as lanes too, against ``jax.jit(jax.value_and_grad)`` of the same model.
The quick run (the test suite's smoke run) records the section as skipped: the exactness
of both models is tests/test_flax_examples.py's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

ORDER = 125
FIELDS = ("mesh", "rows")
FULL = dict(layers=8, embed=128, hidden=512, heads=4, head_dim=32, kv_heads=2, vocab=512,
            seq=32, batch=32, m=8)
LM1B = dict(layers=8, vocab=512, seq=32, batch=32, m=8)


def _row(name: str, pipe: Any, model: Any, params: Any, batch: Any, plain: Any,
         repeats: int) -> dict[str, Any]:
    """One model's row: the resident AdamW step's compiled bytes beside the cutter's
    prediction, the staged share, and value_and_grad against ``plain``."""
    import optax

    from benchmarks import common as C

    sys.path.insert(0, str(REPO / "tests" / "support"))
    from flax_examples import staged_share

    state = pipe.init(params, optax.adamw(1e-3))
    stats = C.memory_stats(state.trainer.step_fn.lower(state, batch).compile())
    staged = pipe.shard(params)
    times = C.time_interleaved({"jaxpipe": (pipe.value_and_grad, (params, batch)),
                                "plain": (plain, (model, batch))},
                               warmup=1, repeats=repeats)
    predicted = float(pipe.inspect.cut_report.peak_memory)
    return {"model": name, "program": pipe.inspect.executor.program_report(), "compiled": stats,
            "predicted_bytes": predicted,
            "predicted_over_compiled": predicted / stats["total_bytes"],
            "staged_share": staged_share(staged),
            "jaxpipe": times["jaxpipe"], "plain": times["plain"],
            "step_ratio_cpu": times["jaxpipe"]["cpu_median_s"] / times["plain"]["cpu_median_s"]}


def _gemma_row(size: dict[str, int], repeats: int, lanes: bool | str = "auto"
               ) -> dict[str, Any]:
    import jax
    from flax import nnx

    import jaxpipe as jp
    from jaxpipe.runtime.spmd import SpmdRuntime

    sys.path.insert(0, str(REPO / "tests" / "support"))
    from flax_examples import gemma_setup

    mesh = jax.make_mesh((2, 2, 2), ("pipe", "fsdp", "tp"), devices=jax.devices()[:8])
    with jax.set_mesh(mesh):
        model, batch, loss_fn = gemma_setup(
            mesh, **{k: v for k, v in size.items() if k != "m"})
        pipe = jp.flax.pipeline(model, loss_fn, batch, mesh=mesh,
                                schedule=jp.OneFOneB(2, size["m"]),
                                runtime=SpmdRuntime(lanes=lanes))
        row = _row("gemma (nnx) fsdp_tp_sharding" + ("" if lanes else ", lanes=False"),
                   pipe, model, model, batch, nnx.jit(nnx.value_and_grad(loss_fn)), repeats)
    return row | {"size": size}


def _lm1b_row(size: dict[str, int], repeats: int) -> dict[str, Any]:
    import flax.linen as nn
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import jaxpipe as jp

    sys.path.insert(0, str(REPO / "tests" / "support"))
    from flax_examples import LM1B_RULES, lm1b_setup

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("pipe", "fsdp", "tensor"))
    model, variables, loss_fn, batch = lm1b_setup(mesh, layers=size["layers"],
                                                  vocab=size["vocab"], seq=size["seq"],
                                                  batch=size["batch"])
    rules = [list(r) for r in LM1B_RULES]
    with nn.logical_axis_rules(rules):
        pipe = jp.flax.pipeline_linen(model, variables, loss_fn, batch, mesh=mesh,
                                      schedule=jp.OneFOneB(2, size["m"]))
        plain = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(model, {"params": p}, b)))
        row = _row("lm1b (linen) logical rules", pipe, variables["params"],
                   variables["params"], batch, plain, repeats)
    return row | {"size": size}


def measure(quick: bool = False) -> dict[str, Any]:
    import jax

    res: dict[str, Any] = {"mesh": {"pipe": 2, "fsdp": 2, "tp": 2}, "rows": []}
    if quick:
        res["skipped"] = "full run only (exactness: tests/test_flax_examples.py)"
        return res
    if len(jax.devices()) < 8:
        res["skipped"] = f"needs 8 devices, have {len(jax.devices())}"
        return res
    res["rows"].append(_gemma_row(FULL, repeats=5))
    res["rows"].append(_gemma_row(FULL, repeats=5, lanes=False))
    res["rows"].append(_lm1b_row(LM1B, repeats=5))
    return res


def run(r: Any) -> dict[str, Any]:
    return measure(r.s.quick)


def summary(res: dict[str, Any]) -> str:
    rows = [r for r in res["rows"] if "compiled" in r]
    if not rows:
        return f"**flax's models**: {res.get('skipped', 'no rows')}"
    return "\n".join(
        f"**{r['model']}** on pipe 2 x fsdp 2 x tp 2: compiled "
        f"{r['compiled']['total_bytes'] / 2**20:.2f} MiB/device, predicted / compiled "
        f"{r['predicted_over_compiled']:.2f}, staged share {r['staged_share']:.3f}; "
        f"value_and_grad / plain {r['step_ratio_cpu']:.2f} (CPU time)" for r in rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from benchmarks.common import write_json

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "flax_models"))
    args = ap.parse_args(argv)
    res = measure()
    print(summary(res))
    write_json(args.out, "flax_models.json", res)
    return res


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    from benchmarks.cpu_setup import single_core_cpu

    single_core_cpu(devices=8)
    main()
