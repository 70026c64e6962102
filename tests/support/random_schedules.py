"""Random valid schedules for property tests, written against the public API only.

A schedule is drawn as a random global execution order that respects every dependency
(forward chain, backward chain, I before W); each device's action list is that order
restricted to its stages, so the schedule never deadlocks. Placement is the loop
placement, or a V (two stages per device, down then back up); any backward may be split
into I + W with the W deferred by a random amount.
"""

from __future__ import annotations

import random

from hypothesis import strategies as st

import jaxpipe as jp


class ListedSchedule(jp.Schedule):
    """A schedule given by explicit per-device action lists and a placement table."""

    def __init__(self, lists: dict[int, list[jp.Action]], num_microbatches: int,
                 placement: list[int], stages_per_device: int):
        super().__init__(len(lists), num_microbatches, stages_per_device)
        self._lists = lists
        self._placement = placement

    def placement(self, stage: int) -> int:
        return self._placement[stage]

    def device_actions(self, device: int) -> list[jp.Action]:
        return list(self._lists[device])


def random_schedule(p: int, v: int, m: int, v_shape: bool, split_prob: float,
                    seed: int) -> ListedSchedule:
    rng = random.Random(seed)
    S = p * v
    if v_shape and v == 2:
        placement = [s if s < p else 2 * p - 1 - s for s in range(S)]
    else:
        placement = [s % p for s in range(S)]
    split = {(s, mb) for s in range(S) for mb in range(m) if rng.random() < split_prob}
    done: set[jp.Action] = set()
    lists: dict[int, list[jp.Action]] = {d: [] for d in range(p)}
    todo = set()
    for s in range(S):
        for mb in range(m):
            todo.add(jp.Action("F", s, mb))
            if (s, mb) in split:
                todo |= {jp.Action("I", s, mb), jp.Action("W", s, mb)}
            else:
                todo.add(jp.Action("B", s, mb))

    def ready(a: jp.Action) -> bool:
        s, mb = a.stage, a.microbatch
        if a.kind == "F":
            return s == 0 or jp.Action("F", s - 1, mb) in done
        if a.kind == "W":
            return jp.Action("I", s, mb) in done
        nxt = "I" if (s + 1, mb) in split else "B"
        return jp.Action("F", s, mb) in done and (
            s == S - 1 or jp.Action(nxt, s + 1, mb) in done)

    while todo:
        cands = sorted((a for a in todo if ready(a)), key=str)
        a = rng.choice(cands)
        todo.remove(a)
        done.add(a)
        lists[placement[a.stage]].append(a)
    return ListedSchedule(lists, m, placement, v)


@st.composite
def schedules(draw, max_devices: int = 4, max_microbatches: int = 5) -> ListedSchedule:
    """A random valid schedule (see the module docstring)."""
    p = draw(st.integers(1, max_devices))
    v = draw(st.integers(1, 2))
    m = draw(st.integers(1, max_microbatches))
    v_shape = draw(st.booleans())
    split_prob = draw(st.sampled_from([0.0, 0.5, 1.0]))
    seed = draw(st.integers(0, 2**16))
    return random_schedule(p, v, m, v_shape, split_prob, seed)
