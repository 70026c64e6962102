"""A MaxText/praxis-style SPMD GPipe: the pipeline JAX users run today, as a baseline.

Written for this benchmark from the public description of the MaxText ``Pipeline``
layer and praxis' ``LayerwiseShardablePipelined`` (no code copied):

* every stage runs the same function, and the stage weights are **stacked on a leading
  axis of size p sharded over the ``pipe`` mesh axis** (``[p, ...]``);
* one loop iteration runs all p stages at once with **``jax.vmap`` over the stage
  axis** (``spmd_axis_name="pipe"``): GSPMD partitions the vmapped computation so each
  device runs its own stage on its own slice of the ``[p, microbatch, ...]`` state;
* after each iteration the stage outputs are **shifted one stage to the right with a
  ``ppermute``** (stage 0 instead takes the next microbatch), and the input/output
  stream ``state_io [p, m/p, microbatch, ...]`` (also sharded over ``pipe``) is
  rotated one stage to the left so that stage 0 always reads the next input from its
  own shard and the last stage's finished output lands in the last shard;
* the loop runs **``m + p - 1`` iterations** (a ``lax.scan``); the first and last
  ``p - 1`` iterations are the fill/drain bubble, computed on garbage and discarded;
* the **backward is ``jax.grad`` through the whole loop**: XLA stores the residuals of
  every iteration, so each device keeps ``m + p - 1`` microbatches of residuals (GPipe
  memory behaviour) unless ``remat=True`` recomputes each iteration's forward.

The loss head runs after the pipeline on the collected outputs (sharded over ``pipe``,
``m/p`` microbatches per device), as MaxText computes its logits after the decoder
stack. The result equals ``jax.value_and_grad`` of the unpipelined mean loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["auto_mesh", "spmd_gpipe_loss", "spmd_gpipe_value_and_grad", "stack_stages",
           "unstack_stages"]


def auto_mesh(mesh: Mesh) -> Mesh:
    """The same devices and axis names with every axis ``Auto`` (GSPMD propagation).

    The baseline is a GSPMD program (sharding constraints, not explicit sharding), as in
    MaxText; ``jax.make_mesh`` now defaults to ``Explicit`` axes.
    """
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def stack_stages(layers: list[Any], num_stages: int) -> Any:
    """Stack ``L`` homogeneous layer pytrees to leaves of shape ``[p, L // p, ...]``."""
    n = len(layers)
    if n % num_stages:
        raise ValueError(f"{n} layers do not split evenly into {num_stages} stages")
    per = n // num_stages
    return jax.tree.map(lambda *xs: jnp.stack(xs).reshape(num_stages, per, *xs[0].shape),
                        *layers)


def unstack_stages(stacked: Any) -> list[Any]:
    """Inverse of :func:`stack_stages`: a list of ``L`` layer pytrees."""
    leaves, tree = jax.tree.flatten(stacked)
    p, per = leaves[0].shape[:2]
    return [jax.tree.unflatten(tree, [x[s, k] for x in leaves])
            for s in range(p) for k in range(per)]


def spmd_gpipe_loss(
    stage_fn: Callable[[Any, jax.Array], jax.Array],
    loss_fn: Callable[[jax.Array, Any], jax.Array],
    mesh: Mesh,
    num_microbatches: int,
    *,
    axis: str = "pipe",
    remat: bool = False,
) -> Callable[[Any, jax.Array, Any], jax.Array]:
    """Build ``f(stacked_params, xs, ys) -> mean loss`` over microbatches.

    Args:
      stage_fn: ``stage_fn(stage_params, x) -> y`` with ``y.shape == x.shape``; called with
        one stage's slice of the stacked parameters (leading axis removed).
      loss_fn: ``loss_fn(y_microbatch, target_microbatch) -> scalar``.
      mesh: a mesh with axis ``axis`` of size p (the number of stages).
      num_microbatches: m, a multiple of p (as in MaxText).
      remat: recompute each iteration's forward in the backward (``jax.checkpoint``).

    ``xs`` is ``[m, microbatch, ...]``, ``ys`` a pytree with leaves ``[m, ...]``.
    """
    mesh = auto_mesh(mesh)
    p, m = mesh.shape[axis], num_microbatches
    if m % p:
        raise ValueError(f"num_microbatches={m} must be a multiple of the {p} stages")
    mps = m // p
    staged = NamedSharding(mesh, P(axis))

    def constrain(x: jax.Array) -> jax.Array:
        return lax.with_sharding_constraint(x, staged)

    @jax.shard_map(mesh=mesh, in_specs=P(axis), out_specs=P(axis))
    def shift_right(x: jax.Array) -> jax.Array:
        # stage s's output becomes stage s+1's input; stage 0's slot is refilled by the caller
        return lax.ppermute(x, axis, [(i, (i + 1) % p) for i in range(p)])

    @jax.shard_map(mesh=mesh, in_specs=(P(axis), P(axis)), out_specs=P(axis))
    def rotate_stream(stream: jax.Array, out: jax.Array) -> jax.Array:
        # rotate the stream slice left by one stage; the last stage stores its finished output
        rotated = lax.ppermute(stream, axis, [(i, (i - 1) % p) for i in range(p)])
        return jnp.where(lax.axis_index(axis) == p - 1, out, rotated)

    run_stages = jax.vmap(stage_fn, spmd_axis_name=axis)

    def iteration(stacked: Any, carry: tuple, i: jax.Array) -> tuple[tuple, None]:
        state_io, shift = carry
        col = i % mps
        stream = constrain(lax.dynamic_index_in_dim(state_io, col, axis=1, keepdims=False))
        stage_ids = lax.broadcasted_iota(jnp.int32, shift.shape, 0)
        stages_in = constrain(jnp.where(stage_ids == 0, stream, shift))
        out = constrain(run_stages(stacked, stages_in))
        state_io = lax.dynamic_update_index_in_dim(state_io, rotate_stream(stream, out), col, 1)
        return (constrain(state_io), shift_right(out)), None

    def loss(stacked: Any, xs: jax.Array, ys: Any) -> jax.Array:
        stacked = jax.tree.map(constrain, stacked)
        # microbatch j = k * mps + c sits in state_io[k, c]; stage 0 reads column i % mps
        state_io = constrain(xs.reshape(p, mps, *xs.shape[1:]))
        shift = constrain(jnp.zeros((p, *xs.shape[1:]), xs.dtype))
        body = lambda c, i: iteration(stacked, c, i)
        if remat:
            body = jax.checkpoint(body)
        (state_io, _), _ = lax.scan(body, (state_io, shift), jnp.arange(m + p - 1))
        # microbatch j = k * mps + r finished in column (r + p - 1) % mps of row k
        outs = state_io[:, (np.arange(mps) + p - 1) % mps]
        ys_staged = jax.tree.map(lambda y: constrain(y.reshape(p, mps, *y.shape[1:])), ys)
        per_mb = jax.vmap(jax.vmap(loss_fn))(outs, ys_staged)
        return jnp.mean(per_mb)

    return loss


def spmd_gpipe_value_and_grad(
    stage_fn: Callable[[Any, jax.Array], jax.Array],
    loss_fn: Callable[[jax.Array, Any], jax.Array],
    mesh: Mesh,
    num_microbatches: int,
    *,
    axis: str = "pipe",
    remat: bool = False,
) -> Any:
    """``jax.jit`` of ``(stacked, xs, ys) -> (mean loss, grads of stacked)``.

    ``stacked`` leaves ``[p, ...]`` are placed sharded over ``axis``; ``xs``/``ys`` are
    taken replicated (each device slices its own part of the stream inside). The grads
    come back sharded like ``stacked``.
    """
    mesh = auto_mesh(mesh)
    loss = spmd_gpipe_loss(stage_fn, loss_fn, mesh, num_microbatches, axis=axis, remat=remat)
    staged = NamedSharding(mesh, P(axis))
    rep = NamedSharding(mesh, P())
    return jax.jit(jax.value_and_grad(loss),
                   in_shardings=(staged, rep, rep), out_shardings=(rep, staged))
