"""jaxpipe GPipe and 1F1B against the MaxText-style SPMD GPipe baseline
(``benchmarks/baselines/spmd_gpipe.py``) at the same p and m in {p, 2p, 4p, 8p}, on the
block stack: step-time ratio and compiled per-device memory ratio."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import jaxpipe as jp
from benchmarks.harness import Prepared, Runner, fmt, log, ratio, ratios, section_settings

ORDER = 20
FIELDS = ("p", "mb_size", "memory_metric", "program", "rows", "settings")
#: Fields of each row (one per m).
ROW_FIELDS = ("m", "spmd_gpipe", "jaxpipe", "step_ratio", "memory_ratio", "temp_ratio")


@dataclass(frozen=True)
class BaselineSettings:
    """The baseline section's own sizes (recorded in its result under ``"settings"``)."""

    m_factors: tuple[int, ...] = (1, 2, 4, 8)  # m = factor * p

    @classmethod
    def for_run(cls, quick: bool) -> BaselineSettings:
        """A full run's values, or the smoke test's (``--quick``)."""
        return cls(m_factors=(4,)) if quick else cls()


def run(r: Runner) -> dict[str, Any]:
    s = r.s
    own = section_settings(s, "baseline", BaselineSettings.for_run)
    p = s.p
    rows = []
    for f in own.m_factors:
        m = f * p
        scheds = {"GPipe": jp.GPipe(p, m), "1F1B": jp.OneFOneB(p, m)}
        bkey = ("blocks", "spmd_gpipe", p, m, 1)
        group: dict[tuple, Callable[[], Prepared]] = {
            bkey: lambda m=m: r.prepare_baseline(p, m)}
        for name, sched in scheds.items():
            group[r.key(name, sched)] = lambda name=name, sched=sched: r.prepare_jaxpipe(
                name, sched)
        res = r.measure(group)
        base = res[bkey]
        row: dict[str, Any] = {"m": m, "spmd_gpipe": base, "jaxpipe": {}, "step_ratio": {},
                               "memory_ratio": {}, "temp_ratio": {}}
        for name, sched in scheds.items():
            one = res[r.key(name, sched)]
            row["jaxpipe"][name] = one
            row["step_ratio"][name] = ratios(one, base)
            row["memory_ratio"][name] = ratio(one["memory"]["total_bytes"],
                                              base["memory"]["total_bytes"])
            row["temp_ratio"][name] = ratio(one["memory"]["temp_bytes"],
                                            base["memory"]["temp_bytes"])
        log(f"baseline m={m}: spmd_gpipe {base['median_s'] * 1e3:.1f} ms "
            f"{base['memory']['total_bytes'] / 2**20:.1f} MiB | step (cpu) x"
            + ", ".join(f"{k} {v['cpu']:.2f}" for k, v in row["step_ratio"].items())
            + " | memory x" + ", ".join(f"{k} {v:.2f}" for k, v in row["memory_ratio"].items()))
        rows.append(row)
    return {
        "p": p, "mb_size": s.mb, "model": "block stack (float activations in, MSE loss)",
        "memory_metric": "per-device argument + output + temp - alias bytes from "
                         "compiled.memory_analysis(); temp_ratio compares temp bytes alone",
        "program": "both take stage-layout parameters sharded over pipe and return "
                   "stage-layout gradients; the batch is replicated on both",
        "rows": rows, "settings": asdict(own),
    }


def summary(bl: dict[str, Any]) -> str:
    lines = [f"**vs MaxText-style SPMD GPipe** (block stack, p={bl['p']}; ratios "
             "jaxpipe / baseline; memory = per-device arg+out+temp-alias)", "",
             "| m | baseline ms | baseline MiB | GPipe step | 1F1B step | GPipe mem | "
             "1F1B mem | 1F1B temp |", "|---|---|---|---|---|---|---|---|"]
    for row in bl["rows"]:
        b = row["spmd_gpipe"]
        lines.append(
            f"| {row['m']} | {b['median_s'] * 1e3:.1f} | "
            f"{b['memory']['total_bytes'] / 2**20:.1f} | "
            f"{fmt(row['step_ratio']['GPipe']['cpu'])} | "
            f"{fmt(row['step_ratio']['1F1B']['cpu'])} | {fmt(row['memory_ratio']['GPipe'])} | "
            f"{fmt(row['memory_ratio']['1F1B'])} | {fmt(row['temp_ratio']['1F1B'])} |")
    return "\n".join(lines)


def plot(bl: dict[str, Any], save: Any) -> None:
    import matplotlib.pyplot as plt

    if not bl["rows"]:
        return
    ms = [row["m"] for row in bl["rows"]]
    fig, axs = plt.subplots(1, 2, figsize=(10, 3.5))
    for name in ("GPipe", "1F1B"):
        axs[0].plot(ms, [row["step_ratio"][name]["cpu"] for row in bl["rows"]], "o-",
                    label=f"{name} (CPU time)")
        axs[0].plot(ms, [row["step_ratio"][name]["wall"] for row in bl["rows"]], "x--",
                    label=f"{name} (wall)")
        axs[1].plot(ms, [row["memory_ratio"][name] for row in bl["rows"]], "o-",
                    label=f"{name} total")
        axs[1].plot(ms, [row["temp_ratio"][name] for row in bl["rows"]], "x--",
                    label=f"{name} temp")
    for ax, t in zip(axs, ("step time / spmd_gpipe", "per-device memory / spmd_gpipe"),
                     strict=True):
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("microbatches m")
        ax.set_title(f"{t} (p={bl['p']})")
        ax.legend()
    save(fig, "baseline.png")
