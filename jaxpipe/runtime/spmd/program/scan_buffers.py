"""Stacked values of a scanned layer stack go straight between its scans and the buffers.

A stage that scans over its slice of a layer stack stores, per microbatch, the residuals
of every iteration: ``jax.vjp`` of the scan emits them as the scan's stacked outputs
(``ys``, ``[layers, ...]``) and the backward scan reads them back as its stacked inputs
(``xs``); the backward scan also emits each layer's parameter gradient as a stacked
output. Stored the ordinary way, each such value is built by its scan in a zero-filled
buffer of its own and then copied (or added) whole into its slot, and a stored residual is
copied whole out of its slot again before the backward scan slices it: a full residual
set of extra memory at each end and several kernels per leaf that plain JAX does not have
(the compile time of a scanned model is mostly kernels; benchmarks/README.md).

:func:`evaluate` runs a stage's jaxpr with its top-level scans rewritten so that chosen
stacked outputs go, iteration by iteration, into buffers the scan carries (a *sink*:
write a storage row, add into a gradient slot), and chosen stacked inputs are read,
iteration by iteration, from buffers (a *source*). A value qualifies when the scan's output
is used only as that jaxpr output (:func:`direct_outputs`) or the jaxpr input only as that
scan's stacked input (:func:`direct_inputs`); the caller stores and reads the others as
before. The buffers' layout is the caller's: sinks and sources are its functions.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jcore

from jaxpipe.jaxpr.interpret import eval_eqns, read
from jaxpipe.sharding.constraints import entering, for_context, leaving, stage_as_fun

__all__ = ["Sink", "Source", "direct_inputs", "direct_outputs", "evaluate", "flatten",
           "pick_source", "row_add_sink", "row_sink", "row_source",
           "unused_inputs"]

#: ``(buffer, value, iteration) -> buffer``: how one iteration's value enters its buffer.
Sink = Callable[[jax.Array, jax.Array, Any], jax.Array]
#: ``(buffer, iteration) -> value``: one iteration's value, read from its buffer.
Source = Callable[[jax.Array, Any], jax.Array]


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
    produces as a stacked output used nowhere else (sinks may take them)."""
    j = closed.jaxpr
    uses = _uses(j)
    ys = {v for e in _scans(j) for v in e.outvars[e.params["num_carry"]:]}
    # (a literal output, e.g. a 0-d parameter's zero gradient, is no scan's)
    return frozenset(i for i in candidates if not isinstance(j.outvars[i], jcore.Literal)
                     and j.outvars[i] in ys and uses[j.outvars[i]] == 1)


def direct_inputs(closed: jcore.ClosedJaxpr, candidates: Sequence[int]) -> frozenset[int]:
    """Which of the inputs ``candidates`` (indices into the inputs) have exactly one use,
    as a top-level scan's stacked input (sources may provide them)."""
    j = closed.jaxpr
    uses = _uses(j)
    xs = {v for e in _scans(j)
          for v in e.invars[e.params["num_consts"] + e.params["num_carry"]:]
          if not isinstance(v, jcore.Literal)}
    return frozenset(i for i in candidates if j.invars[i] in xs and uses[j.invars[i]] == 1)


def unused_inputs(closed: jcore.ClosedJaxpr, candidates: Sequence[int]) -> frozenset[int]:
    """Which of the inputs ``candidates`` the jaxpr never reads."""
    uses = _uses(closed.jaxpr)
    return frozenset(i for i in candidates if uses[closed.jaxpr.invars[i]] == 0)


def evaluate(closed: jcore.ClosedJaxpr, args: Sequence[Any],
             bufs: Mapping[Hashable, jax.Array], *,
             sinks: Mapping[int, tuple[Hashable, Sink]] | None = None,
             sources: Mapping[int, tuple[Hashable, Source]] | None = None
             ) -> tuple[list[Any], dict[Hashable, jax.Array]]:
    """Evaluate ``closed`` on ``args``, with its top-level scans rewritten.

    Args:
      closed: the jaxpr.
      args: its inputs; an input in ``sources`` is ignored (``None`` will do).
      bufs: the buffers sinks write and sources read, by key.
      sinks: output index (one of :func:`direct_outputs`) -> ``(key, sink)``: the scan
        producing it passes each iteration's value to ``sink`` on ``bufs[key]`` instead.
      sources: input index (one of :func:`direct_inputs`) -> ``(key, source)``: the scan
        consuming it reads each iteration's value from ``bufs[key]``.

    Returns the outputs (``None`` at those in ``sinks``) and the updated buffers.
    """
    args = entering(closed, args)
    closed = for_context(closed)  # bound equation by equation below
    j = closed.jaxpr
    bufs = dict(bufs)
    target = {j.outvars[i]: s for i, s in (sinks or {}).items()}
    origin = {j.invars[i]: s for i, s in (sources or {}).items()}

    def scan(eqn: Any, invals: list) -> list | None:
        p = eqn.params
        body, nc, nk, length = p["jaxpr"], p["num_consts"], p["num_carry"], p["length"]
        ys, xs_vars = eqn.outvars[nk:], eqn.invars[nc + nk:]
        out_sel = [k for k, v in enumerate(ys) if v in target]
        in_sel = {k: origin[v] for k, v in enumerate(xs_vars)
                  if not isinstance(v, jcore.Literal) and v in origin}
        if not out_sel and not in_sel:
            return None
        consts, init, xs = invals[:nc], invals[nc:nc + nk], invals[nc + nk:]
        written = sorted({target[ys[k]][0] for k in out_sel}, key=repr)
        read_only = {key: bufs[key] for key, _ in in_sel.values()}
        rest = [x for k, x in enumerate(xs) if k not in in_sel]

        def step(carry, rest_i):
            # the iteration counts in the carry: an arange of xs was a kernel of its own
            c, wbufs, i = carry
            it = iter(rest_i)
            xs_i = [in_sel[k][1](read_only[in_sel[k][0]], i) if k in in_sel else next(it)
                    for k in range(len(xs))]
            outs = stage_as_fun(body)(*consts, *c, *xs_i)
            wbufs = dict(wbufs)
            for k in out_sel:
                key, sink = target[ys[k]]
                wbufs[key] = sink(wbufs[key], outs[nk + k], i)
            return ((outs[:nk], wbufs, i - 1 if p["reverse"] else i + 1),
                    [y for k, y in enumerate(outs[nk:]) if k not in out_sel])

        first = jnp.int32(length - 1 if p["reverse"] else 0)
        (c, wbufs, _), kept = lax.scan(step, (list(init), {k: bufs[k] for k in written}, first),
                                       rest, length=length, reverse=p["reverse"],
                                       unroll=p.get("unroll", 1))
        bufs.update(wbufs)
        it = iter(kept)
        return [*c, *(None if k in out_sel else next(it) for k in range(len(ys)))]

    env: dict = dict(zip(j.constvars, closed.consts, strict=True))
    env.update(zip(j.invars, args, strict=True))
    eval_eqns(j.eqns, env,
              override=lambda e, v: scan(e, v) if e.primitive.name == "scan" else None)
    return leaving([read(env, v) for v in j.outvars]), bufs


def row_sink(layers: int, base: Any, offset: Any) -> Sink:
    """Write into row ``base + offset`` of a ``[slots, layers, *row]`` buffer held
    flattened (``[slots * layers, *row]``, a free reshape)."""
    def sink(buf: jax.Array, y: jax.Array, i: Any) -> jax.Array:
        y = jnp.asarray(y, buf.dtype).reshape(buf.shape[1:])  # a row: see row_shape
        return lax.dynamic_update_index_in_dim(buf, y,
                                               _flat_index(layers, base, offset, i), 0,
                                               allow_negative_indices=False)
    return sink


def row_source(layers: int, base: Any, offset: Any, shape: tuple[int, ...]) -> Source:
    """Read from row ``base + offset`` of a flattened ``[slots, layers, *row]`` buffer,
    as a value of ``shape`` (a row drops size-1 dimensions: ``ValueClass.row_shape``)."""
    def source(buf: jax.Array, i: Any) -> jax.Array:
        return lax.dynamic_index_in_dim(buf, _flat_index(layers, base, offset, i), 0,
                                        keepdims=False,
                                        allow_negative_indices=False).reshape(shape)
    return source


def row_add_sink(layers: int, base: Any) -> Sink:
    """Add into row ``base`` of a ``[rows, layers, *shape]`` buffer held flattened (a
    gradient slot ``[layers, *shape]`` is row 0 of one, unflattened)."""
    def sink(buf: jax.Array, y: jax.Array, i: Any) -> jax.Array:
        at = _flat_index(layers, base, 0, i)
        old = lax.dynamic_index_in_dim(buf, at, 0, keepdims=False,
                                       allow_negative_indices=False)
        return lax.dynamic_update_index_in_dim(buf, old + y.astype(buf.dtype), at, 0,
                                               allow_negative_indices=False)
    return sink


def pick_source(q: Any) -> Source:
    """Read layer ``i`` of candidate ``q`` from a tuple of ``[layers, *shape]`` arrays
    (a parameter whose slot the running stage picks: the layer's slice is read anyway,
    so the pick costs no kernel of its own and copies nothing whole)."""
    def source(bufs: tuple, i: Any) -> jax.Array:
        return lax.select_n(q, *(lax.dynamic_index_in_dim(b, i, 0, keepdims=False,
                                                          allow_negative_indices=False)
                                 for b in bufs))
    return source


def _flat_index(layers: int, base: Any, offset: Any, i: Any) -> Any:
    # Only ``base * layers`` is the same in every iteration, and it is shared by a group's
    # values: indexed (base + offset, i), XLA hoisted each value's row arithmetic out of
    # the loop into a kernel of its own (~8 ms of compile each).
    return base * layers + (i + offset * layers)


def flatten(buf: jax.Array) -> jax.Array:
    """``[slots, layers, *shape]`` -> ``[slots * layers, *shape]``."""
    return buf.reshape(buf.shape[0] * buf.shape[1], *buf.shape[2:])
