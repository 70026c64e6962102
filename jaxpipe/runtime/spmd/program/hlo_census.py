"""What a compiled program's tick loop holds, read from its optimized HLO text.

What XLA:CPU, GPU and TPU made of the program can be read from ``compiled.as_text()`` on
any machine (``jaxpipe.aot`` compiles for GPUs and TPUs without one). :func:`census` finds
the tick loop (the outermost ``while`` whose body reaches a collective-permute) and counts
what runs inside it, per tick:

- whiles of unknown trip count: XLA:GPU copies the loop predicate to the host and waits
  on it every iteration (TPUs loop on the device's scalar core; there it costs little).
  XLA:CPU and GPU note a known trip count in the while's ``backend_config``; XLA:TPU
  does not, so it is read from the loop instead: the condition's ``compare`` of a tuple
  element against a constant, that element's initial constant and its constant step.
- conditionals: XLA:GPU reads the branch index on the host (a wait per tick); a
  collective inside a branch cannot overlap the work outside it.
- permutes and their overlap windows: GPU and TPU split a collective-permute into a
  ``collective-permute-start`` and a ``-done`` (or wrap it in ``async-start`` /
  ``async-done``), and the scheduled body (``is_scheduled=true``: text order is run
  order) places work between them. Work in that window (the tick's ``conditional``, a
  dot, a convolution, a GEMM fusion or custom call) runs while the message is in flight;
  an empty window, or a synchronous permute, exposes the transfer every tick.
- other collectives (all-gather, all-reduce, reduce-scatter, all-to-all: tensor or data
  parallelism inside the stages), a start/done pair counted once.
- copies of carried buffers: a ``copy`` of a loop-carried or passed-in value costs its
  bytes every tick. TPU layouts carry tiling and memory space
  (``f32[1,2,4,8]{3,2,1,0:T(4,128)S(1)}``); shapes are reported without them. TPU memory
  space assignment also moves carried buffers between HBM and VMEM (``S(1)``) with
  ``copy-start`` / ``copy-done``, which overlap compute: reported apart, as
  ``async_copied``.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field

from jaxpipe.runtime.spmd.program.hlo_text import PERMUTE, Instr, Module

__all__ = ["PermuteWindow", "TickLoopCensus", "census", "loop_conditionals"]

_ARRAY = re.compile(r"^\(?(\w+\[[\d,]*\])")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}


@dataclass(frozen=True)
class PermuteWindow:
    """A collective-permute inside the tick loop and what its computation's schedule runs
    while it is in flight (between its start and its done).

    Attributes:
      name: the start instruction (the permute itself when synchronous).
      start_index, done_index: their positions in their computation's schedule (equal for
        a synchronous permute).
      between: instructions scheduled strictly between them.
      overlaps_conditional: whether a ``conditional`` (the tick's switch) is among them.
      compute_between: those of them doing real work: a dot, convolution, GEMM fusion or
        custom call, or a conditional / while / call reaching one.
    """

    name: str
    start_index: int
    done_index: int
    between: int
    overlaps_conditional: bool
    compute_between: int


@dataclass(frozen=True)
class TickLoopCensus:
    """The tick loop of a compiled program and what runs inside it (each tick).

    Attributes:
      trip_count: the tick loop's trip count, if XLA notes it (CPU, GPU) or its condition
        shows it (TPU: induction variable against a constant).
      unknown_trip_whiles: ``while`` loops inside it whose trip count is known neither way.
      known_trip_whiles: ``while`` loops inside it whose trip count is known (a scanned
        layer stack, say).
      conditionals: ``conditional`` instructions inside it.
      permutes: collective-permutes inside it (an async start/done pair counts once).
      permutes_in_conditionals: those of them inside a conditional's branches.
      copied: the shapes of the buffers copied inside it: ``copy`` of a loop-carried or
        passed-in value (a tuple element or a parameter, a fusion's too; copies of
        computed values, a transpose's output say, and scalars left out).
      windows: one :class:`PermuteWindow` per permute, the tick body's first.
      collectives: other collectives inside it (all-gather, all-reduce, reduce-scatter,
        all-to-all...; an async pair counts once).
      collectives_in_conditionals: those of them inside a conditional's branches.
      collective_ops: their count by op name (``{"all-reduce": 2}``).
      copies_in_conditionals: how many of ``copied`` are inside a conditional's branches
        (they cost only in the ticks that take the branch).
      relayout_copies: how many of ``copied`` change the value's layout (minor-to-major
        order or tiling: a transpose XLA chose); the others copy it as it is (XLA could
        not update the carried buffer in place).
      async_copied: shapes of loop-carried or passed-in values moved by ``copy-start``
        (TPU: between HBM and VMEM; overlaps compute, still bandwidth every tick).
    """

    trip_count: int | None
    unknown_trip_whiles: int
    known_trip_whiles: int
    conditionals: int
    permutes: int
    permutes_in_conditionals: int
    copied: tuple[str, ...]
    windows: tuple[PermuteWindow, ...] = ()
    collectives: int = 0
    collectives_in_conditionals: int = 0
    collective_ops: dict[str, int] = field(default_factory=dict)
    copies_in_conditionals: int = 0
    relayout_copies: int = 0
    async_copied: tuple[str, ...] = ()

    def summary(self) -> str:
        """A few readable lines (``jaxpipe compile`` prints them under "tick loop:")."""
        trips = "unknown" if self.trip_count is None else self.trip_count
        out = [f"trips: {trips}; inside: {self.unknown_trip_whiles} whiles of unknown trip "
               f"count, {self.known_trip_whiles} of known, {self.conditionals} conditionals",
               f"permutes: {self.permutes} ({self.permutes_in_conditionals} in conditionals)"]
        bare = [w.name for w in self.windows if not w.between]
        if bare:
            out.append(f"  {len(bare)} overlapping nothing (synchronous, or done right after "
                       f"start): {', '.join(bare[:3])}{', ...' if len(bare) > 3 else ''}")
        out += [f"  {w.name}: {w.between} instructions until its done, {w.compute_between} "
                f"compute, the conditional {'inside' if w.overlaps_conditional else 'outside'}"
                for w in self.windows if w.between]
        ops = ", ".join(f"{k} {v}" for k, v in sorted(self.collective_ops.items()))
        out.append(f"other collectives: {self.collectives} ({self.collectives_in_conditionals}"
                   f" in conditionals){': ' + ops if ops else ''}")
        shapes = ", ".join(f"{k} x{n}" if n > 1 else k for k, n in Counter(self.copied).items())
        out.append(f"copies of carried buffers: {len(self.copied)}, {_bytes(self.copied)} bytes "
                   f"({self.copies_in_conditionals} in conditionals, {self.relayout_copies} "
                   f"changing layout){': ' + shapes if shapes else ''}")
        if self.async_copied:
            out.append(f"async copies (copy-start) of carried buffers: "
                       f"{len(self.async_copied)}, {_bytes(self.async_copied)} bytes")
        return "\n".join(out)


def census(hlo: str) -> TickLoopCensus:
    """:class:`TickLoopCensus` of the optimized HLO text ``hlo`` (``compiled.as_text()``);
    raises ``ValueError`` when no ``while`` reaches a collective-permute."""
    m = Module(hlo)
    loop, where = m.tick_loop()
    inside = m.reach(m.called(loop))
    # the computations async-starts wrap: their op is counted at the start
    wrapped = {c for b in inside for i in m.comps[b] if i.op.startswith("async-")
               for c in m.called(i)}
    scope = [(c, i) for c in inside if c not in wrapped for i in m.comps[c]]
    in_branches = set(m.reach([b for _, i in scope if i.op == "conditional"
                               for b in m.called(i)])) - wrapped
    n = Counter()  # (what, in a branch) -> count
    ops, windows, copied, async_copied, trips = Counter(), [], [], [], []
    for c, i in scope:
        kind, branch = m.collective(i), c in in_branches
        if kind == PERMUTE:
            n["permutes", branch] += 1
            windows.append(_window(m, c, i))
        elif kind:
            n["collectives", branch] += 1
            ops[kind] += 1
        elif i.op in ("copy", "copy-start") and i.operands and m.carried(c, i.operands[0]):
            shape = _ARRAY.match(i.shape)
            if (not shape or shape.group(1).endswith("[]")
                    or (i.op == "copy" and i.shape.startswith("("))):
                continue  # a scalar (the counter moved to scalar memory, say), a tuple
            shape = shape.group(1)
            if i.op == "copy-start":
                async_copied.append(shape)
                continue
            copied.append(shape)
            n["copies", branch] += 1
            n["relayouts"] += _layout(i.shape) != _layout(m.names[c][i.operands[0]].shape)
        elif i.op == "while":
            trips.append(m.trip_count(c, i))
    return TickLoopCensus(
        trip_count=m.trip_count(where, loop),
        unknown_trip_whiles=trips.count(None),
        known_trip_whiles=len(trips) - trips.count(None),
        conditionals=sum(i.op == "conditional" for _, i in scope),
        permutes=n["permutes", False] + n["permutes", True],
        permutes_in_conditionals=n["permutes", True],
        copied=tuple(sorted(copied)),
        windows=tuple(windows),
        collectives=n["collectives", False] + n["collectives", True],
        collectives_in_conditionals=n["collectives", True],
        collective_ops=dict(ops),
        copies_in_conditionals=n["copies", True],
        relayout_copies=n["relayouts"],
        async_copied=tuple(sorted(async_copied)))


def loop_conditionals(hlo: str) -> tuple[int, int]:
    """``(while loops, conditionals inside any of them)`` in the optimized HLO text
    ``hlo``: the lanes program scans its ticks in several loops (its segments), and none
    of them may hold a conditional."""
    m = Module(hlo)
    loops = [i for body in m.comps.values() for i in body if i.op == "while"]
    inside = m.reach([c for i in loops for c in m.called(i)])
    return len(loops), sum(i.op == "conditional" for c in inside for i in m.comps[c])


def _window(m: Module, comp: str, start: Instr) -> PermuteWindow:
    """What the schedule places between ``start`` and its done."""
    body = m.comps[comp]
    s = d = body.index(start)
    pending = {start.name}  # follow start -> (async-update ->) done
    for k in range(s + 1, len(body) if start.op != PERMUTE else s):
        if body[k].op.endswith(("-done", "-update")) and pending & set(body[k].operands):
            pending.add(body[k].name)
            if body[k].op.endswith("-done"):
                d = k
                break
    between = body[s + 1:d]
    return PermuteWindow(start.name, s, d, len(between),
                         any(i.op == "conditional" for i in between),
                         sum(m.heavy(i) for i in between))


def _layout(shape: str) -> str:
    """An array shape's layout, less its memory space (``S(n)``)."""
    m = re.search(r"\{([^}]*)\}", shape)
    return re.sub(r"S\(\d+\)", "", m.group(1)) if m else ""


def _bytes(shapes) -> int:
    total = 0
    for s in shapes:
        dtype, dims = s.split("[")
        total += _BYTES.get(dtype, 4) * math.prod(int(d) for d in dims[:-1].split(",") if d)
    return total
