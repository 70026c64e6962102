"""Inputs wherever they live: placement on the mesh, no silent recompiles, donated state.

Batches and parameters committed to one device, placed on another mesh, or made with
numpy run the same compiled program as inputs placed on the pipeline's mesh; a real
recompile warns once; a state whose buffers were donated is refused before XLA runs.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpipe as jp
from jaxpipe import checkpoint as jpc
from jaxpipe.compile_watch import RecompileWarning

P_, M, W, B = 2, 2, 8, 8


def loss_fn(params, mb):
    h = mb["x"]
    for w in params["w"]:
        h = jp.boundary(jnp.tanh(h @ w))
    return jnp.mean((h - mb["y"]) ** 2)


def _params():
    ks = jax.random.split(jax.random.key(0), 2)
    return {"w": [jax.random.normal(k, (W, W)) / np.sqrt(W) for k in ks]}


def _batch():
    kx, ky = jax.random.split(jax.random.key(1))
    return {"x": jax.random.normal(kx, (B, W)), "y": jax.random.normal(ky, (B, W))}


@pytest.fixture(scope="module")
def pipe():
    mesh = jax.make_mesh((P_,), ("pipe",), devices=jax.devices()[:P_])
    return jp.pipeline(loss_fn, _params(), _batch(), mesh=mesh, schedule=jp.OneFOneB(P_, M))


def _placements():
    other = jax.make_mesh((2,), ("pipe",), devices=jax.devices()[4:6])
    return {
        "numpy": np.asarray,
        "committed to device 3": lambda x: jax.device_put(x, jax.devices()[3]),
        "on another mesh": lambda x: jax.device_put(x, NamedSharding(other, P())),
    }


def test_inputs_anywhere_run_one_program(pipe):
    params, batch = _params(), _batch()
    want_loss, want_grads = pipe.value_and_grad(params, batch)
    state = pipe.init(params, optax.sgd(0.1))
    for name, move in _placements().items():
        loss, grads = pipe.value_and_grad(jax.tree.map(move, params),
                                          jax.tree.map(move, batch))
        np.testing.assert_array_equal(loss, want_loss, err_msg=name)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=name)
        state, _ = pipe.train_step(state, jax.tree.map(move, batch))
        moved = pipe.init(jax.tree.map(move, params), optax.sgd(0.1))  # init, shard too
        assert len(pipe.unshard([move(x) for x in moved.params])["w"]) == 2
    # one compilation each, whatever the placement
    assert pipe.inspect.value_and_grad_fn._cache_size() == 1
    assert state.trainer.step_fn._cache_size() == 1


def test_params_from_a_pipeline_on_other_devices(pipe):
    # The path the layout-change error message recommends: params of one pipeline into
    # another pipeline's init, on other devices.
    other = jp.pipeline(loss_fn, _params(), _batch(),
                        mesh=jax.make_mesh((2,), ("pipe",), devices=jax.devices()[4:6]),
                        schedule=jp.GPipe(2, M))
    state = other.init(_params(), optax.sgd(0.1))
    state, _ = other.train_step(state, _batch())
    here = pipe.init(other.params(state), optax.sgd(0.1))
    state_here, metrics = pipe.train_step(here, _batch())
    # the same two SGD steps of the unpipelined mean loss (equal microbatches of a mean
    # loss: the full batch's), wherever each step ran
    grad = jax.value_and_grad(loss_fn)
    plain = _params()
    for step in range(2):
        value, g = grad(plain, _batch())
        plain = jax.tree.map(lambda p, d: p - 0.1 * d, plain, g)
        if step == 0:
            for a, b in zip(jax.tree.leaves(other.params(state)), jax.tree.leaves(plain),
                            strict=True):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["loss"], value, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(pipe.params(state_here)), jax.tree.leaves(plain),
                    strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_recompile_from_around_the_call_says_so():
    """Called inside ``jax.set_mesh`` and then outside, the program compiles again with
    the same inputs: the warning names what changes around a call (it said only 'no
    input signature changed' and to pass the same shardings)."""
    mesh = jax.make_mesh((P_,), ("pipe",), devices=jax.devices()[:P_])
    pipe = jp.pipeline(loss_fn, _params(), _batch(), mesh=mesh, schedule=jp.OneFOneB(P_, M))
    params, batch = _params(), _batch()
    pipe.value_and_grad(params, batch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with jax.set_mesh(mesh):
            pipe.value_and_grad(params, batch)
    recompiles = [str(w.message) for w in caught if issubclass(w.category, RecompileWarning)]
    assert len(recompiles) == 1 and "jax.set_mesh" in recompiles[0], recompiles


def test_a_real_recompile_warns_once(pipe):
    params, batch = _params(), _batch()
    pipe.value_and_grad(params, batch)  # compiled (maybe by an earlier test)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Parameters with a sharding of the user's own on the pipeline's mesh are kept
        # as they are: a new input signature, so a second compilation.
        rows = NamedSharding(pipe.mesh, P("pipe"))
        pipe.value_and_grad(jax.device_put(params, rows), batch)
        pipe.value_and_grad(jax.device_put(params, NamedSharding(pipe.mesh, P(None, "pipe"))),
                            batch)
    recompiles = [w for w in caught if issubclass(w.category, RecompileWarning)]
    assert len(recompiles) == 1, [str(w.message) for w in caught]
    assert "pipe.value_and_grad compiled again" in str(recompiles[0].message)
    assert "['w'][0]" in str(recompiles[0].message)


def test_donated_state_is_refused_before_xla(pipe, tmp_path):
    state = pipe.init(_params(), optax.adam(1e-2))
    new_state, _ = pipe.train_step(state, _batch())
    donated = r"donated to an earlier call, such as train_step.*state the last train_step returned"
    with pytest.raises(jp.PipelineError, match=donated):
        pipe.train_step(state, _batch())
    with pytest.raises(jp.PipelineError, match=donated):
        pipe.params(state)
    with pytest.raises(jp.PipelineError, match="donated"):
        pipe.unshard(state.params)
    with pytest.raises(jp.PipelineError, match="donated"):
        pipe.staged_value_and_grad(state.params, _batch())
    with pytest.raises(jp.PipelineError, match="donated"):
        jpc.save(tmp_path / "ckpt", state)
    new_state, metrics = pipe.train_step(new_state, _batch())  # the returned one trains
    assert np.isfinite(metrics["loss"])
