"""Values that are not float parameters flow through a pipeline, exactly.

PRNG keys crossing cuts and stored as residuals, per-example key batches, dropout with a
key per call (plain JAX, nnx and linen), integer and unused parameter leaves, and
optax transformations with per-leaf or scalar state (``MultiSteps``). Every exactness
test compares against ``jax.value_and_grad`` of the unpipelined mean over microbatches
with the same per-microbatch keys.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import jaxpipe as jp

P_, M, W, B = 2, 4, 8, 16
RTOL, ATOL = 1e-5, 1e-6


def _mesh(p=P_, names=("pipe",)):
    n = int(np.prod(p)) if isinstance(p, tuple) else p
    shape = p if isinstance(p, tuple) else (p,)
    return jax.make_mesh(shape, names, devices=jax.devices()[:n])


def _params(n=4, seed=0):
    ks = jax.random.split(jax.random.key(seed), n)
    return {"w": [jax.random.normal(k, (W, W)) / np.sqrt(W) for k in ks]}


def _batch(n=B, seed=1):
    kx, ky = jax.random.split(jax.random.key(seed))
    return {"x": jax.random.normal(kx, (n, W)), "y": jax.random.normal(ky, (n, W))}


def _mbs(batch, m=M):
    return [jax.tree.map(lambda x, i=i: x.reshape(m, x.shape[0] // m, *x.shape[1:])[i], batch)
            for i in range(m)]


def _close(a, b, rtol=RTOL, atol=ATOL):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def _dropout(x, key, rate=0.5):
    keep = jax.random.bernoulli(key, 1 - rate, x.shape)
    return jnp.where(keep, x / (1 - rate), 0.0)


def dropout_loss(params, mb, key):
    """Dropout after every layer; the key is split per layer, so it crosses every cut."""
    h = mb["x"]
    for w in params["w"]:
        key, sub = jax.random.split(key)
        h = _dropout(jnp.tanh(h @ w), sub)
        h, key = jp.boundary((h, key))
    return jnp.mean((h - mb["y"]) ** 2)


def reference(loss_fn, params, batch, key, m=M):
    """jax.value_and_grad of the mean over microbatches, microbatch i keyed fold_in(key, i)."""
    def mean_loss(p):
        return jnp.mean(jnp.stack([loss_fn(p, mb, jax.random.fold_in(key, i))
                                   for i, mb in enumerate(_mbs(batch, m))]))
    return jax.value_and_grad(mean_loss)(params)


# ----------------------------------------------------------------------------- keys
@pytest.mark.parametrize("sched", [jp.GPipe(P_, M), jp.OneFOneB(P_, M)],
                         ids=["gpipe", "1f1b"])
def test_dropout_with_key_per_call_matches_unpipelined(sched):
    params, batch, key = _params(), _batch(), jax.random.key(7)
    pipe = jp.pipeline(dropout_loss, params, batch, mesh=_mesh(), schedule=sched, rng=True)
    loss, grads = pipe.value_and_grad(params, batch, key)
    ref_loss, ref_grads = reference(dropout_loss, params, batch, key)
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
    _close(grads, ref_grads)
    # reproducible, and another key draws other masks
    np.testing.assert_array_equal(pipe.value_and_grad(params, batch, key)[0], loss)
    assert float(pipe.value_and_grad(params, batch, jax.random.key(8))[0]) != float(loss)
    # a raw uint32 key (jax.random.PRNGKey) is the same key
    raw = jax.random.key_data(key)
    np.testing.assert_array_equal(pipe.value_and_grad(params, batch, raw)[0], loss)


def test_dropout_keys_differ_per_microbatch_and_stage():
    # Each (microbatch, layer) draws its own mask: the loss records every mask's sum.
    def loss_fn(params, mb, key):
        h, total = mb["x"], 0.0
        for w in params["w"]:
            key, sub = jax.random.split(key)
            mask = jax.random.bernoulli(sub, 0.5, (W,))
            total = total + jnp.sum(mask * jnp.arange(1.0, W + 1))
            h, key = jp.boundary((jnp.tanh(h @ w) * mask, key))
        return jnp.mean(h) * 0 + total

    params, batch, key = _params(), _batch(), jax.random.key(3)
    pipe = jp.pipeline(loss_fn, params, batch, mesh=_mesh(), schedule=jp.GPipe(P_, M),
                       rng=True)
    masks = [[jax.random.bernoulli(jax.random.split(k)[1], 0.5, (W,))
              for k in _layer_keys(jax.random.fold_in(key, i))] for i in range(M)]
    flat = [tuple(np.asarray(m)) for ms in masks for m in ms]
    assert len(set(flat)) > len(flat) // 2  # masks differ across microbatches and layers
    loss, _ = pipe.value_and_grad(params, batch, key)
    np.testing.assert_allclose(loss, reference(loss_fn, params, batch, key)[0], rtol=RTOL)


def _layer_keys(key, n=4):
    out = []
    for _ in range(n):
        out.append(key)
        key = jax.random.split(key)[0]
    return out


def test_dropout_with_data_axis_keys_each_shard():
    # mesh data x pipe: piece j of microbatch i gets fold_in(key, i * n + j); the
    # unpipelined reference is the mean over m * n pieces of consecutive rows.
    mesh = _mesh((2, P_), ("data", "pipe"))
    params, batch, key = _params(), _batch(), jax.random.key(5)
    pipe = jp.pipeline(dropout_loss, params, batch, mesh=mesh, schedule=jp.OneFOneB(P_, M),
                       rng=True)
    loss, grads = pipe.value_and_grad(params, batch, key)
    ref_loss, ref_grads = reference(dropout_loss, params, batch, key, m=2 * M)
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
    _close(grads, ref_grads)


def test_train_step_with_key_matches_optax():
    params, batch = _params(), _batch()
    tx = optax.adam(1e-2)
    pipe = jp.pipeline(dropout_loss, params, batch, mesh=_mesh(), schedule=jp.OneFOneB(P_, M),
                       rng=True)
    state = pipe.init(params, tx)
    ref, opt = params, tx.init(params)
    for step in range(2):
        key = jax.random.fold_in(jax.random.key(0), step)
        state, metrics = pipe.train_step(state, batch, key)
        ref_loss, g = reference(dropout_loss, ref, batch, key)
        upd, opt = tx.update(g, opt, ref)
        ref = optax.apply_updates(ref, upd)
        np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=RTOL)
    _close(pipe.params(state), ref, rtol=1e-4)


def test_key_batch_leaves_and_key_residuals():
    # Per-example keys in the batch, a key closed over and a key stored as a residual of
    # the first stage's backward.
    fixed = jax.random.key(11)

    def loss_fn(params, mb):
        noise = jax.vmap(lambda k: jax.random.normal(k, (W,)))(mb["keys"])
        h = jp.boundary(jnp.tanh(mb["x"] @ params["w"][0] + 0.1 * noise))
        h = h * jax.random.bernoulli(fixed, 0.7, (W,))
        h = jp.boundary(jnp.tanh(h @ params["w"][1]))
        return jnp.mean((h - mb["y"]) ** 2)

    params, batch = _params(2), _batch()
    batch["keys"] = jax.random.split(jax.random.key(2), B)
    pipe = jp.pipeline(loss_fn, params, batch, mesh=_mesh(), schedule=jp.OneFOneB(P_, M))
    loss, grads = pipe.value_and_grad(params, batch)
    ref_loss, ref_grads = jax.value_and_grad(
        lambda p: jnp.mean(jnp.stack([loss_fn(p, mb) for mb in _mbs(batch)])))(params)
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
    _close(grads, ref_grads)
    for st in pipe.inspect.stages:  # no runtime ever sees an extended dtype
        for a in (*st.in_avals, *st.out_avals, *st.residual_avals, *st.w_residual_avals):
            assert not jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended), a
    assert not any(jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended)
                   for a in pipe.inspect.executor.spec.microbatch_avals)


def test_reference_runtime_runs_keys():
    params, batch, key = _params(), _batch(), jax.random.key(4)
    pipe = jp.pipeline(dropout_loss, params, batch, mesh=_mesh(), schedule=jp.GPipe(P_, M),
                       rng=True, runtime="reference")
    loss, grads = pipe.value_and_grad(params, batch, key)
    ref_loss, ref_grads = reference(dropout_loss, params, batch, key)
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
    _close(grads, ref_grads)


# ----------------------------------------------------------------------------- leaves
def _int_loss(params, mb):
    h = mb["x"] * params["scale"].astype(jnp.float32)
    h = jp.boundary(jnp.tanh(h @ params["w"][0]))
    h = h + params["offset"].astype(jnp.float32) * 0.01 * params["scale"]  # scale: tied
    return jnp.mean((jnp.tanh(h @ params["w"][1]) - mb["y"]) ** 2)


def test_int_and_unused_leaves_keep_values_and_train_like_optax():
    params = {"w": _params(2)["w"], "scale": jnp.array(2, jnp.int32),
              "offset": jnp.arange(W, dtype=jnp.int32), "unused": jnp.full((3,), 7.0),
              "flag": jnp.array(True),
              # an unused 0-d float: its zero gradient is a literal in the stage's jaxpr
              # (the CPU program's build crashed on it: unhashable Literal)
              "temperature": jnp.array(0.5)}
    batch = _batch()
    pipe = jp.pipeline(_int_loss, params, batch, mesh=_mesh(), schedule=jp.OneFOneB(P_, M))
    assert pipe.inspect.param_owners[2] == (0, 1)  # the int scale (leaf 2) is read by both stages
    loss, grads = pipe.value_and_grad(params, batch)
    ref_loss, ref_grads = jax.value_and_grad(
        lambda w: jnp.mean(jnp.stack([_int_loss({**params, "w": w}, mb)
                                      for mb in _mbs(batch)])))(params["w"])
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
    _close(grads["w"], ref_grads)
    np.testing.assert_array_equal(grads["unused"], np.zeros(3))  # as jax.grad gives
    np.testing.assert_array_equal(grads["temperature"], np.zeros(()))
    np.testing.assert_array_equal(grads["offset"], np.zeros(W, np.int32))
    assert pipe.unshard(pipe.shard(params))["unused"].tolist() == [7.0] * 3

    # adamw: the unused float leaf decays exactly as optax on the whole tree does; the
    # integer leaves are constants the optimizer never sees.
    tx = optax.adamw(1e-2, weight_decay=0.5)
    floats = {"w": params["w"], "unused": params["unused"]}
    state = pipe.init(params, tx)
    opt = tx.init(floats)
    for _ in range(2):
        state, _ = pipe.train_step(state, batch)
        _, g = jax.value_and_grad(lambda f: jnp.mean(jnp.stack(
            [_int_loss({**params, **f}, mb) for mb in _mbs(batch)])))(floats)
        upd, opt = tx.update(g, opt, floats)
        floats = optax.apply_updates(floats, upd)
    trained = pipe.params(state)
    _close({"w": trained["w"], "unused": trained["unused"]}, floats, rtol=1e-4)
    for name in ("scale", "offset", "flag"):
        np.testing.assert_array_equal(trained[name], params[name])
        assert trained[name].dtype == params[name].dtype


def test_zero_size_leaves_work_as_in_jax():
    """An empty parameter (a bias of width 0, read by the last stage) and an empty batch
    leaf: jax.value_and_grad takes both; the program gathered the parameter's gradient
    with an all-gather XLA refuses for a zero-size operand, and the batch's reshape
    could not infer its -1 from an array of no elements."""
    params = {**_params(2), "empty": jnp.zeros((0,)), "empty_rows": jnp.zeros((3, 0))}
    batch = {**_batch(), "e": jnp.zeros((B, 0))}

    def loss_fn(p, mb):
        h = mb["x"]
        for w in p["w"]:
            h = jp.boundary(jnp.tanh(h @ w))
        return (jnp.mean((h - mb["y"]) ** 2) + jnp.sum(p["empty"]) + jnp.sum(mb["e"])
                + jnp.sum(p["empty_rows"]))

    pipe = jp.pipeline(loss_fn, params, batch, mesh=_mesh(), schedule=jp.OneFOneB(P_, M))
    loss, grads = pipe.value_and_grad(params, batch)
    ref_loss, ref_grads = jax.value_and_grad(lambda p: jnp.mean(jnp.stack(
        [loss_fn(p, mb) for mb in _mbs(batch)])))(params)
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
    _close(grads, ref_grads)
    assert grads["empty"].shape == (0,) and grads["empty_rows"].shape == (3, 0)
    state, _ = pipe.train_step(pipe.init(params, optax.adam(1e-2)), batch)
    assert pipe.params(state)["empty_rows"].shape == (3, 0)


def test_multisteps_accumulates_exactly():
    params, batch = _params(), _batch()
    tx = optax.MultiSteps(optax.adam(1e-2), every_k_schedule=2)
    loss_fn = _plain_loss
    pipe = jp.pipeline(loss_fn, params, batch, mesh=_mesh(), schedule=jp.OneFOneB(P_, M))
    state = pipe.init(params, tx)
    ref, opt = params, tx.init(params)
    for _ in range(4):
        state, _ = pipe.train_step(state, batch)
        _, g = jax.value_and_grad(lambda p: jnp.mean(jnp.stack(
            [loss_fn(p, mb) for mb in _mbs(batch)])))(ref)
        upd, opt = tx.update(g, opt, ref)
        ref = optax.apply_updates(ref, upd)
    _close(pipe.params(state), ref, rtol=1e-4)


def _plain_loss(params, mb):
    h = mb["x"]
    for w in params["w"]:
        h = jp.boundary(jnp.tanh(h @ w))
    return jnp.mean((h - mb["y"]) ** 2)


# ----------------------------------------------------------------------------- flax
@jp.layer
class DropBlock(nnx.Module):
    def __init__(self, d, rngs):
        self.linear = nnx.Linear(d, d, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)

    def __call__(self, x):
        return self.drop(jnp.tanh(self.linear(x)))


class DropNet(nnx.Module):
    def __init__(self, rngs, depth=4):
        self.blocks = nnx.List([DropBlock(W, rngs) for _ in range(depth)])

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def nnx_loss(model, mb):
    return jnp.mean((model(mb["x"]) - mb["y"]) ** 2)


def test_nnx_dropout_matches_unpipelined_model():
    model = DropNet(nnx.Rngs(0, dropout=1))
    batch, key = _batch(), jax.random.key(9)
    pipe = jp.flax.pipeline(model, nnx_loss, batch, mesh=_mesh(), schedule=jp.OneFOneB(P_, M),
                            rng=True)
    loss, grads = pipe.value_and_grad(model, batch, key)

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def ref(pure):
        total = 0.0
        for i, mb in enumerate(_mbs(batch)):
            state = jax.tree.map(lambda v: v, params)
            nnx.replace_by_pure_dict(state, pure)
            m = nnx.merge(graphdef, state, jax.tree.map(lambda v: v, rest))
            jp.flax.reseed(m, jax.random.fold_in(key, i))
            total = total + nnx_loss(m, mb)
        return total / M

    ref_loss, ref_grads = jax.value_and_grad(ref)(nnx.to_pure_dict(params))
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
    _close(grads, ref_grads)
    state = pipe.init(model, optax.sgd(0.1), clip_global_norm=1.0, skip_nonfinite=True)
    state, metrics = pipe.train_step(state, batch, key)
    np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=RTOL)


@jp.layer
class _DropBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(W, W, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(jnp.tanh(self.linear(x)))


class _ScannedDropNet(nnx.Module):
    """flax's scan-over-layers pattern: blocks made under split_rngs + vmap (a dropout key
    per layer), run by nnx.scan."""

    def __init__(self, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=4)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return _DropBlock(rngs)

        self.blocks = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, block):
            return block(x)

        return run(x, self.blocks)


def test_nnx_scanned_blocks_with_a_dropout_key_per_layer():
    """rng=True reseeds a stream stacked over layers by splitting its key to the stream's
    shape (flax's reseed refused the non-scalar key: the pattern could not be pipelined)."""
    model = _ScannedDropNet(nnx.Rngs(0, dropout=1))
    batch, key = _batch(), jax.random.key(4)
    pipe = jp.flax.pipeline(model, nnx_loss, batch, mesh=_mesh(), schedule=jp.OneFOneB(P_, M),
                            rng=True)
    loss, grads = pipe.value_and_grad(model, batch, key)

    def ref(model):
        total = 0.0
        for i, mb in enumerate(_mbs(batch)):
            jp.flax.reseed(model, jax.random.fold_in(key, i))
            total = total + nnx_loss(model, mb)
        return total / M

    ref_loss, ref_grads = nnx.value_and_grad(ref)(model)
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
    _close(grads, nnx.to_pure_dict(ref_grads))
    assert float(loss) != float(pipe.value_and_grad(model, batch, jax.random.key(5))[0])


def test_nnx_batchnorm_eval_is_exact_and_train_mode_is_refused():
    @jp.layer
    class BNBlock(nnx.Module):
        def __init__(self, d, rngs):
            self.linear = nnx.Linear(d, d, rngs=rngs)
            self.bn = nnx.BatchNorm(d, rngs=rngs)

        def __call__(self, x):
            return self.bn(jnp.tanh(self.linear(x)))

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([BNBlock(W, rngs) for _ in range(2)])

        def __call__(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    model, batch = Net(nnx.Rngs(0)), _batch()
    with pytest.raises(jp.PipelineError, match=r"updates the model's BatchStat.*model.eval"):
        jp.flax.pipeline(model, nnx_loss, batch, mesh=_mesh(), schedule=jp.GPipe(P_, M))
    model.eval()
    # running statistics that are not the defaults, read as constants
    nnx.update(model, jax.tree.map(lambda x: x + 0.5, nnx.state(model, nnx.BatchStat)))
    pipe = jp.flax.pipeline(model, nnx_loss, batch, mesh=_mesh(), schedule=jp.GPipe(P_, M))
    loss, grads = pipe.value_and_grad(model, batch)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def ref(pure):
        state = jax.tree.map(lambda v: v, params)
        nnx.replace_by_pure_dict(state, pure)
        m = nnx.merge(graphdef, state, rest)
        return jnp.mean(jnp.stack([nnx_loss(m, mb) for mb in _mbs(batch)]))

    ref_loss, ref_grads = jax.value_and_grad(ref)(nnx.to_pure_dict(params))
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
    _close(grads, ref_grads)
    # the model's statistics changed after the build: refused, not silently ignored
    nnx.update(model, jax.tree.map(lambda x: x + 1.0, nnx.state(model, nnx.BatchStat)))
    with pytest.raises(jp.PipelineError, match=r"BatchStat .*changed since the pipeline"):
        pipe.value_and_grad(model, batch)
    model.train()
    with pytest.raises(jp.PipelineError, match=r"structure or static attributes changed"):
        pipe.value_and_grad(model, batch)


def test_nnx_dropout_without_rng_is_refused():
    with pytest.raises(jp.PipelineError, match=r"draws random numbers.*'dropout'.*rng=True"):
        jp.flax.pipeline(DropNet(nnx.Rngs(0, dropout=1)), nnx_loss, _batch(), mesh=_mesh(),
                         schedule=jp.GPipe(P_, M))
    model = DropNet(nnx.Rngs(0, dropout=1))
    model.eval()  # deterministic: nothing drawn, no key needed
    pipe = jp.flax.pipeline(model, nnx_loss, _batch(), mesh=_mesh(), schedule=jp.GPipe(P_, M))
    assert np.isfinite(pipe.value_and_grad(model, _batch())[0])


class LinenDrop(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        for _ in range(4):
            x = jp.boundary(nn.Dropout(0.3, deterministic=not train)(jnp.tanh(nn.Dense(W)(x))))
        return x


def test_linen_dropout_matches_unpipelined():
    module, batch, key = LinenDrop(), _batch(), jax.random.key(6)
    variables = module.init(jax.random.key(0), batch["x"], train=False)

    def loss_fn(mod, variables, mb, key):
        out = mod.apply(variables, mb["x"], rngs={"dropout": key})
        return jnp.mean((out - mb["y"]) ** 2)

    pipe = jp.flax.pipeline_linen(module, variables, loss_fn, batch, mesh=_mesh(),
                                  schedule=jp.OneFOneB(P_, M), rng=True)
    loss, grads = pipe.value_and_grad(variables, batch, key)
    ref_loss, ref_grads = reference(lambda p, mb, k: loss_fn(module, {"params": p}, mb, k),
                                    variables["params"], batch, key)
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
    _close(grads, ref_grads)


def test_tied_bool_parameter_leaf_trains():
    """A tied bool leaf keeps its dtype through the tied-gradient sums (psum promotes)."""
    def loss_fn(params, mb):
        h = mb["x"] * jnp.where(params["flag"], 1.0, 2.0)
        for w in params["w"]:
            h = jp.boundary(jnp.tanh(h @ w))
        return jnp.mean((h * jnp.where(params["flag"], 1.0, 3.0) - mb["y"]) ** 2)

    params = {"w": _params()["w"], "flag": jnp.array(True)}
    pipe = jp.pipeline(loss_fn, params, _batch(), mesh=_mesh(4), schedule=jp.OneFOneB(4, M))
    assert pipe.inspect.param_owners[0] == (0, 3)  # the flag is read by the first and last stage
    state, _ = pipe.train_step(pipe.init(params, optax.sgd(0.1)), _batch())
    assert pipe.params(state)["flag"].dtype == jnp.bool_


def test_flax_state_mistakes_are_named():
    class Plain(nnx.Module):
        def __init__(self, rngs):
            self.w = nnx.Param(jnp.eye(W))

        def __call__(self, x):
            return jp.boundary(jnp.tanh(x @ self.w[...])) @ self.w[...]

    def assigning_loss(model, mb):
        model.w[...] = model.w[...] * 2  # an update the pipeline would lose
        return nnx_loss(model, mb)

    batch = _batch()
    with pytest.raises(jp.PipelineError, match=r"no RNG streams to seed"):
        jp.flax.pipeline(Plain(nnx.Rngs(0)), nnx_loss, batch, mesh=_mesh(),
                         schedule=jp.GPipe(P_, M), rng=True)
    with pytest.raises(jp.PipelineError, match=r"assigns to the parameter \['w'\]"):
        jp.flax.pipeline(Plain(nnx.Rngs(0)), assigning_loss, batch, mesh=_mesh(),
                         schedule=jp.GPipe(P_, M))

    class Count(nnx.Variable):
        pass

    class Counting(Plain):
        def __init__(self, rngs):
            super().__init__(rngs)
            self.calls = Count(jnp.zeros((), jnp.int32))

        def __call__(self, x):
            self.calls[...] += 1  # a counter of the user's: the advice is not BatchNorm's
            return super().__call__(x)

    with pytest.raises(jp.PipelineError, match=r"updates the model's Count \['calls'\].*"
                                               r"Compute the value in loss_fn"):
        jp.flax.pipeline(Counting(nnx.Rngs(0)), nnx_loss, batch, mesh=_mesh(),
                         schedule=jp.GPipe(P_, M))

    class LinenBN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = jp.boundary(jnp.tanh(nn.Dense(W)(x)))
            return nn.BatchNorm(use_running_average=True)(x)

    module = LinenBN()
    variables = module.init(jax.random.key(0), batch["x"])
    pipe = jp.flax.pipeline_linen(
        module, variables, lambda m, v, mb: jnp.mean((m.apply(v, mb["x"]) - mb["y"]) ** 2),
        batch, mesh=_mesh(), schedule=jp.GPipe(P_, M))
    moved = {**variables, "batch_stats": jax.tree.map(lambda x: x + 1, variables["batch_stats"])}
    with pytest.raises(jp.PipelineError, match=r"variables\['batch_stats'\] differs"):
        pipe.value_and_grad(moved, batch)
