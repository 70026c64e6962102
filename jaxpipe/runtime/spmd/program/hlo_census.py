"""What a compiled program's tick loop holds, read from its optimized HLO text.

What XLA:GPU and TPU do with the program can be read from its HLO on any backend: a
``while`` whose trip count XLA does not know, or a ``conditional``, makes XLA:GPU wait
for the device on the host (every iteration, every execution); a collective-permute
inside a conditional cannot overlap compute; a ``copy`` of a buffer inside the loop
costs its bytes every tick. :func:`census` finds the tick loop (the outermost ``while``
whose body reaches a collective-permute) and counts those inside it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["TickLoopCensus", "census"]

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_CALLED = re.compile(r"(?:calls|to_apply|body|condition|true_computation|"
                     r"false_computation)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_COPY = re.compile(r"= (\w+\[[\d,]*\])\{[\d,]*\} copy\(%(?:get-tuple-element|param)")


@dataclass(frozen=True)
class TickLoopCensus:
    """The tick loop of a compiled program and what runs inside it.

    Attributes:
      trip_count: the tick loop's trip count, if XLA knows it.
      unknown_trip_whiles: ``while`` loops inside it whose trip count XLA does not know.
      known_trip_whiles: ``while`` loops inside it whose trip count it knows (a scanned
        layer stack, say).
      conditionals: ``conditional`` instructions inside it.
      permutes: collective-permutes inside it (an async start/done pair counts once).
      permutes_in_conditionals: those of them inside a conditional's branches.
      copied: the shapes of the buffers copied inside it: ``copy`` of a loop-carried or
        passed-in value (a tuple element or a parameter; copies of computed values, a
        transpose's change of layout say, left out).
    """

    trip_count: int | None
    unknown_trip_whiles: int
    known_trip_whiles: int
    conditionals: int
    permutes: int
    permutes_in_conditionals: int
    copied: tuple[str, ...]


def census(hlo: str) -> TickLoopCensus:
    """:class:`TickLoopCensus` of the optimized HLO text ``hlo`` (``compiled.as_text()``);
    raises ``ValueError`` when no ``while`` reaches a collective-permute."""
    bodies: dict[str, list[str]] = {}
    entry = None
    current: list[str] | None = None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m and not line.startswith(" "):
            current = bodies.setdefault(m.group(1), [])
            if line.startswith("ENTRY"):
                entry = m.group(1)
            continue
        if current is not None and line.startswith(" "):
            current.append(line)

    def called(line: str) -> list[str]:
        out = _CALLED.findall(line)
        b = _BRANCHES.search(line)
        if b:
            out += [x.strip().lstrip("%") for x in b.group(1).split(",") if x.strip()]
        return out

    def reach(roots: list[str]) -> set[str]:
        seen: set[str] = set()
        stack = list(roots)
        while stack:
            c = stack.pop()
            if c in seen or c not in bodies:
                continue
            seen.add(c)
            for line in bodies[c]:
                stack.extend(called(line))
        return seen

    def has_permute(comps: set[str]) -> bool:
        return any(_is_permute(line) for c in comps for line in bodies[c])

    # the outermost while reaching a permute: search from the entry, not into such loops
    loop = None
    stack, seen = [entry], set()
    while stack and loop is None:
        c = stack.pop()
        if c in seen or c not in bodies:
            continue
        seen.add(c)
        for line in bodies[c]:
            if " while(" in line:
                body = re.search(r"body=%([\w.\-]+)", line).group(1)
                if has_permute(reach([body])):
                    loop = line
                    break
            stack.extend(called(line))
    if loop is None:
        raise ValueError("no while loop in this program reaches a collective-permute")
    inside = reach(called(loop))
    lines = [line for c in inside for line in bodies[c]]
    in_branches = reach([b for line in lines if " conditional(" in line
                         for b in called(line)])
    whiles = [line for line in lines if " while(" in line]
    known = sum("known_trip_count" in line for line in whiles)
    trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop)
    copied = tuple(sorted(m.group(1) for line in lines for m in [_COPY.search(line)] if m))
    return TickLoopCensus(
        trip_count=int(trip.group(1)) if trip else None,
        unknown_trip_whiles=len(whiles) - known,
        known_trip_whiles=known,
        conditionals=sum(" conditional(" in line for line in lines),
        permutes=sum(_is_permute(line) for line in lines),
        permutes_in_conditionals=sum(_is_permute(line) for c in in_branches
                                     for line in bodies[c]),
        copied=copied)


def _is_permute(line: str) -> bool:
    return " collective-permute(" in line or " collective-permute-start(" in line
