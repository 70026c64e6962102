"""Lower a validated schedule to static per-tick tables for the SPMD runtime.

Ticks come from simulating the schedule with unit cost per action (each device runs its
actions in order, each as soon as its inputs exist; a value sent at the end of tick t
can be used at tick t+1). For every tick and device the table says which branch
(action kind x stage) runs, on which microbatch, where its residuals are written or read,
which inbox slot its input comes from, and where incoming messages are stored.

Buffers are sized by liveness: a residual set lives from the end of its F tick to its
last backward tick (B, or W when the backward is split), a message from the end of the
tick that sends it to the tick that consumes it. Residual storage is a flat pool per
dtype with first-fit offsets, so a device holding few large residual sets and one holding
many small ones both pay only what is live at once (the memory-aware cutter relies on
this); messages use fixed-size inbox slots.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from jaxpipe.schedule import Action, Schedule

__all__ = ["Lowered", "lower", "KINDS", "branch_index"]

KINDS = ("F", "B", "I", "W")
UNIT_COSTS = {"F": 1, "B": 1, "I": 1, "W": 1}


def branch_index(kind: str, stage: int, num_stages: int) -> int:
    """Branch 0 is idle; branch ``1 + kind * S + stage`` runs ``kind`` for ``stage``."""
    return 1 + KINDS.index(kind) * num_stages + stage


@dataclass
class Lowered:
    """Static tables and buffer sizes for one (schedule, stage sizes) pair."""

    num_ticks: int
    num_devices: int
    num_stages: int
    stages_per_device: int
    columns: dict[str, int]  # column name -> index into table's last axis
    table: np.ndarray  # int32 [ticks, devices, columns]
    perm_offsets: tuple[int, ...]  # each ppermute sends device d -> (d + offset) % D
    perm_active: np.ndarray  # bool [ticks, len(perm_offsets)]: someone sends this tick
    local_index: dict[int, int]  # stage -> index among its device's stages
    res_pool: dict[str, int]  # dtype -> residual pool elements needed (max over devices)
    wres_pool: dict[str, int]
    num_inbox: int  # message slots (max over devices)
    res_peak: list[int] = field(default_factory=list)  # per device: live residual sets
    inbox_peak: list[int] = field(default_factory=list)
    res_pool_per_device: list[dict[str, int]] = field(default_factory=list)

    def col(self, name: str) -> int:
        return self.columns[name]


def _first_fit(intervals: list[tuple[int, int, int, object]]) -> tuple[dict, int]:
    """Offsets for (start, end, size, key) half-open-in-time (start, end] intervals."""
    placed: list[tuple[int, int, int, int]] = []  # (start, end, offset, size)
    offsets = {}
    top = 0
    for start, end, size, key in sorted(intervals, key=lambda iv: (iv[0], -iv[2])):
        if size == 0:
            offsets[key] = 0
            continue
        busy = sorted((o, o + s) for (a, b, o, s) in placed if a < end and start < b)
        off = 0
        for lo, hi in busy:
            if off + size <= lo:
                break
            off = max(off, hi)
        offsets[key] = off
        placed.append((start, end, off, size))
        top = max(top, off + size)
    return offsets, top


def _peak(intervals) -> int:
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals],
                    key=lambda e: (e[0], e[1]))
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    return peak


def lower(
    schedule: Schedule,
    res_sizes: list[dict[str, int]],
    wres_sizes: list[dict[str, int]] | None = None,
) -> Lowered:
    """Build the tick tables for ``schedule``.

    Args:
      schedule: a schedule (validated here).
      res_sizes: per stage, elements of stored residuals per dtype.
      wres_sizes: per stage, elements the I half hands to the W half, per dtype.
    """
    schedule.validate()
    S, D = schedule.num_stages, schedule.num_devices
    # SPMD buffers need one shape: size by the device holding the most stages.
    spd = max(len(schedule.device_stages(d)) for d in range(D))
    wres_sizes = wres_sizes or [{} for _ in range(S)]
    timeline = schedule.simulate(costs=UNIT_COSTS)
    when: dict[Action, tuple[int, int]] = {}
    for ev in timeline.events:
        if int(ev.start) != ev.start:
            raise AssertionError(f"non-integral tick for {ev.action}")
        when[ev.action] = (ev.device, int(ev.start))
    T = int(timeline.makespan)
    place = {s: schedule.placement(s) for s in range(S)}
    local_index = {}
    for d in range(D):
        for k, s in enumerate(schedule.device_stages(d)):
            local_index[s] = k

    split = {(a.stage, a.microbatch) for a in when if a.kind == "I"}

    def bwd_in(s, mb):  # the action that consumes the cotangent for (s, mb)
        return Action("I" if (s, mb) in split else "B", s, mb)

    # Messages: (producer action, consumer action)
    messages = []
    for a in when:
        if a.kind == "F" and a.stage < S - 1:
            messages.append((a, Action("F", a.stage + 1, a.microbatch)))
        elif a.kind in ("B", "I") and a.stage > 0:
            messages.append((a, bwd_in(a.stage - 1, a.microbatch)))

    offsets = sorted({(place[c.stage] - place[p.stage]) % D for p, c in messages} - {0})
    dtypes_res = sorted({k for r in res_sizes for k in r})
    dtypes_wres = sorted({k for r in wres_sizes for k in r})
    names = ["branch", "mb", "in_slot", "local_dst"]
    names += [f"recv{j}" for j in range(len(offsets))]
    for k in dtypes_res:
        names += [f"res_w:{k}", f"res_wlen:{k}", f"res_r:{k}"]
    for k in dtypes_wres:
        names += [f"wres_w:{k}", f"wres_wlen:{k}", f"wres_r:{k}"]
    cols = {n: i for i, n in enumerate(names)}

    # Per-device liveness: residual sets and messages.
    res_iv = defaultdict(list)  # device -> (start, end, (s, mb))
    wres_iv = defaultdict(list)
    last_bwd: dict = {}
    for a, (_, t) in when.items():
        if a.kind != "F":
            key = (a.stage, a.microbatch)
            last_bwd[key] = max(last_bwd.get(key, t), t)
    for a, (d, t) in when.items():
        if a.kind == "F":
            res_iv[d].append((t, last_bwd[(a.stage, a.microbatch)], (a.stage, a.microbatch)))
        elif a.kind == "I":
            tw = when[Action("W", a.stage, a.microbatch)][1]
            wres_iv[d].append((t, tw, (a.stage, a.microbatch)))
    msg_iv = defaultdict(list)
    for p, c in messages:
        msg_iv[when[c][0]].append((when[p][1], when[c][1], (p, c)))

    res_off: dict = {}
    wres_off: dict = {}
    res_pool: dict[str, int] = {k: 0 for k in dtypes_res}
    wres_pool: dict[str, int] = {k: 0 for k in dtypes_wres}
    per_dev_pool = []
    for d in range(D):
        mine = {}
        for k in dtypes_res:
            ivs = [(a, b, res_sizes[s].get(k, 0), (s, mb)) for a, b, (s, mb) in res_iv[d]]
            off, top = _first_fit(ivs)
            res_off.update({(key, k): o for key, o in off.items()})
            res_pool[k] = max(res_pool[k], top)
            mine[k] = top
        per_dev_pool.append(mine)
        for k in dtypes_wres:
            ivs = [(a, b, wres_sizes[s].get(k, 0), (s, mb)) for a, b, (s, mb) in wres_iv[d]]
            off, top = _first_fit(ivs)
            wres_off.update({(key, k): o for key, o in off.items()})
            wres_pool[k] = max(wres_pool[k], top)
    msg_slot = {}
    num_inbox = 0
    for d in range(D):
        off, top = _first_fit([(a, b, 1, key) for a, b, key in msg_iv[d]])
        msg_slot.update(off)
        num_inbox = max(num_inbox, top)

    dummy_slot = num_inbox
    table = np.zeros((T, D, len(cols)), np.int32)
    table[:, :, cols["in_slot"]] = dummy_slot
    table[:, :, cols["local_dst"]] = dummy_slot
    for j in range(len(offsets)):
        table[:, :, cols[f"recv{j}"]] = dummy_slot
    perm_active = np.zeros((T, len(offsets)), bool)

    for a, (d, t) in when.items():
        row = table[t, d]
        s, mb = a.stage, a.microbatch
        row[cols["branch"]] = branch_index(a.kind, s, S)
        row[cols["mb"]] = mb
        if a.kind == "F":
            for k in dtypes_res:
                row[cols[f"res_w:{k}"]] = res_off[((s, mb), k)]
                row[cols[f"res_wlen:{k}"]] = res_sizes[s].get(k, 0)
        else:
            for k in dtypes_res:
                row[cols[f"res_r:{k}"]] = res_off[((s, mb), k)]
        if a.kind == "I":
            for k in dtypes_wres:
                row[cols[f"wres_w:{k}"]] = wres_off[((s, mb), k)]
                row[cols[f"wres_wlen:{k}"]] = wres_sizes[s].get(k, 0)
        if a.kind == "W":
            for k in dtypes_wres:
                row[cols[f"wres_r:{k}"]] = wres_off[((s, mb), k)]
    for p, c in messages:
        (dp, tp), (dc, tc) = when[p], when[c]
        slot = msg_slot[(p, c)]
        table[tc, dc, cols["in_slot"]] = slot
        if dp == dc:
            table[tp, dp, cols["local_dst"]] = slot
        else:
            j = offsets.index((dc - dp) % D)
            table[tp, dc, cols[f"recv{j}"]] = slot
            perm_active[tp, j] = True

    return Lowered(
        num_ticks=T, num_devices=D, num_stages=S, stages_per_device=spd, columns=cols,
        table=table, perm_offsets=tuple(offsets), perm_active=perm_active,
        local_index=local_index, res_pool=res_pool, wres_pool=wres_pool,
        num_inbox=num_inbox,
        res_peak=[_peak([(a, b) for a, b, _ in res_iv[d]]) for d in range(D)],
        inbox_peak=[_peak([(a, b) for a, b, _ in msg_iv[d]]) for d in range(D)],
        res_pool_per_device=per_dev_pool,
    )
