"""What-if: messages delivered a tick late, so their transfer overlaps the next tick.

    python benchmarks/probes/late_delivery.py             # table + results/late_delivery.json
    python benchmarks/probes/late_delivery.py --transfer 0,0.1,0.3 --ps 4,8

The program exchanges a tick's messages at its end: every pair that exchanges a message
then meets and pays the transfer before the next tick starts (the sync model,
:mod:`jaxpipe.runtime.spmd.lowering.sync`). Where collectives run on their own
stream, the exchange of tick ``t``'s messages could run during tick ``t + 1`` and be read
from ``t + 2`` on: a device then waits, at the end of ``t + 1``, for its partners' end of
``t`` plus the transfer. This script prices three programs under that model, in the
schedule's own asynchronous makespan with free transfers over the program's makespan:

- ``now``: the lowering as it is (every message exchanged at the end of its tick);
- ``slack``: the same ticks, a message exchanged a tick late wherever its reader runs two
  or more ticks after its writer (never slower than ``now``);
- ``late``: every message a tick late, ticks reassigned so that a reader runs at least
  two ticks after another device's writer.

``--transfer`` is the transfer time per message tick in units of the mean forward cost.
Deterministic (no timing). Nothing here is built into the runtime: it measures whether
building it is worth it (it needs an accelerator to measure, see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]


def reader_ticks(graph: Any, remote_latency: int) -> np.ndarray:
    """Per action, its tick: unit-cost, one action per device per tick, and a reader at
    least ``remote_latency`` ticks after another device's writer (1 after its own)."""
    tick = np.zeros(len(graph.actions), np.int64)
    for k in range(len(graph.actions)):  # actions are in dependency order
        t = tick[graph.prev[k]] + 1 if graph.prev[k] >= 0 else 0
        for q in graph.data_deps[k]:
            if q >= 0:
                gap = 1 if graph.devices[q] == graph.devices[k] else remote_latency
                t = max(t, tick[q] + gap)
        tick[k] = t
    return tick


def makespan(graph: Any, tick: np.ndarray, cost: Any, transfer: float, late: str) -> float:
    """The program's makespan when ``late`` (``"none"``, ``"slack"`` or ``"all"``)
    messages are exchanged during the tick after their writer's."""
    D, n_ticks = len(graph.lists), int(tick.max()) + 1
    work = np.zeros((n_ticks, D))
    np.add.at(work, (tick, graph.devices), [cost(a) for a in graph.actions])
    now = [set() for _ in range(n_ticks)]
    later = [set() for _ in range(n_ticks)]
    for k in range(len(graph.actions)):
        for q in graph.data_deps[k]:
            if q >= 0 and graph.devices[q] != graph.devices[k]:
                pair = (int(graph.devices[q]), int(graph.devices[k]))
                slack = tick[k] >= tick[q] + 2
                (later if late == "all" or (late == "slack" and slack) else now)[tick[q]].add(pair)
    clock, pending = np.zeros(D), None
    for t in range(n_ticks):
        done = clock + work[t]
        new = done.copy()
        if pending is not None:  # last tick's late messages arrive by the end of this one
            pairs, base = pending
            new = np.maximum(new, _met(base, pairs, transfer))
        if now[t]:
            new = np.maximum(new, _met(done, now[t], transfer))
        pending = (later[t], done) if later[t] else None
        clock = new
    return float(clock.max())


def _met(clock: np.ndarray, pairs: set[tuple[int, int]], transfer: float) -> np.ndarray:
    """Each device's clock after meeting the partners it exchanges with (pairs), plus the
    transfer where it exchanges anything."""
    from jaxpipe.runtime.spmd.lowering.sync import meet

    src, dst = (np.array(x, np.int64) for x in zip(*sorted(pairs), strict=True))
    return meet(clock, src, dst, transfer)


def measure(ps: tuple[int, ...], transfers: tuple[float, ...], layers: int = 16
            ) -> list[dict[str, Any]]:
    from benchmarks.sections.lowering import gpt_costs, schedules
    from jaxpipe import Action
    from jaxpipe.runtime.spmd.lowering import expand
    from jaxpipe.runtime.spmd.lowering.sync import split_cost

    rows = []
    for name, make in schedules():
        for p in ps:
            for m in (2 * p, 4 * p):
                try:
                    sched = make(p, m)
                    sched.validate()
                except Exception:  # noqa: BLE001 - e.g. DualPipeV needs m >= 2p
                    continue
                cost = gpt_costs(sched, layers)
                unit = float(np.mean([cost(Action("F", s, 0))
                                      for s in range(sched.num_stages)]))
                asyn = sched.simulate(cost).makespan
                run, split = expand(sched, True)  # I+W: what runs where devices overlap
                graph, c = run.graph(), split_cost(cost, split)
                ticks = {1: reader_ticks(graph, 1), 2: reader_ticks(graph, 2)}
                for tr in transfers:
                    row = {"schedule": name, "p": p, "m": m, "transfer": tr}
                    for key, lat, late in (("now", 1, "none"), ("slack", 1, "slack"),
                                           ("late", 2, "all")):
                        row[key] = asyn / makespan(graph, ticks[lat], c, tr * unit, late)
                    rows.append(row)
                    print(f"{name:16s} p={p} m={m:2d} transfer {tr:.1f}: now "
                          f"{row['now']:.3f}  slack {row['slack']:.3f}  late {row['late']:.3f}",
                          flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ps", default="4,8")
    ap.add_argument("--transfer", default="0,0.3",
                    help="transfer time per message tick, in mean forward costs")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    rows = measure(tuple(int(x) for x in args.ps.split(",")),
                   tuple(float(x) for x in args.transfer.split(",")))
    from benchmarks import common as C

    C.write_json(args.out, "late_delivery.json", {"rows": rows}, indent=1)
    return rows


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    from benchmarks.cpu_setup import virtual_cpus  # (imports no jax)

    virtual_cpus(8)
    main()
