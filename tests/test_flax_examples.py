"""flax's own models, as their authors wrote and shard them, pipelined exact and sharded.

The files are pinned under ``tests/flax_examples`` (flax's licence; see its README). The
only change a user makes is marking the blocks: ``modules.Block = jp.layer(modules.Block)``.

- Gemma (nnx) with its ``ShardingConfig.fsdp_tp_sharding()`` (parameter metadata,
  ``out_sharding=`` on activations, an ``nnx.Embed`` lookup under ``auto_axes``), built
  under ``jax.set_mesh`` on a default ``jax.make_mesh`` (every axis Explicit): XLA aborted
  the process partitioning its embedding's gather inside the program's switch until
  :mod:`jaxpipe.gathers` (the reproducer: ``test_xla_gather_bug.py``).
- lm1b (linen) with its logical axis rules: refused with the reason (a collective-permute
  in a stage), the open part of the real-sharding issue.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax_examples import gemma_setup, staged_share

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
def _gemma_run(shape: tuple[int, ...], backend: str = "cpu"):
    """Gemma pipelined with 1F1B on ``shape`` (pipe, fsdp[, tp]): the pipeline, its loss
    and gradients, nnx.value_and_grad's on the same mesh, and the staged parameters."""
    mesh = jax.make_mesh(shape, ("pipe", "fsdp", "tp")[:len(shape)])
    with jax.set_mesh(mesh):
        model, batch, loss_fn = _gemma(mesh)
        pipe = jp.flax.pipeline(model, loss_fn, batch, mesh=mesh,
                                schedule=jp.OneFOneB(shape[0], M),
                                runtime=SpmdRuntime(backend=backend))
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


def test_gemma_on_the_accelerator_program_is_exact():
    """The accelerator program (``backend="gpu"``, compiled here by XLA:CPU) on
    (pipe 2, fsdp 2, tp 2): the same loss and gradients."""
    _, _, _, (loss, grads), (ref_loss, ref_grads), _ = _gemma_run((2, 2, 2), "gpu")
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    assert _rel(grads, ref_grads) <= 1e-5


@pytest.mark.parametrize("platform", ["tpu", "gpu"])
def test_gemma_compiles_for_a_tpu_and_a_gpu_target(platform):
    """Gemma (pipe 2, fsdp 2, tp 2) built from shapes on 8 compile-only TPU v5e / H100
    devices: the accelerator program compiles with XLA's real compiler (its partitioner
    aborted before :mod:`jaxpipe.gathers`); the tick loop holds one conditional, no
    permute inside it, and the stages' FSDP/TP collectives, counted per tick."""
    import importlib.util

    from jaxpipe.aot import target
    from jaxpipe.runtime.spmd.program.hlo_census import census

    module = {"tpu": "libtpu", "gpu": "jax_plugins.xla_cuda12"}[platform]
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"XLA's {platform.upper()} compiler is not installed: "
                    "pip install -e '.[aot]'")
    mesh = target({"tpu": "tpu:v5e:2x4", "gpu": "gpu:h100:8"}[platform]).mesh(
        (2, 2, 2), ("pipe", "fsdp", "tp"))
    with jax.set_mesh(mesh):
        model, batch, loss_fn = _gemma(mesh, abstract=True)
        pipe = jp.flax.pipeline(model, loss_fn, batch, mesh=mesh, schedule=jp.OneFOneB(2, M),
                                runtime=SpmdRuntime(overlap=True))
        found = census(pipe.lower("value_and_grad").compile().as_text())
    assert found.trip_count == pipe.executor.lowering.num_ticks, found.summary()
    assert found.conditionals == 1 and found.permutes_in_conditionals == 0, found.summary()
    assert found.collectives >= found.collectives_in_conditionals > 0, found.summary()
    assert {"all-gather", "all-reduce"} <= set(found.collective_ops), found.summary()


def test_lm1b_with_its_logical_rules_is_refused_with_the_reason():
    """flax's lm1b (linen) with its own logical axis rules (mlp, vocab, heads -> tensor,
    embed -> fsdp), its parameters placed as its train.py places them: XLA partitions the
    attention projections ('embed' on fsdp on both sides of the contraction) with a
    collective-permute, which a stage under the program's per-device switch cannot run
    (XLA:CPU waits for every device in it; only one pipe position runs the stage). The
    pipeline says so, naming the op, instead of hanging: the open part of the
    real-sharding issue (a stage's collectives out of the conditional)."""
    import flax.linen as nn
    from flax_examples import lm1b
    from jax.sharding import Mesh

    models = lm1b()
    rules = [["mlp", "tensor"], ["vocab", "tensor"], ["embed", "fsdp"], ["heads", "tensor"]]
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("pipe", "fsdp", "tensor"))
    cfg = models.TransformerConfig(
        vocab_size=VOCAB, output_vocab_size=VOCAB, emb_dim=32, num_heads=4, num_layers=4,
        qkv_dim=32, mlp_dim=64, max_len=SEQ, dropout_rate=0.0, attention_dropout_rate=0.0,
        deterministic=True)
    model = models.TransformerLM(cfg)
    layer = jp.layer(models.EncoderDecoder1DBlock)
    tokens = jax.random.randint(jax.random.key(1), (BATCH, SEQ), 1, VOCAB)
    init = lambda: model.init(jax.random.key(0), tokens[:2])
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        shardings = nn.logical_to_mesh_sharding(
            nn.get_partition_spec(jax.eval_shape(init)), mesh, rules)
        variables = jax.jit(init, out_shardings=shardings)()

    def loss_fn(module, v, b):
        logits = module.apply(v, b["x"])
        return -jnp.mean(jnp.sum(jax.nn.one_hot(b["x"], VOCAB) * nn.log_softmax(logits), -1))

    original, models.EncoderDecoder1DBlock = models.EncoderDecoder1DBlock, layer
    try:
        with nn.logical_axis_rules(rules):
            pipe = jp.flax.pipeline_linen(model, variables, loss_fn, {"x": tokens}, mesh=mesh,
                                          schedule=jp.OneFOneB(2, M))
        with pytest.raises(jp.PipelineError, match="collective-permute.*dot_general"):
            pipe.value_and_grad(variables["params"], {"x": tokens})
    finally:
        models.EncoderDecoder1DBlock = original
