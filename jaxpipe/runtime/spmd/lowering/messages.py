"""Step 3 of the lowering: every value that crosses from one action to another.

The stage carry (F -> next stage's F) and the cotangent (B/I -> previous stage's B/I),
with the step at whose end each is available to its reader's device.
"""

from __future__ import annotations

import numpy as np

from jaxpipe.runtime.spmd.lowering.types import Messages, Ticks
from jaxpipe.schedule.graph import KB, KF, KI

__all__ = ["list_messages"]


def list_messages(ticks: Ticks, delay: int = 1) -> Messages:
    """Every stage carry (F -> next stage's F) and cotangent (B/I -> previous stage's B/I),
    ordered by the producer's step and device. A message to another device arrives at
    the end of its producer's tick, or ``delay - 1`` ticks later (``Exchange.delay``)."""
    graph = ticks.graph
    kind, data = graph.kinds, graph.data_deps
    carry = (kind == KF) & (data[:, 0] >= 0)
    cotangent = ((kind == KB) | (kind == KI)) & (data[:, 1] >= 0)
    c = np.flatnonzero(carry | cotangent)
    p = np.where(carry[c], data[c, 0], data[c, 1])
    order = np.lexsort((c, ticks.device[p], ticks.step[p]))
    p, c = p[order], c[order]
    src, dst = ticks.device[p], ticks.device[c]
    arrival = np.minimum(ticks.tick[p] + delay - 1, ticks.num_ticks - 1)
    sent = np.where(src == dst, ticks.step[p], ticks.tick_end[arrival])
    return Messages(p, c, src, dst, sent, ticks.step[c])
