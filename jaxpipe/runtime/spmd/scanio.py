"""Stacked residuals of a scanned layer stack go straight between the scan and storage.

A stage that scans over its slice of a layer stack stores, per microbatch, the residuals
of every iteration: ``jax.vjp`` of the scan emits them as the scan's stacked outputs
(``ys``, ``[layers, ...]``) and the backward scan reads them back as its inputs (``xs``).
Stored the ordinary way, each such value is built by the scan in a zero-filled buffer of
its own, copied whole into its storage slot, and at the backward copied whole out of the
slot again before the backward scan slices it: one full residual set of extra memory at
each end and three kernels per leaf that plain JAX does not have (the compile time of a
scanned model is mostly kernels; benchmarks/README.md).

Here the forward scan instead carries the storage buffers and writes each iteration's
value into its slot row directly, and the backward scan reads its slice of the slot row
directly: :func:`forward_writing` and :func:`backward_reading` evaluate a stage's jaxpr
with its top-level scans rewritten that way. A value qualifies when the scan's output is
used only as that stage output (forward) or the stage input only as that scan's input
(backward); everything else is stored and read as before by the caller.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore
from jax.extend.core import jaxpr_as_fun

from jaxpipe.interpret import eval_eqns, read

__all__ = ["backward_reading", "direct_inputs", "direct_outputs", "forward_writing"]

#: Where a stored value lives: ``(buffer key, base, offset)``, row ``base + offset`` of
#: the buffer; ``base`` may be traced (shared by the values of one group), ``offset`` is
#: static.
Location = tuple[Hashable, Any, int]


def _uses(jaxpr: Any) -> Counter:
    """How often every variable is read (by equations and as an output)."""
    n: Counter = Counter()
    for eqn in jaxpr.eqns:
        n.update(v for v in eqn.invars if not isinstance(v, jcore.Literal))
    n.update(v for v in jaxpr.outvars if not isinstance(v, jcore.Literal))
    return n


def _scans(jaxpr: Any) -> list[Any]:
    return [e for e in jaxpr.eqns if e.primitive.name == "scan"]


def direct_outputs(closed: jcore.ClosedJaxpr, candidates: Sequence[int]) -> frozenset[int]:
    """Which of the outputs ``candidates`` (indices into the outputs) a top-level scan
    produces as a stacked output used nowhere else: :func:`forward_writing` writes those
    straight into storage."""
    j = closed.jaxpr
    uses = _uses(j)
    ys = {v for e in _scans(j) for v in e.outvars[e.params["num_carry"]:]}
    return frozenset(i for i in candidates
                     if j.outvars[i] in ys and uses[j.outvars[i]] == 1)


def direct_inputs(closed: jcore.ClosedJaxpr, candidates: Sequence[int]) -> frozenset[int]:
    """Which of the inputs ``candidates`` (indices into the inputs) feed exactly one use,
    a top-level scan's stacked input: :func:`backward_reading` reads those from storage
    inside the scan."""
    j = closed.jaxpr
    uses = _uses(j)
    xs = {v for e in _scans(j)
          for v in e.invars[e.params["num_consts"] + e.params["num_carry"]:]
          if not isinstance(v, jcore.Literal)}
    return frozenset(i for i in candidates if j.invars[i] in xs and uses[j.invars[i]] == 1)


# Buffers are ``[slots, layers, *shape]``; the scans index them flattened,
# ``[slots * layers, *shape]`` (a free reshape) at ``base * layers + (i + offset *
# layers)``: only ``base * layers`` is the same in every iteration, and it is shared by a
# group's values. Indexed ``(base + offset, i)``, XLA hoisted each value's row arithmetic
# out of the loop into a kernel of its own (~8 ms of compile each).
def _flat(buf: jax.Array) -> jax.Array:
    return buf.reshape(buf.shape[0] * buf.shape[1], *buf.shape[2:])


def _index(loc: Location, layers: int, i: Any) -> Any:
    _, base, offset = loc
    return base * layers + (i + offset * layers)


def _scan_params(eqn: Any) -> tuple[jcore.ClosedJaxpr, int, int, int, bool, Any]:
    p = eqn.params
    return p["jaxpr"], p["num_consts"], p["num_carry"], p["length"], p["reverse"], \
        p.get("unroll", 1)


def forward_writing(closed: jcore.ClosedJaxpr, args: Sequence[Any],
                    store: Mapping[Hashable, jax.Array],
                    where: Mapping[int, Location]) -> tuple[list[Any], dict]:
    """Evaluate ``closed`` on ``args``; every output ``i`` in ``where`` (each one of
    :func:`direct_outputs`) is written, iteration by iteration, into
    row ``base + offset``, at the iteration's index, of ``store[key]`` by the scan that
    produces it instead of being returned.

    Returns the outputs (``None`` at the written ones) and the updated ``store``.
    """
    j = closed.jaxpr
    store = dict(store)
    target = {j.outvars[i]: loc for i, loc in where.items()}

    def scan(eqn: Any, invals: list) -> list | None:
        body, nc, nk, length, reverse, unroll = _scan_params(eqn)
        ys = eqn.outvars[nk:]
        sel = [k for k, v in enumerate(ys) if v in target]
        if not sel:
            return None
        consts, init, xs = invals[:nc], invals[nc:nc + nk], invals[nc + nk:]
        keys = sorted({target[ys[k]][0] for k in sel}, key=repr)

        def step(carry, x):
            c, bufs = carry
            i, xs_i = x
            outs = jaxpr_as_fun(body)(*consts, *c, *xs_i)
            bufs = dict(bufs)
            for k in sel:
                key = target[ys[k]][0]
                bufs[key] = lax.dynamic_update_index_in_dim(
                    bufs[key], jnp.asarray(outs[nk + k], bufs[key].dtype),
                    _index(target[ys[k]], length, i), 0, allow_negative_indices=False)
            return (outs[:nk], bufs), [outs[nk + k] for k in range(len(ys)) if k not in sel]

        (c, bufs), rest = lax.scan(step, (list(init), {k: _flat(store[k]) for k in keys}),
                                   (jnp.arange(length), list(xs)), length=length,
                                   reverse=reverse, unroll=unroll)
        store.update({k: b.reshape(store[k].shape) for k, b in bufs.items()})
        it = iter(rest)
        return [*c, *(None if k in sel else next(it) for k in range(len(ys)))]

    env: dict = dict(zip(j.constvars, closed.consts, strict=True))
    env.update(zip(j.invars, args, strict=True))
    eval_eqns(j.eqns, env,
              override=lambda e, v: scan(e, v) if e.primitive.name == "scan" else None)
    return [read(env, v) for v in j.outvars], store


def backward_reading(closed: jcore.ClosedJaxpr, args: Sequence[Any],
                     store: Mapping[Hashable, jax.Array],
                     where: Mapping[int, Location]) -> list[Any]:
    """Evaluate ``closed`` on ``args``; every input ``i`` in ``where`` (each one of
    :func:`direct_inputs`; its ``args`` entry is ignored) is read inside the scan that
    consumes it, iteration by iteration, from row ``base + offset`` of ``store[key]``."""
    j = closed.jaxpr
    source = {j.invars[i]: loc for i, loc in where.items()}

    def scan(eqn: Any, invals: list) -> list | None:
        body, nc, nk, length, reverse, unroll = _scan_params(eqn)
        xs_vars = eqn.invars[nc + nk:]
        sel = {k for k, v in enumerate(xs_vars)
               if not isinstance(v, jcore.Literal) and v in source}
        if not sel:
            return None
        consts, init, xs = invals[:nc], invals[nc:nc + nk], invals[nc + nk:]
        locs = {k: source[xs_vars[k]] for k in sel}
        bufs = {loc[0]: _flat(store[loc[0]]) for loc in locs.values()}
        rest = [x for k, x in enumerate(xs) if k not in sel]

        def step(c, x):
            i, rest_i = x
            it = iter(rest_i)
            xs_i = [lax.dynamic_index_in_dim(bufs[locs[k][0]], _index(locs[k], length, i), 0,
                                             keepdims=False, allow_negative_indices=False)
                    if k in sel else next(it) for k in range(len(xs))]
            outs = jaxpr_as_fun(body)(*consts, *c, *xs_i)
            return outs[:nk], outs[nk:]

        c, ys = lax.scan(step, list(init), (jnp.arange(length), rest), length=length,
                         reverse=reverse, unroll=unroll)
        return [*c, *ys]

    env: dict = dict(zip(j.constvars, closed.consts, strict=True))
    env.update(zip(j.invars, args, strict=True))
    eval_eqns(j.eqns, env,
              override=lambda e, v: scan(e, v) if e.primitive.name == "scan" else None)
    return [read(env, v) for v in j.outvars]


Evaluator = Callable[..., Any]
