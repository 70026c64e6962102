"""1F1B at p=P as m grows: compile time (should be flat) and step time (should be linear
in m), on the block stack."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

import jaxpipe as jp
from benchmarks.harness import Runner, fmt, linear_fit, section_settings

ORDER = 40  # after baseline: reuses its compiled 1F1B programs
FIELDS = ("p", "schedule", "rows", "step_time_fit", "compile_time_spread", "settings")


@dataclass(frozen=True)
class ScalingSettings:
    """The scaling section's own sizes (recorded in its result under ``"settings"``)."""

    factors: tuple[int, ...] = (1, 2, 4, 8)  # m = factor * p

    @classmethod
    def for_run(cls, quick: bool) -> ScalingSettings:
        """A full run's values, or the smoke test's (``--quick``: the baseline's 1F1B run
        plus one)."""
        return cls(factors=(1, 4)) if quick else cls()


def run(r: Runner) -> dict[str, Any]:
    s = r.s
    own = section_settings(s, "scaling", ScalingSettings.for_run)
    p = s.p
    rows = []
    for f in own.factors:
        m = f * p
        res = r.jaxpipe_blocks("1F1B", jp.OneFOneB(p, m))
        rows.append({"m": m, "build_s": res["build_s"], "lower_s": res["lower_s"],
                     "compile_s": res["compile_s"], "median_s": res["median_s"],
                     "cpu_median_s": res["cpu_median_s"], "num_ticks": res["num_ticks"],
                     "per_microbatch_s": res["median_s"] / m})
    comp = [row["compile_s"] for row in rows]
    return {
        "p": p, "schedule": "1F1B", "rows": rows,
        "step_time_fit": linear_fit([row["m"] for row in rows],
                                    [row["median_s"] for row in rows]),
        "compile_time_spread": (max(comp) / min(comp)) if comp else None,
        "settings": asdict(own),
    }


def summary(sc: dict[str, Any]) -> str:
    lines = [f"**Scaling** (1F1B, p={sc['p']}): compile time spread (max/min) "
             f"{fmt(sc['compile_time_spread'])}, step-time linear fit R^2 "
             f"{fmt(sc['step_time_fit']['r2'], '{:.3f}')}", "",
             "| m | ticks | compile s | step ms (wall) | step ms (CPU) | wall ms / microbatch |",
             "|---|---|---|---|---|---|"]
    for row in sc["rows"]:
        lines.append(f"| {row['m']} | {row['num_ticks']} | {row['compile_s']:.1f} | "
                     f"{row['median_s'] * 1e3:.1f} | {row['cpu_median_s'] * 1e3:.1f} | "
                     f"{row['per_microbatch_s'] * 1e3:.2f} |")
    return "\n".join(lines)


def plot(sc: dict[str, Any], save: Any) -> None:
    import matplotlib.pyplot as plt

    if not sc["rows"]:
        return
    ms = [row["m"] for row in sc["rows"]]
    fig, axs = plt.subplots(1, 2, figsize=(10, 3.5))
    axs[0].plot(ms, [row["compile_s"] for row in sc["rows"]], "o-", label="compile")
    axs[0].plot(ms, [row["build_s"] + row["lower_s"] for row in sc["rows"]], "o-",
                label="build + lower")
    axs[0].set_ylim(bottom=0)
    axs[0].set_title(f"Compile time vs m (1F1B, p={sc['p']})")
    axs[1].plot(ms, [1e3 * row["median_s"] for row in sc["rows"]], "o-", label="step")
    fit = sc["step_time_fit"]
    if fit["slope_s_per_microbatch"] is not None:
        xs = np.array([0, max(ms)])
        axs[1].plot(xs, 1e3 * (fit["intercept_s"] + fit["slope_s_per_microbatch"] * xs),
                    "--", color="gray", label=f"linear fit, R2={fit['r2']:.3f}")
    axs[1].set_title("Step time vs m")
    for ax, yl in zip(axs, ("s", "ms"), strict=True):
        ax.set_xlabel("microbatches m")
        ax.set_ylabel(yl)
        ax.legend()
    save(fig, "scaling.png")
