"""Load flax's own example models pinned under ``tests/flax_examples`` (see its README)."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

import jaxpipe as jp

ROOT = Path(__file__).resolve().parent.parent / "flax_examples"


def _import_from(folder: Path, *names: str) -> list[types.ModuleType]:
    sys.path.insert(0, str(folder))
    try:
        return [importlib.import_module(n) for n in names]
    finally:
        sys.path.remove(str(folder))


def gemma() -> tuple[types.ModuleType, types.ModuleType, types.ModuleType]:
    """flax's Gemma: ``(transformer, transformer_cfg, modules)``, imported once, its
    ``modules.Block`` marked ``@jp.layer`` (the one change a user makes)."""
    try:
        import jaxtyping  # noqa: F401
    except ImportError:  # one annotation needs it; not a dependency of ours
        shim = types.ModuleType("jaxtyping")
        shim.Array = jax.Array
        sys.modules["jaxtyping"] = shim
    transformer, cfg, modules = _import_from(ROOT / "gemma", "transformer", "transformer_cfg",
                                             "modules")
    if modules.Block not in _MARKED:
        modules.Block = jp.layer(modules.Block)
        _MARKED.add(modules.Block)
    return transformer, cfg, modules


_MARKED: set = set()


def gemma_setup(mesh: jax.sharding.Mesh, *, layers: int = 4, embed: int = 32,
                hidden: int = 64, heads: int = 4, head_dim: int = 8, kv_heads: int = 2,
                vocab: int = 64, seq: int = 8, batch: int = 16, abstract: bool = False
                ) -> tuple[Any, dict, Callable]:
    """``(model, batch, loss_fn)``: a Gemma of this size with flax's FSDP x TP sharding
    config on ``mesh`` ('tp' if it has the axis), built under ``jax.set_mesh(mesh)``
    (the caller's), random tokens, and flax's examples/gemma/train.py cross entropy per
    microbatch. ``abstract``: shapes only (``nnx.eval_shape``), for a compile-only mesh."""
    import jax.numpy as jnp
    from flax import nnx

    transformer, transformer_cfg, modules = gemma()
    cfg = transformer.TransformerConfig(
        num_layers=layers, num_embed=vocab, embed_dim=embed, hidden_dim=hidden,
        num_heads=heads, head_dim=head_dim, num_kv_heads=kv_heads, final_logit_softcap=None,
        attention_types=[modules.AttentionType.GLOBAL] * layers, use_post_attn_norm=False,
        use_post_ffw_norm=False,
        shd_config=transformer_cfg.ShardingConfig.fsdp_tp_sharding(
            tensor_parallel_axis_name="tp" if "tp" in mesh.axis_names else None))
    make = lambda: transformer.Transformer(cfg, rngs=nnx.Rngs(params=0))
    if abstract:
        model = nnx.eval_shape(make)
        tokens = {k: jax.ShapeDtypeStruct((batch, seq), jnp.int32) for k in ("x", "y")}
    else:
        model = make()
        x = jax.random.randint(jax.random.key(1), (batch, seq), 0, vocab)
        tokens = {"x": x, "y": jnp.roll(x, -1, axis=1)}

    def loss_fn(model, mb):
        positions = jnp.broadcast_to(jnp.arange(seq), mb["x"].shape)
        mask = transformer.make_causal_attn_mask(jnp.ones_like(mb["x"], bool))
        logits, _ = model(mb["x"], positions, None, mask)
        return -jnp.sum(jax.nn.one_hot(mb["y"], vocab) * nnx.log_softmax(logits), -1).mean()

    return model, tokens, loss_fn


def lm1b() -> types.ModuleType:
    """flax's lm1b ``models`` module, imported once (as ``lm1b_models``), its
    ``EncoderDecoder1DBlock`` marked ``@jp.layer`` (the one change a user makes)."""
    if "lm1b_models" not in sys.modules:
        spec = importlib.util.spec_from_file_location("lm1b_models", ROOT / "lm1b" / "models.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["lm1b_models"] = module
        spec.loader.exec_module(module)
        module.EncoderDecoder1DBlock = jp.layer(module.EncoderDecoder1DBlock)
    return sys.modules["lm1b_models"]


#: lm1b's logical axis rules, as its train.py gives them for FSDP x tensor parallelism.
LM1B_RULES = (("mlp", "tensor"), ("vocab", "tensor"), ("embed", "fsdp"), ("heads", "tensor"))


def lm1b_setup(mesh: jax.sharding.Mesh, *, layers: int = 4, vocab: int = 64, seq: int = 8,
               batch: int = 16, abstract: bool = False) -> tuple[Any, Any, Callable, dict]:
    """``(model, variables, loss_fn, batch)``: an lm1b ``TransformerLM`` of this size, its
    variables placed as its train.py places them (``nn.logical_to_mesh_sharding`` of its
    rules, :data:`LM1B_RULES`, on ``mesh``), random tokens, and a next-token cross
    entropy per microbatch. ``abstract``: shapes with their shardings only, for a
    compile-only mesh. Build the pipeline under ``nn.logical_axis_rules(LM1B_RULES)``."""
    import flax.linen as nn
    import jax.numpy as jnp

    models = lm1b()
    cfg = models.TransformerConfig(
        vocab_size=vocab, output_vocab_size=vocab, emb_dim=32, num_heads=4,
        num_layers=layers, qkv_dim=32, mlp_dim=64, max_len=seq, dropout_rate=0.0,
        attention_dropout_rate=0.0, deterministic=True)
    model = models.TransformerLM(cfg)
    rules = [list(r) for r in LM1B_RULES]
    init = lambda: model.init(jax.random.key(0), jnp.ones((2, seq), jnp.int32))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        shapes = jax.eval_shape(init)
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(shapes), mesh, rules)
        if abstract:
            def placed(box, s):  # the logical metadata kept, its value a placed shape
                a = box.value if isinstance(box, nn.meta.AxisMetadata) else box
                sds = jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
                return box.replace(value=sds) if isinstance(box, nn.meta.AxisMetadata) else sds

            variables = jax.tree.map(placed, shapes, shardings,
                                     is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))
            tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
        else:
            variables = jax.jit(init, out_shardings=shardings)()
            tokens = jax.random.randint(jax.random.key(1), (batch, seq), 1, vocab)

    def loss_fn(module, v, b):
        logits = module.apply(v, b["x"])
        return -jnp.mean(jnp.sum(jax.nn.one_hot(b["x"], vocab) * nn.log_softmax(logits), -1))

    return model, variables, loss_fn, {"x": tokens}


def staged_share(staged: Any) -> float:
    """The most bytes one device holds of staged parameters (``pipe.shard(model)``), over
    their total: 1 / (pipe x the axes that split every weight) at best."""
    from benchmarks.common import load_example

    held = load_example("gpt").param_bytes_per_device(staged)
    return held / sum(x.nbytes for x in jax.tree.leaves(staged))
