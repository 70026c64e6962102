"""Worker script for tests/test_multiprocess.py, run under ``python -m jaxpipe.launch``.

Every process builds the same tiny 4-layer MLP pipeline (p=4, 1F1B) over the mesh of
all global devices (2 processes x 2 virtual CPU devices), runs ``value_and_grad`` and a
few ``train_step`` s (one with a host numpy batch, which must not recompile the step),
checkpoints with orbax and resumes, and process 0 writes the
results to ``<out>.npz`` for the test to compare against the unpipelined model computed
in one process.

The test imports ``make_model`` and ``loss_fn`` from here to compute the reference.

Usage: ``mp_worker.py ok <out>``, ``mp_worker.py accelerator <out>`` (the same on the
accelerator program), ``mp_worker.py interleaved <out>`` (Interleaved1F1B over one device
of each process, two chunks each) or ``mp_worker.py mismatch <out>`` (process 1 builds
its schedule with a different ``num_microbatches``, which must fail with a clear error;
``optimizer-mismatch``: its ``pipe.init`` another optimizer, refused the same way),
or ``mp_worker.py sharded <out>``: a pipe 2 x model 2 mesh (the pipe axis across the
processes, the tensor-parallel ``model`` axis inside each), an MLP whose weights are
split over ``model`` (``param_specs``), trained with AdamW and checkpointed;
``mp_worker.py sharded-explicit <out>`` the same on Explicit axes (sharding in types).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpipe as jp
from jaxpipe import checkpoint as jpc
from jaxpipe import distributed as jpd
from jaxpipe.runtime.spmd import SpmdRuntime
from jaxpipe.transport_threads import thread_ids, waiting_in_epoll

P_STAGES, M, WIDTH, BATCH = 4, 4, 8, 16
TRAIN_STEPS, LR = 2, 0.05


def make_model(seed: int = 0) -> tuple[dict, dict]:
    """Parameters and a batch, identical in every process (same seed, numpy RNG)."""
    rng = np.random.default_rng(seed)
    params = {"w": [(rng.standard_normal((WIDTH, WIDTH)) * 0.5).astype(np.float32)
                    for _ in range(P_STAGES)],
              "b": [np.zeros((WIDTH,), np.float32) for _ in range(P_STAGES)]}
    batch = {"x": rng.standard_normal((BATCH, WIDTH)).astype(np.float32),
             "y": rng.standard_normal((BATCH, WIDTH)).astype(np.float32)}
    return params, batch


def loss_fn(params: dict, mb: dict) -> jax.Array:
    h = mb["x"]
    for i, (w, b) in enumerate(zip(params["w"], params["b"], strict=True)):
        h = jnp.tanh(h @ w + b)
        if i < len(params["w"]) - 1:
            h = jp.boundary(h)
    return jnp.mean((h - mb["y"]) ** 2)


def report(out: str, loss, grads, losses, trained, resumed) -> None:
    """Process 0 writes what the test compares to ``<out>.npz``; every process says done."""
    pid, n = jax.process_index(), jax.process_count()
    if pid == 0:
        flat = {"loss": loss, "train_losses": np.stack(losses), "resumed": np.stack(resumed)}
        flat.update({f"grad_{i}": g for i, g in enumerate(jax.tree.leaves(grads))})
        flat.update({f"trained_{i}": t for i, t in enumerate(jax.tree.leaves(trained))})
        np.savez(out, **flat)
    print(f"process {pid}/{n} done: loss={float(loss):.6f}", flush=True)


def main(mode: str, out: str) -> None:
    pid, n = jax.process_index(), jax.process_count()
    assert n == 2 and jax.device_count() == 4 and jax.local_device_count() == 2, (
        n, jax.device_count(), jax.local_device_count())
    m = M if not (mode == "mismatch" and pid == 1) else M // 2
    if mode == "interleaved":  # one device of each process, two chunks each
        mesh = jax.make_mesh((2,), ("pipe",), devices=jax.devices()[::2])
        schedule = jp.Interleaved1F1B(2, m, stages_per_device=2)
    else:
        mesh = jax.make_mesh((P_STAGES,), ("pipe",))
        schedule = jp.OneFOneB(P_STAGES, m)
    host_params, host_batch = make_model()
    params = jpd.replicate(host_params, mesh)
    batch = jpd.global_batch(host_batch, mesh)
    # "accelerator": the GPU/TPU program (straight-line ticks), built and run on CPU
    runtime = {"runtime": SpmdRuntime(backend="gpu")} if mode == "accelerator" else {}
    pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=schedule, cut="markers",
                       **runtime)
    jpd.check_consistent(pipe)  # raises on the mismatch, in every process
    if mode == "interleaved":  # concurrent devices: a body per chunk, no run-time pick
        bodies = pipe.inspect.executor.bodies
        assert all(len(b.candidates(j)) == 1 for b in bodies
                   for j in range(len(b.param_classes))), [b.stages for b in bodies]
        # ... and the lazy exchange: messages wait in the outbox for a shared meeting
        low = pipe.inspect.executor.lowering
        assert low.exchange.lazy and max(low.units) > 1, (low.exchange, low.units)

    loss, grads = pipe.value_and_grad(params, batch)
    pipe.value_and_grad(host_params, host_batch)  # host (numpy) inputs: the same program
    assert pipe.inspect.value_and_grad_fn._cache_size() == 1, "value_and_grad recompiled"
    loss, grads = jpd.fetch((loss, grads))

    # "optimizer-mismatch": process 1 trains with another optimizer (refused by init)
    tx = optax.adam(LR) if mode == "optimizer-mismatch" and pid == 1 else optax.sgd(LR)
    state = pipe.init(params, tx)
    losses = []
    for i in range(TRAIN_STEPS):
        # a globally placed batch first, then the same rows as a host numpy batch
        state, metrics = pipe.train_step(state, batch if i == 0 else host_batch)
        losses.append(jpd.fetch(metrics["loss"]))
    assert state.trainer.step_fn._cache_size() == 1, "train_step recompiled"
    trained = jpd.fetch(pipe.params(state))

    # Checkpoint across processes (each writes its own shards to the shared directory),
    # then resume: the restored state's next step is bit-identical to the original's.
    ckpt = out + ".ckpt"
    jpc.save(f"{ckpt}/state", state, pipe=pipe)
    jpc.save_params(f"{ckpt}/params", pipe, state)
    restored = jpc.restore(f"{ckpt}/state", pipe, like=state)
    restored_params = jpd.fetch(jpc.restore_params(f"{ckpt}/params", pipe=pipe))
    state, m_orig = pipe.train_step(state, batch)
    restored, m_rest = pipe.train_step(restored, batch)
    resumed = [jpd.fetch(m_orig["loss"]), jpd.fetch(m_rest["loss"])]
    for a, b in zip(jax.tree.leaves(restored_params), jax.tree.leaves(trained), strict=True):
        np.testing.assert_array_equal(a, b)
    after = jpd.fetch((pipe.params(state), pipe.params(restored)))
    for a, b in zip(*map(jax.tree.leaves, after), strict=True):
        np.testing.assert_array_equal(a, b)

    report(out, loss, grads, losses, trained, resumed)


# ------------------------------------------------------------- tensor parallel, sharded
TP_SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": None}


def make_tp_model(seed: int = 1) -> tuple[dict, dict]:
    """Residual MLP blocks (one per stage), identical in every process."""
    rng = np.random.default_rng(seed)
    params = [{"w1": (rng.standard_normal((WIDTH, 2 * WIDTH)) * 0.4).astype(np.float32),
               "b1": np.full((2 * WIDTH,), 0.01 * i, np.float32),
               "w2": (rng.standard_normal((2 * WIDTH, WIDTH)) * 0.3).astype(np.float32),
               "b2": np.zeros((WIDTH,), np.float32)} for i in range(2)]
    batch = {"x": rng.standard_normal((BATCH, WIDTH)).astype(np.float32),
             "y": rng.standard_normal((BATCH, WIDTH)).astype(np.float32)}
    return params, batch


def tp_loss_fn(params: list, mb: dict) -> jax.Array:
    h = mb["x"]
    for i, blk in enumerate(params):
        h = h + jnp.tanh(h @ blk["w1"] + blk["b1"]) @ blk["w2"] + blk["b2"]
        if i < len(params) - 1:
            h = jp.boundary(h)
    return jnp.mean((h - mb["y"]) ** 2)


def tp_optimizer() -> optax.GradientTransformation:
    return optax.adamw(LR, weight_decay=0.1)


def tp_loss_fn_typed(params: list, mb: dict) -> jax.Array:
    """:func:`tp_loss_fn` written for sharding in types: the row-parallel contraction says
    its output sharding (both operands are sharded over 'model')."""
    h = mb["x"]
    for i, blk in enumerate(params):
        u = jnp.tanh(h @ blk["w1"] + blk["b1"])
        h = h + jnp.einsum("bh,hd->bd", u, blk["w2"], out_sharding=P()) + blk["b2"]
        if i < len(params) - 1:
            h = jp.boundary(h)
    return jnp.mean((h - mb["y"]) ** 2)


def sharded(out: str, axis_type: AxisType = AxisType.Auto) -> None:
    mesh = jax.make_mesh((2, 2), ("pipe", "model"), axis_types=(axis_type,) * 2)
    with jax.set_mesh(mesh):
        _sharded(out, mesh, tp_loss_fn if axis_type == AxisType.Auto else tp_loss_fn_typed)


def _sharded(out: str, mesh: Any, loss_fn: Any) -> None:
    # the pipe axis spans the processes; 'model' stays inside each
    for stage in range(2):
        assert {d.process_index for d in mesh.devices[stage]} == {stage}, mesh.devices
    host_params, host_batch = make_tp_model()
    specs = [dict(TP_SPECS) for _ in host_params]
    params = jpd.replicate(host_params, mesh)
    batch = jpd.global_batch(host_batch, mesh, data_axes=())
    pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=jp.OneFOneB(2, M),
                       cut="markers", param_specs=specs)
    jpd.check_consistent(pipe)
    loss, grads = pipe.value_and_grad(params, batch)
    for g, spec in zip(jax.tree.leaves(grads), jax.tree.leaves(pipe.inspect.param_specs),
                       strict=True):  # gradients come back sharded like their parameters
        assert g.sharding.is_equivalent_to(NamedSharding(mesh, spec), g.ndim), g.sharding
    loss, grads = jpd.fetch((loss, grads))

    state = pipe.init(params, tp_optimizer())
    for leaf in state.params:  # each device holds its shard of its own stage only
        if leaf.ndim == 3 and "model" in leaf.sharding.spec:
            assert leaf.addressable_shards[0].data.size == leaf.size // 4, leaf.sharding
    losses = []
    for _ in range(TRAIN_STEPS):
        state, metrics = pipe.train_step(state, batch)
        losses.append(jpd.fetch(metrics["loss"]))
    trained = jpd.fetch(pipe.params(state))
    ckpt = out + ".ckpt"
    jpc.save(f"{ckpt}/state", state, pipe=pipe)
    restored = jpc.restore(f"{ckpt}/state", pipe, like=state)
    for a, b in zip(jax.tree.leaves((restored.params, restored.opt_state)),
                    jax.tree.leaves((state.params, state.opt_state)), strict=True):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim), (a.sharding, b.sharding)
    state, m_orig = pipe.train_step(state, batch)
    restored, m_rest = pipe.train_step(restored, batch)
    resumed = [jpd.fetch(m_orig["loss"]), jpd.fetch(m_rest["loss"])]
    report(out, loss, grads, losses, trained, resumed)


if __name__ == "__main__":
    # Importing jax is fine; initialize must come before anything touches its backend.
    jpd.initialize(require=True)
    mode, out = sys.argv[1], sys.argv[2]
    # gloo's event-loop threads, which initialize gave SCHED_IDLE (the test reads this)
    idle = {t for t in thread_ids() if os.sched_getscheduler(t) == os.SCHED_IDLE}
    Path(out + ".idle.json").write_text(json.dumps(
        {"idle": len(idle), "in_epoll": len(waiting_in_epoll(idle))}))
    if mode == "sharded":
        sharded(out)
    elif mode == "sharded-explicit":
        sharded(out, AxisType.Explicit)
    else:
        main(mode, out)
