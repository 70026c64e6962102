"""Cost model: FLOPs from the jaxpr (exact for matmuls/convs) and per-segment bytes."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpipe as jp
from jaxpipe.cut.cost import SegmentCost, aval_bytes, segment_costs
from jaxpipe.cut.flops import eqn_flops, jaxpr_flops
from jaxpipe.jaxpr.trace import segments, trace


def _flops_by_primitive(closed):
    out: dict[str, float] = {}
    for eqn in closed.jaxpr.eqns:
        out[eqn.primitive.name] = out.get(eqn.primitive.name, 0.0) + eqn_flops(eqn)
    return out


def test_small_mlp_flops_exact():
    B, din, h, dout = 4, 5, 7, 3

    def mlp(p, x):
        z = jnp.tanh(x @ p["w1"] + p["b1"])
        return jnp.sum((z @ p["w2"]) ** 2)

    p = {"w1": jnp.ones((din, h)), "b1": jnp.ones((h,)), "w2": jnp.ones((h, dout))}
    closed = jax.make_jaxpr(mlp)(p, jnp.ones((B, din)))
    by = _flops_by_primitive(closed)
    assert by["dot_general"] == 2 * B * din * h + 2 * B * h * dout  # exact: 2 x MACs
    assert by["broadcast_in_dim"] == 0  # data movement is free
    # bias add + tanh (B*h each), square (B*dout), sum reads B*dout elements
    assert jaxpr_flops(closed) == by["dot_general"] + 2 * B * h + 2 * B * dout


def test_batched_and_multi_contracting_dot_general():
    x, y = jnp.ones((3, 4, 5, 6)), jnp.ones((3, 5, 6, 2))
    closed = jax.make_jaxpr(lambda a, b: jnp.einsum("bijk,bjkl->bil", a, b))(x, y)
    assert _flops_by_primitive(closed)["dot_general"] == 2 * 3 * 4 * 2 * (5 * 6)


@pytest.mark.parametrize("groups", [1, 2])
def test_conv_flops_exact(groups):
    cin, cout, k = 4, 6, 3
    lhs = jnp.ones((2, cin, 8, 8))
    rhs = jnp.ones((cout, cin // groups, k, k))

    def conv(a, b):
        return jax.lax.conv_general_dilated(a, b, (1, 1), "SAME", feature_group_count=groups)

    closed = jax.make_jaxpr(conv)(lhs, rhs)
    out_elems = 2 * cout * 8 * 8
    assert jaxpr_flops(closed) == 2 * out_elems * (cin // groups) * k * k


def test_nested_jaxprs_are_followed():
    w = jnp.ones((8, 8))
    x = jnp.ones((2, 8))
    mm = 2 * 2 * 8 * 8

    def plain(w, x):
        return x @ w

    for wrap in (jax.jit, jax.checkpoint, jax.custom_jvp):
        f = wrap(plain)
        if wrap is jax.custom_jvp:
            f.defjvp(lambda primals, tangents: (plain(*primals), plain(*tangents)))
        assert jaxpr_flops(jax.make_jaxpr(f)(w, x)) == mm, wrap

    @jax.custom_vjp
    def g(w, x):
        return x @ w

    g.defvjp(lambda w, x: (x @ w, (w, x)), lambda r, ct: (r[1].T @ ct, ct @ r[0].T))
    assert jaxpr_flops(jax.make_jaxpr(g)(w, x)) == mm

    def scanned(w, x):
        return jax.lax.scan(lambda c, _: (c @ w, None), x, None, length=5)[0]

    assert jaxpr_flops(jax.make_jaxpr(scanned)(w, x)) == 5 * mm

    def branchy(w, x):  # cond costs its most expensive branch
        return jax.lax.cond(x.sum() > 0, lambda x: (x @ w) @ w, lambda x: x + 1.0, x)

    by = _flops_by_primitive(jax.make_jaxpr(branchy)(w, x))
    assert by["cond"] == 2 * mm


def test_aval_bytes():
    assert aval_bytes(jax.core.ShapedArray((3, 4), jnp.float32)) == 48
    assert aval_bytes(jax.core.ShapedArray((3, 4), jnp.bfloat16)) == 24
    assert aval_bytes(jax.core.ShapedArray((), jnp.int8)) == 1


def test_segment_cost_validation():
    c = SegmentCost(flops=10.0, param_leaf_bytes={0: 8, 3: 4})
    assert c.param_bytes == 12 and c.param_ids == {0, 3} and c.private_param_bytes == 0
    assert c.bwd_flops == 20.0  # the documented 2x backward assumption
    assert SegmentCost(flops=1, param_bytes=20, param_leaf_bytes={1: 8}).private_param_bytes == 12
    with pytest.raises(ValueError, match="smaller"):
        SegmentCost(flops=1, param_bytes=4, param_leaf_bytes={0: 8})
    with pytest.raises(ValueError, match="residual_bytes"):
        SegmentCost(flops=1, residual_bytes=-1)


B, H, L = 8, 16, 4


@jp.layer(name="block")
def _block(w, h):
    return jnp.tanh(h @ w)


def _tied_model(p, batch):
    h = jp.boundary(batch["x"] @ p["emb"], name="embed")
    for w in p["ws"]:
        h = _block(w, h)
    logits = h @ p["emb"].T  # tied head reads the embedding again
    return jnp.mean((logits - batch["y"]) ** 2)


@pytest.fixture(scope="module")
def tied():
    rng = np.random.default_rng(0)
    params = {
        "emb": jnp.asarray(rng.normal(size=(H, H)), jnp.float32),
        "ws": [jnp.asarray(rng.normal(size=(H, H)), jnp.float32) for _ in range(L)],
    }
    mb = {"x": jnp.ones((B, H)), "y": jnp.ones((B, H))}
    t = trace(_tied_model, params, mb)
    return t, segment_costs(t)


def test_segment_costs_of_a_traced_model(tied):
    t, costs = tied
    assert len(costs) == len(t.markers) + 1 == L + 2
    assert [c.name for c in costs[:-1]] == ["embed"] + ["block"] * L
    # FLOPs add up to the whole program, segment by segment
    eqns = t.closed_jaxpr.jaxpr.eqns
    for c, (a, b) in zip(costs, segments(t), strict=True):
        assert c.flops == sum(eqn_flops(e) for e in eqns[a:b])
    assert sum(c.flops for c in costs) == jaxpr_flops(t.closed_jaxpr)
    mm = 2 * B * H * H
    assert costs[1].flops == mm + B * H  # matmul + tanh
    # parameters: leaf 0 is the embedding (read by the first and the last segment)
    leaf = H * H * 4
    assert costs[0].param_leaf_bytes == {0: leaf}
    assert costs[-1].param_leaf_bytes == {0: leaf}
    assert [c.param_ids for c in costs[1:-1]] == [{i} for i in range(1, L + 1)]
    # what crosses each marker is the [B, H] float32 activation; the loss is not sent
    assert [c.out_bytes for c in costs] == [B * H * 4] * (L + 1) + [0]
    # each block's backward needs at least its input activation (for dW)
    assert all(c.residual_bytes >= B * H * 4 for c in costs[1:-1])


def test_tied_embedding_counted_once_when_both_ends_share_a_stage(tied):
    from jaxpipe.cut import Cut, partition

    _, costs = tied
    leaf = H * H * 4
    one = partition(costs, [0], [1], Cut())
    assert one.stage_memory[0].params == (L + 1) * leaf  # not L + 2
    two = partition(costs, [0, 1], [2, 1], Cut(indices=[2]))
    assert sum(s.params for s in two.stage_memory) == (L + 2) * leaf


def test_profile_fills_measured_times():
    def loss(p, b):
        h = jp.boundary(jnp.tanh(b["x"] @ p[0]))
        return jnp.mean(h @ p[1])

    p = [jnp.ones((8, 8)), jnp.ones((8, 8))]
    t = trace(loss, p, {"x": jnp.ones((4, 8))})
    costs = segment_costs(t, profile=True)
    assert all(c.profiled and c.fwd_time > 0 and c.bwd_time >= 0 for c in costs)
    assert all(math.isfinite(c.fwd_time) for c in costs)
