"""Lowered efficiency of every built-in and gallery schedule, and schedule work at scale.

    python benchmarks/sections/lowering.py               # table + results/lowering.json
    python benchmarks/sections/lowering.py --scale       # also validate/simulate/lower at p=64
    python benchmarks/sections/lowering.py --scale-only  # only that

*Lowered efficiency* = the schedule's asynchronous makespan (``Schedule.simulate``: each
device waits only for its data) / the makespan of jaxpipe's lowered SPMD program under
the sync model of :mod:`jaxpipe.runtime.spmd.lowering.sync` (devices run their steps back to back
and meet their source and target at every active ``ppermute``). 1.0 means the one SPMD
program loses nothing to an ideal MPMD runtime; above 1.0 the lowered program is faster
than the schedule as written (a backward run as I then W hands its cotangent on sooner).

Two cost models: uniform F:B:I:W = 1:2:1:1, and the cost model's own per-stage costs for
the GPT benchmark model (embedding in the first stage, head and loss in the last; the
cutter's ``CutResult.action_cost``). Each with the full backward run as one step
(``split_backward=False``, what the runtime does on CPU) and as I then W (``True``, what it
does where devices run concurrently), lowered with the costs it is priced under and the
local search over ticks, as the runtime lowers where devices run concurrently (ticks
follow the cutter's costs where that runs faster; :mod:`jaxpipe.runtime.spmd.lowering.refine`).
The accelerator program (``SpmdRuntime(backend="gpu")``) is lowered too, B as I then W
and every pair meeting every tick (its sync model, :mod:`jaxpipe.runtime.spmd.lowering.sync`),
with the overlap as the runtime picks it (off without a transfer time) and forced on.
Deterministic: no timing.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def schedules() -> list[tuple[str, Callable[[int, int], Any]]]:
    """Built-in and gallery (``schedules/*.py``) schedules, as ``(name, make(p, m))``."""
    import jaxpipe as jp
    from benchmarks import common as C

    out: list[tuple[str, Callable[[int, int], Any]]] = [
        ("GPipe", jp.GPipe), ("1F1B", jp.OneFOneB),
        ("Interleaved1F1B", lambda p, m: jp.Interleaved1F1B(p, m, stages_per_device=2)),
    ]
    out += C.gallery_schedules()
    return out


def gpt_costs(schedule: Any, layers: int) -> Callable[[Any], float]:
    """The cutter's per-action costs for the GPT benchmark model under ``schedule``."""
    import jax

    import jaxpipe as jp
    from benchmarks import common as C

    cfg = C.GPTConfig(n_layers=layers)
    params = jax.eval_shape(lambda: C.init_params(cfg, jax.random.key(0)))
    batch = jax.eval_shape(lambda: C.make_gpt_batch(cfg, 2 * schedule.num_microbatches))
    from jaxpipe.cut import Cut, choose_cuts
    from jaxpipe.cut.cost import segment_costs
    from jaxpipe.jaxpr.trace import microbatch_like, trace
    from jaxpipe.runtime.spmd import SpmdRuntime

    traced = trace(C.gpt_loss(cfg), params, microbatch_like(batch,
                                                             schedule.num_microbatches))
    del jp
    return choose_cuts(segment_costs(traced), schedule, Cut(),
                       memory_model=SpmdRuntime().memory_model).action_cost


def section_lowering(ps: tuple[int, ...] = (2, 4, 8), layers: int = 16,
                     gpt: bool = True) -> dict[str, Any]:
    """Lowered efficiency for every schedule, p in ``ps``, m in {p, 2p, 4p}."""
    from jaxpipe.runtime.spmd.backends import REFINE_EVALS
    from jaxpipe.runtime.spmd.lowering import lower, lower_accelerator
    from jaxpipe.runtime.spmd.lowering.sync import sync_report
    from jaxpipe.schedule.simulate import resolve_costs

    rows = []
    for name, make in schedules():
        for p in ps:
            for m in (p, 2 * p, 4 * p):
                row: dict[str, Any] = {"schedule": name, "p": p, "m": m}
                try:
                    sched = make(p, m)
                    sched.validate()
                except Exception as e:  # noqa: BLE001 - e.g. DualPipeV needs m >= 2p
                    row["skipped"] = f"{type(e).__name__}: {e}"
                    rows.append(row)
                    continue
                costs: dict[str, Any] = {"uniform": resolve_costs(None)}
                if gpt and sched.num_stages <= layers:
                    costs["gpt"] = gpt_costs(sched, layers)
                for split in (False, True):
                    tag = "split" if split else "b"
                    for cname, cost in costs.items():
                        # the runtime lowers with the cutter's costs (ticks by cost where
                        # that runs faster)
                        low = lower(sched, {}, split_backward=split, costs=cost,
                                    refine=REFINE_EVALS)
                        rep = sync_report(sched, low, cost)
                        row[f"{cname}_{tag}"] = rep.efficiency
                        row[f"{cname}_ticks_{tag}"] = low.num_ticks
                # the accelerator program: B as I then W, every pair meeting every tick;
                # the overlap as the runtime picks it (off without a transfer time) and
                # forced on (one more tick before a message can be read)
                for cname, cost in costs.items():
                    for tag, overlap in (("accel", "auto"), ("accel_overlap", True)):
                        low = lower_accelerator(sched, {}, split_backward=True, costs=cost,
                                                refine=REFINE_EVALS, overlap=overlap)
                        row[f"{cname}_{tag}"] = sync_report(sched, low, cost).efficiency
                rows.append(row)
    done = [r for r in rows if "skipped" not in r]
    summary = {k: min((r[k] for r in done if k in r), default=None)
               for k in ("uniform_b", "uniform_split", "gpt_b", "gpt_split", "uniform_accel",
                         "uniform_accel_overlap", "gpt_accel", "gpt_accel_overlap")}
    return {"ps": list(ps), "layers": layers, "rows": rows, "min_efficiency": summary}


def section_scale(p: int = 64, m: int = 512) -> dict[str, Any]:
    """Seconds to validate, simulate and lower every schedule at cluster scale."""
    from jaxpipe.runtime.spmd.lowering import lower

    rows = []
    for name, make in schedules():
        row: dict[str, Any] = {"schedule": name, "p": p, "m": m}
        try:
            t0 = time.perf_counter()
            sched = make(p, m)
            sched.validate()
            t1 = time.perf_counter()
            sched.simulate()
            t2 = time.perf_counter()
            lower(sched, {})
            t3 = time.perf_counter()
        except Exception as e:  # noqa: BLE001
            row["skipped"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            continue
        row.update({"validate_s": t1 - t0, "simulate_s": t2 - t1, "lower_s": t3 - t2,
                    "total_s": t3 - t0})
        rows.append(row)
    return {"p": p, "m": m, "rows": rows}


def markdown(res: dict[str, Any]) -> str:
    lines = ["| schedule | p | m | uniform, B | uniform, I+W | GPT costs, B | GPT costs, I+W "
             "| accel., uniform | accel. + overlap, uniform | accel., GPT | accel. + overlap, "
             "GPT |", "|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(x: Any) -> str:
        return "-" if x is None else f"{x:.3f}"

    for r in res["rows"]:
        if "skipped" in r:
            continue
        lines.append(f"| {r['schedule']} | {r['p']} | {r['m']} | {f(r.get('uniform_b'))} | "
                     f"{f(r.get('uniform_split'))} | {f(r.get('gpt_b'))} | "
                     f"{f(r.get('gpt_split'))} | {f(r.get('uniform_accel'))} | "
                     f"{f(r.get('uniform_accel_overlap'))} | {f(r.get('gpt_accel'))} | "
                     f"{f(r.get('gpt_accel_overlap'))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--no-gpt", action="store_true", help="uniform costs only (fast)")
    ap.add_argument("--scale", action="store_true",
                    help="also time validate/simulate/lower at p=64, m=512")
    ap.add_argument("--scale-only", action="store_true", help="only the p=64 timing")
    args = ap.parse_args(argv)
    res: dict[str, Any] = {}
    if not args.scale_only:
        res = section_lowering(gpt=not args.no_gpt)
        print(markdown(res))
        print("minimum efficiency:", res["min_efficiency"])
    if args.scale or args.scale_only:
        res["scale"] = section_scale()
        for r in res["scale"]["rows"]:
            print(r)
    from benchmarks import common as C

    name = "lowering_scale.json" if args.scale_only else "lowering.json"
    C.write_json(args.out, name, res, indent=1, default=str)
    return res


# ------------------------------------------------------------ the section in benchmarks/run.py
ORDER = 70
FIELDS = ("ps", "rows", "min_efficiency", "scale")


def run(r: Any) -> dict[str, Any]:
    """Lowered efficiency (p in {2, 4, 8}; 2 with ``--quick``) and schedule work at scale."""
    from benchmarks.harness import log

    res = section_lowering(ps=(2,) if r.s.quick else (2, 4, 8), gpt=not r.s.quick)
    log(f"lowering: minimum efficiency {res['min_efficiency']}")
    res["scale"] = section_scale(*((8, 32) if r.s.quick else (64, 512)))
    for row in res["scale"]["rows"]:
        log(f"lowering at scale {row['schedule']}: {row.get('total_s', row.get('skipped'))}")
    return res


def summary(lw: dict[str, Any]) -> str:
    return ("**Lowered efficiency** (asynchronous makespan / lowered SPMD makespan, "
            f"sync model; minimum {lw['min_efficiency']})\n\n" + markdown(lw))


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    from benchmarks.cpu_setup import virtual_cpus  # (imports no jax)

    virtual_cpus(8)
    main()
