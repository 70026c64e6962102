"""Evaluating and training through the pipeline: ``pipe.loss`` (forward only), ``has_aux``,
``reduction="mean" | "sum" | "weighted"``, against ``jax.value_and_grad`` of the
unpipelined model on every runtime (the reference, the CPU and the accelerator program).

The weighted case is a per-token loss over padded sequences whose microbatches hold very
different numbers of real tokens, so the mean of per-microbatch means differs from the
loss people train on (the sum over every real token divided by their count).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from models import assert_matches
from split_schedule import DeferredW1F1B

import jaxpipe as jp
from jaxpipe.runtime.spmd import SpmdRuntime

M, VOCAB, WIDTH, SEQ, BATCH = 4, 11, 8, 5, 16


def _lm(n_layers=4, seed=0):
    """A tied-embedding LM (the embedding is also the output projection: read by the first
    and the last stage) over padded sequences: rows of microbatch ``i`` hold few real
    tokens for small ``i``."""
    ks = jax.random.split(jax.random.key(seed), 2 * n_layers + 3)
    params = {"embed": jax.random.normal(ks[0], (VOCAB, WIDTH)) * 0.5,
              "blocks": [{"w": jax.random.normal(ks[1 + i], (WIDTH, WIDTH)) / 3,
                          "b": jnp.full((WIDTH,), 0.01 * i)} for i in range(n_layers)]}
    tokens = jax.random.randint(ks[-1], (BATCH, SEQ + 1), 0, VOCAB)
    lengths = jnp.repeat(jnp.array([1, 2, 4, 5]), BATCH // M)  # microbatch i: 1, 2, 4, 5
    mask = (jnp.arange(SEQ)[None] < lengths[:, None]).astype(jnp.float32)
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}
    return params, batch


def _nll(params, mb):
    h = params["embed"][mb["tokens"]]
    for blk in params["blocks"]:
        h = jp.boundary(h + jnp.tanh(h @ blk["w"] + blk["b"]))
    logp = jax.nn.log_softmax(h @ params["embed"].T)
    return -jnp.take_along_axis(logp, mb["targets"][..., None], -1)[..., 0], logp


def weighted_loss(params, mb):
    nll, logp = _nll(params, mb)
    correct = (jnp.argmax(logp, -1) == mb["targets"]) * mb["mask"]
    aux = {"correct": jnp.sum(correct), "tokens": jnp.sum(mb["mask"] > 0).astype(jnp.int32),
           "pred": jnp.argmax(logp, -1)}
    return (jnp.sum(nll * mb["mask"]), jnp.sum(mb["mask"])), aux


def _microbatches(batch, m=M):
    return [jax.tree.map(lambda x, i=i: x.reshape(m, -1, *x.shape[1:])[i], batch)
            for i in range(m)]


def weighted_reference(params, batch):
    """``jax.value_and_grad(has_aux=True)`` of the full batch's sum / count, and every
    microbatch's aux stacked."""
    def full(p):
        outs = [weighted_loss(p, mb) for mb in _microbatches(batch)]
        total = sum(o[0][0] for o in outs) / sum(o[0][1] for o in outs)
        return total, jax.tree.map(lambda *x: jnp.stack(x), *[o[1] for o in outs])
    return jax.value_and_grad(full, has_aux=True)(params)


def _check(result, expected):
    (loss, aux), grads = result
    (ref_loss, ref_aux), ref_grads = expected
    assert_matches((loss, grads), (ref_loss, ref_grads))
    assert jax.tree.structure(aux) == jax.tree.structure(ref_aux)
    for a, b in zip(jax.tree.leaves(aux), jax.tree.leaves(ref_aux), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype)
        np.testing.assert_allclose(a, b, rtol=1e-5)


RUNTIMES = {"reference": "reference", "cpu": SpmdRuntime(backend="cpu"),
            "gpu": SpmdRuntime(backend="gpu")}
CASES = [(r, s) for r in ("reference", "cpu", "gpu") for s in ("gpipe", "1f1b", "interleaved")]
CASES.append(("cpu", "split_iw"))
SCHEDULES = {"gpipe": lambda: jp.GPipe(4, M), "1f1b": lambda: jp.OneFOneB(4, M),
             "interleaved": lambda: jp.Interleaved1F1B(2, M, stages_per_device=2),
             "split_iw": lambda: DeferredW1F1B(4, M)}


@pytest.mark.parametrize("runtime,sched", CASES, ids=[f"{r}-{s}" for r, s in CASES])
def test_weighted_loss_with_aux_and_evaluation(runtime, sched):
    """reduction="weighted" with has_aux: the loss is the padded batch's sum over real
    tokens / their count (not the mean of the microbatches' means), its gradient is
    exact, each aux leaf comes back stacked over microbatches; pipe.loss gives the same
    loss and aux forward only."""
    schedule = SCHEDULES[sched]()
    params, batch = _lm()
    mesh = jax.make_mesh((schedule.num_devices,), ("pipe",))
    pipe = jp.pipeline(weighted_loss, params, batch, mesh=mesh, schedule=schedule,
                       cut="markers", runtime=RUNTIMES[runtime], has_aux=True,
                       reduction="weighted")
    expected = weighted_reference(params, batch)
    means = np.mean([float(o[0][0] / o[0][1]) for o in
                     (weighted_loss(params, mb) for mb in _microbatches(batch))])
    assert abs(means - float(expected[0][0])) > 1e-3  # the mean of means differs
    _check(pipe.value_and_grad(params, batch), expected)
    loss, aux = pipe.loss(params, batch)
    _check(((loss, aux), expected[1]), expected)


@jax.custom_vjp
def _clip_gradient(x):  # JAX's custom_vjp docs' example: its backward is not linear
    return x


_clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1e-2, 1e-2),))


@pytest.mark.parametrize("runtime", ["reference", "cpu", "gpu"])
def test_weighted_gradient_through_a_nonlinear_custom_vjp(runtime):
    """A weight the batch alone gives (a token count) is totalled before the backward and
    each microbatch's loss seeded with 1 / total, as jax.value_and_grad of the quotient
    is: a custom_vjp clipping its cotangent then sees what it sees unpipelined (seeded
    with 1 and divided at the end, the gradients before the clip were 0.95 off). A
    weight a parameter enters is still divided at the end, exact for linear rules; one
    with a gradient in the parameters is refused (its gradient term was left out: 0.95
    off, silently)."""
    from jaxpipe.jaxpr.weight import batch_weight

    def loss_fn(p, b):
        h = jp.boundary(jnp.tanh(b["x"] @ p[0]))
        h = jp.boundary(_clip_gradient(jnp.tanh(h @ p[1])))
        err = jnp.sum((h @ p[2] - b["y"]) ** 2, -1) * b["m"]
        return jnp.sum(err), jnp.sum(b["m"])

    k = jax.random.split(jax.random.key(0), 5)
    params = [jax.random.normal(k[i], (16, 16)) / 3 for i in range(3)]
    batch = {"x": jax.random.normal(k[3], (32, 16)), "y": jax.random.normal(k[4], (32, 16)),
             "m": (jnp.arange(32) % 3 > 0).astype(jnp.float32)}

    def quotient(p, fn=loss_fn):
        outs = [fn(p, jax.tree.map(lambda a, i=i: a[i * 8:(i + 1) * 8], batch))
                for i in range(M)]
        return sum(o[0] for o in outs) / sum(o[1] for o in outs)

    pipe = jp.pipeline(loss_fn, params, batch, mesh=jax.make_mesh((2,), ("pipe",)),
                       schedule=jp.OneFOneB(2, M), cut="markers", reduction="weighted",
                       runtime=RUNTIMES[runtime])
    assert pipe.inspect.executor.spec.batch_weight is not None
    assert_matches(pipe.value_and_grad(params, batch),
                   jax.jit(jax.value_and_grad(quotient))(params))
    if runtime == "reference":  # a weight a parameter enters: divided at the end
        def linear(p, b):
            h = jp.boundary(jnp.tanh(b["x"] @ p[0]))
            err = jnp.sum((h @ p[2] - b["y"]) ** 2, -1) * b["m"]
            return jnp.sum(err), jnp.sum(b["m"]) + 1e-3 * jax.lax.stop_gradient(p[1][0, 0])

        other = jp.pipeline(linear, params, batch, mesh=jax.make_mesh((2,), ("pipe",)),
                            schedule=jp.OneFOneB(2, M), cut="markers", reduction="weighted",
                            runtime="reference")
        assert batch_weight(other.inspect.traced) is None
        assert_matches(other.value_and_grad(params, batch),
                       jax.value_and_grad(lambda p: quotient(p, linear))(params))

        def differentiable(p, b):  # the same weight without stop_gradient: refused
            loss_sum, weight = linear(p, b)
            return loss_sum, weight + 1e-3 * jnp.sum(jnp.tanh(b["x"] @ p[1]))

        with pytest.raises(jp.PipelineError, match=r"weight .* has a gradient in the "
                                                   r"parameters.*stop_gradient"):
            jp.pipeline(differentiable, params, batch, mesh=jax.make_mesh((2,), ("pipe",)),
                        schedule=jp.OneFOneB(2, M), cut="markers", reduction="weighted",
                        runtime="reference")


def test_evaluation_runs_forward_actions_only():
    """pipe.loss lowers the schedule's forward actions (each device's in its order): no
    backward, no stored residual, and its compiled program holds less than value_and_grad's."""
    params, batch = _lm()
    pipe = jp.pipeline(weighted_loss, params, batch, mesh=jax.make_mesh((4,), ("pipe",)),
                       schedule=jp.OneFOneB(4, M), cut="markers", has_aux=True,
                       reduction="weighted")
    low = pipe.inspect.executor.forward_lowering
    assert {a.kind for a in low.actions} == {"F"} and not low.slots
    assert low.num_ticks == M + 4 - 1  # the forwards flow as fast as they can
    vg = pipe.inspect.value_and_grad_fn.lower(params, batch).compile()
    ev = pipe.inspect.eval_fn.lower(params, batch).compile()
    assert (ev.memory_analysis().temp_size_in_bytes
            < vg.memory_analysis().temp_size_in_bytes / 2)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_mean_and_sum_with_aux_on_data_and_pipe(reduction):
    """mean / sum over microbatches of a per-microbatch mean loss, over data 2 x pipe 2:
    the batch axis is split by hand, so each aux leaf has a shard axis after the
    microbatch axis (each data shard's value of every microbatch)."""
    params, batch = _lm(2)

    def loss_fn(p, mb):
        nll, _ = _nll(p, mb)
        return jnp.mean(nll), {"rows": nll.shape[0] * jnp.ones((), jnp.int32)}

    mesh = jax.make_mesh((2, 2), ("data", "pipe"))
    pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=jp.OneFOneB(2, M),
                       cut="markers", has_aux=True, reduction=reduction)

    def full(p):
        losses = jnp.stack([loss_fn(p, mb)[0] for mb in _microbatches(batch)])
        return jnp.mean(losses) if reduction == "mean" else jnp.sum(losses)

    (loss, aux), grads = pipe.value_and_grad(params, batch)
    assert_matches((loss, grads), jax.value_and_grad(full)(params))
    assert aux["rows"].shape == (M, 2) and (np.asarray(aux["rows"]) == BATCH // M // 2).all()
    np.testing.assert_allclose(pipe.loss(params, batch)[0], loss, rtol=1e-6)
    # the sequential reference runs the data shards one by one and reduces them alike
    (ref_loss, ref_aux), ref_grads = pipe.inspect.reference_value_and_grad(params, batch)
    assert_matches((ref_loss, ref_grads), (loss, grads))
    np.testing.assert_array_equal(ref_aux["rows"], aux["rows"])


def test_weighted_with_aux_on_data_and_pipe_in_the_reference_runtime():
    """The reference runtime over data 2 x pipe 2 (stages traced on one data shard's
    rows): the shards' loss sums and weights are totalled before dividing, as the
    program does; each aux leaf gets the shard axis after the microbatch axis."""
    params, batch = _lm(2)
    mesh = jax.make_mesh((2, 2), ("data", "pipe"))
    pipe = jp.pipeline(weighted_loss, params, batch, mesh=mesh, schedule=jp.OneFOneB(2, M),
                       cut="markers", runtime="reference", has_aux=True,
                       reduction="weighted")
    (loss, aux), grads = pipe.value_and_grad(params, batch)
    (ref_loss, ref_aux), ref_grads = weighted_reference(params, batch)
    assert_matches((loss, grads), (ref_loss, ref_grads))
    assert aux["tokens"].shape == (M, 2)
    np.testing.assert_array_equal(jnp.sum(aux["tokens"], 1), ref_aux["tokens"])
    np.testing.assert_allclose(pipe.loss(params, batch)[0], loss, rtol=1e-6)


def test_weighted_training_matches_optax_and_logs_aux():
    """train_step on the weighted loss: the update is optax's on the quotient's gradient,
    and metrics["aux"] holds the step's aux; a TrainState evaluates in place."""
    params, batch = _lm()
    pipe = jp.pipeline(weighted_loss, params, batch, mesh=jax.make_mesh((4,), ("pipe",)),
                       schedule=jp.OneFOneB(4, M), cut="markers", has_aux=True,
                       reduction="weighted")
    tx = optax.adam(1e-2)
    state, ref_p, ref_o = pipe.init(params, tx), params, tx.init(params)
    for _ in range(2):
        state, metrics = pipe.train_step(state, batch)
        (loss, aux), grads = weighted_reference(ref_p, batch)
        np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
        np.testing.assert_array_equal(metrics["aux"]["tokens"], aux["tokens"])
        updates, ref_o = tx.update(grads, ref_o, ref_p)
        ref_p = optax.apply_updates(ref_p, updates)
    for a, b in zip(jax.tree.leaves(pipe.params(state)), jax.tree.leaves(ref_p), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    loss, aux = pipe.loss(state, batch)  # evaluated in the stage layout
    np.testing.assert_allclose(loss, weighted_reference(ref_p, batch)[0][0], rtol=1e-5)


def test_scanned_stack_weighted():
    """A scanned layer stack, cut between its iterations, with the weighted loss: exact."""
    params, batch = _lm()
    stacked = {"embed": params["embed"],
               "blocks": jax.tree.map(lambda *x: jnp.stack(x), *params["blocks"])}

    def scan_loss(p, mb):
        def body(h, blk):
            return jp.boundary(h + jnp.tanh(h @ blk["w"] + blk["b"])), None
        h, _ = jax.lax.scan(body, p["embed"][mb["tokens"]], p["blocks"])
        logp = jax.nn.log_softmax(h @ p["embed"].T)
        nll = -jnp.take_along_axis(logp, mb["targets"][..., None], -1)[..., 0]
        return jnp.sum(nll * mb["mask"]), jnp.sum(mb["mask"])

    pipe = jp.pipeline(scan_loss, stacked, batch, mesh=jax.make_mesh((2,), ("pipe",)),
                       schedule=jp.OneFOneB(2, M), reduction="weighted")

    def full(p):
        outs = [scan_loss(p, mb) for mb in _microbatches(batch)]
        return sum(o[0] for o in outs) / sum(o[1] for o in outs)

    assert_matches(pipe.value_and_grad(stacked, batch), jax.value_and_grad(full)(stacked))


def test_dropout_with_aux_matches_the_reference_runtime():
    """rng=True with has_aux and reduction="sum": the SPMD programs equal the sequential
    reference runtime (the oracle) on the same keys."""
    params, batch = _lm(2)

    def loss_fn(p, mb, key):
        nll, _ = _nll(p, mb)
        keep = jax.random.bernoulli(key, 0.7, nll.shape)
        return jnp.sum(jnp.where(keep, nll, 0.0)), {"kept": jnp.sum(keep)}

    key = jax.random.key(3)
    results = []
    for runtime in ("reference", SpmdRuntime(backend="cpu"), SpmdRuntime(backend="gpu")):
        pipe = jp.pipeline(loss_fn, params, batch, mesh=jax.make_mesh((2,), ("pipe",)),
                           schedule=jp.OneFOneB(2, M), cut="markers", rng=True,
                           has_aux=True, reduction="sum", runtime=runtime)
        results.append(pipe.value_and_grad(params, batch, key))
        np.testing.assert_allclose(pipe.loss(params, batch, key)[0], results[-1][0][0],
                                   rtol=1e-6)
    for r in results[1:]:
        _check(r, results[0])


def test_a_key_in_aux_comes_back_a_key():
    """A PRNG key among the aux leaves crosses the program as its key data; it comes back
    a key (stacked over microbatches) from value_and_grad and train_step, as
    jax.value_and_grad returns it, not as uint32 key data."""
    params, batch = _lm(2)

    def loss_fn(p, mb):
        nll, _ = _nll(p, mb)
        return jnp.mean(nll), {"key": jax.random.fold_in(jax.random.key(0), mb["tokens"][0, 0])}

    pipe = jp.pipeline(loss_fn, params, batch, mesh=jax.make_mesh((2,), ("pipe",)),
                       schedule=jp.OneFOneB(2, M), cut="markers", has_aux=True)
    (_, aux), _ = pipe.value_and_grad(params, batch)
    want = jnp.stack([jax.random.key_data(loss_fn(params, mb)[1]["key"])
                      for mb in _microbatches(batch)])
    assert jax.dtypes.issubdtype(aux["key"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(aux["key"]), want)
    _, metrics = pipe.train_step(pipe.init(params, optax.sgd(0.1)), batch)
    np.testing.assert_array_equal(jax.random.key_data(metrics["aux"]["key"]), want)


@pytest.mark.parametrize("runtime", ["reference", "cpu"])
def test_float64_losses_are_summed_in_float64(runtime):
    """Under jax.enable_x64, a float64 model's loss (and a train step's loss and gradient
    norm) come back float64, as jax.value_and_grad's, not summed and returned in
    float32 (1.5e-8 off)."""
    with jax.enable_x64(True):
        params, batch = _lm(2)
        params = jax.tree.map(lambda x: x.astype(jnp.float64), params)

        def loss_fn(p, mb):
            h = p["embed"][mb["tokens"]]
            for blk in p["blocks"]:
                h = jp.boundary(h + jnp.tanh(h @ blk["w"] + blk["b"]))
            return jnp.mean(h ** 2)

        pipe = jp.pipeline(loss_fn, params, batch, mesh=jax.make_mesh((2,), ("pipe",)),
                           schedule=jp.OneFOneB(2, M), cut="markers",
                           runtime=RUNTIMES[runtime])
        loss, grads = pipe.value_and_grad(params, batch)
        want, want_grads = jax.value_and_grad(
            lambda p: jnp.mean(jnp.stack([loss_fn(p, mb) for mb in _microbatches(batch)])))(
                params)
        assert loss.dtype == jnp.float64
        np.testing.assert_allclose(loss, want, rtol=1e-14)
        for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
            np.testing.assert_allclose(g, r, rtol=1e-12, atol=1e-15)
        _, metrics = pipe.train_step(pipe.init(params, optax.sgd(0.1)), batch)
        assert metrics["loss"].dtype == metrics["grad_norm"].dtype == jnp.float64


def test_constant_loss_has_a_zero_gradient():
    """A loss function returning a constant while the model is being written pipelines,
    with a zero gradient (it crashed inside the stage splitter)."""
    params, batch = _lm(2)
    pipe = jp.pipeline(lambda p, mb: jp.boundary(p["embed"][mb["tokens"]]).sum() * 0 + 0.0,
                       params, batch, mesh=jax.make_mesh((2,), ("pipe",)),
                       schedule=jp.OneFOneB(2, M), cut="markers")
    loss, grads = pipe.value_and_grad(params, batch)
    assert float(loss) == 0.0
    const = jp.pipeline(lambda p, mb: 0.0, params, batch,
                        mesh=jax.make_mesh((1,), ("pipe",)), schedule=jp.OneFOneB(1, M))
    loss, grads = const.value_and_grad(params, batch)
    assert float(loss) == 0.0 and all(not np.any(g) for g in jax.tree.leaves(grads))


def test_zero_total_weight_is_nan_and_skipped_when_asked():
    """A batch without a real token has a total weight of 0: the loss is NaN (0/0), and
    skip_nonfinite leaves the state unchanged for that step."""
    params, batch = _lm(2)
    empty = dict(batch, mask=jnp.zeros_like(batch["mask"]))
    pipe = jp.pipeline(weighted_loss, params, empty, mesh=jax.make_mesh((2,), ("pipe",)),
                       schedule=jp.OneFOneB(2, M), cut="markers", has_aux=True,
                       reduction="weighted")
    assert np.isnan(pipe.loss(params, empty)[0])
    state = pipe.init(params, optax.sgd(0.1), skip_nonfinite=True)
    state, metrics = pipe.train_step(state, empty)
    assert int(metrics["skipped"]) == 1
    for a, b in zip(jax.tree.leaves(pipe.params(state)), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_flax_models_evaluate_through_the_pipeline():
    """An nnx model trained with dropout (rng=True) evaluates in eval mode through the
    pipeline: pipe.loss(model.eval(), batch) traces the eval-mode pipeline once and
    equals the unpipelined eval loss; has_aux passes through jp.flax.pipeline, and a
    linen pipeline evaluates its params. The model keeps a config dict (its graphdef
    cannot be hashed: the eval-mode pipelines are not keyed by it)."""
    from flax import nnx
    from test_stateful import DropNet, LinenDrop, _batch, _mbs, _mesh, nnx_loss

    model, batch = DropNet(nnx.Rngs(0, dropout=1)), _batch()
    model.cfg = {"note": "a config dict kept on the model"}

    def loss_fn(m, mb):
        out = m(mb["x"])
        return nnx_loss(m, mb), {"mean_out": jnp.mean(out)}

    pipe = jp.flax.pipeline(model, loss_fn, batch, mesh=_mesh(), schedule=jp.OneFOneB(2, 4),
                            rng=True, has_aux=True)
    (loss, aux), _ = pipe.value_and_grad(model, batch, jax.random.key(1))
    assert aux["mean_out"].shape == (4,)
    model.eval()
    eval_loss, eval_aux = pipe.loss(model, batch)
    ref = [loss_fn(model, mb) for mb in _mbs(batch)]
    np.testing.assert_allclose(eval_loss, np.mean([r[0] for r in ref]), rtol=1e-5)
    np.testing.assert_allclose(eval_aux["mean_out"], [r[1]["mean_out"] for r in ref],
                               rtol=1e-5)
    assert len(pipe._modes) == 1
    pipe.loss(model, batch)
    assert len(pipe._modes) == 1  # traced once
    assert float(eval_loss) != float(loss)  # dropout was on in training

    module = LinenDrop()
    variables = module.init(jax.random.key(0), batch["x"], train=False)
    lpipe = jp.flax.pipeline_linen(
        module, variables, lambda mod, v, mb: jnp.mean((mod.apply(v, mb["x"], train=False)
                                                        - mb["y"]) ** 2),
        batch, mesh=_mesh(), schedule=jp.GPipe(2, 4))
    ref = np.mean([jnp.mean((module.apply(variables, mb["x"], train=False) - mb["y"]) ** 2)
                   for mb in _mbs(batch)])
    np.testing.assert_allclose(lpipe.loss(variables["params"], batch), ref, rtol=1e-5)
