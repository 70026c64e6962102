"""flax's own models, as their authors wrote and shard them, pipelined exact and sharded.

The files are pinned under ``tests/flax_examples`` (flax's licence; see its README). The
only change a user makes is marking the blocks: ``modules.Block = jp.layer(modules.Block)``.

- Gemma (nnx) with its ``ShardingConfig.fsdp_tp_sharding()`` (parameter metadata,
  ``out_sharding=`` on activations, an ``nnx.Embed`` lookup under ``auto_axes``), built
  under ``jax.set_mesh`` on a default ``jax.make_mesh`` (every axis Explicit): XLA aborted
  the process partitioning its embedding's gather inside the program's switch until
  :mod:`jaxpipe.sharding.gathers` (the reproducer: ``test_xla_gather_bug.py``).
- lm1b (linen) with its logical axis rules: XLA puts collective-permutes inside its
  stages, which run on every device at once in the lanes program (and are refused, with
  the reason, under the switch program's per-device conditional).

Both share one body over their stages, so by default (``lanes="auto"``, the mesh has
axes sharding parameters) they run as lanes: no stage compute, and so no FSDP or TP
collective, under a conditional.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from flax_examples import LM1B_RULES, gemma_setup, lm1b_setup, staged_share

import jaxpipe as jp
from jaxpipe.runtime.spmd import SpmdRuntime

VOCAB, SEQ, BATCH, M = 64, 8, 16, 4


def _gemma(mesh: jax.sharding.Mesh, abstract: bool = False):
    """A 4-block Gemma with flax's FSDP x TP sharding config on ``mesh``, its batch and
    loss (``flax_examples.gemma_setup``: the blocks marked ``@jp.layer``)."""
    return gemma_setup(mesh, vocab=VOCAB, seq=SEQ, batch=BATCH, abstract=abstract)


def _rel(got, want) -> float:
    """The gradients' relative error: ||got - want|| / ||want|| over every leaf."""
    g = [np.asarray(x, np.float64) for x in jax.tree.leaves(got)]
    w = [np.asarray(x, np.float64) for x in jax.tree.leaves(want)]
    assert len(g) == len(w)
    return float(np.sqrt(sum(np.sum((a - b) ** 2) for a, b in zip(g, w, strict=True))
                         / sum(np.sum(b ** 2) for b in w)))


@functools.cache
def _gemma_run(shape: tuple[int, ...], backend: str = "cpu", lanes: bool | str = "auto"):
    """Gemma pipelined with 1F1B on ``shape`` (pipe, fsdp[, tp]): the pipeline, its loss
    and gradients, nnx.value_and_grad's on the same mesh, and the staged parameters."""
    mesh = jax.make_mesh(shape, ("pipe", "fsdp", "tp")[:len(shape)])
    with jax.set_mesh(mesh):
        model, batch, loss_fn = _gemma(mesh)
        pipe = jp.flax.pipeline(model, loss_fn, batch, mesh=mesh,
                                schedule=jp.OneFOneB(shape[0], M),
                                runtime=SpmdRuntime(backend=backend, lanes=lanes))
        loss, grads = pipe.value_and_grad(model, batch)
        # one compiled program: op by op, each eager collective is a rendezvous of the 8
        # virtual devices of its own, and one aborted the suite's process under load
        ref_loss, ref_grads = nnx.jit(nnx.value_and_grad(loss_fn))(model, batch)
        staged = pipe.shard(model)
    return pipe, model, batch, (loss, grads), (ref_loss, nnx.to_pure_dict(ref_grads)), staged


@pytest.mark.parametrize("shape", [(2, 2, 2), (4, 2)], ids=["pipe2_fsdp2_tp2", "pipe4_fsdp2"])
def test_gemma_with_its_fsdp_tp_sharding_is_exact_and_sharded(shape):
    """Loss and gradients equal nnx.value_and_grad's on the same mesh (rel <= 1e-5); the
    gradients keep the parameters' sharded types; each device holds its pipe position's
    share of its fsdp x tp shard of the staged weights (<= 0.275 of all)."""
    pipe, _, _, (loss, grads), (ref_loss, ref_grads), staged = _gemma_run(shape)
    assert pipe.inspect.executor.lanes  # its stages share one body: no conditional around them
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert _rel(grads, ref_grads) <= 1e-5
    w = jax.tree.leaves(grads["layers"][0]["attn"])[0]
    assert set(jax.typeof(w).sharding.spec) - {None}, jax.typeof(w)
    assert staged_share(staged) <= 0.275


def test_gemma_trains_with_adamw():
    """pipe.init + three AdamW train steps: the first step's loss is the model's, and the
    loss goes down."""
    pipe, model, batch, _, (ref_loss, _), _ = _gemma_run((2, 2, 2))
    with jax.set_mesh(pipe.mesh):
        state = pipe.init(model, optax.adamw(1e-2))
        losses = []
        for _ in range(3):
            state, metrics = pipe.train_step(state, batch)
            losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses[0], ref_loss, rtol=1e-6)
    assert losses[2] < losses[1] < losses[0]


def test_gemma_on_the_switch_program_is_exact():
    """The accelerator program without the lanes (``backend="gpu"``, ``lanes=False``,
    compiled here by XLA:CPU) on (pipe 2, fsdp 2, tp 2): every stage under the
    per-device switch, its embedding's gather made partitionable there by
    :mod:`jaxpipe.sharding.gathers`; the same loss and gradients."""
    pipe, _, _, (loss, grads), (ref_loss, ref_grads), _ = _gemma_run((2, 2, 2), "gpu", False)
    assert not pipe.inspect.executor.lanes
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert _rel(grads, ref_grads) <= 1e-5


@pytest.mark.parametrize("model", ["gemma", "lm1b"])
@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_flax_models_compile_for_a_tpu_and_a_gpu_target(platform, model):
    """Gemma and lm1b (pipe 2, fsdp 2, tp 2) built from shapes on 8 compile-only TPU v5e /
    H100 devices compile with XLA's real compiler as lanes: no tick loop holds a
    conditional, so every FSDP all-gather and TP reduction of the stages runs outside
    one (the switch program held 142 of Gemma's 191 on TPU, all 70 on GPU), counted per
    tick by the census."""
    import importlib.util

    import flax.linen as nn

    from jaxpipe.aot import target
    from jaxpipe.runtime.spmd.program.hlo_census import census, loop_conditionals

    module = {"tpu": "libtpu", "gpu": "jax_plugins.xla_cuda12"}[platform]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"XLA's {platform.upper()} compiler is not installed: "
                    "pip install -e '.[aot]'")
    # lm1b's linen constraints need Auto axes, as its train.py's Mesh has them
    axes = ("pipe", "fsdp", "tp" if model == "gemma" else "tensor")
    types = None if model == "gemma" else (jax.sharding.AxisType.Auto,) * 3
    mesh = target({"tpu": "tpu:v5e:2x4", "gpu": "gpu:h100:8"}[platform]).mesh(
        (2, 2, 2), axes, axis_types=types)
    with jax.set_mesh(mesh):
        if model == "gemma":
            net, batch, loss_fn = _gemma(mesh, abstract=True)
            pipe = jp.flax.pipeline(net, loss_fn, batch, mesh=mesh, schedule=jp.OneFOneB(2, M))
        else:
            net, variables, loss_fn, batch = lm1b_setup(mesh, vocab=VOCAB, seq=SEQ,
                                                        batch=BATCH, abstract=True)
            with nn.logical_axis_rules([list(r) for r in LM1B_RULES]):
                pipe = jp.flax.pipeline_linen(net, variables, loss_fn, batch, mesh=mesh,
                                              schedule=jp.OneFOneB(2, M))
        text = pipe.lower("value_and_grad").compile().as_text()
    assert pipe.inspect.executor.lanes
    found = census(text)
    assert loop_conditionals(text)[1] == 0, found.summary()
    assert found.conditionals == 0 and found.collectives_in_conditionals == 0, found.summary()
    assert found.collectives > 0, found.summary()
    assert {"all-gather", "all-reduce"} <= set(found.collective_ops), found.summary()


@functools.cache
def _lm1b_run(backend: str):
    """lm1b with its logical rules on (pipe 2, fsdp 2, tensor 2), 1F1B: the pipeline, its
    loss and gradients, jax.value_and_grad's of the same model, and the staged
    parameters."""
    import flax.linen as nn
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("pipe", "fsdp", "tensor"))
    model, variables, loss_fn, batch = lm1b_setup(mesh, vocab=VOCAB, seq=SEQ, batch=BATCH)
    rules = [list(r) for r in LM1B_RULES]
    with nn.logical_axis_rules(rules):
        pipe = jp.flax.pipeline_linen(model, variables, loss_fn, batch, mesh=mesh,
                                      schedule=jp.OneFOneB(2, M),
                                      runtime=SpmdRuntime(backend=backend))
        got = pipe.value_and_grad(variables["params"], batch)
        want = jax.jit(jax.value_and_grad(lambda p: loss_fn(model, {"params": p}, batch)))(
            variables["params"])
    return pipe, got, want, pipe.shard(variables["params"])


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_lm1b_with_its_logical_rules_is_exact_and_sharded(backend):
    """flax's lm1b (linen) with its own logical axis rules (mlp, vocab, heads -> tensor,
    embed -> fsdp), its parameters placed as its train.py places them. XLA partitions the
    attention projections ('embed' on fsdp on both sides of the contraction) with
    collective-permutes inside the stages; the lanes program runs them on every device
    at once (chosen by default: the stages share one body), on the CPU runtime and the
    accelerator program: loss and gradients equal jax.value_and_grad's, each device
    holds its share of the staged weights."""
    pipe, (loss, grads), (ref_loss, ref_grads), staged = _lm1b_run(backend)
    assert pipe.inspect.executor.lanes
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert _rel(grads, ref_grads) <= 1e-5
    assert staged_share(staged) <= 0.275


def test_lm1b_under_the_switch_is_refused_with_the_reason():
    """Without the lanes (``lanes=False``) every stage runs under the program's
    per-device switch, where XLA:CPU's collective-permute (it waits for every device of
    the program; one pipe position runs the stage) would hang: the pipeline says so,
    naming the op, before it runs."""
    import flax.linen as nn
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("pipe", "fsdp", "tensor"))
    model, variables, loss_fn, batch = lm1b_setup(mesh, vocab=VOCAB, seq=SEQ, batch=BATCH)
    with nn.logical_axis_rules([list(r) for r in LM1B_RULES]):
        pipe = jp.flax.pipeline_linen(model, variables, loss_fn, batch, mesh=mesh,
                                      schedule=jp.OneFOneB(2, M),
                                      runtime=SpmdRuntime(lanes=False))
        with pytest.raises(jp.PipelineError, match="collective-permute.*dot_general"):
            pipe.value_and_grad(variables["params"], batch)
