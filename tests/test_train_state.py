"""A train state owns its optimizer: several states on one pipeline, and reports that
compile their own steps, never change which optimizer a state trains with."""

import dataclasses
import os
import warnings

import jax
import numpy as np
import optax
import pytest
from models import MODELS, reference

import jaxpipe as jp
from jaxpipe.compile_watch import RecompileWarning

M = 4


@pytest.fixture(scope="module")
def setup():
    loss_fn, params, batch = MODELS["mlp"](4, batch=8)
    pipe = jp.pipeline(loss_fn, params, batch, mesh=jax.make_mesh((2,), ("pipe",)),
                       schedule=jp.OneFOneB(2, M), cut="markers")
    return loss_fn, params, batch, pipe


def _plain_steps(loss_fn, params, batch, tx, n):
    opt = tx.init(params)
    for _ in range(n):
        _, g = reference(loss_fn, params, batch, M)
        u, opt = tx.update(g, opt, params)
        params = optax.apply_updates(params, u)
    return params


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_two_states_two_optimizers_on_one_pipeline(setup):
    loss_fn, params, batch, pipe = setup
    adamw, sgd = optax.adamw(1e-2, weight_decay=0.1), optax.sgd(0.1, momentum=0.9)
    s_adamw = pipe.init(params, adamw)
    s_sgd = pipe.init(params, sgd)  # made later: must not take over s_adamw's training
    for _ in range(2):
        s_adamw, _ = pipe.train_step(s_adamw, batch)
        s_sgd, _ = pipe.train_step(s_sgd, batch)
    _close(pipe.params(s_adamw), _plain_steps(loss_fn, params, batch, adamw, 2))
    _close(pipe.params(s_sgd), _plain_steps(loss_fn, params, batch, sgd, 2))


def test_compare_compiled_leaves_user_state_alone(setup):
    loss_fn, params, batch, pipe = setup
    adamw = optax.adamw(1e-2, weight_decay=0.1)
    state = pipe.init(params, adamw)
    report = pipe.inspect.compare_compiled(params, batch)  # compiles an Adam step of its own
    assert report["compiled_bytes"] > 0
    state, _ = pipe.train_step(state, batch)
    _close(pipe.params(state), _plain_steps(loss_fn, params, batch, adamw, 1))


def test_a_returned_state_goes_back_in_without_a_copy(setup, monkeypatch):
    """train_step returns its state under the layout's very shardings (its program's
    outputs would carry ``P('pipe', None)`` for the layout's ``P('pipe')``), so the next
    step takes it as it is. A state under such an equivalent sharding (from a user's own
    jit, say) gets the same buffers under the layout's sharding: no device_put (~0.5 ms
    a leaf across processes, every step), one compile, and the old state is still refused
    once donated."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    loss_fn, params, batch, pipe = setup
    state = pipe.init(params, optax.sgd(0.1, momentum=0.9))
    state, _ = pipe.train_step(state, batch)
    layout = jax.tree.leaves(pipe.inspect.executor.staged_abstract())
    assert [x.sharding for x in state.params] == [a.sharding for a in layout]
    opt_layout = jax.tree.leaves(state.trainer.abstract_opt_state())
    assert [x.sharding for x in jax.tree.leaves(state.opt_state)] == [
        a.sharding for a in opt_layout]

    def padded(x):  # the same shards, the spec padded with Nones: equivalent, not equal
        spec = P(*x.sharding.spec, *[None] * (x.ndim - len(x.sharding.spec)))
        return jax.make_array_from_single_device_arrays(
            x.shape, NamedSharding(x.sharding.mesh, spec),
            [s.data for s in x.addressable_shards])

    odd = dataclasses.replace(state, params=[padded(x) for x in state.params])
    assert any(x.sharding != a.sharding for x, a in zip(odd.params, layout, strict=True))
    puts = []
    device_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: puts.append(a) or device_put(*a, **k))
    live = pipe.inspect.live_state(odd, "train_step")
    monkeypatch.undo()
    assert not puts
    for x, y in zip(jax.tree.leaves(odd), jax.tree.leaves(live), strict=True):
        assert [s.data.unsafe_buffer_pointer() for s in x.addressable_shards] == [
            s.data.unsafe_buffer_pointer() for s in y.addressable_shards]
    assert [x.sharding for x in live.params] == [a.sharding for a in layout]
    old = state
    state, _ = pipe.train_step(odd, batch)
    state, _ = pipe.train_step(state, batch)
    assert state.trainer.step_fn._cache_size() == 1
    _close(pipe.params(state), _plain_steps(loss_fn, params, batch,
                                            optax.sgd(0.1, momentum=0.9), 3))
    with pytest.raises(jp.PipelineError,
                       match=r"was deleted \(donated to an earlier call, such as train_step"):
        pipe.train_step(old, batch)


def test_state_of_another_pipeline_is_refused(setup):
    loss_fn, params, batch, pipe = setup
    other = jp.pipeline(loss_fn, params, batch, mesh=jax.make_mesh((2,), ("pipe",)),
                        schedule=jp.OneFOneB(2, M), cut="markers")
    state = other.init(params, optax.sgd(0.1))
    with pytest.raises(jp.PipelineError, match="another pipeline"):
        pipe.train_step(state, batch)


def test_pipeline_runs_inside_the_callers_jit(setup):
    """A user's own ``jax.jit`` step may call the pipeline (value_and_grad with an optax
    update around it, shard / unshard, train_step): its inputs are then tracers, which have
    no buffers to check and are placed by sharding constraints. Same results as eager."""
    loss_fn, params, batch, pipe = setup
    sgd = optax.sgd(0.1)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = pipe.value_and_grad(params, batch)
        updates, opt_state = sgd.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    new, _, loss = step(params, sgd.init(params), batch)
    want_loss, _ = reference(loss_fn, params, batch, M)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    _close(new, _plain_steps(loss_fn, params, batch, sgd, 1))
    _close(jax.jit(lambda p: pipe.unshard(pipe.shard(p)))(params), params)
    state, _ = jax.jit(pipe.train_step)(pipe.init(params, sgd), batch)
    _close(pipe.params(state), _plain_steps(loss_fn, params, batch, sgd, 1))


def test_pipeline_with_per_compile_options_runs_inside_the_callers_jit(setup, monkeypatch):
    """Where ``XLA_FLAGS`` does not name them, a pipeline's own programs carry per-compile
    XLA options (CPU: LLVM -O1), which JAX takes on the outermost jit only: called inside
    the user's jit, the pipeline's programs go without them (the suite's ``XLA_FLAGS``
    names the CPU option, which hides this everywhere else)."""
    from jaxpipe.xla_flags import compiler_options

    loss_fn, params, batch, _ = setup
    monkeypatch.setenv("XLA_FLAGS", " ".join(f for f in os.environ["XLA_FLAGS"].split()
                                             if "xla_backend_optimization_level" not in f))
    assert compiler_options("cpu")  # the pipeline's programs get options
    pipe = jp.pipeline(loss_fn, params, batch, mesh=jax.make_mesh((2,), ("pipe",)),
                       schedule=jp.OneFOneB(2, M), cut="markers")
    want_loss, want_grads = reference(loss_fn, params, batch, M)
    loss, grads = jax.jit(pipe.value_and_grad)(params, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    _close(grads, want_grads)
    staged = pipe.shard(params)
    loss, sgrads = jax.jit(pipe.staged_value_and_grad)(staged, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    _close(pipe.unshard(sgrads), want_grads)
    np.testing.assert_allclose(jax.jit(pipe.loss)(params, batch), want_loss, rtol=1e-5)
    sgd = optax.sgd(0.1)
    state, _ = jax.jit(pipe.train_step)(pipe.init(params, sgd), batch)
    _close(pipe.params(state), _plain_steps(loss_fn, params, batch, sgd, 1))
    # and called outside a jit, the options are the pipeline's own
    np.testing.assert_allclose(pipe.value_and_grad(params, batch)[0], want_loss, rtol=1e-5)


def test_devices_that_update_alike_share_one_optimizer_branch(setup):
    """Both devices of the two-stage MLP hold two layers of the same shapes and update
    them alike, so the optimizer step (gradient norms, updates) runs without a switch over
    devices: the program compiles one branch per distinct device computation, and the
    train step holds no conditional beyond those of the value-and-grad program. (The
    middle devices of a deep model share one branch the same way; 8 devices, 64 scanned
    layers: train step 7.2 -> 6.0 s to its first result.)"""
    loss_fn, params, batch, pipe = setup
    state = pipe.init(params, optax.adamw(1e-2))
    train = state.trainer.step_fn.lower(state, batch).as_text()
    staged = pipe.inspect.staged_value_and_grad_fn.lower(state.params, batch).as_text()
    assert train.count("stablehlo.case") == staged.count("stablehlo.case")
    state, _ = pipe.train_step(state, batch)
    _close(pipe.params(state), _plain_steps(loss_fn, params, batch, optax.adamw(1e-2), 1))


#: the orders a training loop calls a pipeline in: evaluate first, train first, or
#: differentiate first, each then interleaving the others (the state's loss after training)
ORDERS = {
    "evaluate_first": ("loss", "loss", "init", "train", "loss_state", "vg_state", "loss"),
    "train_first": ("init", "train", "loss_state", "loss", "vg", "train", "loss_state"),
    "grad_first": ("vg", "loss", "init", "train", "vg_state", "loss_state", "loss"),
}


@pytest.mark.parametrize(("runtime", "has_aux", "order"), [
    ("cpu", True, "evaluate_first"), ("cpu", False, "train_first"),
    ("gpu", False, "evaluate_first"), ("gpu", True, "grad_first"),
    ("reference", True, "train_first"), ("reference", False, "grad_first"),
    ("lanes", True, "evaluate_first"), ("lanes", False, "train_first")])
def test_evaluate_train_evaluate_in_a_training_loops_order(runtime, has_aux, order):
    """loss, value_and_grad, init, train_step and loss(state) interleaved as a training
    loop calls them, on every runtime, with and without aux: the evaluation program built
    inside the first loss call's trace once leaked its tick tables into later calls
    (UnexpectedTracerError); every value equals the reference's at that point of
    training. No entry point compiles twice (the state's parameters, P(None,), came back
    under another name for the replicated sharding than the user's, P(), and
    value_and_grad compiled again)."""
    from jaxpipe.runtime.reference import ReferenceRuntime
    from jaxpipe.runtime.spmd import SpmdRuntime

    warnings.simplefilter("error", RecompileWarning)

    # the lanes program needs stages of one body: two tiny_lm blocks a stage
    loss_fn, params, batch = (MODELS["tiny_lm"](4, batch=8) if runtime == "lanes"
                              else MODELS["mlp"](4, batch=8))
    def with_aux(p, b):
        value = loss_fn(p, b)
        return value, {"l": value}

    fn = with_aux if has_aux else loss_fn
    pipe = jp.pipeline(fn, params, batch, mesh=jax.make_mesh((2,), ("pipe",)),
                       schedule=jp.OneFOneB(2, M), cut="auto" if runtime == "lanes"
                       else "markers", has_aux=has_aux,
                       runtime=ReferenceRuntime() if runtime == "reference"
                       else SpmdRuntime(lanes=True) if runtime == "lanes"
                       else SpmdRuntime(backend=runtime))
    loss_only = (lambda out: out[0]) if has_aux else (lambda out: out)
    tx = optax.sgd(0.1)
    state, trained = None, 0
    for op in ORDERS[order]:
        now = _plain_steps(loss_fn, params, batch, tx, trained)
        if op == "init":
            state = pipe.init(params, tx)
        elif op == "train":
            state, _ = pipe.train_step(state, batch)
            trained += 1
        elif op in ("loss", "loss_state"):
            at = state if op == "loss_state" else params
            want = reference(loss_fn, now if op == "loss_state" else params, batch, M)[0]
            np.testing.assert_allclose(loss_only(pipe.loss(at, batch)), want, rtol=1e-5)
        else:  # vg of the user's params, or of the state's
            at, ref_at = (pipe.params(state), now) if op == "vg_state" else (params, params)
            value, grads = pipe.value_and_grad(at, batch)
            want, want_grads = reference(loss_fn, ref_at, batch, M)
            np.testing.assert_allclose(loss_only(value), want, rtol=1e-5)
            _close(grads, want_grads)
