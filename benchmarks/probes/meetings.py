"""Which devices meet at a tick, and when ticks start: what the V schedules would gain.

    python benchmarks/probes/meetings.py                  # V schedules and 1F1B, p in {4, 8}
    python benchmarks/probes/meetings.py --ps 8 --schedules DualPipeV

Until the program's permutations listed only the pairs that exchange at a tick (what the
sync model, :mod:`jaxpipe.runtime.spmd.lowering.sync`, now describes: rule ``tick`` below), it ran
one ``lax.ppermute`` per offset over *all* devices (``d -> d + offset`` around the ring),
so a V schedule's device 0 also met device p-1, with which it never exchanges a message,
and every device met its neighbours at every tick someone sent. This script evaluates the
lowered makespan under three meeting rules and two ways of choosing ticks, for the GPT
benchmark model's per-stage costs with every backward run as I then W
(``split_backward=True``, what the runtime does where devices run concurrently):

- meetings ``offset``: the program before per-tick permutations;
- ``pair``: only pairs that exchange some message ever meet (a ``ppermute`` whose
  permutation lists those pairs only);
- ``tick``: only pairs that exchange a message at that tick meet (the program now: one
  ``ppermute`` per direction and tick, listing those pairs);
- ticks ``unit``: the lowering's (each action at its unit-cost simulation start);
- ticks ``grid``: each action at its start in the schedule's own simulation with the real
  costs, in steps of the cheapest action, later where a message or its device needs it.

Deterministic: no timing. Writes ``meetings.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]


def unit_ticks(run: Any) -> np.ndarray:
    """The lowering's tick of every action of ``run`` (the expanded schedule)."""
    from jaxpipe.runtime.spmd.lowering import assign_ticks

    return np.asarray(assign_ticks(run).tick)


def grid_ticks(run: Any, costs: np.ndarray) -> np.ndarray:
    """Ticks from the real-cost simulation, one per cheapest action's length, each action
    at least one tick after a remote producer and after its device's previous action
    (the lowering's own cost-grid ticks, :func:`~jaxpipe.runtime.spmd.lowering.assign_ticks`)."""
    from jaxpipe.runtime.spmd.lowering import assign_ticks

    return np.asarray(assign_ticks(run, costs=costs).tick)


def makespan(run: Any, costs: np.ndarray, tick: np.ndarray, meet: str) -> float:
    """The lowered makespan under the sync model with meeting rule ``meet``."""
    g = run.graph()
    D, T = run.num_devices, int(tick.max()) + 1
    work = np.zeros((T, D))
    np.add.at(work, (tick, g.devices), costs)
    sends: dict[int, set[tuple[int, int]]] = {}
    for k, deps in enumerate(g.data_deps.tolist()):
        for dep in deps:
            if dep >= 0 and g.devices[dep] != g.devices[k]:
                sends.setdefault(int(tick[dep]), set()).add((int(g.devices[dep]),
                                                             int(g.devices[k])))
    ever = set().union(*sends.values()) if sends else set()
    clock = np.zeros(D)
    for t in range(T):
        clock = clock + work[t]
        if t not in sends:
            continue
        if meet == "tick":
            pairs = sends[t]
        else:
            offsets = {(d - s) % D for s, d in sends[t]}
            pairs = {(s, (s + o) % D) for o in offsets for s in range(D)}
            if meet == "pair":
                pairs &= {(s, d) for s, d in ever if (d - s) % D in offsets}
        new = clock.copy()
        for s, d in pairs:
            both = max(clock[s], clock[d])
            new[s], new[d] = max(new[s], both), max(new[d], both)
        clock = new
    return float(clock.max())


def measure(names: list[str], ps: list[int]) -> list[dict[str, Any]]:
    from benchmarks.sections.lowering import gpt_costs, schedules
    from jaxpipe.runtime.spmd.lowering import expand
    from jaxpipe.runtime.spmd.lowering.sync import split_cost

    rows = []
    for name, make in schedules():
        if name not in names:
            continue
        for p in ps:
            sched = make(p, 2 * p)
            cost = gpt_costs(sched, 16)
            run, split = expand(sched, True)
            c = split_cost(cost, split)
            costs = np.array([c(a) for a in run.graph().actions], float)
            asyn = sched.simulate(cost).makespan
            ticks = {"unit": unit_ticks(run), "grid": grid_ticks(run, costs)}
            row: dict[str, Any] = {"schedule": name, "p": p, "m": 2 * p}
            for tname, tick in ticks.items():
                for meet in ("offset", "pair", "tick"):
                    row[f"{tname}/{meet}"] = asyn / makespan(run, costs, tick, meet)
            rows.append(row)
            print(f"{name:>16} p={p} m={2 * p}: " + "  ".join(
                f"{k} {v:.3f}" for k, v in row.items() if "/" in k), flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schedules", default="DualPipeV,VHalf,1F1B")
    ap.add_argument("--ps", default="4,8")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    rows = measure(args.schedules.split(","), [int(x) for x in args.ps.split(",")])
    from benchmarks import common as C

    C.write_json(args.out, "meetings.json", rows)
    return rows


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    from benchmarks.cpu_setup import virtual_cpus  # (imports no jax)

    virtual_cpus(8)
    main()
