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
    store: dict[str, int]  # dtype -> elements of residual storage (max over devices)
    num_inbox: int  # message slots (max over devices)
    res_peak: list[int] = field(default_factory=list)  # per device: live residual sets
    pool_per_device: list[dict[str, int]] = field(default_factory=list)  # dtype -> elements

    def col(self, name: str) -> int:
        return self.columns[name]

    @property
    def res_pool(self) -> dict[str, int]:
        """Residual storage elements per dtype the program allocates per device."""
        return dict(self.store)


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


# Storage pools: (action kind that writes, action kinds that read). Residuals are stored
# in two parts: "resa" (what only the input-gradient needs: freed after B or I) and "resb"
# (what the weight-gradient W also needs: freed after B or W). "wres" is what I hands to W.
POOLS = {
    "resa": ("F", ("B", "I")),
    "resb": ("F", ("B", "I", "W")),
    "wres": ("I", ("W",)),
}


def lower(schedule: Schedule, pool_sizes: dict[str, list[dict[str, int]]]) -> Lowered:
    """Build the tick tables for ``schedule``.

    Args:
      schedule: a schedule (validated here).
      pool_sizes: for each pool in :data:`POOLS`, per stage, elements per dtype that one
        microbatch stores there.
    """
    schedule.validate()
    S, D = schedule.num_stages, schedule.num_devices
    # SPMD buffers need one shape: size by the device holding the most stages.
    spd = max(len(schedule.device_stages(d)) for d in range(D))
    pool_sizes = {name: pool_sizes.get(name) or [{} for _ in range(S)] for name in POOLS}
    timeline = schedule.simulate(costs=UNIT_COSTS)
    when: dict[Action, tuple[int, int]] = {}
    for ev in timeline.events:
        if int(ev.start) != ev.start:
            raise AssertionError(f"non-integral tick for {ev.action}")
        when[ev.action] = (ev.device, int(ev.start))
    T = int(timeline.makespan)
    place = {s: schedule.placement(s) for s in range(S)}

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
    dtypes = {name: sorted({k for r in sizes for k in r}) for name, sizes in pool_sizes.items()}
    names = ["branch", "mb", "in_slot", "local_dst"]
    names += [f"recv{j}" for j in range(len(offsets))]
    for name in POOLS:
        for k in dtypes[name]:
            names += [f"{name}_w:{k}", f"{name}_r:{k}"]
    cols = {n: i for i, n in enumerate(names)}

    # Liveness per pool: from the writer's tick to the last reader's tick. All pools share
    # one storage per dtype, so parts freed early (I-only residuals) make room for others
    # and the size is the peak of what is live at once, not a sum of per-pool peaks.
    actions_of: dict = defaultdict(dict)  # (s, mb) -> kind -> tick
    for a, (_, t) in when.items():
        actions_of[(a.stage, a.microbatch)][a.kind] = t
    store_keys = sorted({k for name in POOLS for k in dtypes[name]})
    pool_off: dict = {}
    store = {k: 0 for k in store_keys}
    per_dev_pool = []
    res_peak = []
    for d in range(D):
        keys = [(a.stage, a.microbatch) for a, (dd, _) in when.items()
                if dd == d and a.kind == "F"]
        ivs = []
        for name, (writer, readers) in POOLS.items():
            for key in keys:
                ticks = actions_of[key]
                if writer in ticks:
                    last = max((ticks[r] for r in readers if r in ticks), default=ticks[writer])
                    ivs.append((ticks[writer], last, name, key))
        mine = {}
        for k in store_keys:
            off, top = _first_fit([(a, b, pool_sizes[name][key[0]].get(k, 0), (name, key))
                                   for a, b, name, key in ivs])
            pool_off.update({(name, key, k): o for (name, key), o in off.items()})
            store[k] = max(store[k], top)
            mine[k] = top
        per_dev_pool.append(mine)
        # residual *sets* live from F to the last backward action (the simulator's count)
        res_peak.append(_peak([(actions_of[key]["F"], max(t for kd, t in actions_of[key].items()
                                                          if kd != "F")) for key in keys]))
    msg_iv = defaultdict(list)
    for p, c in messages:
        msg_iv[when[c][0]].append((when[p][1], when[c][1], (p, c)))
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
        key = (a.stage, a.microbatch)
        row[cols["branch"]] = branch_index(a.kind, a.stage, S)
        row[cols["mb"]] = a.microbatch
        for name, (writer, readers) in POOLS.items():
            for k in dtypes[name]:
                off = pool_off.get((name, key, k))
                if off is None:
                    continue
                if a.kind == writer:
                    row[cols[f"{name}_w:{k}"]] = off
                elif a.kind in readers:
                    row[cols[f"{name}_r:{k}"]] = off
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
        store=store, num_inbox=num_inbox, res_peak=res_peak,
        pool_per_device=per_dev_pool,
    )
