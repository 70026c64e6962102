"""Measured segment costs: each segment's forward and backward compiled on its own and
timed on the default device (``jp.Cut(profile=True)``), to replace the FLOP estimate of
:mod:`jaxpipe.cut.cost`. Apart from the cost model because it runs code, not a jaxpr walk.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from jax.extend import core as jcore

from jaxpipe.jaxpr.avals import is_differentiable
from jaxpipe.jaxpr.interpret import eval_slice
from jaxpipe.jaxpr.trace import segments

__all__ = ["profile_segments"]


def _segment_io(jaxpr: Any, start: int, end: int) -> tuple[list[Any], list[Any]]:
    """Free input vars and live-out vars of equations [start, end)."""
    eqns = jaxpr.eqns[start:end]
    defined: set[Any] = set()
    inputs: list[Any] = []
    seen: set[Any] = set()
    for eqn in eqns:
        for v in eqn.invars:
            if isinstance(v, jcore.Var) and v not in defined and v not in seen:
                seen.add(v)
                inputs.append(v)
        defined.update(v for v in eqn.outvars if not isinstance(v, jcore.DropVar))
    used_later: set[Any] = {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}
    for eqn in jaxpr.eqns[end:]:
        used_later.update(v for v in eqn.invars if isinstance(v, jcore.Var))
    outputs = [v for eqn in eqns for v in eqn.outvars if v in defined and v in used_later]
    return inputs, outputs


def profile_segments(traced: Any, repeats: int = 5) -> list[tuple[float, float]]:
    """Median (forward, backward) seconds per microbatch of every segment, measured.

    Each segment is compiled on its own with random inputs of the traced shapes;
    the backward is the VJP with respect to every differentiable (inexact) input, minus the
    forward it recomputes. Numbers include per-call dispatch overhead, so tiny
    segments look slower than they are.
    """
    import jax
    import jax.numpy as jnp

    jaxpr = traced.closed_jaxpr.jaxpr
    consts = dict(zip(jaxpr.constvars, traced.closed_jaxpr.consts, strict=True))
    key = jax.random.key(0)
    out: list[tuple[float, float]] = []
    for start, end in segments(traced):
        ins, outs_ = _segment_io(jaxpr, start, end)
        args = []
        for i, v in enumerate(ins):
            if v in consts:
                args.append(consts[v])
            elif is_differentiable(v.aval):
                args.append(jax.random.normal(jax.random.fold_in(key, i), v.aval.shape,
                                              v.aval.dtype))
            else:
                args.append(jnp.zeros(v.aval.shape, v.aval.dtype))
        differentiable = tuple(is_differentiable(v.aval) for v in ins)

        def fwd(*xs, _e=jaxpr.eqns[start:end], _i=ins, _o=outs_):
            return eval_slice(_e, _i, _o, xs)

        def bwd(*xs, _fwd=fwd, _diff=differentiable):
            def f(*fl):
                it = iter(fl)
                return _fwd(*[next(it) if d else x for x, d in zip(xs, _diff, strict=True)])

            def f_float(*fl):  # only differentiable outputs carry cotangents
                return [o for o in f(*fl) if is_differentiable(o)]

            floats = [x for x, d in zip(xs, _diff, strict=True) if d]
            outs, vjp = jax.vjp(f_float, *floats)
            return vjp([jnp.ones_like(o) for o in outs])

        times = []
        for fn in (jax.jit(fwd), jax.jit(bwd)):
            jax.block_until_ready(fn(*args))  # compile
            samples = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*args))
                samples.append(time.perf_counter() - t0)
            times.append(float(np.median(samples)))
        # The VJP runs the forward again: the backward's own time is the difference.
        out.append((times[0], max(times[1] - times[0], 0.0)))
    return out
