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
from typing import NamedTuple

__all__ = ["PermuteWindow", "TickLoopCensus", "census"]

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_NAME = re.compile(r"(?:ROOT )?%?([\w.\-]+) = ")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_REF = re.compile(r"%([\w.\-]+)")
_CALLED = re.compile(r"(?:calls|to_apply|body|condition|true_computation|"
                     r"false_computation)=%([\w.\-]+)")
_CALLED_LIST = re.compile(r"(?:branch_computations|called_computations)=\{([^}]*)\}")
_ARRAY = re.compile(r"^\(?(\w+\[[\d,]*\])")
_INT = re.compile(r"^-?\d+$")
_GEMM = re.compile(r'custom_call_target="[^"]*(?:gemm|cublas|cudnn|matmul|conv|triton)',
                   re.IGNORECASE)
_PERMUTE = "collective-permute"
_COLLECTIVES = frozenset({"all-gather", "all-reduce", "reduce-scatter", "all-to-all",
                          "ragged-all-to-all", "collective-broadcast", _PERMUTE})
_MATH = frozenset({"dot", "convolution", "ragged-dot"})
_PASS = frozenset({"copy", "bitcast", "convert", "reshape"})  # value-preserving for ints
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}


class _Instr(NamedTuple):
    name: str
    shape: str  # with layout
    op: str
    operands: list[str]
    args: str  # the text between the operand parentheses (a constant's literal)
    attrs: str


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
    m = _Module(hlo)
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
        if kind == _PERMUTE:
            n["permutes", branch] += 1
            windows.append(m.window(c, i))
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


class _Module:
    """The computations of an HLO module: instructions in text (= schedule) order."""

    def __init__(self, hlo: str):
        self.comps: dict[str, list[_Instr]] = {}
        self.roots: dict[str, _Instr] = {}
        self.entry = None
        current = name = None
        for line in hlo.splitlines():
            m = _COMPUTATION.match(line)
            if m and not line.startswith(" "):
                name = m.group(1)
                current = self.comps.setdefault(name, [])
                if line.startswith("ENTRY"):
                    self.entry = m.group(1)
            elif current is not None and line.startswith(" "):
                i = _parse(line)
                if i is not None:
                    current.append(i)
                    if line.lstrip().startswith("ROOT "):
                        self.roots[name] = i
            elif line.startswith("}"):
                current = None
        self.names = {c: {i.name: i for i in body} for c, body in self.comps.items()}
        self._heavy: dict[str, bool] = {}

    def called(self, i: _Instr) -> list[str]:
        out = _CALLED.findall(i.attrs)
        for group in _CALLED_LIST.findall(i.attrs):
            out += [x.strip().lstrip("%") for x in group.split(",") if x.strip()]
        return out

    def reach(self, roots: list[str]) -> dict[str, None]:
        """The computations ``roots`` reach, in depth-first order (an ordered set)."""
        seen: dict[str, None] = {}
        stack = list(roots)
        while stack:
            c = stack.pop()
            if c not in seen and c in self.comps:
                seen[c] = None
                for i in reversed(self.comps[c]):
                    stack.extend(reversed(self.called(i)))
        return seen

    def collective(self, i: _Instr) -> str | None:
        """The collective ``i`` is or starts (sync op, ``*-start``, ``async-start``)."""
        if i.op in _COLLECTIVES:
            return i.op
        if i.op.endswith("-start") and i.op[:-6] in _COLLECTIVES:
            return i.op[:-6]
        if i.op == "async-start":
            for c in self.called(i):
                for j in self.comps.get(c, ()):
                    if j.op in _COLLECTIVES:
                        return j.op
        return None

    def tick_loop(self) -> tuple[_Instr, str]:
        """The outermost while reaching a permute (search from the entry, not into such
        loops), and the computation holding it; of several (TPU's windowed einsums loop
        over permutes too), the one reaching the most instructions."""
        found: list[tuple[int, _Instr, str]] = []
        stack, seen = [self.entry], set()
        while stack:
            c = stack.pop()
            if c in seen or c not in self.comps:
                continue
            seen.add(c)
            for i in self.comps[c]:
                if i.op == "while":
                    inside = self.reach(self.called(i))
                    if any(self.collective(j) == _PERMUTE for b in inside
                           for j in self.comps[b]):
                        found.append((sum(len(self.comps[b]) for b in inside), i, c))
                        continue
                stack.extend(self.called(i))
        if not found:
            raise ValueError("no while loop in this program reaches a collective-permute")
        _, loop, comp = max(found, key=lambda f: f[0])
        return loop, comp

    def carried(self, comp: str, name: str) -> bool:
        """Whether ``name`` is a tuple element or a parameter (a carried / passed-in value)."""
        i = self.names[comp].get(name)
        return i is not None and i.op in ("get-tuple-element", "parameter")

    def heavy(self, i: _Instr) -> bool:
        """Whether ``i`` does real work: a dot or convolution, a GEMM / convolution custom
        call, or a fusion, conditional, while or call reaching one."""
        if i.op in _MATH:
            return True
        if i.op == "custom-call":
            return bool(_GEMM.search(i.attrs))
        for c in self.called(i):
            if c not in self._heavy:
                self._heavy[c] = False  # (no cycles in HLO; guards malformed text)
                self._heavy[c] = any(self.heavy(j) for j in self.comps.get(c, ()))
            if self._heavy[c]:
                return True
        return False

    def window(self, comp: str, start: _Instr) -> PermuteWindow:
        body = self.comps[comp]
        s = d = body.index(start)
        pending = {start.name}  # follow start -> (async-update ->) done
        for k in range(s + 1, len(body) if start.op != _PERMUTE else s):
            if body[k].op.endswith(("-done", "-update")) and pending & set(body[k].operands):
                pending.add(body[k].name)
                if body[k].op.endswith("-done"):
                    d = k
                    break
        between = body[s + 1:d]
        return PermuteWindow(start.name, s, d, len(between),
                             any(i.op == "conditional" for i in between),
                             sum(self.heavy(i) for i in between))

    def trip_count(self, comp: str, loop: _Instr) -> int | None:
        """XLA's known trip count, else (TPU) one read from the loop: the condition
        compares tuple element ``k`` (plus a constant) with a constant, ``k`` starts at a
        constant and the body adds a constant to it."""
        known = re.search(r'"known_trip_count":\{"n":"(\d+)"', loop.attrs)
        if known:
            return int(known.group(1))
        cond = re.search(r"condition=%([\w.\-]+)", loop.attrs)
        body = re.search(r"body=%([\w.\-]+)", loop.attrs)
        if not (cond and body and loop.operands) or cond.group(1) not in self.comps:
            return None
        c, cmp, outer = cond.group(1), self.roots.get(cond.group(1)), None
        if cmp is not None and cmp.op == "fusion" and self.called(cmp):
            # (the compare fused: its parameters are the fusion's operands)
            outer, c = (c, cmp), self.called(cmp)[0]
            cmp = self.roots.get(c)
        if cmp is None or cmp.op != "compare" or len(cmp.operands) != 2:
            return None
        direction = re.search(r"direction=(\w+)", cmp.attrs)
        a, b = (self._affine(c, x, outer) for x in cmp.operands)
        if not (direction and a and b):
            return None
        op = direction.group(1)
        if a[0] is None:  # constant on the left: swap sides
            a, b = b, a
            op = {"LT": "GT", "GT": "LT", "LE": "GE", "GE": "LE"}.get(op, op)
        if a[0] is None or b[0] is not None:
            return None
        k, bound = a[0], b[1] - a[1]
        init = self._element(comp, loop.operands[0], k)
        step = self._element(body.group(1), None, k)
        if init is None or init[0] is not None or not step or step[0] != k or not step[1]:
            return None
        return _trips(init[1], step[1], bound, op)

    def _element(self, comp: str, tup: str | None, k: int):
        """Element ``k`` of tuple ``tup`` in ``comp`` (``None``: its root), as affine."""
        i = self.roots.get(comp) if tup is None else self.names[comp].get(tup)
        while i is not None and i.op in _PASS and i.operands:
            i = self.names[comp].get(i.operands[0])
        if i is None or i.op != "tuple" or len(i.operands) <= k:
            return None
        return self._affine(comp, i.operands[k])

    def _affine(self, comp: str, name: str, outer=None, depth: int = 0):
        """``name`` as ``(k, c)``: element ``k`` of the computation's parameter plus ``c``
        (``k`` None: the constant ``c``); None when it is neither. ``outer``: the
        computation and fusion instruction calling ``comp``, a fused computation."""
        i = self.names[comp].get(name)
        if i is None or depth > 32:
            return None
        if i.op == "parameter" and outer is not None and _INT.match(i.args.strip()):
            arg = outer[1].operands[int(i.args):][:1]  # the fusion's operand
            return self._affine(outer[0], arg[0], None, depth + 1) if arg else None
        if i.op == "constant":
            return (None, int(i.args)) if _INT.match(i.args.strip()) else None
        if i.op in _PASS and i.operands:
            return self._affine(comp, i.operands[0], outer, depth + 1)
        if i.op == "get-tuple-element" and i.operands:
            src = self.names[comp].get(i.operands[0])
            index = re.search(r"index=(\d+)", i.attrs)
            if outer is None and src is not None and src.op == "parameter" and index:
                return int(index.group(1)), 0
        if i.op in ("add", "subtract") and len(i.operands) == 2:
            x, y = (self._affine(comp, o, outer, depth + 1) for o in i.operands)
            sign = 1 if i.op == "add" else -1
            if x and y and (y[0] is None or (sign > 0 and x[0] is None)):
                return (x[0] if x[0] is not None else y[0]), x[1] + sign * y[1]
        return None


def _trips(init: int, step: int, bound: int, op: str) -> int | None:
    """Iterations of ``for (v = init; v <op> bound; v += step)``."""
    span = bound + {"LE": 1, "GE": -1}.get(op, 0) - init
    if op in ("LT", "LE", "GT", "GE") and (step > 0) == (op[0] == "L"):
        return max(0, -(-span // step))  # ceil
    return span // step if op == "NE" and span % step == 0 and span // step >= 0 else None


def _parse(line: str) -> _Instr | None:
    s = line.strip()
    m = _NAME.match(s)
    if not m:
        return None
    rest = s[m.end():]
    end = _close(rest, 0) + 1 if rest.startswith("(") else rest.find(" ")
    o = _OPCODE.match(rest, end) if end > 0 else None
    if not o:
        return None
    close = _close(rest, o.end() - 1)
    args = rest[o.end():close]
    return _Instr(m.group(1), rest[:end], o.group(1), _REF.findall(args), args,
                  rest[close + 1:])


def _close(s: str, i: int) -> int:
    """The index of the parenthesis closing the one at ``s[i]``."""
    depth = 0
    for j in range(i, len(s)):
        depth += {"(": 1, ")": -1}.get(s[j], 0)
        if depth == 0:
            return j
    return len(s)


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
