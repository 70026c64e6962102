"""Every built-in and gallery (``schedules/*.py``) schedule at p=P (and p=P_big when the
devices allow), on the block stack: simulated bubble, compiled memory, step time,
compile time. ``--quick`` compiles nothing new (schedules not measured by an earlier
section are simulated only)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import jax

import jaxpipe as jp
from benchmarks import common as C
from benchmarks.harness import Runner, fmt, log, section_settings

ORDER = 30  # after baseline: reuses its compiled GPipe and 1F1B programs
FIELDS = ("microbatches_per_p", "mb_size", "rows", "settings")
#: Fields of each row (one per schedule and p).
ROW_FIELDS = ("schedule", "p", "m", "stages_per_device", "bubble", "makespan",
              "num_ticks", "res_peak", "memory", "compile_s", "median_s", "skipped")


@dataclass(frozen=True)
class SweepSettings:
    """The sweep section's own sizes (recorded in its result under ``"settings"``)."""

    factor: int = 2  # m = factor * p
    compile: bool = True  # False: only schedules already measured are compiled

    @classmethod
    def for_run(cls, quick: bool) -> SweepSettings:
        """A full run's values, or the smoke test's (``--quick``: compiles nothing new)."""
        return cls(factor=4, compile=False) if quick else cls()


def run(r: Runner) -> dict[str, Any]:
    s, cfg = r.s, r.s.model
    own = section_settings(s, "sweep", SweepSettings.for_run)
    builtins: list[tuple[str, Callable[[int, int], jp.Schedule]]] = [
        ("GPipe", jp.GPipe), ("1F1B", jp.OneFOneB),
        ("Interleaved1F1B", lambda p, m: jp.Interleaved1F1B(p, m, stages_per_device=2)),
    ]
    scheds = builtins + C.gallery_schedules()
    ps = sorted({p for p in (s.p, s.p_big) if p <= len(jax.devices())})
    rows = []
    for p in ps:
        m = own.factor * p
        for name, make in scheds:
            row: dict[str, Any] = {k: None for k in ROW_FIELDS}
            row.update({"schedule": name, "p": p, "m": m, "skipped": None})
            try:
                sched = make(p, m)
                sched.validate()
            except Exception as e:  # noqa: BLE001 - report, keep going
                row["skipped"] = f"{type(e).__name__}: {e}"
                rows.append(row)
                continue
            row["stages_per_device"] = sched.stages_per_device
            if sched.num_stages > cfg.n_layers:
                tl = sched.simulate()
                row.update({"bubble": float(tl.bubble_fraction), "makespan": float(tl.makespan),
                            "skipped": f"needs {sched.num_stages} stages, the model has "
                                       f"{cfg.n_layers} blocks (use --layers)"})
                rows.append(row)
                continue
            if not own.compile and not r.has(name, sched):
                tl = sched.simulate()
                row.update({"bubble": float(tl.bubble_fraction), "makespan": float(tl.makespan),
                            "skipped": "quick mode: simulated only"})
                rows.append(row)
                continue
            try:
                res = r.jaxpipe_blocks(name, sched)
            except Exception as e:  # noqa: BLE001 - a gallery schedule may not run yet
                row["skipped"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(row)
                continue
            row.update({k: res[k] for k in ("bubble", "makespan", "num_ticks", "res_peak",
                                            "memory", "compile_s", "median_s")})
            row.update({k: res[k] for k in ("cpu_median_s", "tflops_per_device", "mfu")})
            log(f"sweep p={p} {name}: bubble {row['bubble']:.3f}, "
                f"{res['memory']['total_bytes'] / 2**20:.1f} MiB, "
                f"{res['median_s'] * 1e3:.1f} ms, compile {res['compile_s']:.1f}s")
            rows.append(row)
    return {"microbatches_per_p": own.factor, "mb_size": s.mb, "p_values": ps,
            "rows": rows, "settings": asdict(own)}


def summary(sw: dict[str, Any]) -> str:
    lines = [f"**Schedule sweep** (block stack, m={sw['microbatches_per_p']}p)", "",
             "| schedule | p | m | bubble (sim.) | MiB/device | step ms (CPU) "
             "| step ms (wall) | compile s | note |", "|---|---|---|---|---|---|---|---|---|"]
    for row in sw["rows"]:
        mem = row["memory"]["total_bytes"] / 2**20 if row["memory"] else None
        ms = row["median_s"] * 1e3 if row["median_s"] is not None else None
        cpu = row.get("cpu_median_s")
        lines.append(f"| {row['schedule']} | {row['p']} | {row['m']} | "
                     f"{fmt(row['bubble'], '{:.3f}')} | {fmt(mem, '{:.1f}')} | "
                     f"{fmt(cpu * 1e3 if cpu is not None else None, '{:.1f}')} | "
                     f"{fmt(ms, '{:.1f}')} | {fmt(row['compile_s'], '{:.1f}')} | "
                     f"{(row['skipped'] or '')[:60]} |")
    return "\n".join(lines)


def plot(sw: dict[str, Any], save: Any) -> None:
    import matplotlib.pyplot as plt

    done = [row for row in sw["rows"] if row["median_s"] is not None]
    if not done:
        return
    labels = [f"{row['schedule']}\np={row['p']}" for row in done]
    fig, axs = plt.subplots(1, 4, figsize=(16, 4))
    metrics = [("bubble", "simulated bubble", 1.0),
               ("memory", "compiled MiB / device", None),
               ("cpu_median_s", "step ms (process CPU)", 1e3),
               ("compile_s", "compile s", 1.0)]
    for ax, (k, title, scale) in zip(axs, metrics, strict=True):
        vals = [row[k]["total_bytes"] / 2**20 if k == "memory" else row[k] * scale
                for row in done]
        ax.barh(range(len(done)), vals)
        ax.set_yticks(range(len(done)), labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(title)
    save(fig, "sweep.png")
