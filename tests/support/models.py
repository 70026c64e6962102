"""Small test models with markers, and the unpipelined reference they must match.

- ``mlp``: one marker per layer.
- ``skip_mlp``: a value produced by the first layer is consumed by the last one, so with
  three or more stages it jumps over the middle stages.
- ``tiny_lm``: int token inputs, a token embedding tied to the output projection (read by
  the first and the last stage), attention blocks with a marker after each
  (``block_scale`` < 1 keeps a deep stack's activations, and so float32 rounding, small).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jaxpipe as jp


def _keys(seed, n):
    return jax.random.split(jax.random.key(seed), n)


def mlp(n_layers: int, width: int = 8, batch: int = 16, seed: int = 0):
    ks = _keys(seed, n_layers + 2)
    params = [{"w": jax.random.normal(ks[i], (width, width)) / jnp.sqrt(width),
               "b": jnp.full((width,), 0.01 * i)} for i in range(n_layers)]
    data = {"x": jax.random.normal(ks[-2], (batch, width)),
            "y": jax.random.normal(ks[-1], (batch, width))}

    def loss_fn(p, b):
        h = b["x"]
        for layer in p:
            h = jp.boundary(jnp.tanh(h @ layer["w"] + layer["b"]))
        return jnp.mean((h - b["y"]) ** 2)

    return loss_fn, params, data


def skip_mlp(n_layers: int, width: int = 8, batch: int = 16, seed: int = 1):
    loss_fn0, params, data = mlp(n_layers, width, batch, seed)

    def loss_fn(p, b):
        h = b["x"]
        first = None
        for i, layer in enumerate(p):
            z = h @ layer["w"] + layer["b"]
            if i == len(p) - 1 and i > 0:
                z = z + 0.5 * first  # skip connection from the first layer
            h = jp.boundary(jnp.tanh(z))
            if i == 0:
                first = h
        return jnp.mean((h - b["y"]) ** 2)

    return loss_fn, params, data


def tiny_lm(n_layers: int, vocab: int = 11, width: int = 8, seq: int = 4, batch: int = 16,
            seed: int = 2, block_scale: float = 1.0):
    ks = _keys(seed, 4 * n_layers + 3)
    params = {
        "embed": jax.random.normal(ks[0], (vocab, width)) * 0.5,
        "pos": jax.random.normal(ks[1], (seq, width)) * 0.1,
        "blocks": [
            {"qkv": jax.random.normal(ks[2 + 4 * i], (width, 3 * width)) / jnp.sqrt(width),
             "out": block_scale * jax.random.normal(ks[3 + 4 * i], (width, width))
             / jnp.sqrt(width),
             "mlp": block_scale * jax.random.normal(ks[4 + 4 * i], (width, width))
             / jnp.sqrt(width)}
            for i in range(n_layers)
        ],
    }
    tokens = jax.random.randint(ks[-1], (batch, seq + 1), 0, vocab)
    data = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}

    def loss_fn(p, b):
        h = p["embed"][b["tokens"]] + p["pos"]
        mask = jnp.tril(jnp.ones((seq, seq), bool))
        for blk in p["blocks"]:
            q, k, v = jnp.split(h @ blk["qkv"], 3, axis=-1)
            att = jnp.einsum("bqd,bkd->bqk", q, k) / jnp.sqrt(width)
            att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
            h = h + jnp.einsum("bqk,bkd->bqd", att, v) @ blk["out"]
            h = jp.boundary(h + jax.nn.gelu(h @ blk["mlp"]))
        logits = h @ p["embed"].T  # tied output projection
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, b["targets"][..., None], -1))

    return loss_fn, params, data


MODELS = {"mlp": mlp, "skip_mlp": skip_mlp, "tiny_lm": tiny_lm}


def reference(loss_fn, params, batch, m: int):
    """``jax.value_and_grad`` of the unpipelined mean-over-microbatches loss."""

    def mean_loss(p):
        mbs = jax.tree.map(lambda x: x.reshape(m, -1, *x.shape[1:]), batch)
        return jnp.mean(jax.vmap(lambda mb: loss_fn(p, mb))(mbs))

    return jax.value_and_grad(mean_loss)(params)


def reference_per_microbatch(loss_fn, params, batch, m: int):
    """``jax.value_and_grad`` of each microbatch, averaged: the pipeline's order of sums,
    for models computing in bf16 (a vmap over microbatches sums their bf16 products
    before the float32 gradient sees them)."""
    mbs = jax.tree.map(lambda x: x.reshape(m, -1, *x.shape[1:]), batch)
    each = [jax.value_and_grad(loss_fn)(params, jax.tree.map(lambda x, i=i: x[i], mbs))
            for i in range(m)]
    return jax.tree.map(lambda *xs: sum(xs) / m, *each)


def assert_matches(result, expected, rtol=1e-5):
    """Loss and every gradient leaf close, atol scaled to the gradient's magnitude."""
    import numpy as np

    (l1, g1), (l2, g2) = result, expected
    np.testing.assert_allclose(l1, l2, rtol=rtol, atol=1e-7, err_msg="the loss differs")
    assert jax.tree.structure(g1) == jax.tree.structure(g2), (
        f"gradient structures differ: {jax.tree.structure(g1)} vs {jax.tree.structure(g2)}")
    got = jax.tree_util.tree_leaves_with_path(g1)
    for (path, a), b in zip(got, jax.tree.leaves(g2), strict=True):
        scale = float(jnp.max(jnp.abs(b))) + 1e-12
        np.testing.assert_allclose(
            a, b, rtol=rtol, atol=rtol * scale,
            err_msg=f"gradient of {jax.tree_util.keystr(path)} (max |grad| {scale:.3g})")
