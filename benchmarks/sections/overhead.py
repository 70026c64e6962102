"""Plain JAX against jaxpipe 1F1B at p=1 and p=P on the full GPT: step-time ratios.

Plain JAX is ``value_and_grad`` over the same microbatches in one jit (a ``lax.scan``);
jaxpipe runs the public ``Pipeline.value_and_grad`` (user pytree in and out).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import jax

import jaxpipe as jp
from benchmarks import common as C
from benchmarks.harness import (
    Prepared,
    Runner,
    compile_program,
    fmt,
    log,
    mesh,
    ratios,
    section_settings,
    time_group,
)
from jaxpipe.runtime.spmd import SpmdRuntime

ORDER = 10
FIELDS = ("p_values", "microbatches", "mb_size", "flops_per_step", "plain", "jaxpipe",
          "ratios", "settings")


@dataclass(frozen=True)
class OverheadSettings:
    """The overhead section's own sizes (recorded in its result under ``"settings"``)."""

    m: int = 8  # microbatches
    mb: int = 4  # sequences per microbatch (``run.py --mb-size`` sets it)

    @classmethod
    def for_run(cls, quick: bool) -> OverheadSettings:
        """A full run's values, or the smoke test's (``--quick``)."""
        return cls(m=4, mb=2) if quick else cls()


def run(r: Runner) -> dict[str, Any]:
    s, cfg = r.s, r.s.model
    own = section_settings(s, "overhead", OverheadSettings.for_run)
    m, mb = own.m, own.mb
    params = C.init_params(cfg, jax.random.key(0), embed=True)
    batch = C.make_gpt_batch(cfg, m * mb)
    loss_fn = C.gpt_loss(cfg)
    flops = C.model_flops(cfg, m * mb * cfg.seq, embed=True)
    compiled, info = compile_program(jax.jit(C.plain_value_and_grad(loss_fn, m)),
                                     (params, batch))
    group = {"plain": Prepared(compiled, (params, batch), info, flops, 1)}
    p_values = [p for p in (1, s.p) if p <= len(jax.devices())]
    for p in p_values:
        t0 = time.perf_counter()
        pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh(p),
                           schedule=jp.OneFOneB(p, m), cut="markers",
                           runtime=SpmdRuntime(backend=s.program))
        build_s = time.perf_counter() - t0
        compiled, info = compile_program(pipe.inspect.value_and_grad_fn, (params, batch))
        info.update({"build_s": build_s,
                     "num_ticks": int(pipe.inspect.executor.lowering.num_ticks)})
        group[f"p{p}"] = Prepared(compiled, (params, batch), info, flops, p)
        log(f"overhead: p={p} built in {build_s:.1f}s, compiled in {info['compile_s']:.1f}s")
    res = time_group(group, s)
    plain = res.pop("plain")
    out: dict[str, Any] = {"p_values": p_values, "microbatches": m, "mb_size": mb,
                           "model": "gpt (embedding + blocks + head)", "schedule": "1F1B",
                           "program": "public Pipeline.value_and_grad (user pytree in/out)",
                           "flops_per_step": flops, "plain": plain, "jaxpipe": res,
                           "ratios": {k: ratios(v, plain) for k, v in res.items()},
                           "settings": asdict(own)}
    for k, v in out["ratios"].items():
        log(f"overhead: jaxpipe {k} x{v['cpu']:.2f} cpu, x{v['wall']:.2f} wall "
            f"(plain {plain['median_s'] * 1e3:.1f} ms)")
    return out


def summary(ov: dict[str, Any]) -> str:
    lines = [f"**Executor overhead** (GPT, 1F1B, m={ov['microbatches']}, "
             f"{ov['mb_size']} seq/microbatch; ratio to plain JAX "
             f"{ov['plain']['median_s'] * 1e3:.1f} ms)", "",
             "| p | step ms | ratio (CPU time) | ratio (wall) | compile s |",
             "|---|---|---|---|---|"]
    for k, v in ov["jaxpipe"].items():
        rt = ov["ratios"][k]
        lines.append(f"| {k[1:]} | {v['median_s'] * 1e3:.1f} | {fmt(rt['cpu'])} | "
                     f"{fmt(rt['wall'])} | {v['compile_s']:.1f} |")
    return "\n".join(lines)


def plot(ov: dict[str, Any], save: Any) -> None:
    import matplotlib.pyplot as plt
    import numpy as np

    names = ["plain JAX"] + [f"jaxpipe {k}" for k in ov["jaxpipe"]]
    runs = [ov["plain"]] + list(ov["jaxpipe"].values())
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = np.arange(len(runs))
    ax.bar(x - 0.2, [1e3 * v["median_s"] for v in runs], 0.4, label="wall (median)")
    ax.bar(x + 0.2, [1e3 * v["cpu_median_s"] for v in runs], 0.4, label="process CPU")
    ax.set_xticks(x, names)
    ax.set_ylabel("ms / step")
    ax.set_title(f"Executor overhead (GPT, 1F1B, m={ov['microbatches']})")
    ax.legend()
    save(fig, "overhead.png")
