"""``pipe.loss`` (the schedule's forward actions only) against ``pipe.value_and_grad`` on
the full GPT, 1F1B at p=P, m=2P: step time and compiled temp memory."""

from __future__ import annotations

from typing import Any

import jax

import jaxpipe as jp
from benchmarks import common as C
from benchmarks.harness import (
    Prepared,
    Runner,
    compile_program,
    log,
    mesh,
    ratio,
    ratios,
    time_group,
)
from jaxpipe.runtime.spmd import SpmdRuntime

ORDER = 110
FIELDS = ("p", "microbatches", "value_and_grad", "loss", "time_ratio", "temp_ratio")


def run(r: Runner) -> dict[str, Any]:
    s, cfg = r.s, r.s.model
    p, m = s.p, 2 * s.p
    params = C.init_params(cfg, jax.random.key(0), embed=True)
    batch = C.make_gpt_batch(cfg, m * s.mb)
    pipe = jp.pipeline(C.gpt_loss(cfg), params, batch, mesh=mesh(p),
                       schedule=jp.OneFOneB(p, m), runtime=SpmdRuntime(backend=s.program))
    flops = C.model_flops(cfg, m * s.mb * cfg.seq, embed=True)
    group = {}
    for name, fn in (("value_and_grad", pipe.inspect.value_and_grad_fn),
                     ("loss", pipe.inspect.eval_fn)):
        compiled, info = compile_program(fn, (params, batch))
        group[name] = Prepared(compiled, (params, batch), info, flops / 3 if name == "loss"
                               else flops, p)
    res = time_group(group, s)
    vg, ev = res["value_and_grad"], res["loss"]
    out = {"p": p, "microbatches": m, "mb_size": s.mb, "model": "gpt", "schedule": "1F1B",
           "value_and_grad": vg, "loss": ev,
           "num_ticks": {"value_and_grad": int(pipe.inspect.executor.lowering.num_ticks),
                         "loss": int(pipe.inspect.executor.forward_lowering.num_ticks)},
           "time_ratio": ratios(ev, vg),
           "temp_ratio": ratio(ev["memory"]["temp_bytes"], vg["memory"]["temp_bytes"])}
    log(f"eval: pipe.loss / value_and_grad time x{out['time_ratio']['wall']:.2f} wall, "
        f"temp memory x{out['temp_ratio']:.2f}")
    return out


def summary(ev: dict[str, Any]) -> str:
    return (f"**Evaluation** (GPT, 1F1B, p={ev['p']}, m={ev['microbatches']}): pipe.loss / "
            f"value_and_grad step time x{ev['time_ratio']['wall']:.2f} (wall), "
            f"x{ev['time_ratio']['cpu']:.2f} (CPU time); temp memory x{ev['temp_ratio']:.2f}")
