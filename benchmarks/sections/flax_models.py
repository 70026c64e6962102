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

flax's lm1b with its logical rules is not pipelined yet (XLA partitions its attention
projections with a collective-permute that a stage cannot run under the program's
switch; see the closing note of the real-sharding issue): its row records the refusal.
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


def _gemma_row(size: dict[str, int], repeats: int) -> dict[str, Any]:
    import jax
    import optax
    from flax import nnx

    import jaxpipe as jp
    from benchmarks import common as C

    sys.path.insert(0, str(REPO / "tests" / "support"))
    from flax_examples import gemma_setup, staged_share

    mesh = jax.make_mesh((2, 2, 2), ("pipe", "fsdp", "tp"), devices=jax.devices()[:8])
    with jax.set_mesh(mesh):
        model, batch, loss_fn = gemma_setup(
            mesh, **{k: v for k, v in size.items() if k != "m"})
        pipe = jp.flax.pipeline(model, loss_fn, batch, mesh=mesh,
                                schedule=jp.OneFOneB(2, size["m"]))
        state = pipe.init(model, optax.adamw(1e-3))
        stats = C.memory_stats(state.trainer.step_fn.lower(state, batch).compile())
        staged = pipe.shard(model)
        plain = nnx.jit(nnx.value_and_grad(loss_fn))
        times = C.time_interleaved({"jaxpipe": (pipe.value_and_grad, (model, batch)),
                                    "plain": (plain, (model, batch))},
                                   warmup=1, repeats=repeats)
    predicted = float(pipe.cut_report.peak_memory)
    return {"model": "gemma (nnx) fsdp_tp_sharding", "size": size, "compiled": stats,
            "predicted_bytes": predicted,
            "predicted_over_compiled": predicted / stats["total_bytes"],
            "staged_share": staged_share(staged),
            "jaxpipe": times["jaxpipe"], "plain": times["plain"],
            "step_ratio_cpu": times["jaxpipe"]["cpu_median_s"] / times["plain"]["cpu_median_s"]}


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
    res["rows"].append({"model": "lm1b (linen) logical rules", "error": (
        "refused: XLA partitions the attention projections with a collective-permute "
        "the program's per-device switch cannot run (see the module doc)")})
    return res


def run(r: Any) -> dict[str, Any]:
    return measure(r.s.quick)


def summary(res: dict[str, Any]) -> str:
    rows = [r for r in res["rows"] if "compiled" in r]
    if not rows:
        return f"**flax's models**: {res.get('skipped', 'no rows')}"
    r = rows[0]
    return (f"**flax's Gemma (fsdp_tp_sharding) on pipe 2 x fsdp 2 x tp 2**: compiled "
            f"{r['compiled']['total_bytes'] / 2**20:.2f} MiB/device, predicted / compiled "
            f"{r['predicted_over_compiled']:.2f}, staged share {r['staged_share']:.3f}; "
            f"value_and_grad / nnx.value_and_grad {r['step_ratio_cpu']:.2f} (CPU time)")


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
