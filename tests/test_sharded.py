"""Issue 16: pipelines inside a bigger mesh. The program is manual over the pipe axis (and
the batch axes that shard no parameter); the other axes keep JAX's sharding inside the
stages: tensor parallelism (pipe 2 x data 2 x model 2) and FSDP (pipe 2 x fsdp 4).

Compiled pipelines are shared through module fixtures (CI has two cores).
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from models import assert_matches, reference

import jaxpipe as jp
from jaxpipe import checkpoint as jpc
from jaxpipe.sharding.mesh_axes import spec_dims

D, H, LAYERS, M = 24, 40, 2, 4  # D, H: sizes no activation or batch shape has
reference = jax.jit(reference, static_argnums=(0, 3))  # one compile, not op by op


def _model(wspec, bspec, batch_size):
    """An MLP with residual blocks and a projection tied between the first and last stage."""
    ks = jax.random.split(jax.random.key(0), 2 * LAYERS + 3)
    params = {
        "proj": jax.random.normal(ks[-3], (D, D)) / 5,
        "blocks": [{"w1": jax.random.normal(ks[2 * i], (D, H)) / 5,
                    "b1": jnp.full((H,), 0.01 * i),
                    "w2": jax.random.normal(ks[2 * i + 1], (H, D)) / 7,
                    "b2": jnp.full((D,), -0.01 * i)} for i in range(LAYERS)],
    }
    specs = {"proj": wspec[0],
             "blocks": [{"w1": wspec[0], "b1": bspec, "w2": wspec[1], "b2": None}
                        for _ in range(LAYERS)]}
    batch = {"x": jax.random.normal(ks[-2], (batch_size, D)),
             "y": jax.random.normal(ks[-1], (batch_size, D))}

    def loss_fn(p, b):
        h = jp.boundary(b["x"] @ p["proj"])
        for blk in p["blocks"]:
            h = jp.boundary(h + jnp.tanh(h @ blk["w1"] + blk["b1"]) @ blk["w2"] + blk["b2"])
        return jnp.mean((h @ p["proj"].T - b["y"]) ** 2)

    return loss_fn, params, specs, batch


def _tanh_mlp(seed, rows, width=16, layers=4):
    """Host weights of a ``layers``-block tanh MLP, a batch of ``rows`` and its loss."""
    ks = jax.random.split(jax.random.key(seed), layers + 2)
    params = [jax.random.normal(k, (width, width)) / 4 for k in ks[:layers]]
    batch = {"x": jax.random.normal(ks[-2], (rows, width)),
             "y": jax.random.normal(ks[-1], (rows, width))}

    def loss_fn(params, b):
        h = b["x"]
        for w in params:
            h = jp.boundary(jnp.tanh(h @ w))
        return jnp.mean((h - b["y"]) ** 2)

    return params, batch, loss_fn


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


# tensor parallel: w1 column-, w2 row-sharded over 'model'; data parallel over 'data'
TP = dict(mesh=((2, 2, 2), ("pipe", "data", "model")),
          wspec=(P(None, "model"), P("model", None)), bspec=P("model"), batch=16,
          kwargs={})
# FSDP: weights sharded over 'fsdp' on their first dimension, the batch split over it too
# (the batch is placed so: its placement gives the batch axes)
FSDP = dict(mesh=((2, 4), ("pipe", "fsdp")), wspec=(P("fsdp", None), P("fsdp", None)),
            bspec=None, batch=32, kwargs={})
CASES = {"tp": TP, "fsdp": FSDP}


def _place(params, specs, mesh):
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s or P())),
                        params, specs, is_leaf=lambda v: v is None)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request):
    """tp: parameters placed with their shardings and no param_specs (the default keeps
    what the user placed, as jax.jit does); fsdp: host parameters and param_specs, the
    batch placed split over 'fsdp' and no batch_axes (its placement is the default)."""
    c = CASES[request.param]
    loss_fn, params, specs, batch = _model(c["wspec"], c["bspec"], c["batch"])
    mesh = _mesh(*c["mesh"])
    kwargs = dict(c["kwargs"])
    if request.param == "tp":
        params = _place(params, specs, mesh)
    else:
        kwargs["param_specs"] = specs
        batch = jax.device_put(batch, NamedSharding(mesh, P("fsdp")))
    pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=jp.OneFOneB(2, M),
                       cut="markers", **kwargs)
    return request.param, loss_fn, params, specs, batch, pipe


def _tx():
    return optax.adamw(1e-2, weight_decay=0.1)


@pytest.fixture(scope="module")
def trained(case):
    """Two train steps (clipped by the global norm) and the state after them."""
    name, loss_fn, params, specs, batch, pipe = case
    state = pipe.init(params, _tx(), clip_global_norm=0.5)
    metrics = []
    for _ in range(2):
        state, mt = pipe.train_step(state, batch)
        metrics.append(mt)
    return state, metrics


def _axes(spec):
    """The mesh axes a spec (or part of one) names."""
    return {a for e in spec if e for a in ((e,) if isinstance(e, str) else e)}


def _full_shapes(specs, params):
    """``f32[a,b]`` of every parameter that is sharded."""
    return {"f32[" + ",".join(map(str, x.shape)) + "]"
            for s, x in zip(jax.tree.leaves(specs, is_leaf=lambda v: v is None),
                            jax.tree.leaves(params), strict=True) if s is not None and any(s)}


def test_roles_of_the_mesh_axes(case):
    name, _, _, _, _, pipe = case
    if name == "tp":
        assert pipe.batch_axes == ("data",)  # default: the axes no parameter uses
        assert pipe.inspect.mesh_axes.manual_axes == ("pipe", "data")
    else:
        assert pipe.batch_axes == ("fsdp",)
        assert pipe.inspect.mesh_axes.manual_axes == ("pipe",)
        assert pipe.inspect.mesh_axes.auto_batch_axes == ("fsdp",)


def test_the_plan_says_which_axes_split_the_batch(case):
    """An FSDP or TP user whose batch is not split over an axis gets no data parallelism
    there: the plan says which axes split the batch and which repeat each microbatch."""
    name, _, _, _, _, pipe = case
    line = next(x for x in str(pipe.plan).splitlines() if x.startswith("batch: "))
    if name == "tp":
        assert line.startswith("batch: split over ('data',); the devices along ('model',) "
                               "each compute every microbatch whole"), line
    else:
        assert line == "batch: split over ('fsdp',)", line


def test_value_and_grad_matches_and_keeps_shardings(case):
    _, loss_fn, params, specs, batch, pipe = case
    loss, grads = pipe.value_and_grad(params, batch)
    assert_matches((loss, grads), reference(loss_fn, params, batch, M))
    want = jax.tree.leaves(pipe.inspect.param_specs)
    for g, spec in zip(jax.tree.leaves(grads), want, strict=True):
        assert g.sharding.is_equivalent_to(NamedSharding(pipe.mesh, spec), g.ndim)


def test_staged_layout_keeps_shardings_and_round_trips(case):
    _, _, params, specs, _, pipe = case
    staged = pipe.shard(params)
    param_axes = set(pipe.inspect.mesh_axes.param_axes)
    sharded = [v for v in staged if _axes(v.sharding.spec[1:]) & param_axes]
    assert sharded and all(v.sharding.spec[0] == "pipe" for v in staged)
    for v in staged:  # each device holds its share only: 1 / (pipe x the spec's axes)
        shards = np.prod([pipe.mesh.shape[a] for a in _axes(v.sharding.spec)])
        assert v.addressable_shards[0].data.size * shards == v.size
    held = sum(v.addressable_shards[0].data.nbytes for v in staged)
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    assert held < 0.3 * total  # pipe 2 x model 2 (tp) / pipe 2 x fsdp 4, not pipe 2 alone
    back = pipe.unshard(staged)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_train_step_matches_plain_optax(case, trained):
    _, loss_fn, params, _, batch, pipe = case
    state, metrics = trained
    tx = optax.chain(optax.clip_by_global_norm(0.5), _tx())
    ref_p, ref_o = params, tx.init(params)
    for mt in metrics:
        ref_l, g = reference(loss_fn, ref_p, batch, M)
        np.testing.assert_allclose(mt["loss"], ref_l, rtol=1e-5)
        np.testing.assert_allclose(mt["grad_norm"], optax.tree.norm(g), rtol=1e-5)
        u, ref_o = tx.update(g, ref_o, ref_p)
        ref_p = optax.apply_updates(ref_p, u)
    for a, b in zip(jax.tree.leaves(pipe.params(state)), jax.tree.leaves(ref_p), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # optimizer moments are sharded like their parameters
    assert any(_axes(o.sharding.spec[1:]) & set(pipe.inspect.mesh_axes.param_axes)
               for o in state.opt_state)


def _train_step_compiled(pipe, state, batch):
    batch = jax.device_put(batch, pipe.inspect.batch_sharding)
    return state.trainer.step_fn.lower(state, batch).compile()


def _entry_params(hlo: str) -> str:
    return re.search(r"entry_computation_layout=\{\((.*?)\)->", hlo).group(1)


def test_compiled_step_holds_only_shards(case, trained):
    name, _, params, specs, batch, pipe = case
    state, _ = trained
    compiled = _train_step_compiled(pipe, state, batch)
    hlo = compiled.as_text()
    full = _full_shapes(specs, params)
    # no argument of the step (parameters, optimizer state) is a full-size parameter
    entry = _entry_params(hlo)
    assert not [s for s in full if s in entry], entry
    if name == "tp":
        # tensor parallelism never gathers a weight: no full-size tensor anywhere
        assert not [s for s in full if s in hlo]
    # argument bytes: every state leaf divided by the axes it is sharded over
    mesh = pipe.mesh

    def share(x, sharding):
        shards = np.prod([mesh.shape[a] for a in _axes(sharding.spec)])
        return x.size * x.dtype.itemsize // int(shards)

    state_leaves = jax.tree.leaves((state.params, state.opt_state, state.step))
    analytic = sum(share(x, x.sharding) for x in state_leaves)
    analytic += sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(batch)) \
        // pipe.inspect.batch_shards
    got = compiled.memory_analysis().argument_size_in_bytes
    assert abs(got - analytic) <= 0.1 * analytic, (got, analytic)
    replicated = sum(x.size * x.dtype.itemsize // mesh.shape["pipe"] for x in state_leaves)
    assert got < 0.6 * replicated  # the sharded axes really divide the state


def test_checkpoint_round_trip(case, trained, tmp_path):
    _, _, params, _, batch, pipe = case
    state, _ = trained
    jpc.save(tmp_path / "state", state, pipe=pipe)
    restored = jpc.restore(tmp_path / "state", pipe, like=pipe.init(params, _tx(),
                                                                    clip_global_norm=0.5))
    for a, b in zip(jax.tree.leaves((restored.params, restored.opt_state)),
                    jax.tree.leaves((state.params, state.opt_state)), strict=True):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
        np.testing.assert_array_equal(a, b)


def test_placed_shardings_are_the_default_specs():
    """param_specs=None follows each parameter's own sharding ("params" says the same);
    host arrays are replicated; an explicit param_specs wins."""
    loss_fn, params, specs, batch = _model(TP["wspec"], TP["bspec"], 16)
    mesh = _mesh(*TP["mesh"])
    placed = _place(params, specs, mesh)
    placed["proj"] = params["proj"]  # a host array: replicated
    want = dict(specs, proj=None)
    for kwargs in ({}, {"param_specs": "params"}):
        pipe = jp.pipeline(loss_fn, placed, batch, mesh=mesh, schedule=jp.OneFOneB(2, M),
                           cut="markers", **kwargs)
        for got, w in zip(jax.tree.leaves(pipe.inspect.param_specs),
                          jax.tree.leaves(want, is_leaf=lambda v: v is None), strict=True):
            assert spec_dims(got, 2) == spec_dims(w, 2)
        assert pipe.batch_axes == ("data",)
    replicated = jax.tree.map(lambda _: P(), params)
    pipe = jp.pipeline(loss_fn, placed, batch, mesh=mesh, schedule=jp.OneFOneB(2, M),
                       cut="markers", param_specs=replicated)
    assert not any(spec_dims(s, 2) != ((), ()) for s in jax.tree.leaves(pipe.inspect.param_specs))
    assert pipe.batch_axes == ("data", "model")


def test_placed_shardings_the_pipeline_cannot_keep_are_refused():
    loss_fn, params, specs, batch = _model(TP["wspec"], TP["bspec"], 16)
    mesh = _mesh(*TP["mesh"])

    def build(p, m=mesh):
        return jp.pipeline(loss_fn, p, batch, mesh=m, schedule=jp.OneFOneB(2, M),
                           cut="markers")

    other = _mesh((2, 4), ("pipe", "model"))
    elsewhere = dict(params, proj=jax.device_put(params["proj"], NamedSharding(other, P())))
    with pytest.raises(jp.PipelineError, match=r"params\['proj'\] is placed on a mesh with "
                       r"axes \{'pipe': 2, 'model': 4\} on devices \[0, .*\], not on the "
                       r"pipeline's mesh"):
        build(elsewhere)
    # a shape placed on another abstract mesh (nnx.eval_shape's): named, no device ids
    abstract = dict(params, proj=jax.ShapeDtypeStruct(
        params["proj"].shape, params["proj"].dtype,
        sharding=NamedSharding(other.abstract_mesh, P())))
    with pytest.raises(jp.PipelineError, match=r"params\['proj'\] is placed on a mesh with "
                       r"axes \{'pipe': 2, 'model': 4\}, not on the pipeline's mesh"):
        build(abstract)
    on_pipe = dict(params, proj=jax.device_put(params["proj"], NamedSharding(mesh, P("pipe"))))
    with pytest.raises(jp.PipelineError, match=r"params\['proj'\] is placed sharded over the "
                       "pipe axis 'pipe'"):
        build(on_pipe)


def test_a_placed_batch_gives_the_batch_axes():
    """batch_axes=None follows the batch's placement along axis 0 (over a parameter axis
    too: FSDP); a batch_axes= wins; placements the pipeline cannot keep are refused."""
    loss_fn, params, specs, batch = _model(TP["wspec"], TP["bspec"], 16)
    mesh = _mesh(*TP["mesh"])
    placed = _place(params, specs, mesh)

    def build(b, **kwargs):
        return jp.pipeline(loss_fn, placed, b, mesh=mesh, schedule=jp.OneFOneB(2, M),
                           cut="markers", **kwargs)

    def put(b, spec):
        return jax.device_put(b, NamedSharding(mesh, spec))

    assert build(put(batch, P("model"))).batch_axes == ("model",)
    assert build(put(batch, P(("model", "data")))).batch_axes == ("data", "model")
    assert build(put(batch, P()), batch_axes=()).batch_axes == ()
    assert build(put(batch, P())).batch_axes == ("data",)  # not split: the axes no one uses
    assert build(put(batch, P("model")), batch_axes=("data",)).batch_axes == ("data",)
    with pytest.raises(jp.PipelineError, match=r"batch\['x'\] is placed with .*splits a "
                       "batch never over the pipe axis 'pipe'"):
        build(put(batch, P("pipe")))
    with pytest.raises(jp.PipelineError, match=r"batch\['y'\] is placed with .*only along "
                       r"its axis 0 \(the rows\), not along another dimension\. Place"):
        build(dict(batch, y=put(batch["y"], P(None, "model"))))
    with pytest.raises(jp.PipelineError, match=r"placed split over different mesh axes "
                       r"\(batch\['x'\] over \('data',\), batch\['y'\] over \('model',\)\)"):
        build({"x": put(batch["x"], P("data")), "y": put(batch["y"], P("model"))})
    other = _mesh((2, 4), ("pipe", "data"))
    with pytest.raises(jp.PipelineError, match=r"batch\['x'\] is placed on a mesh with axes"):
        build(dict(batch, x=jax.device_put(batch["x"], NamedSharding(other, P("data")))))


@pytest.mark.parametrize("bad,kwargs,match", [
    ("w1", {"w1": P(None, "tensor")}, "names mesh axis 'tensor'"),
    ("w1", {"w1": P(None, "pipe")}, "shards over the pipe axis"),
    ("b1", {"b1": P("model", "data")}, "has 2 entries but the parameter has shape"),
    ("w1", {"w1": P(("data", "model"), "model")}, "uses a mesh axis twice"),
    ("b2", {"b2": P("model")}, r"dimension 0 \(size 25\) of the parameter.*2 devices"),
    ("w1", {"w1": "model"}, "is a str"),
    (None, {"batch_axes": ("pipe",)}, "names the pipe axis"),
    (None, {"batch_axes": ("batch",)}, "names 'batch'"),
    (None, {"batch_axes": ("data", "data")}, "names an axis twice"),
])
def test_bad_specs_name_problem_and_fix(bad, kwargs, match):
    loss_fn, params, specs, batch = _model(TP["wspec"], TP["bspec"], 16)
    if bad is not None:
        specs["blocks"][1][bad] = kwargs[bad]
        kwargs = {}
    if bad == "b2":  # 25 rows do not split over 2 devices (checked before tracing)
        params["blocks"][1]["b2"] = jnp.zeros((D + 1,))
    with pytest.raises(jp.PipelineError, match=match):
        jp.pipeline(loss_fn, params, batch, mesh=_mesh(*TP["mesh"]),
                    schedule=jp.OneFOneB(2, M), cut="markers", param_specs=specs, **kwargs)


def test_specs_of_another_structure_are_refused():
    loss_fn, params, specs, batch = _model(TP["wspec"], TP["bspec"], 16)
    with pytest.raises(jp.PipelineError, match="structure of params"):
        jp.pipeline(loss_fn, params, batch, mesh=_mesh(*TP["mesh"]),
                    schedule=jp.OneFOneB(2, M), cut="markers",
                    param_specs={"proj": P(None, "model")})


def test_resharding_inside_a_stage_is_refused_on_cpu_not_hung():
    """A split across a sharded dimension makes XLA reshard with a collective-permute
    inside the stage; the CPU runtime would wait for every device there forever."""
    mesh = _mesh((2, 4), ("pipe", "model"))
    params = {"w": jnp.ones((D, 3 * 16)) / D, "v": jnp.ones((16, D)) / 16}
    batch = {"x": jnp.ones((8, D))}

    def loss_fn(p, b):
        q, k, v = jnp.split(b["x"] @ p["w"], 3, axis=-1)
        return jnp.mean(jp.boundary(q * k + v) @ p["v"])

    pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=jp.GPipe(2, 2),
                       cut="markers", param_specs={"w": P(None, "model"), "v": None})
    if jax.default_backend() != "cpu":
        pytest.skip("the check is for the CPU runtime")
    with pytest.raises(jp.PipelineError, match="collective-permute.*cannot run inside a stage"):
        pipe.value_and_grad(params, batch)


def test_rng_over_an_fsdp_batch_axis():
    """A stage on an automatic batch axis runs on its whole microbatch and draws with the
    key of its first piece: microbatch i uses fold_in(key, i * batch_shards)."""
    loss0, params, specs, batch = _model(FSDP["wspec"], FSDP["bspec"], FSDP["batch"])

    def loss_fn(p, b, key):
        keep = jax.random.bernoulli(key, 0.8, b["x"].shape)
        return loss0(p, {"x": jnp.where(keep, b["x"], 0.0), "y": b["y"]})

    pipe = jp.pipeline(loss_fn, params, batch, mesh=_mesh(*FSDP["mesh"]),
                       schedule=jp.OneFOneB(2, M), cut="markers", param_specs=specs,
                       rng=True, **FSDP["kwargs"])
    key = jax.random.key(7)
    n = pipe.inspect.batch_shards

    def mean_loss(p):
        mbs = jax.tree.map(lambda x: x.reshape(M, -1, *x.shape[1:]), batch)
        keys = jnp.stack([jax.random.fold_in(key, i * n) for i in range(M)])
        return jnp.mean(jax.vmap(lambda mb, k: loss_fn(p, mb, k))(mbs, keys))

    assert_matches(pipe.value_and_grad(params, batch, key),
                   jax.jit(jax.value_and_grad(mean_loss))(params))


def _nnx_stack(block):
    """An nnx model of two ``block`` s in a row."""
    from flax import nnx

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([block(rngs) for _ in range(2)])

        def __call__(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    return Model


def test_nnx_partitioning_metadata_gives_the_specs():
    from flax import nnx

    mesh = _mesh(*TP["mesh"])
    kernel = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))

    @jp.layer
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(D, H, kernel_init=kernel, rngs=rngs)
            self.down = nnx.Linear(H, D, rngs=rngs)

        def __call__(self, x):
            return x + self.down(jnp.tanh(self.up(x)))

    Model = _nnx_stack(Block)

    with jax.set_mesh(mesh):
        model = Model(nnx.Rngs(0))
    batch = {"x": jnp.ones((16, D)), "y": jnp.zeros((16, D))}
    for kwargs in ({}, {"param_specs": "flax"}):  # by default: as flax placed them
        pipe = jp.flax.pipeline(model, lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2),
                                batch, mesh=mesh, schedule=jp.GPipe(2, 2), cut="markers",
                                **kwargs)
        specs = pipe.inspect.param_specs["blocks"][0]
        assert spec_dims(specs["up"]["kernel"], 2) == ((), ("model",))
        assert spec_dims(specs["down"]["kernel"], 2) == ((), ())
        assert pipe.batch_axes == ("data",)
    with nnx.use_eager_sharding(False):  # variables on no mesh: their metadata decides
        model = Model(nnx.Rngs(0))
    assert jax.tree.leaves(nnx.state(model))[0].sharding.num_devices == 1
    pipe = jp.flax.pipeline(model, lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2),
                            batch, mesh=mesh, schedule=jp.GPipe(2, 2), cut="markers")
    assert spec_dims(pipe.inspect.param_specs["blocks"][1]["up"]["kernel"], 2) == ((), ("model",))


@pytest.mark.parametrize("layer_axis", [False, True], ids=["tensor", "layer_axis"])
def test_scanned_stack_keeps_its_sharding_per_stage(layer_axis):
    """A lax.scan over stacked tensor-parallel weights, cut between iterations: each
    stage holds its own layers' rows, still sharded over 'model'. With the layer axis
    itself sharded over 'model', the stages' rows are cut outside the moves' shard_map
    (inside, a cut would move rows between the 'model' devices: a collective the CPU
    runtime refuses)."""
    ks = jax.random.split(jax.random.key(3), 4)
    params = {"w1": jax.random.normal(ks[0], (4, D, H)) / 5,
              "w2": jax.random.normal(ks[1], (4, H, D)) / 7}
    specs = ({"w1": P("model", None, None), "w2": P("model", None, None)} if layer_axis
             else {"w1": P(None, None, "model"), "w2": P(None, "model", None)})
    batch = {"x": jax.random.normal(ks[2], (16, D)), "y": jax.random.normal(ks[3], (16, D))}

    def loss_fn(p, b):
        def layer(h, w):
            return jp.boundary(h + jnp.tanh(h @ w["w1"]) @ w["w2"]), None
        h, _ = jax.lax.scan(layer, b["x"], p)
        return jnp.mean((h - b["y"]) ** 2)

    pipe = jp.pipeline(loss_fn, params, batch, mesh=_mesh(*TP["mesh"]),
                       schedule=jp.OneFOneB(2, M), cut="markers", param_specs=specs)
    assert pipe.inspect.stacks
    loss, grads = pipe.value_and_grad(params, batch)
    assert_matches((loss, grads), reference(loss_fn, params, batch, M))
    staged = pipe.shard(params)
    assert {v.shape[1] for v in staged} == {2}  # each stage: its 2 of the 4 layers
    assert all(_axes(v.sharding.spec) == {"pipe", "model"} for v in staged)


def test_linen_logical_partitioning_gives_the_specs():
    """nn.with_logical_partitioning boxes, mapped by the nn.logical_axis_rules active when
    the pipeline is built, shard the parameters with no param_specs."""
    import flax.linen as nn

    def kernel(*names):
        return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = jnp.tanh(nn.Dense(H, kernel_init=kernel("embed", "mlp"))(x))
            return x + nn.Dense(D, kernel_init=kernel("mlp", "embed"))(h)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(2):
                x = jp.boundary(Block()(x))
            return x

    mesh = _mesh(*TP["mesh"])
    batch = {"x": jax.random.normal(jax.random.key(1), (16, D))}
    variables = Model().init(jax.random.key(0), batch["x"])

    def loss_fn(module, v, b):
        return jnp.mean(module.apply(v, b["x"]) ** 2)

    with nn.logical_axis_rules((("embed", None), ("mlp", "model"))):
        pipe = jp.flax.pipeline_linen(Model(), variables, loss_fn, batch, mesh=mesh,
                                      schedule=jp.GPipe(2, 2), cut="markers")
    specs = nn.unbox(pipe.inspect.param_specs)["Block_1"]
    assert spec_dims(specs["Dense_0"]["kernel"], 2) == ((), ("model",))
    assert spec_dims(specs["Dense_1"]["kernel"], 2) == (("model",), ())
    assert spec_dims(specs["Dense_1"]["bias"], 1) == ((),)
    assert pipe.batch_axes == ("data",)
    loss, grads = pipe.value_and_grad(variables["params"], batch)
    ref_loss, ref_grads = jax.value_and_grad(
        lambda p: loss_fn(Model(), {"params": p}, batch))(variables["params"])
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)
    kernel_grad = nn.unbox(grads)["Block_0"]["Dense_0"]["kernel"]
    assert "model" in _axes(kernel_grad.sharding.spec)


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_activation_constraints_inside_stages(backend):
    """A model that constrains its activations (with_sharding_constraint on the user's
    mesh) runs inside the stages, in either tick program; an axis its constraints name is
    not split by hand, so it is no default batch axis. Named in batch_axes= (or by a batch
    placed split over it, as a data loader gives it: MaxText's data x tensor layout) it
    was refused; it is left to JAX's sharding, the batch split over it, as on Explicit
    axes."""
    from jaxpipe.runtime.spmd import SpmdRuntime

    loss0, params, specs, batch = _model(TP["wspec"], TP["bspec"], 16)
    mesh = _mesh(*TP["mesh"])
    # one constraint on a NamedSharding, one a bare spec under jax.set_mesh (below)
    rows, hidden = NamedSharding(mesh, P("data", None)), P(None, "model")

    def loss_fn(p, b):
        h = jp.boundary(jax.lax.with_sharding_constraint(b["x"] @ p["proj"], rows))
        for blk in p["blocks"]:
            u = jax.lax.with_sharding_constraint(jnp.tanh(h @ blk["w1"] + blk["b1"]), hidden)
            h = jp.boundary(h + u @ blk["w2"] + blk["b2"])
        return jnp.mean((h @ p["proj"].T - b["y"]) ** 2)

    placed = _place(params, specs, mesh)
    with jax.set_mesh(mesh):  # traced under the user's mesh: its equations record it
        pipe = jp.pipeline(loss_fn, placed, batch, mesh=mesh, schedule=jp.OneFOneB(2, M),
                           cut="markers", runtime=SpmdRuntime(backend=backend))
        assert pipe.batch_axes == ()  # 'data' is the model's (its constraints name it)
        assert_matches(pipe.value_and_grad(placed, batch),
                       reference(loss_fn, placed, batch, M))
    if backend == "gpu":
        return
    on_data = jax.device_put(batch, NamedSharding(mesh, P("data")))
    for kwargs, b in [({"batch_axes": ("data",)}, batch), ({}, on_data)]:
        with jax.set_mesh(mesh):
            pipe = jp.pipeline(loss_fn, placed, b, mesh=mesh, schedule=jp.OneFOneB(2, M),
                               cut="markers", **kwargs)
            assert pipe.batch_axes == pipe.inspect.mesh_axes.auto_batch_axes == ("data",)
            assert_matches(pipe.value_and_grad(placed, b), reference(loss_fn, placed, batch, M))


@pytest.mark.parametrize("layer_axis", [False, True], ids=["whole_leaves", "stacked"])
def test_cutter_counts_the_shards_of_parameters(layer_axis):
    """The cutter's predicted parameter, gradient and optimizer bytes are what one device
    holds: each leaf divided by the devices of one pipe position its sharding spans."""
    mesh = _mesh(*TP["mesh"])
    if layer_axis:  # a scanned stack: the cutter sees per-layer views of the stacked leaves
        ks = jax.random.split(jax.random.key(3), 3)
        params = {"w1": jax.random.normal(ks[0], (4, D, H)) / 5,
                  "w2": jax.random.normal(ks[1], (4, H, D)) / 7}
        specs = {"w1": P(None, None, "model"), "w2": P(None, "model", None)}
        batch = {"x": jax.random.normal(ks[2], (16, D)), "y": jnp.zeros((16, D))}

        def loss_fn(p, b):
            def layer(h, w):
                return jp.boundary(h + jnp.tanh(h @ w["w1"]) @ w["w2"]), None
            return jnp.mean((jax.lax.scan(layer, b["x"], p)[0] - b["y"]) ** 2)
    else:
        loss_fn, params, specs, batch = _model(TP["wspec"], TP["bspec"], 16)

    def predicted(p):
        """The cutter's parameter bytes per stage, and the plan's (the stage's params as
        the runtime stores them: its device's shards)."""
        pipe = jp.pipeline(loss_fn, p, batch, mesh=mesh, schedule=jp.OneFOneB(2, M),
                           cut="markers")
        rows = pipe.plan.stage_rows
        return ([m.params for m in pipe.inspect.cut_report.stage_memory],
                [r["param_bytes"] for r in rows])

    full, full_stored = predicted(params)
    sharded, stored = predicted(_place(params, specs, mesh))
    assert full == full_stored and sharded == stored
    for f, s in zip(full, sharded, strict=True):
        assert s < 0.7 * f  # most bytes are the weights tensor parallelism halves


@pytest.mark.parametrize("backend", ["cpu", "gpu"])
def test_an_nnx_model_on_explicit_axes_trains_exactly(backend):
    """Sharding in types: an nnx model written as flax's examples write one (partitioning
    metadata on its kernels, out_sharding= where a contraction needs one), built under
    jax.set_mesh on a default jax.make_mesh (every axis Explicit), pipelined with no
    sharding argument: exact, the parameters, gradients and optimizer state keep their
    sharded types, each device holds its shard."""
    from flax import nnx

    from jaxpipe.jaxpr.avals import aval_bytes, shard_bytes
    from jaxpipe.runtime.spmd import SpmdRuntime

    mesh = jax.make_mesh(*TP["mesh"])
    assert set(mesh.axis_types) == {AxisType.Explicit}

    def kernel(*names):
        return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)

    @jp.layer
    class Block(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(D, H, kernel_init=kernel(None, "model"),
                                 bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(),
                                                                 ("model",)), rngs=rngs)
            self.down = nnx.Linear(H, D, kernel_init=kernel("model", None), rngs=rngs)

        def __call__(self, x):
            return x + self.down(jnp.tanh(self.up(x)), out_sharding=P())

    Model = _nnx_stack(Block)

    def loss_fn(model, b):
        return jnp.mean((model(b["x"]) - b["y"]) ** 2)

    ks = jax.random.split(jax.random.key(2))
    batch = {"x": jax.random.normal(ks[0], (16, D)), "y": jax.random.normal(ks[1], (16, D))}
    with jax.set_mesh(mesh):
        model = Model(nnx.Rngs(0))
        pipe = jp.flax.pipeline(model, loss_fn, batch, mesh=mesh, schedule=jp.OneFOneB(2, M),
                                cut="markers", runtime=SpmdRuntime(backend=backend))
        assert pipe.batch_axes == ("data",)
        up = pipe.inspect.param_specs["blocks"][0]["up"]
        assert spec_dims(up["kernel"], 2) == ((), ("model",))
        # the cutter counts what a device stores: residuals typed @model are half size
        report = pipe.inspect.cut_report
        for st in pipe.inspect.stages:
            assert any(shard_bytes(a) < aval_bytes(a) for a in st.residual_avals)
            assert report.stage_memory[st.index].residuals == report.in_flight[st.index] * sum(
                shard_bytes(a) for a in st.residual_avals)
        loss, grads = pipe.value_and_grad(model, batch)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def mean_loss(s):
            mbs = jax.tree.map(lambda x: x.reshape(M, -1, *x.shape[1:]), batch)
            return jnp.mean(jax.vmap(lambda mb: loss_fn(nnx.merge(graphdef, s, rest), mb))(mbs))

        ref_loss, ref_grads = jax.jit(jax.value_and_grad(mean_loss))(params)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
        for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(nnx.to_pure_dict(ref_grads)),
                        strict=True):
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-6)
        kgrad = grads["blocks"][1]["down"]["kernel"]
        assert _axes(jax.typeof(kgrad).sharding.spec) == {"model"}
        state = pipe.init(model, optax.adamw(1e-2))
        state, metrics = pipe.train_step(state, batch)
        np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=1e-5)
    kernels = [v for v in jax.tree.leaves((state.params, state.opt_state))
               if v.shape == (2, D, H)]  # the up kernels and their two moments, staged
    assert len(kernels) == 3
    for v in kernels:  # each device: its pipe position's, its model shard's
        assert v.addressable_shards[0].data.size * 4 == v.size


@pytest.mark.parametrize("types", [(AxisType.Auto, AxisType.Auto, AxisType.Explicit),
                                   (AxisType.Explicit, AxisType.Explicit, AxisType.Auto)],
                         ids=["model_explicit", "model_auto"])
def test_mixed_meshes(types):
    """Explicit and Auto axes in one mesh (flax refuses to place on one; plain JAX does
    not): tensor parallel over 'model' of either type, data parallel over 'data'."""
    mesh = jax.make_mesh(*TP["mesh"], axis_types=types)
    _, params, specs, batch = _model(TP["wspec"], TP["bspec"], 16)
    specs["proj"] = None  # the blocks are tensor parallel; the tied projection whole

    def loss_fn(p, b):  # _model's loss; the row-parallel contraction says its sharding
        h = jp.boundary(b["x"] @ p["proj"])
        for blk in p["blocks"]:
            u = jnp.tanh(h @ blk["w1"] + blk["b1"])
            h = jp.boundary(h + jnp.einsum("bh,hd->bd", u, blk["w2"], out_sharding=P())
                            + blk["b2"])
        return jnp.mean((h @ p["proj"].T - b["y"]) ** 2)

    with jax.set_mesh(mesh):
        placed = _place(params, specs, mesh)
        pipe = jp.pipeline(loss_fn, placed, batch, mesh=mesh, schedule=jp.OneFOneB(2, M),
                           cut="markers")
        assert pipe.batch_axes == ("data",)
        assert_matches(pipe.value_and_grad(placed, batch), reference(loss_fn, placed, batch, M))


def test_the_gpt_example_on_pipe_fsdp_tp_is_exact():
    """examples/gpt.py's GPT as flax's examples write one (out_sharding metadata on its
    kernels and tables, out_sharding= on its contractions and nnx.Embed lookups), built
    under jax.set_mesh on a default jax.make_mesh (pipe 2 x fsdp 2 x tp 2, every axis
    Explicit), its batch placed over 'fsdp', pipelined with no sharding argument: loss,
    aux and gradients equal nnx.value_and_grad's; each device holds ~1/8 of the weights."""
    from flax import nnx

    from benchmarks.common import load_example

    gpt = load_example("gpt")
    mesh = jax.make_mesh((2, 2, 2), ("pipe", "fsdp", "tp"))
    cfg = gpt.Config(seq=16, layers=4, width=128, heads=4)  # the example's default width
    ids = np.random.default_rng(0).integers(0, gpt.VOCAB, 2048).astype(np.int32)
    host = gpt.sample_batch(ids, np.random.default_rng(1), 8, cfg.seq)

    def full(model, b):  # the weighted reduction over the whole batch
        (loss_sum, count), aux = gpt.loss_fn(model, b)
        return loss_sum / count, aux

    with jax.set_mesh(mesh):
        model = gpt.GPT(cfg, rngs=nnx.Rngs(0), sharding=gpt.Sharding.for_mesh(mesh.axis_names))
        batch = gpt.place_batch(host, mesh)
        pipe = jp.flax.pipeline(model, gpt.loss_fn, batch, mesh=mesh,
                                schedule=jp.OneFOneB(2, M), has_aux=True, reduction="weighted")
        assert pipe.batch_axes == ("fsdp",) and pipe.inspect.mesh_axes.param_axes == ("fsdp", "tp")
        (loss, aux), grads = pipe.value_and_grad(model, batch)
        (ref_loss, ref_aux), ref_grads = nnx.jit(nnx.value_and_grad(full, has_aux=True))(
            model, host)
        staged = pipe.shard(model)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for key in ("correct", "tokens"):
        np.testing.assert_allclose(jnp.sum(aux[key]), ref_aux[key], rtol=1e-6)
    flat = jax.tree.leaves(nnx.to_pure_dict(ref_grads))
    assert len(flat) == len(jax.tree.leaves(grads))
    for g, r in zip(jax.tree.leaves(grads), flat, strict=True):
        np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6)
    kernel = grads["blocks"][0]["fc"]["kernel"]
    assert _axes(jax.typeof(kernel).sharding.spec) == {"fsdp", "tp"}
    total = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert gpt.param_bytes_per_device(staged) < 1.1 * total / 8  # tables, norms: the excess


def test_interleaved_with_weights_split_on_their_rows_on_explicit_axes():
    """Two stages a device hold their weights in a group (:mod:`param_groups`); gathered
    back to the user's leaves on Explicit axes, the untiled all-gather typed the group
    one dimension early and the call raised (P("model", None) weights, pipe 2 x model
    4). Exact, and the gradients keep the weights' sharding."""
    mesh = jax.make_mesh((2, 4), ("pipe", "model"))
    host, batch, loss_fn = _tanh_mlp(0, 16)
    params = [jax.device_put(w, NamedSharding(mesh, P("model", None))) for w in host]

    pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh,
                       schedule=jp.Interleaved1F1B(2, 4, stages_per_device=2))
    loss, grads = pipe.value_and_grad(params, batch)
    assert_matches((loss, grads), jax.value_and_grad(loss_fn)(host, batch))
    for g in grads:
        assert _axes(jax.typeof(g).sharding.spec) == {"model"}


@pytest.mark.parametrize("how", ["out_sharding", "constraint"])
def test_a_model_sharding_over_the_batch_axis_on_explicit_axes(how):
    """On Explicit axes a model that splits its rows over 'data' itself (out_sharding=,
    or a constraint, which there asserts the type), the batch placed over 'data': traced
    on one shard's rows, as a manual batch axis is split, it failed inside JAX (one row
    cannot be split over 'data'; the batch's type had no 'data'). 'data' is then left to
    JAX's sharding (an automatic batch axis, the rows typed split over it): exact."""
    mesh = jax.make_mesh((2, 2, 2), ("pipe", "data", "model"))
    ks = jax.random.split(jax.random.key(0), 6)
    params = [jax.random.normal(k, (16, 16)) / 4 for k in ks[:4]]
    batch = jax.device_put({"x": jax.random.normal(ks[4], (16, 16)),
                            "y": jax.random.normal(ks[5], (16, 16))},
                           NamedSharding(mesh, P("data")))

    def layer(h, w):
        if how == "out_sharding":
            return jnp.dot(h, w, out_sharding=P("data", None))
        return jax.lax.with_sharding_constraint(h @ w, P("data", None))

    def loss_fn(params, b):
        h = b["x"]
        for w in params:
            h = jp.boundary(jnp.tanh(layer(h, w)))
        return jnp.mean((h - b["y"]) ** 2)

    with jax.set_mesh(mesh):
        pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=jp.OneFOneB(2, 8))
        assert pipe.inspect.mesh_axes.auto_batch_axes == ("data",)
        assert_matches(pipe.value_and_grad(params, batch),
                       jax.value_and_grad(loss_fn)(params, batch))


def test_fsdp_with_the_batch_over_its_axis_on_explicit_axes():
    """docs/multihost.md: Explicit and Auto axes both work. On Auto axes this is the fsdp
    case above; on Explicit ones (jax.make_mesh's default) the values a stage computes
    from the microbatch carry the data axis in their types, so the trace gives the
    microbatch that type (it raised ShardingTypeError at a residual write). The loss
    draws random numbers: the hidden key leaf is split over the same axis."""
    import optax

    mesh = jax.make_mesh((2, 4), ("data", "pipe"))
    ks = jax.random.split(jax.random.key(0), 6)
    host = [jax.random.normal(k, (16, 16)) / 4 for k in ks[:4]]
    params = [jax.device_put(w, NamedSharding(mesh, P("data"))) for w in host]
    hb = {"x": jax.random.normal(ks[4], (32, 16)), "y": jax.random.normal(ks[5], (32, 16))}
    batch = jax.device_put(hb, NamedSharding(mesh, P("data")))

    def loss_fn(params, b, key):
        h = jnp.where(jax.random.bernoulli(key, 0.8, b["x"].shape), b["x"], 0.0)
        for w in params:
            h = jp.boundary(jnp.tanh(h @ w))
        return jnp.mean((h - b["y"]) ** 2)

    pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=jp.OneFOneB(4, 4),
                       rng=True)
    assert pipe.batch_axes == ("data",)
    assert pipe.inspect.mesh_axes.auto_batch_axes == ("data",)
    key, n = jax.random.key(7), pipe.inspect.batch_shards

    def mean_loss(p):  # microbatch i draws with fold_in(key, i * batch_shards)
        mbs = jax.tree.map(lambda x: x.reshape(4, -1, *x.shape[1:]), hb)
        keys = jnp.stack([jax.random.fold_in(key, i * n) for i in range(4)])
        return jnp.mean(jax.vmap(lambda mb, k: loss_fn(p, mb, k))(mbs, keys))

    loss, grads = pipe.value_and_grad(params, batch, key)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(mean_loss))(host)
    assert_matches((loss, grads), (ref_loss, ref_grads))
    for g in grads:  # the gradients keep the parameters' sharding
        assert _axes(jax.typeof(g).sharding.spec) == {"data"}
    # one optimizer step: the program's update equals optax's on the reference gradients
    opt = optax.sgd(0.1)
    state, metrics = pipe.train_step(pipe.init(params, opt), batch, key)
    np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=1e-6)
    want = optax.apply_updates(host, opt.update(ref_grads, opt.init(host), host)[0])
    for w, r in zip(pipe.params(state), want, strict=True):
        np.testing.assert_allclose(w, r, rtol=1e-5, atol=1e-6)


def test_a_lookup_in_a_table_split_over_auto_axes_compiles_and_is_exact():
    """MaxText's layout on Auto axes (a jax.sharding.Mesh): the embedding table split over
    ('tensor', 'fsdp'), the batch over 'fsdp'. The gather's operand is made whole in the
    program's context, not in the context the model was traced in (which names no mesh,
    so nothing was constrained and XLA's partitioner aborted the process). In a
    subprocess, which that abort would end; the pipeline against jax.value_and_grad."""
    script = Path(__file__).resolve().parent / "support" / "auto_axes_lookup.py"
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["batch_axes"] == ["fsdp"]
    np.testing.assert_allclose(out["loss"], out["want_loss"], rtol=1e-6)
    assert out["grad_err"] < 1e-5, out


def test_a_budget_only_the_program_without_lanes_fits_builds_it():
    """Where the lanes program is wanted (an automatic batch axis) its first device holds
    one more residual set than the schedule's own; a budget between the two minima was
    refused although the program without lanes fits it. It is built, and the plan says
    why; a budget neither fits is still refused with the smaller minimum."""
    from jaxpipe.runtime.spmd import SpmdRuntime

    loss_fn, params, specs, batch = _model(FSDP["wspec"], None, FSDP["batch"])
    mesh = _mesh(*FSDP["mesh"])
    batch = jax.device_put(batch, NamedSharding(mesh, P("fsdp")))

    def build(budget, **kw):  # (no recomputation: the residual sets decide the peak)
        return jp.pipeline(loss_fn, params, batch, mesh=mesh, param_specs=specs,
                           cut=jp.Cut(memory_budget=budget, remat="none"),
                           **{"schedule": jp.OneFOneB(2, M), **kw})

    def smallest(**kw):  # the smallest budget the error names
        with pytest.raises(jp.CutError) as err:
            build(1, **kw)
        return int(re.search(r"budget is [^(]*\((\d+) bytes\)", str(err.value)).group(1))

    without = smallest(runtime=SpmdRuntime(lanes=False))
    assert smallest() == without  # (it named the lanes program's minimum, larger)
    pipe = build(without)
    assert "program: cpu" in str(pipe.plan) and "lanes not used: " in str(pipe.plan)
    assert pipe.inspect.cut_report.peak_memory <= without
    assert_matches(pipe.value_and_grad(params, batch), reference(loss_fn, params, batch, M))
    # schedule="auto" cuts its candidates the same way (it refused every one of them)
    auto = build(without, schedule=jp.Auto(microbatches=M, families=("1f1b",)))
    (row,) = auto.inspect.auto_choice.candidates
    assert row.verdict == "chosen" and "lanes=False" in row.note, row
    assert row.memory == auto.inspect.cut_report.peak_memory <= without
    assert "the budget does not fit the runtime's own program" in str(auto.plan)


def test_auto_prices_its_candidates_for_the_program_that_runs():
    """The lanes program is wanted on a tensor-parallel mesh, and turned down once the
    stages are built (the first and last stages differ): the plan's table described the
    program with lanes; every candidate is priced again for the one that runs."""
    mesh = jax.make_mesh((2, 4), ("tp", "pipe"))
    ks = jax.random.split(jax.random.key(0), 12)
    sh = NamedSharding(mesh, P(None, "tp"))
    params = [jax.device_put(jax.random.normal(k, (16, 16)) / 4, sh) for k in ks[:10]]
    batch = {"x": jax.random.normal(ks[6], (16, 16)), "y": jax.random.normal(ks[7], (16, 16))}

    def loss_fn(params, b):
        h = b["x"] @ params[0]
        for w in params[1:-1]:
            h = jp.boundary(h + jnp.tanh(h @ w))
        return jnp.mean((h @ params[-1] - b["y"]) ** 2)

    pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh,
                       schedule=jp.Auto(microbatches=4, families=("1f1b", "gpipe")))
    assert pipe.inspect.runtime.lanes is False and "lanes not used: " in str(pipe.plan)
    (row,) = [c for c in pipe.inspect.auto_choice.candidates if c.verdict == "chosen"]
    assert row.memory == pipe.inspect.cut_report.peak_memory
    assert row.time == min(c.time for c in pipe.inspect.auto_choice.candidates)
    assert_matches(pipe.value_and_grad(params, batch), reference(loss_fn, params, batch, 4))


def test_a_microbatch_count_the_data_axis_does_not_divide_on_explicit_axes():
    """Six rows over data=2 as three microbatches of two rows, one a data shard: the
    microbatches are split over the data axis within each, as with any m. Reshaping the
    [6@data] batch to [3, 2] put the split on the leading dimension, which JAX refuses
    where the axis does not divide it (ShardingTypeError at the first call)."""
    mesh = jax.make_mesh((2, 4), ("data", "pipe"))
    params, batch, loss_fn = _tanh_mlp(3, 6)

    pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=jp.OneFOneB(4, 3))
    assert pipe.batch_axes == ("data",)
    assert_matches(pipe.value_and_grad(params, batch), reference(loss_fn, params, batch, 3))
