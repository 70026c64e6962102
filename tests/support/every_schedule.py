"""Every built-in and gallery schedule by name, as ``(p, m) -> Schedule`` (v=2 where a
schedule has chunks): the grid the accelerator-program tests run on."""

from pathlib import Path

import jaxpipe as jp

GALLERY = Path(__file__).resolve().parents[2] / "schedules"


def _gallery(spec: str):
    return jp.load_schedule(str(GALLERY / spec))


EVERY_SCHEDULE = {
    "GPipe": jp.GPipe,
    "1F1B": jp.OneFOneB,
    "Interleaved1F1B": lambda p, m: jp.Interleaved1F1B(p, m, stages_per_device=2),
    "Eager1F1B": _gallery("eager_1f1b.py:Eager1F1B"),
    "LoopedBFS": _gallery("looped_bfs.py:LoopedBFS"),
    "ZeroBubbleH1": _gallery("zero_bubble.py:ZeroBubbleH1"),
    "DualPipeV": _gallery("dualpipe_v.py:DualPipeV"),
    "VHalf": _gallery("v_half.py:VHalf"),
}
