"""Print the simulated bubble/memory table of every schedule (built-in and gallery).

    python schedules/table.py            # p=4, m=8 and p=8, m=32, markdown

Costs F=1, B=2, I=1, W=1 (the simulator's defaults). Columns:

- ``v``: stages per device. Stages of a ``v``-stage schedule are ``v`` times
  smaller, so one of its stage-microbatches is ``1/v`` of a 1F1B one.
- ``bubble``: ``Timeline.bubble_fraction`` (idle / (makespan * p)).
- ``idle / 1F1B``: total idle time relative to 1F1B's, with every action of a
  ``v``-stage schedule costing ``1/v`` (its stages are smaller).
- ``peak in-flight``: most residual sets live on one device (max over devices),
  in stage-microbatches; a residual set lives from its ``F`` until its ``B`` (or
  ``W``, when the backward is split into ``I`` + ``W``).
- ``act. mem / 1F1B``: that peak in units of a 1F1B stage-microbatch
  (``peak / v``), divided by 1F1B's peak ``min(p, m)``.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import jaxpipe as jp

HERE = Path(__file__).resolve().parent

#: (label, schedule class or "file.py:Class" under schedules/, extra constructor kwargs)
SCHEDULES: list[tuple[str, str, dict]] = [
    ("GPipe", "gpipe", {}),
    ("1F1B", "1f1b", {}),
    ("Interleaved1F1B (v=2)", "interleaved", {"stages_per_device": 2}),
    ("Eager1F1B", "eager_1f1b.py:Eager1F1B", {}),
    ("LoopedBFS (v=2)", "looped_bfs.py:LoopedBFS", {}),
    ("ZeroBubbleH1", "zero_bubble.py:ZeroBubbleH1", {}),
    ("DualPipeV", "dualpipe_v.py:DualPipeV", {}),
    ("VHalf", "v_half.py:VHalf", {}),
]


def load(spec: str) -> type[jp.Schedule]:
    """A built-in name, or ``file.py:Class`` relative to this folder."""
    return jp.load_schedule(str(HERE / spec) if ":" in spec else spec)


def row(label: str, schedule: jp.Schedule, baseline: jp.Timeline) -> dict:
    """One table row: the metrics above for ``schedule``."""
    v = schedule.stages_per_device
    timeline = schedule.simulate()
    scaled_idle = Fraction(timeline.idle_time) / v
    peak = max(timeline.peak_in_flight)
    return {
        "schedule": label,
        "v": v,
        "bubble": timeline.bubble_fraction,
        "idle_vs_1f1b": float(scaled_idle / Fraction(baseline.idle_time)),
        "peak": peak,
        "mem_vs_1f1b": peak / v / max(baseline.peak_in_flight),
    }


def table(p: int, m: int) -> list[dict]:
    """Rows for every schedule at ``p`` devices and ``m`` microbatches."""
    baseline = jp.OneFOneB(p, m).simulate()
    return [row(label, load(spec)(p, m, **kw), baseline) for label, spec, kw in SCHEDULES]


def markdown(p: int, m: int) -> str:
    lines = [
        f"p={p}, m={m}\n",
        "| schedule | v | bubble | idle / 1F1B | peak in-flight | act. mem / 1F1B |",
        "|---|---|---|---|---|---|",
    ]
    for r in table(p, m):
        lines.append(
            f"| {r['schedule']} | {r['v']} | {r['bubble']:.3f} | {r['idle_vs_1f1b']:.2f} "
            f"| {r['peak']} | {r['mem_vs_1f1b']:.2f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    for p, m in [(4, 8), (8, 32)]:
        print(markdown(p, m))
        print()
