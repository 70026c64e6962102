"""The bad-input catalogue (docs/errors.md): one test per entry.

Each test feeds one kind of bad input to the entry point a user would hit it at and
asserts the exception type and the key words of the message (what is wrong and how to
fix it). None of them compiles more than a tiny program, and none can hang: errors are
raised in Python before anything runs on the devices. Multi-process mismatches and
checkpoint misuse have their entries tested in test_multiprocess.py / test_checkpoint.py.

Every entry's check is in the library.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jaxpipe as jp

P_, M, WIDTH, BATCH = 4, 4, 8, 16


def loss_fn(params, mb):
    h = mb["x"]
    for i, w in enumerate(params["w"]):
        h = jnp.tanh(h @ w)
        if i < len(params["w"]) - 1:
            h = jp.boundary(h)
    return jnp.mean((h - mb["y"]) ** 2)


def _params():
    k = jax.random.split(jax.random.key(0), P_)
    return {"w": [jax.random.normal(k[i], (WIDTH, WIDTH)) * 0.5 for i in range(P_)]}


def _batch(n=BATCH):
    kx, ky = jax.random.split(jax.random.key(1))
    return {"x": jax.random.normal(kx, (n, WIDTH)), "y": jax.random.normal(ky, (n, WIDTH))}


def _mesh(n=P_, names=("pipe",)):
    return jax.make_mesh((n,), names, devices=jax.devices()[:n])


def build(**kw):
    """jp.pipeline on the tiny 4-layer model with any argument replaced."""
    args = {"loss_fn": loss_fn, "params": _params(), "batch": _batch(), "mesh": _mesh(),
            "schedule": jp.OneFOneB(P_, M), "cut": "markers"}
    args.update(kw)
    return jp.pipeline(args.pop("loss_fn"), args.pop("params"), args.pop("batch"), **args)


@pytest.fixture(scope="module")
def pipe():
    return build()


# ------------------------------------------------------------------- batch
def test_batch_not_divisible_by_microbatches(pipe):
    bad = _batch(14)
    with pytest.raises(jp.PipelineError, match=r"batch size 14 is not divisible by "
                                               r"num_microbatches=4.*multiple of 4"):
        build(batch=bad)
    with pytest.raises(jp.PipelineError, match="not divisible by num_microbatches=4"):
        pipe.value_and_grad(_params(), bad)


def test_batch_inconsistent_leading_dims(pipe):
    b = _batch()
    bad = {"x": b["x"], "y": b["y"][:8]}
    with pytest.raises(jp.PipelineError, match=r"inconsistent leading dimensions.*'x'.*16"
                                               r".*'y'.*8.*same batch size"):
        build(batch=bad)
    with pytest.raises(jp.PipelineError, match="inconsistent leading dimensions"):
        pipe.value_and_grad(_params(), bad)


def test_batch_of_another_size_or_structure_at_call(pipe):
    with pytest.raises(jp.PipelineError, match=r"differs from the.*rebuild the pipeline "
                                               r"for a new batch size\.$"):
        pipe.value_and_grad(_params(), _batch(8))
    b = _batch()  # the same rows, another feature size: not a batch size to rebuild for
    with pytest.raises(jp.PipelineError, match=r"a row of it is \(3,\), where the pipeline "
                                               r"was built for rows of \(\d+,\)"):
        pipe.value_and_grad(_params(), {**b, "y": b["y"][:, :3]})
    b = _batch()
    with pytest.raises(jp.PipelineError, match=r"batch structure.*'z'.*differs from the traced"):
        pipe.value_and_grad(_params(), {"x": b["x"], "z": b["y"]})


def test_scalar_or_empty_batch():
    with pytest.raises(jp.PipelineError, match=r"batch leaf \['s'\] is a scalar.*leading "
                                               r"batch axis"):
        build(batch={**_batch(), "s": jnp.float32(1.0)})
    with pytest.raises(jp.PipelineError, match="no array leaves"):
        build(batch={})


def test_microbatch_not_divisible_by_data_axis():
    mesh = jax.make_mesh((2, P_), ("data", "pipe"), devices=jax.devices()[:2 * P_])
    with pytest.raises(jp.PipelineError, match=r"microbatch size 3 is not divisible by the 2 "
                                               r"devices of the data axes.*divisible by 8"):
        build(mesh=mesh, batch=_batch(12))


def test_batch_dtype_differs_at_call(pipe):
    b = _batch()
    bad = {"x": b["x"].astype(jnp.int32), "y": b["y"]}
    with pytest.raises(jp.PipelineError, match=r"dtype int32.*traced.*float32"):
        pipe.value_and_grad(_params(), bad)


def test_a_call_under_another_matmul_precision_than_the_builds(pipe):
    """The stages are traced at build, when JAX fixes each matmul's precision: a call
    under another jax.default_matmul_precision is refused (it ran at the build's,
    silently); a pipeline built and called under 'highest' computes at it (exact)."""
    params, batch = _params(), _batch()
    with jax.default_matmul_precision("highest"):
        with pytest.raises(jp.PipelineError, match=r"precision 'highest'.*built under None"):
            pipe.value_and_grad(params, batch)
        with pytest.raises(jp.PipelineError, match=r"pipe.lower\('loss'\) runs under"):
            pipe.lower("loss")
        high = build()
        assert "precision = [HIGHEST, HIGHEST]" in high.lower("loss").as_text()
        np.testing.assert_allclose(high.loss(params, batch), loss_fn(params, batch),
                                   rtol=1e-6)
    assert "HIGHEST" not in pipe.lower("loss").as_text()
    with pytest.raises(jp.PipelineError, match=r"precision None.*built under 'highest'"):
        high.loss(params, batch)


# ------------------------------------------------------------------- params
def test_params_tree_not_matching_traced(pipe):
    params = _params()
    fewer = {"w": params["w"][:3]}
    for call in (lambda p: pipe.value_and_grad(p, _batch()), pipe.shard,
                 lambda p: pipe.init(p, optax.sgd(0.1))):
        with pytest.raises(jp.PipelineError, match=r"(?s)params do not have the structure the "
                                                   r"pipeline was built with.*expected.*got"):
            call(fewer)
    reshaped = {"w": [*params["w"][:3], jnp.zeros((WIDTH, 4))]}
    with pytest.raises(jp.PipelineError, match=r"parameter leaf 3 has shape \(8, 4\).*traced "
                                               r"with \(8, 8\)"):
        pipe.value_and_grad(reshaped, _batch())


def test_params_with_non_array_leaf():
    with pytest.raises(jp.PipelineError, match=r"params leaf \['name'\] is a str.*array"):
        build(params={**_params(), "name": "foo"})


# ------------------------------------------------------------------- schedule / mesh
def test_schedule_for_wrong_number_of_devices():
    with pytest.raises(jp.PipelineError, match=r"mesh axis 'pipe' has size 4 but the "
                                               r"schedule has num_devices=2.*make them equal"):
        build(schedule=jp.OneFOneB(2, M))


def test_schedule_for_wrong_number_of_stages():
    # 4 devices x 2 stages per device = 8 stages, but the model has 4 segments.
    with pytest.raises(jp.PipelineError, match=r"schedule needs 8 stages but the loss has only "
                                               r"4 cuttable segments.*fewer stages"):
        build(schedule=jp.Interleaved1F1B(P_, M, stages_per_device=2))
    with pytest.raises(jp.PipelineError, match=r"Cut\(indices=\[0, 1\]\) gives 3 stages but the "
                                               r"schedule has 4"):
        build(cut=jp.Cut(indices=[0, 1]))


def test_invalid_user_schedule():
    class ForwardOnly(jp.Schedule):
        def device_actions(self, device):
            return [jp.Action("F", device, mb) for mb in range(self.num_microbatches)]

    with pytest.raises(jp.ScheduleError, match=r"device 0: .*no backward.*rule: missing "
                                               r"backward"):
        build(schedule=ForwardOnly(P_, M))


def test_schedule_class_instead_of_instance():
    with pytest.raises(jp.PipelineError, match=r"schedule must be a jaxpipe.Schedule instance"
                                               r".*got the class OneFOneB, not an instance of "
                                               r"it; e.g. jp.OneFOneB\(num_devices="):
        build(schedule=jp.OneFOneB)
    with pytest.raises(jp.PipelineError, match=r"'auto' or jp.Auto\(...\), got str \('1f1b' "
                                               r"is not a name.*jp\.load_schedule\(name\)"):
        build(schedule="1f1b")
    with pytest.raises(jp.PipelineError, match=r"tuple of family names.*families=\('gpipe',\)"):
        jp.Auto(families="gpipe")


def test_mesh_without_the_axis():
    with pytest.raises(jp.PipelineError, match=r"mesh has axes \('stage',\) but no 'pipe' "
                                               r"axis.*axis=<name"):
        build(mesh=_mesh(names=("stage",)))
    with pytest.raises(jp.PipelineError, match=r"mesh must be a jax.sharding.Mesh.*make_mesh"):
        build(mesh=jax.devices()[:P_])


def test_axis_size_mismatch():
    with pytest.raises(jp.PipelineError, match=r"mesh axis 'pipe' has size 8 but the schedule "
                                               r"has num_devices=4"):
        build(mesh=_mesh(8))


def test_more_stages_than_cuttable_layers():
    with pytest.raises(jp.PipelineError, match=r"needs 8 stages but the loss has only 4 "
                                               r"cuttable segments \(3 markers\).*add "
                                               r"jaxpipe.boundary"):
        build(mesh=_mesh(8), schedule=jp.OneFOneB(8, M))


def test_unknown_cut_option():
    with pytest.raises(jp.PipelineError, match=r"cut must be 'auto', 'markers' or a "
                                               r"jaxpipe.Cut, got 'even'"):
        build(cut="even")


# ------------------------------------------------------------------- loss function
def _cond_loss(params, mb):
    x = lax.cond(mb["x"][0, 0] > 0, lambda h: jp.boundary(h * 2), lambda h: h, mb["x"])
    return loss_fn(params, {"x": x, "y": mb["y"]})


def _while_loss(params, mb):
    _, x = lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, jp.boundary(jnp.tanh(c[1]))),
                          (0, mb["x"]))
    return loss_fn(params, {"x": x, "y": mb["y"]})


def _reversed_scan_loss(params, mb):
    def body(h, w):
        return jp.boundary(jnp.tanh(h @ w)), None

    h, _ = lax.scan(body, mb["x"], jnp.stack(params["w"]), reverse=True)
    return jnp.mean((h - mb["y"]) ** 2)


@pytest.mark.parametrize("fn, prim", [(_cond_loss, "cond"), (_while_loss, "while")])
def test_markers_inside_control_flow(fn, prim):
    # (a forward lax.scan over layers is a scanned stack, cut between iterations:
    # tests/test_stacks.py)
    with pytest.raises(jp.PipelineError, match=rf"used inside `{prim}`.*Cuts must be at the "
                                               r"top level.*lax.scan over layers.*unroll"):
        build(loss_fn=fn)


def test_markers_inside_reversed_scan():
    with pytest.raises(jp.PipelineError, match=r"reversed lax.scan.*scan over the reversed "
                                               r"stack instead"):
        build(loss_fn=_reversed_scan_loss)


@pytest.mark.parametrize("fn, what", [
    (lambda p, b: loss_fn(p, b) * jnp.ones(3), r"1 leaves with shapes \[\(3,\)\]"),
    (lambda p, b: (loss_fn(p, b), loss_fn(p, b)), r"2 leaves"),
    (lambda p, b: None, r"0 leaves"),
])
def test_non_scalar_loss(fn, what):
    with pytest.raises(jp.PipelineError, match=rf"must return one scalar.*{what}.*jnp.mean"):
        build(loss_fn=fn)


def test_python_control_flow_on_the_batch_names_the_users_loss():
    """A loss branching in Python on a batch value is refused by JAX; the error points at
    the user's loss and names the argument, as jax.jit's does (it named jaxpipe's
    tracing helper and 'argument leaves[5]')."""
    def branchy(params, mb):
        if jnp.mean(mb["x"]) > 0:
            return loss_fn(params, mb)
        return 2 * loss_fn(params, mb)

    with pytest.raises(jax.errors.TracerBoolConversionError,
                       match=r"tracing the function branchy at .*test_bad_inputs\.py.*"
                             r"argument mb\['x'\]"):
        build(loss_fn=branchy)


def test_loss_not_float():
    with pytest.raises(jp.PipelineError, match=r"floating-point scalar, got dtype int32.*astype"):
        build(loss_fn=lambda p, b: jnp.sum(b["x"] @ p["w"][0] > 0))


# ------------------------------------------------------------------- cutter
def test_memory_budget_infeasible():
    with pytest.raises(jp.CutError, match=r"memory budget of 1 B.*infeasible.*smallest feasible "
                                          r"budget is .*raise memory_budget"):
        build(cut=jp.Cut(memory_budget=1))


# ------------------------------------------------------------------- schedule names
def test_unknown_schedule_name():
    with pytest.raises(jp.ScheduleError, match=r"unknown schedule '2f2b'; valid: gpipe, 1f1b"):
        jp.load_schedule("2f2b")
    with pytest.raises(jp.ScheduleError, match=r"add ':ClassName'"):
        jp.load_schedule("schedules/zero_bubble.py")


def test_schedule_file_or_class_missing_or_not_a_schedule(tmp_path):
    with pytest.raises(jp.ScheduleError, match=r"schedule file 'nope/zb.py' not found"):
        jp.load_schedule("nope/zb.py:ZeroBubble")
    f = tmp_path / "mine.py"
    f.write_text("import jaxpipe as jp\n\nclass NotASchedule:\n    pass\n\n"
                 "class Mine(jp.GPipe):\n    pass\n\n"
                 "class _Helper(jp.GPipe):\n    pass\n\n"
                 "class Base(jp.Schedule):\n    pass\n")
    # (helpers and abstract bases are not offered)
    with pytest.raises(jp.ScheduleError, match=r"has no class 'Missing'; Schedule subclasses "
                                               r"there: .*Mine$"):
        jp.load_schedule(f"{f}:Missing")
    with pytest.raises(jp.ScheduleError, match=r"NotASchedule is not a Schedule subclass.*"
                                               r"subclass jaxpipe.Schedule"):
        jp.load_schedule(f"{f}:NotASchedule")
    with pytest.raises(jp.ScheduleError, match=r"cannot import schedule module 'nosuchpkg.mod'"):
        jp.load_schedule("nosuchpkg.mod:X")


def test_schedule_arguments():
    with pytest.raises(jp.ScheduleError, match=r"num_microbatches must be a positive int, "
                                               r"got 2.5"):
        jp.OneFOneB(P_, 2.5)


# ------------------------------------------------------------------- training
def test_optimizer_and_train_step_order():
    fresh = build()
    with pytest.raises(jp.PipelineError, match=r"got NoneType; call pipe.init\(params, "
                                               r"optimizer\) before"):
        fresh.train_step(None, _batch())
    with pytest.raises(jp.PipelineError, match=r"optax.GradientTransformation, got str"):
        fresh.init(_params(), "adam")
    fresh.init(_params(), optax.sgd(0.1))
    with pytest.raises(jp.PipelineError, match=r"needs the TrainState returned by pipe.init"):
        fresh.train_step(_params(), _batch())


def test_train_state_from_another_pipeline(pipe):
    other = build(mesh=_mesh(2), schedule=jp.OneFOneB(2, M))
    foreign = other.init(_params(), optax.sgd(0.1))
    pipe.init(_params(), optax.sgd(0.1))
    with pytest.raises(jp.PipelineError, match=r"state.*layout.*this pipeline.*pipe.init"):
        pipe.train_step(foreign, _batch())


def test_differentiating_a_pipeline_call_is_named(pipe):
    """jax.grad around a pipeline call says to call pipe.value_and_grad (it failed inside
    JAX, placing tracers on the mesh: 'Length of device assignment 1 is not equal to the
    size of the mesh', then 'Reverse-mode differentiation does not work for
    lax.while_loop')."""
    params, batch = _params(), _batch()
    with pytest.raises(jp.PipelineError, match=r"with respect to pipe\.loss\(params.*"
                                               r"pipe\.value_and_grad\(params, batch\)"):
        jax.grad(lambda p: pipe.loss(p, batch))(params)
    with pytest.raises(jp.PipelineError, match=r"with respect to batch.*an embedding\) "
                                               r"inside loss_fn, its weights in params"):
        jax.grad(lambda x: pipe.loss(params, {**batch, "x": x}))(batch["x"])
    with pytest.raises(jp.PipelineError, match=r"with respect to params.*higher-order"):
        jax.jit(jax.grad(lambda p: pipe.value_and_grad(p, batch)[0]))(params)
    state = pipe.init(params, optax.sgd(0.1))
    with pytest.raises(jp.PipelineError, match=r"with respect to train_step"):
        jax.grad(lambda s: pipe.train_step(s, batch)[1]["loss"], allow_int=True)(state)


def test_unshard_of_user_pytree(pipe):
    with pytest.raises(jp.PipelineError, match=r"unshard.*stage layout.*pipe.shard"):
        pipe.unshard(_params())


@pytest.fixture(scope="module")
def nonfinite_batches():
    b = _batch()
    return {"nan": {"x": b["x"].at[0, 0].set(jnp.nan), "y": b["y"]},
            "inf": {"x": b["x"], "y": b["y"].at[3, 1].set(jnp.inf)},
            "ok": b}


def test_nonfinite_loss_skipped_and_surfaced(pipe, nonfinite_batches):
    state = pipe.init(_params(), optax.adam(1e-2), skip_nonfinite=True)
    before = jax.tree.map(np.asarray, (pipe.params(state), state.opt_state))
    for kind in ("nan", "inf"):
        state, metrics = pipe.train_step(state, nonfinite_batches[kind])
        assert not np.isfinite(metrics["loss"]), kind  # surfaced in the metrics
        assert int(metrics["skipped"]) == 1, kind
        after = jax.tree.map(np.asarray, (pipe.params(state), state.opt_state))
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
            np.testing.assert_array_equal(a, b)  # nothing propagated into params / optimizer
    state, metrics = pipe.train_step(state, nonfinite_batches["ok"])
    assert int(metrics["skipped"]) == 0 and np.isfinite(metrics["loss"])
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(pipe.params(state)))


def test_nonfinite_loss_without_skip_is_surfaced(pipe, nonfinite_batches):
    state = pipe.init(_params(), optax.sgd(0.1))
    state, metrics = pipe.train_step(state, nonfinite_batches["nan"])
    assert np.isnan(metrics["loss"]) and int(metrics["skipped"]) == 0


def test_empty_batch():
    with pytest.raises(jp.PipelineError, match=r"batch is empty \(batch size 0\)"):
        build(batch={"x": jnp.zeros((0, WIDTH)), "y": jnp.zeros((0, WIDTH))})


def test_state_staged_or_model_where_params_expected(pipe):
    state = pipe.init(_params(), optax.sgd(0.1))
    for call in (lambda p: pipe.value_and_grad(p, _batch()), pipe.shard,
                 lambda p: pipe.init(p, optax.sgd(0.1))):
        with pytest.raises(jp.PipelineError, match=r"got a TrainState; use pipe.params\(state\)"):
            call(state)
        with pytest.raises(TypeError, match=r"stage layout.*pipe.unshard\(staged\)"):
            call(state.params)
    with pytest.raises(jp.PipelineError, match=r"pipe.params needs the TrainState.*got dict"):
        pipe.params(_params())
    with pytest.raises(jp.PipelineError, match=r"unshard expects staged.*got a TrainState.*"
                                               r"pipe.params\(state\)"):
        pipe.unshard(state)
    with pytest.raises(jp.PipelineError, match=r"staged_value_and_grad expects.*stage layout"):
        pipe.staged_value_and_grad(_params(), _batch())
    from flax import nnx

    with pytest.raises(jp.PipelineError, match=r"got a flax Linear.*jp.flax.pipeline"):
        pipe.value_and_grad(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), _batch())


def test_prng_key_in_params():
    with pytest.raises(jp.PipelineError, match=r"params leaf \['key'\] is a PRNG key.*rng=True"):
        build(params={**_params(), "key": jax.random.key(0)})


def test_schedule_author_mistakes_outside_the_action_list():
    class NoReturn(jp.Schedule):
        def device_actions(self, device):
            [jp.Action("F", device, 0)]  # noqa: B018 - the forgotten return under test

    class NotAList(jp.GPipe):
        def device_actions(self, device):
            return 3

    class OneShot(jp.GPipe):
        def __init__(self, p, m):
            super().__init__(p, m)
            self._it = {d: iter(jp.GPipe.device_actions(self, d)) for d in range(p)}

        def device_actions(self, device):
            return self._it[device]

    class NoSuper(jp.GPipe):
        def __init__(self, p, m):
            self.p, self.m = p, m

    cases = [(NoReturn(P_, M), r"NoReturn.device_actions\(0\) returned None.*missing "
                                r"`return`"),
             (NotAList(P_, M), r"device_actions\(0\) returned a int \(3\), not a list"),
             (OneShot(P_, M), r"returned a different list on its second call.*iterator")]
    for sched, words in cases:
        with pytest.raises(jp.ScheduleError, match=words):
            sched.validate()
        with pytest.raises(jp.ScheduleError, match=words):
            build(schedule=sched)
    with pytest.raises(jp.ScheduleError, match=r"NoSuper has no num_devices: its __init__ did "
                                               r"not call super\(\).__init__"):
        build(schedule=NoSuper(P_, M))
    assert not hasattr(NoSuper(P_, M), "num_microbatches")

    class Generator(jp.GPipe):  # a generator method makes a new iterator per call: fine
        def device_actions(self, device):
            yield from super().device_actions(device)

    Generator(P_, M).validate()


def test_cut_option_types():
    with pytest.raises(jp.PipelineError, match=r"got \[0, 1\] \(for explicit cuts: "
                                               r"jp.Cut\(indices=\[0, 1\]\)\)"):
        build(cut=[0, 1])
    for kwargs, words in [({"memory_budget": float("nan")}, r"memory_budget must be positive "
                                                             r"bytes.*got nan"),
                          ({"memory_budget": "1GB"}, r"memory_budget.*got '1GB'"),
                          ({"indices": [1.5]}, r"indices must be ints.*got 1.5"),
                          ({"indices": 3}, r"indices must be a sequence.*got 3"),
                          ({"objective": None}, r"objective must be 'time' or 'memory'"),
                          ({"time_slack": float("nan")}, r"time_slack must be"),
                          ({"profile": 1}, r"profile must be True or False"),
                          # an option another overrides is refused, not dropped
                          ({"objective": "memory", "indices": [1]},
                           r"objective='memory' has no effect with Cut.indices"),
                          ({"objective": "memory", "memory_budget": 2**30},
                           r"objective='memory' has no effect with Cut.memory_budget"),
                          ({"time_slack": 0.3}, r"time_slack only applies to "
                                                r"objective='memory'.*got time_slack=0.3"),
                          ({"time_slack": 0.3, "memory_budget": 2**30},
                           r"time_slack only applies")]:
        with pytest.raises(jp.CutError, match=words):
            jp.Cut(**kwargs)


def test_other_pipeline_argument_types():
    with pytest.raises(TypeError, match=r"loss_fn must be a function"):
        build(loss_fn="loss")
    with pytest.raises(jp.PipelineError, match=r"axis must be the name \(str\)"):
        build(axis=0)
    with pytest.raises(jp.PipelineError, match=r"rng must be True or False"):
        build(rng="yes")
    # the key argument and rng= disagree: Python's TypeError about the call named neither
    with pytest.raises(jp.PipelineError, match=r"cannot be called as loss_fn\(params, "
                                               r"microbatch, key\): with rng=True"):
        build(rng=True)
    with pytest.raises(jp.PipelineError, match=r"loss_fn\(p, mb, key\) cannot be called as "
                                               r"loss_fn\(params, microbatch\): .*needs "
                                               r"rng=True"):
        build(loss_fn=lambda p, mb, key: loss_fn(p, mb))
    build(loss_fn=lambda p, mb, key=None: loss_fn(p, mb))  # a key with a default: either


def test_ordered_effects_are_refused_at_build():
    """jax.debug.print(..., ordered=True): JAX runs ordered effects on one device only;
    the first call failed in JAX's words."""
    def printing(params, mb):
        jax.debug.print("loss input {}", mb["x"].sum(), ordered=True)
        return loss_fn(params, mb)

    with pytest.raises(jp.PipelineError, match=r"ordered effect .*Drop ordered=True"):
        build(loss_fn=printing)


def test_key_missing_unexpected_or_wrong(pipe):
    with pytest.raises(jp.PipelineError, match=r"got a key, but the pipeline was built "
                                               r"without rng=True"):
        pipe.value_and_grad(_params(), _batch(), jax.random.key(0))

    def keyed(params, mb, key):
        return loss_fn(params, mb) + 0 * jax.random.uniform(key)

    rng_pipe = build(loss_fn=keyed, rng=True)
    with pytest.raises(jp.PipelineError, match=r"needs a PRNG key: the pipeline was built "
                                               r"with rng=True"):
        rng_pipe.value_and_grad(_params(), _batch())
    with pytest.raises(jp.PipelineError, match=r"needs one PRNG key \(shape \(\)\)"):
        rng_pipe.value_and_grad(_params(), _batch(), jax.random.split(jax.random.key(0), 4))
    with pytest.raises(TypeError, match=r"needs a PRNG key made by jax.random.key"):
        rng_pipe.value_and_grad(_params(), _batch(), 3)
    with pytest.raises(jp.PipelineError, match=r"key<rbg> but the pipeline was built for "
                                               r"key<fry> \(JAX's default key implementation"):
        rng_pipe.value_and_grad(_params(), _batch(), jax.random.key(0, impl="rbg"))
    state = rng_pipe.init(_params(), optax.sgd(0.1))
    with pytest.raises(jp.PipelineError, match=r"pipe.train_step needs a PRNG key"):
        rng_pipe.train_step(state, _batch())


def test_layer_on_an_instance_or_with_bad_arguments():
    from flax import nnx

    with pytest.raises(TypeError, match=r"instance of the flax module Linear, not the class.*"
                                        r"hide the module's parameters.*jp.boundary"):
        jp.layer(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    with pytest.raises(TypeError, match=r"got the string 'blk'.*@jp.layer\(name='blk'\)"):
        jp.layer("blk")
    with pytest.raises(TypeError, match=r"name must be a str"):
        jp.layer(name=3)
    with pytest.raises(TypeError, match=r"decorates a function or a Module class, got int"):
        jp.layer(3)
    with pytest.raises(TypeError, match=r"jp.boundary marks arrays, but leaf \['b'\] is a str"):
        jp.boundary({"a": jnp.ones(2), "b": "x"})


def test_optimizer_coupling_stages_is_refused(pipe):
    refused = [optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)),
               optax.apply_if_finite(optax.adam(1e-2), 3),
               optax.MultiSteps(optax.adam(1e-2), 2, should_skip_update_fn=optax.skip_not_finite)]
    for tx in refused:
        # the leaf read is named with its own stage (it listed every missing leaf's)
        with pytest.raises(jp.PipelineError, match=r"couples parameters across pipeline stages"
                                                   r".*reads params\['w'\]\[(\d)\] "
                                                   r"\(stage\(s\) \[\1\]\).*"
                                                   r"clip_global_norm=<max norm>"):
            pipe.init(_params(), tx)
    for tx in (optax.adamw(1e-2), optax.lamb(1e-2), optax.adafactor(1e-2),
               optax.MultiSteps(optax.adam(1e-2), 2), optax.chain(optax.clip(1.0), optax.sgd(.1))):
        pipe.init(_params(), tx)  # per-leaf state: accepted


def test_building_and_calling_under_another_set_mesh(pipe):
    """A jax.set_mesh of another mesh (a job's global mesh) around building or calling
    the pipeline: it runs under its own (the stages' types named the other mesh and every
    call failed inside JAX); inside a user's shard_map it is refused with the fix."""
    from jax.sharding import PartitionSpec as P

    params, batch = _params(), _batch()
    want = jax.value_and_grad(lambda p: jnp.mean(jnp.stack([
        loss_fn(p, jax.tree.map(lambda a, i=i: a[i * 4:(i + 1) * 4], batch))
        for i in range(M)])))(params)
    glob = jax.make_mesh((2, 4), ("data", "pipe"))
    with jax.set_mesh(glob):
        built = build(params=params, batch=batch)
    for p in (pipe, built):
        for other in (glob, jax.make_mesh((8,), ("x",))):
            with jax.set_mesh(other):  # (set_mesh takes effect when called)
                got = p.value_and_grad(params, batch)
            np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
            for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
    inner = jax.shard_map(lambda b: pipe.loss(params, b)[None], mesh=glob,
                          in_specs=P("data"), out_specs=P("data"), axis_names={"data"})
    with pytest.raises(jp.PipelineError, match=r"inside a jax.shard_map manual over "
                                               r"\['data'\].*call it outside yours"):
        jax.jit(inner)(batch)


def _raw_key_noise() -> optax.GradientTransformation:
    """Old optax's add_noise: a uint32 key in the state, one subkey per leaf position."""
    def init(params):
        return jax.random.PRNGKey(0)

    def update(updates, key, params=None):
        leaves, treedef = jax.tree.flatten(updates)
        keys = jax.random.split(key, len(leaves) + 1)
        noisy = [u + 1e-2 * jax.random.normal(k, u.shape)
                 for u, k in zip(leaves, keys[1:], strict=True)]
        return jax.tree.unflatten(treedef, noisy), keys[0]

    return optax.GradientTransformation(init, update)


def test_optimizers_drawing_noise_or_reading_the_loss_are_refused(pipe):
    """An optimizer with a PRNG key in its state runs per stage, every stage drawing by
    its leaves' positions from the same key: every layer got the same noise (a raw key),
    or pipe.init crashed on the key's dtype (optax.add_noise's typed key). One reading
    the loss (value=...) failed inside the first train_step's trace."""
    for noise in (_raw_key_noise(), optax.add_noise(0.01, 0.55, 0)):
        with pytest.raises(jp.PipelineError, match=r"draws random numbers.*same noise"):
            pipe.init(_params(), optax.chain(noise, optax.sgd(.1)))
    from optax.contrib import reduce_on_plateau

    with pytest.raises(jp.PipelineError, match=r"needs the loss \(value=...\).*not supported"):
        pipe.init(_params(), optax.chain(optax.adam(1e-2), reduce_on_plateau()))


def test_a_deleted_batch_leaf_and_abstract_params_at_a_call(pipe):
    """A deleted batch leaf is named by its path and not blamed on train_step; abstract
    parameters (ShapeDtypeStruct) at a call are sent to pipe.lower, not told to
    jax.device_get themselves."""
    batch = _batch()
    batch["y"].delete()
    with pytest.raises(jp.PipelineError, match=r"batch\['y'\] was deleted \(donated to an "
                                               r"earlier call"):
        pipe.value_and_grad(_params(), batch)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _params())
    with pytest.raises(jp.PipelineError, match=r"params\['w'\]\[0\] is a "
                                               r"jax.ShapeDtypeStruct.*use pipe.lower"):
        pipe.value_and_grad(abstract, _batch())


def test_clip_and_skip_options():
    fresh = build()
    for value in (0, -1.0, float("nan"), "1", True, np.float32(-1), np.array([1.0])):
        with pytest.raises(jp.PipelineError, match=r"clip_global_norm must be a positive finite"):
            fresh.init(_params(), optax.sgd(0.1), clip_global_norm=value)
    for value in (np.float32(1.0), np.int64(2), jnp.asarray(0.5)):  # the number they hold
        state = fresh.init(_params(), optax.sgd(0.1), clip_global_norm=value)
        assert state.trainer.options.clip_global_norm == float(value)
    with pytest.raises(jp.PipelineError, match=r"skip_nonfinite must be True or False"):
        fresh.init(_params(), optax.sgd(0.1), skip_nonfinite=1)
    with pytest.raises(jp.PipelineError, match=r"GradientTransformation, got the function adam "
                                               r"\(call it to make one\)"):
        fresh.init(_params(), optax.adam)


def test_schedule_file_that_does_not_import_or_is_a_directory(tmp_path):
    bad = tmp_path / "mine.py"
    bad.write_text("import jaxpipe as jp\nclass A(jp.GPipe)\n    pass\n")
    with pytest.raises(jp.ScheduleError, match=r"cannot import schedule file .*SyntaxError at "
                                               r"line 2"):
        jp.load_schedule(f"{bad}:A")
    bad.write_text("import nosuchmod\n")
    with pytest.raises(jp.ScheduleError, match=r"ModuleNotFoundError at line 1"):
        jp.load_schedule(f"{bad}:A")
    with pytest.raises(jp.ScheduleError, match=r"is a directory; name the Python file"):
        jp.load_schedule(f"{tmp_path}:A")


def test_spmd_runtime_options():
    from jaxpipe.runtime.spmd import SpmdRuntime

    with pytest.raises(jp.PipelineError, match="backend must be one of 'auto', 'cpu'"):
        SpmdRuntime(backend="cuda")
    with pytest.raises(jp.PipelineError, match="overlap must be True, False or 'auto'"):
        SpmdRuntime(overlap="yes")
    with pytest.raises(jp.PipelineError, match="runs one step per tick.*iw_same_tick=False"):
        SpmdRuntime(backend="gpu", iw_same_tick=True)
    # options set to True that the program built would ignore (they passed silently)
    with pytest.raises(jp.PipelineError, match=r"overlap=True\) overlaps the GPU/TPU "
                                               r"program's.*Use backend='gpu' or 'tpu'"):
        build(runtime=SpmdRuntime(backend="cpu", overlap=True))
    with pytest.raises(jp.PipelineError, match=r"fuse_fb=True\).*no B is left to fuse"):
        build(runtime=SpmdRuntime(split_backward=True, fuse_fb=True))
    gpu = build(runtime=SpmdRuntime(backend="gpu", overlap=True))
    assert "overlap on)" in gpu.plan.program  # the plan says which the program runs


@pytest.mark.parametrize("fn, kw, what", [
    (loss_fn, {"has_aux": True}, r"has_aux=True: loss_fn must return a pair \(loss, aux\)"),
    (lambda p, b: (loss_fn(p, b), loss_fn(p, b)), {},
     r"returned 2 leaves.*If it returns \(loss, aux\), pass has_aux=True"),
    (lambda p, b: (loss_fn(p, b), {"name": "x"}), {"has_aux": True},
     r"aux leaf \['name'\] is a str; aux must be a pytree of arrays"),
    (loss_fn, {"reduction": "weighted"},
     r"reduction='weighted': loss_fn must return \(loss_sum, weight\)"),
    (loss_fn, {"reduction": "avg"}, r"reduction must be one of 'mean', 'sum', 'weighted'"),
])
def test_aux_and_reduction_mismatches(fn, kw, what):
    with pytest.raises(jp.PipelineError, match=what):
        build(loss_fn=fn, **kw)
