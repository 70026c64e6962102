"""Step 3 of the lowering: every value that crosses from one action to another.

The stage carry (F -> next stage's F) and the cotangent (B/I -> previous stage's B/I),
with the step at whose end each is available to its reader's device; and
:func:`merge_exchanges`, which moves messages between two devices together, at as few tick
ends as their readers allow.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from jaxpipe.runtime.spmd.lowering.types import Messages, Ticks
from jaxpipe.schedule.graph import KB, KF, KI

__all__ = ["list_messages", "meeting_points", "merge_exchanges"]


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


def merge_exchanges(ticks: Ticks, messages: Messages) -> Messages:
    """``messages`` with the ones between devices moved at as few tick ends per pair of
    devices as their readers allow (the CPU program's lazy exchange).

    Two devices meet wherever a message moves between them (:mod:`.sync`); every meeting
    is a collective (~0.1 ms between processes) and a point where the faster side waits.
    A message may move at the end of any tick from its producer's to the one before its
    reader's. Per pair of devices (both directions), the fewest tick ends that give each
    message one in its window are the greedy's (by window end: a new meeting at the end
    of the first window no meeting reaches); each message then moves at the first meeting
    from its producer's tick on, so none waits in the outbox across a meeting of its pair
    (a sender's outbox units are then numbered per meeting, :func:`~.table.fill_table`).
    """
    remote = np.flatnonzero(messages.src != messages.dst)
    if not len(remote):
        return messages
    first = ticks.tick_of(messages.sent[remote])
    last = np.maximum(ticks.tick[messages.consumer[remote]] - 1, first)
    src, dst = messages.src[remote], messages.dst[remote]
    pair = np.minimum(src, dst) * len(ticks.graph.lists) + np.maximum(src, dst)
    at = first.copy()
    for key in np.unique(pair):
        idx = np.flatnonzero(pair == key)
        points = np.asarray(meeting_points(zip(first[idx].tolist(), last[idx].tolist(),
                                               strict=True)), np.int64)
        at[idx] = points[np.searchsorted(points, first[idx])]
    sent = messages.sent.copy()
    sent[remote] = ticks.tick_end[at]
    return Messages(messages.producer, messages.consumer, messages.src, messages.dst, sent,
                    messages.read)


def meeting_points(windows: Iterable[tuple[int, int]]) -> list[int]:
    """The fewest ticks, ascending, that give each ``(first, last)`` window one inside it:
    the greedy by window end (a new point at the end of the first window the points so
    far miss). Each window's first point from its start on is inside it."""
    points: list[int] = []
    for first, last in sorted(windows, key=lambda w: w[1]):
        if not points or first > points[-1]:
            points.append(last)
    return points
