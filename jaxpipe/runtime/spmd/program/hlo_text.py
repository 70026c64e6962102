"""An XLA HLO module as text: its computations, their instructions in schedule order.

The reader :mod:`.hlo_census` stands on: ``compiled.as_text()`` of any backend parsed
into computations of :class:`Instr` (name, shape with layout, opcode, operands, the
text between the operand parentheses, attributes), what each instruction calls, which
computations a set of them reaches, which instructions are collectives (sync,
``*-start`` or ``async-start``-wrapped) or do real work (a dot, a convolution, a GEMM
custom call, or something that calls one), and a ``while``'s trip count: XLA's note in
its ``backend_config`` (CPU, GPU), else (TPU) read from the loop itself.
"""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = ["PERMUTE", "Instr", "Module"]

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_NAME = re.compile(r"(?:ROOT )?%?([\w.\-]+) = ")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_REF = re.compile(r"%([\w.\-]+)")
_CALLED = re.compile(r"(?:calls|to_apply|body|condition|true_computation|"
                     r"false_computation)=%([\w.\-]+)")
_CALLED_LIST = re.compile(r"(?:branch_computations|called_computations)=\{([^}]*)\}")
_INT = re.compile(r"^-?\d+$")
_GEMM = re.compile(r'custom_call_target="[^"]*(?:gemm|cublas|cudnn|matmul|conv|triton)',
                   re.IGNORECASE)
PERMUTE = "collective-permute"
_COLLECTIVES = frozenset({"all-gather", "all-reduce", "reduce-scatter", "all-to-all",
                          "ragged-all-to-all", "collective-broadcast", PERMUTE})
_MATH = frozenset({"dot", "convolution", "ragged-dot"})
_PASS = frozenset({"copy", "bitcast", "convert", "reshape"})  # value-preserving for ints


class Instr(NamedTuple):
    """One HLO instruction as written."""

    name: str
    shape: str  # with layout
    op: str
    operands: list[str]
    args: str  # the text between the operand parentheses (a constant's literal)
    attrs: str



class Module:
    """The computations of an HLO module: instructions in text (= schedule) order."""

    def __init__(self, hlo: str):
        self.comps: dict[str, list[Instr]] = {}
        self.roots: dict[str, Instr] = {}
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

    def called(self, i: Instr) -> list[str]:
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

    def collective(self, i: Instr) -> str | None:
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

    def tick_loop(self) -> tuple[Instr, str]:
        """The outermost while reaching a permute (search from the entry, not into such
        loops), and the computation holding it; of several (TPU's windowed einsums loop
        over permutes too), the one reaching the most instructions."""
        found: list[tuple[int, Instr, str]] = []
        stack, seen = [self.entry], set()
        while stack:
            c = stack.pop()
            if c in seen or c not in self.comps:
                continue
            seen.add(c)
            for i in self.comps[c]:
                if i.op == "while":
                    inside = self.reach(self.called(i))
                    if any(self.collective(j) == PERMUTE for b in inside
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

    def heavy(self, i: Instr) -> bool:
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

    def trip_count(self, comp: str, loop: Instr) -> int | None:
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


def _parse(line: str) -> Instr | None:
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
    return Instr(m.group(1), rest[:end], o.group(1), _REF.findall(args), args,
                  rest[close + 1:])


def _close(s: str, i: int) -> int:
    """The index of the parenthesis closing the one at ``s[i]``."""
    depth = 0
    for j in range(i, len(s)):
        depth += {"(": 1, ")": -1}.get(s[j], 0)
        if depth == 0:
            return j
    return len(s)
