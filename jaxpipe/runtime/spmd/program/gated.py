"""Run a function or not, by a traced predicate, updating its state in place; run one
of a few functions, by device."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax import lax

__all__ = ["by_device", "gated"]


def gated(pred: Any, fn: Callable, x: Any, *args: Any) -> Any:
    """``fn(x, *args)`` if ``pred`` (a predicate, or a 0 / 1 trip count) else ``x``: a
    zero-or-one-trip while loop, which updates ``x`` in place where ``lax.cond`` would
    copy it. ``args`` pass through an optimization barrier tied to the trip counter, so
    XLA's loop-invariant code motion cannot hoist work on them (a stage's compute, a
    ``ppermute``) out of the loop and run it on every step."""
    def body(c):
        i, x = c
        i, a = lax.optimization_barrier((i, args))
        return i + 1, fn(x, *a)
    return lax.while_loop(lambda c: c[0] < pred.astype(jnp.int32), body,
                          (jnp.int32(0), x))[1]


def by_device(branches: list[Callable], group: list[int], axis: str, *args: Any) -> Any:
    """``branches[group[d]](*args)`` on device ``d`` of mesh axis ``axis``: a switch over
    the distinct branches only (devices computing alike share one), none for one."""
    if len(branches) == 1:
        return branches[0](*args)
    return lax.switch(jnp.asarray(group, jnp.int32)[lax.axis_index(axis)], branches, *args)
