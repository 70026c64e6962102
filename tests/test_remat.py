"""Recomputation policies (issue 17): stage functions apply each with ``jax.checkpoint``
(gradients stay exact, stored residuals shrink) and the cost model measures them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from models import assert_matches, reference, tiny_lm
from split_schedule import DeferredW1F1B

import jaxpipe as jp
from jaxpipe.avals import aval_bytes
from jaxpipe.cost import RematCost, jaxpr_flops, segment_costs
from jaxpipe.remat import Remat
from jaxpipe.runtime.reference import run_reference
from jaxpipe.stages import split
from jaxpipe.trace import microbatch_like, trace

M = 4  # microbatches


def _stored(stage):
    return sum(aval_bytes(a) for a in stage.residual_avals)


@pytest.fixture(scope="module")
def lm():
    loss_fn, params, batch = tiny_lm(4, vocab=32, width=16, seq=8, batch=16)
    return loss_fn, params, batch, trace(loss_fn, params, microbatch_like(batch, M))


# ---------------------------------------------------------------------------------------
# stage functions


def test_each_policy_stores_less_and_recomputes_more(lm):
    *_, t = lm
    stored, recompute = {}, {}
    base = None
    for policy in Remat:
        stages = split(t, [1, 3], [policy] * 3)
        stored[policy] = [_stored(s) for s in stages]
        flops = [jaxpr_flops(s.bwd) for s in stages]
        base = base or flops
        recompute[policy] = [f - b for f, b in zip(flops, base, strict=True)]
        assert all(s.remat is policy for s in stages)
    order = [Remat.NONE, Remat.DOTS, Remat.DOTS_NO_BATCH, Remat.BOUNDARY, Remat.FULL]
    for k in range(3):
        seq = [stored[p][k] for p in order]
        assert seq == sorted(seq, reverse=True) and seq[0] > 2 * seq[3], seq
        rec = [recompute[p][k] for p in order]
        assert rec[0] == 0 and rec == sorted(rec), rec
    # the middle stage (two blocks) stores two boundary activations, or one when it is
    # recomputed as a whole (plus the attention mask every block reads)
    act = 4 * 8 * 16 * 4  # microbatch [4, 8, 16] float32
    mask = 8 * 8  # [8, 8] bool
    assert stored[Remat.BOUNDARY][1] == 2 * act + mask
    assert stored[Remat.FULL][1] == act + mask


#: Every policy on both schedule kinds (whole and split backward), on first, middle and
#: last stages of one or two segments.
MIXED = [
    pytest.param([Remat.FULL, Remat.DOTS, Remat.BOUNDARY, Remat.DOTS_NO_BATCH],
                 DeferredW1F1B(4, M), id="split-backward"),
    pytest.param([Remat.DOTS_NO_BATCH, Remat.BOUNDARY, Remat.FULL, Remat.DOTS],
                 jp.OneFOneB(4, M), id="1f1b"),
]
CUTS = [1, 3, 4]  # stages of 2, 2, 1 and 2 segments


@pytest.fixture(scope="module")
def lm6():
    loss_fn, params, batch = tiny_lm(6, vocab=32, width=16, seq=8, batch=16)
    return loss_fn, params, batch, trace(loss_fn, params, microbatch_like(batch, M))


@pytest.mark.parametrize(("policies", "schedule"), MIXED)
def test_every_policy_gives_exact_gradients_on_the_reference_runtime(lm6, policies, schedule):
    loss_fn, params, batch, t = lm6
    stages = split(t, CUTS, policies)
    assert [_stored(s) for s in stages] < [_stored(s) for s in split(t, CUTS)]
    mbs = [x.reshape(M, -1, *x.shape[1:]) for x in jax.tree.leaves(batch)]
    loss, grads, _ = run_reference(stages, schedule, jax.tree.leaves(params), mbs)
    assert_matches((loss, jax.tree.unflatten(t.params_treedef, grads)),
                   reference(loss_fn, params, batch, M))


def _user_checkpointed(policy):
    """A 3-block MLP whose middle block the user wrapped in jax.checkpoint."""
    ks = jax.random.split(jax.random.key(3), 5)
    params = [jax.random.normal(k, (16, 16)) / 4 for k in ks[:3]]
    batch = {"x": jax.random.normal(ks[3], (8, 16)), "y": jax.random.normal(ks[4], (8, 16))}

    def block(w, h):
        return jnp.tanh(jnp.tanh(h @ w) @ w)

    def loss_fn(p, b):
        h = b["x"]
        for i, w in enumerate(p):
            f = jax.checkpoint(block, policy=policy) if i == 1 else block
            h = jp.boundary(f(w, h))
        return jnp.mean((h - b["y"]) ** 2)

    return loss_fn, params, batch


def _count(jaxpr, name, depth=0):
    """(checkpoint equations, deepest nesting of checkpoints) in a jaxpr."""
    n, deepest = 0, depth
    for e in jaxpr.eqns:
        inner_depth = depth + (e.primitive.name == name)
        n += e.primitive.name == name
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            k, d = _count(getattr(sub, "jaxpr", sub), name, inner_depth)
            n, deepest = n + k, max(deepest, d)
        deepest = max(deepest, inner_depth)
    return n, deepest


@pytest.mark.parametrize("user_policy", [jax.checkpoint_policies.dots_saveable,
                                         jax.checkpoint_policies.nothing_saveable])
def test_a_users_own_checkpoint_is_never_wrapped_again(user_policy):
    loss_fn, params, batch = _user_checkpointed(user_policy)
    t = trace(loss_fn, params, microbatch_like(batch, 2))
    costs = segment_costs(t)
    assert [c.user_remat for c in costs] == [False, True, False, False]
    assert all(c.remat_cost(p) == RematCost(costs[1].residual_bytes, 0.0) for p in Remat
               for c in costs[1:2])
    plain = split(t, [0, 1, 2])
    mbs = [x.reshape(2, -1, *x.shape[1:]) for x in jax.tree.leaves(batch)]
    want = reference(loss_fn, params, batch, 2)
    for policy in (Remat.BOUNDARY, Remat.FULL, Remat.DOTS):
        stages = split(t, [0, 1, 2], [policy] * 4)
        # the user's segment stores exactly what the user's own policy stores ...
        assert _stored(stages[1]) == _stored(plain[1])
        # ... and no checkpoint ends up inside another one
        assert _count(stages[1].fwd.jaxpr, "checkpoint")[1] <= 1
        loss, grads, _ = run_reference(stages, jp.GPipe(4, 2), list(params), mbs)
        assert_matches((loss, grads), want)


