"""Issue 15 part 3: scanned layer stacks are cut between their iterations.

A loss that runs ``lax.scan`` (or flax ``nnx.scan`` / linen ``nn.scan``) over stacked layer
parameters with a marker in the body is pipelined without changing the model: each stage
scans its own rows of the stacked weights, gradients come back in the stacked layout, and
loss and gradients equal ``jax.value_and_grad`` of the unpipelined loss.

Pipelines are shared through module fixtures and the models are tiny: every compile
counts on the 2-core CI machine.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from models import assert_matches, reference

import jaxpipe as jp
from jaxpipe.jaxpr.markers import boundary_p
from jaxpipe.sharding.param_views import ParamView

WIDTH, IN, BATCH, M = 8, 6, 16, 4


def scan_model(n_layers: int = 5, *, remat: bool = False, outside_use: bool = False,
               seed: int = 3):
    """Embedding tied to the head (first and last stage), ``n_layers`` scanned blocks with a
    marker in the body, and a skip connection from the embedding around the stack."""
    ks = jax.random.split(jax.random.key(seed), 5)
    params = {
        "embed": jax.random.normal(ks[0], (IN, WIDTH)) / jnp.sqrt(IN),
        "layers": {"w": jax.random.normal(ks[1], (n_layers, WIDTH, WIDTH)) / jnp.sqrt(WIDTH),
                   "b": 0.1 * jax.random.normal(ks[2], (n_layers, WIDTH))},
    }
    batch = {"x": jax.random.normal(ks[3], (BATCH, IN)),
             "y": jax.random.normal(ks[4], (BATCH, IN))}

    def body(h, layer):
        return jp.boundary(h + jnp.tanh(h @ layer["w"] + layer["b"]), name="block"), None

    if remat:
        body = jax.checkpoint(body)

    def loss_fn(p, b):
        h0 = jp.boundary(jnp.tanh(b["x"] @ p["embed"]), name="embed")
        h, _ = lax.scan(body, h0, p["layers"])
        h = h + 0.5 * h0  # skip connection around the stack
        loss = jnp.mean((h @ p["embed"].T - b["y"]) ** 2)  # tied head
        if outside_use:  # the stacked weight is read outside the scan as well
            loss = loss + 0.01 * jnp.sum(p["layers"]["w"][0] ** 2)
        return loss

    return loss_fn, params, batch


def _mesh(p: int):
    return jax.make_mesh((p,), ("pipe",))


def _scans(jaxpr) -> list:
    """Every scan equation, at any depth."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    out = []
    for e in jaxpr.eqns:
        if e.primitive.name == "scan":
            out.append(e)
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            out += _scans(sub)
    return out


def _layer_scans(jaxpr) -> list[int]:
    """Lengths of the scans whose body holds a marker (the stage's piece of the stack)."""
    def marked(j):
        j = getattr(j, "jaxpr", j)
        return any(e.primitive is boundary_p or any(marked(s) for s in
                   jax.extend.core.jaxprs_in_params(e.params)) for e in j.eqns)

    return [e.params["length"] for e in _scans(jaxpr) if marked(e.params["jaxpr"])]


@pytest.fixture(scope="module")
def model():
    return scan_model()


@pytest.fixture(scope="module")
def expected(model):
    loss_fn, params, batch = model
    return reference(loss_fn, params, batch, M)


@pytest.fixture(scope="module")
def uneven(model):
    """p=2, embedding + 1 layer on stage 0, 4 layers + head on stage 1."""
    loss_fn, params, batch = model
    return jp.pipeline(loss_fn, params, batch, mesh=_mesh(2), schedule=jp.OneFOneB(2, M),
                       cut=jp.Cut(indices=[1]))


# ------------------------------------------------------------------- structure


def test_each_stage_scans_its_own_layers(uneven, model):
    pipe = uneven
    assert len(pipe.inspect.stacks) == 1 and pipe.inspect.stacks[0].length == 5
    # the cutter saw one segment per layer: embed + 5 iterations = 6 markers
    assert len(pipe.inspect.cut_traced.markers) == 6
    assert [st.names for st in pipe.inspect.stages] == [("embed", "block[0]"), ("block[1:5]",)]
    assert [_layer_scans(st.fwd) for st in pipe.inspect.stages] == [[1], [4]]
    # every stage holds only its rows of the stacked weights, the tied embedding on both
    _, params, _ = model
    staged = pipe.shard(params)
    shapes = [[tuple(x.shape) for x in leaves] for leaves in pipe.inspect.stage_params(staged)]
    assert shapes == [[(IN, WIDTH), (1, WIDTH), (1, WIDTH, WIDTH)],
                      [(IN, WIDTH), (4, WIDTH), (4, WIDTH, WIDTH)]]
    assert pipe.inspect.param_owners == {0: (0, 1), 1: (0, 1), 2: (0, 1)}
    # unshard gives the user's stacked layout back
    back = pipe.unshard(staged)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_uneven_stages_match_value_and_grad(uneven, model, expected):
    loss_fn, params, batch = model
    result = uneven.value_and_grad(params, batch)
    assert jax.tree.structure(result[1]) == jax.tree.structure(params)
    assert_matches(result, expected)
    assert_matches(uneven.inspect.reference_value_and_grad(params, batch), expected)


def test_train_step_matches_plain_optax(uneven, model):
    loss_fn, params, batch = model
    tx = optax.adamw(1e-2, weight_decay=1e-2)
    state = uneven.init(params, tx)
    ref_params, ref_opt = params, tx.init(params)
    for _ in range(2):
        state, metrics = uneven.train_step(state, batch)
        ref_loss, grads = reference(loss_fn, ref_params, batch, M)
        updates, ref_opt = tx.update(grads, ref_opt, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
        np.testing.assert_allclose(metrics["loss"], ref_loss, rtol=1e-5)
    got = uneven.params(state)
    assert jax.tree.structure(got) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tx", [optax.lamb(1e-2), optax.adafactor(1e-2)],
                         ids=["lamb", "adafactor"])
def test_optimizer_coupling_the_layers_is_refused(uneven, model, tx):
    _, params, _ = model
    with pytest.raises(jp.PipelineError, match=r"couples the layers of the scanned stack "
                                               r"params\['layers'\].*per element.*unroll"):
        uneven.init(params, tx)


def test_state_checkpoint_resumes(uneven, model, tmp_path):
    from jaxpipe import checkpoint as jpc

    _, params, batch = model
    tx = optax.adam(1e-2)
    state, _ = uneven.train_step(uneven.init(params, tx), batch)
    jpc.save(tmp_path / "state", state, pipe=uneven)
    jpc.save_params(tmp_path / "params", uneven, state)
    want = uneven.params(state)
    restored = jpc.restore(tmp_path / "state", uneven, optimizer=tx)
    for a, b in zip(jax.tree.leaves(uneven.params(restored)), jax.tree.leaves(want),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    plain = jpc.restore_params(tmp_path / "params", pipe=uneven)  # the stacked layout
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------- every schedule


def _gallery(spec: str):
    from pathlib import Path

    return jp.load_schedule(str(Path(__file__).resolve().parents[1] / "schedules" / spec))


SCHEDULES = {
    "gpipe": lambda: jp.GPipe(2, M),
    "1f1b": lambda: jp.OneFOneB(2, M),
    "interleaved2": lambda: jp.Interleaved1F1B(2, M, stages_per_device=2),
    "zero_bubble": lambda: _gallery("zero_bubble.py:ZeroBubbleH1")(2, M),
    "dualpipe_v": lambda: _gallery("dualpipe_v.py:DualPipeV")(2, M),
    "eager_1f1b": lambda: _gallery("eager_1f1b.py:Eager1F1B")(2, M),
    "looped_bfs": lambda: _gallery("looped_bfs.py:LoopedBFS")(2, M),
    "v_half": lambda: _gallery("v_half.py:VHalf")(2, M),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_schedule_matches_value_and_grad(name, model, expected):
    loss_fn, params, batch = model
    schedule = SCHEDULES[name]()
    pipe = jp.pipeline(loss_fn, params, batch, mesh=_mesh(2), schedule=schedule,
                       cut="markers")
    assert sum(sum(_layer_scans(st.fwd)) for st in pipe.inspect.stages) == 5
    assert_matches(pipe.value_and_grad(params, batch), expected)


def test_four_devices_auto_cut(model, expected):
    loss_fn, params, batch = model
    pipe = jp.pipeline(loss_fn, params, batch, mesh=_mesh(4), schedule=jp.OneFOneB(4, M))
    lengths = [_layer_scans(st.fwd) for st in pipe.inspect.stages]
    assert sum(sum(x) for x in lengths) == 5 and all(len(x) <= 1 for x in lengths)
    assert_matches(pipe.value_and_grad(params, batch), expected)


@pytest.fixture(scope="module")
def four():
    """6 scanned layers after an embedding, on 4 stages cut at the markers."""
    loss_fn, params, batch = scan_model(6)
    pipe = jp.pipeline(loss_fn, params, batch, mesh=_mesh(4), schedule=jp.OneFOneB(4, M),
                       cut="markers")
    return pipe, loss_fn, params, batch


def test_middle_stages_of_a_stack_share_one_body(four):
    """The two middle stages scan 2 layers each and compute the same function (their cut
    markers' names differ, ``scan[2]`` vs ``scan[4]``), so they run through one compiled
    body with their own rows of the stacked weights; the result stays exact."""
    pipe, loss_fn, params, batch = four
    assert [_layer_scans(st.fwd) for st in pipe.inspect.stages] == [[1], [2], [2], [1]]
    assert pipe.inspect.executor.body_of_stage[1] == pipe.inspect.executor.body_of_stage[2]
    assert len(pipe.inspect.executor.bodies) == 3
    assert_matches(pipe.value_and_grad(params, batch), reference(loss_fn, params, batch, M))


def test_slots_fill_and_empty_without_a_branch_per_device(four):
    """The public value_and_grad moves the user's leaves into slots and the gradients back
    inside its program. A stacked leaf enters whole and its rows reach each device's slot
    by one dynamic slice, and gradients leave by one all_gather per slot; only the whole
    leaves (embedding, head) go through a switch over devices.
    A switch for everything, each branch also zero-filling every other device's
    gradients, grew with leaves x devices (1.4 s of XLA compile at 8 devices, 64 scanned
    layers; benchmarks/README.md)."""
    pipe, _, params, batch = four
    public = pipe.inspect.value_and_grad_fn.lower(params, batch).as_text()
    staged = pipe.inspect.staged_value_and_grad_fn.lower(pipe.shard(params), batch).as_text()
    assert public.count("stablehlo.case") == staged.count("stablehlo.case") + 1
    assert public.count("stablehlo.all_gather") == len(pipe.inspect.executor.layouts.slots)
    back = pipe.unshard(pipe.shard(params))
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(a, b)
    # Devices holding the same whole leaves in the same slots share a branch: the tied
    # embedding is in one slot on the first and the last device, the two middle devices
    # hold none. Two branches for four devices.
    assert _cond_branches(jax.make_jaxpr(pipe.shard)(params).jaxpr) == [2]
    # The moves take the user's whole leaves: one shard_map input per leaf on the way in
    # and one output per leaf on the way out, not one per stage's rows of a stacked leaf.
    n_leaves = len(jax.tree.leaves(params))
    assert len(pipe.inspect.views.views) > n_leaves
    (into,) = _eqns(jax.make_jaxpr(pipe.shard)(params).jaxpr, "shard_map")
    (back_out,) = _eqns(jax.make_jaxpr(pipe.unshard)(pipe.shard(params)).jaxpr, "shard_map")
    leaf_shapes = sorted(tuple(x.shape) for x in jax.tree.leaves(params))
    assert sorted(tuple(v.aval.shape) for v in into.invars  # (int32 tables besides)
                  if v.aval.dtype != np.int32) == leaf_shapes
    assert sorted(tuple(v.aval.shape) for v in back_out.outvars) == leaf_shapes


def _eqns(jaxpr, name: str) -> list:
    """The equations of primitive ``name`` in ``jaxpr``, at any depth."""
    out = []
    for e in jaxpr.eqns:
        if e.primitive.name == name:
            out.append(e)
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            out += _eqns(sub, name)
    return out


def _cond_branches(jaxpr) -> list[int]:
    """The number of branches of every conditional in ``jaxpr``, at any depth."""
    out = []
    for e in jaxpr.eqns:
        if e.primitive.name == "cond":
            out.append(len(e.params["branches"]))
        for v in e.params.values():
            for j in v if isinstance(v, tuple) else (v,):
                if isinstance(j, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
                    out += _cond_branches(getattr(j, "jaxpr", j))
    return out


@pytest.mark.parametrize("split", [False, True])
def test_stacked_residuals_go_straight_between_scans_and_storage(model, expected, split):
    """Every residual a stage's layer scan stacks is written into its storage row by the
    forward scan itself and read back by the backward scan (B, or I and W), and the
    backward scan adds each layer's weight gradient into its slot row, so no stacked
    block is built and copied in or out whole; exact either way."""
    from jaxpipe.runtime.spmd import SpmdRuntime
    from jaxpipe.runtime.spmd.program import scan_buffers as scanio

    loss_fn, params, batch = model
    pipe = jp.pipeline(loss_fn, params, batch, mesh=_mesh(2), schedule=jp.OneFOneB(2, M),
                       cut=jp.Cut(indices=[1]), runtime=SpmdRuntime(split_backward=split))
    for st in pipe.inspect.stages:
        n_out, n_pb = len(st.out_avals), len(st.param_ids) + len(st.batch_ids)
        res = range(len(st.residual_avals))
        layers = sum(_layer_scans(st.fwd))
        stacked = {i for i in res if st.residual_avals[i].shape[:1] == (layers,)
                   and st.residual_avals[i].ndim == 3}
        assert stacked, st.residual_avals
        written = {i - n_out for i in scanio.direct_outputs(st.fwd, [n_out + i for i in res])}
        assert stacked <= written
        for bwd in (st.bwd, st.bwd_i):  # (stage 0's I computes no input gradient)
            used = {id(v) for e in bwd.jaxpr.eqns for v in e.invars}
            needed = {i for i in stacked if id(bwd.jaxpr.invars[n_pb + i]) in used}
            read = {i - n_pb for i in scanio.direct_inputs(bwd, [n_pb + i for i in res])}
            assert needed <= read
            if bwd is st.bwd:  # B reads every stacked residual
                assert needed == stacked
        # and the backward scan adds each layer's weight gradient into its slot row
        n_diff = sum(st.diff_param_mask)
        grads = scanio.direct_outputs(st.bwd, range(n_diff))
        param_avals = st.fwd.in_avals[:len(st.param_ids)]  # this stage's rows of a stack
        diff = [a for a, d in zip(param_avals, st.diff_param_mask, strict=True) if d]
        stacked_params = {q for q, a in enumerate(diff) if a.shape[:1] == (layers,)}
        assert stacked_params and stacked_params <= grads
    assert_matches(pipe.value_and_grad(params, batch), expected)


# ------------------------------------------------------------------- model variants


def test_remat_inside_the_body():
    loss_fn, params, batch = scan_model(remat=True)
    pipe = jp.pipeline(loss_fn, params, batch, mesh=_mesh(2), schedule=jp.OneFOneB(2, M),
                       cut="markers")
    plain = jp.pipeline(*scan_model()[:2], batch, mesh=_mesh(2), schedule=jp.OneFOneB(2, M),
                        cut="markers", runtime="reference")
    for st, st_plain in zip(pipe.inspect.stages, plain.inspect.stages, strict=True):
        # the user's jax.checkpoint still applies: a layer stores only its input
        layers = sum(_layer_scans(st.fwd))
        assert [tuple(a.shape) for a in st.residual_avals].count((layers, BATCH // M, WIDTH)) \
            == 1
        assert len(st.residual_avals) < len(st_plain.residual_avals)
    assert_matches(pipe.value_and_grad(params, batch), reference(loss_fn, params, batch, M))


def test_stacked_weight_also_read_outside_the_scan_is_passed_whole():
    loss_fn, params, batch = scan_model(outside_use=True)
    pipe = jp.pipeline(loss_fn, params, batch, mesh=_mesh(2), schedule=jp.GPipe(2, M),
                       cut="markers")
    w_leaf = 2  # params["layers"]["w"] (leaves: embed, layers.b, layers.w)
    assert [v for v in pipe.inspect.views.views if v.leaf == w_leaf] == [ParamView(w_leaf)]
    assert_matches(pipe.value_and_grad(params, batch), reference(loss_fn, params, batch, M))


def test_scan_over_a_computed_stack():
    """The scanned array is built inside the loss (not a parameter): sliced per stage."""
    ks = jax.random.split(jax.random.key(0), 5)
    params = {"w": [jax.random.normal(k, (WIDTH, WIDTH)) / jnp.sqrt(WIDTH) for k in ks[:3]]}
    batch = {"x": jax.random.normal(ks[3], (BATCH, WIDTH)),
             "y": jax.random.normal(ks[4], (BATCH, WIDTH))}

    def loss_fn(p, b):
        h, _ = lax.scan(lambda h, w: (jp.boundary(jnp.tanh(h @ w)), None), b["x"],
                        jnp.stack(p["w"]))
        return jnp.mean((h - b["y"]) ** 2)

    pipe = jp.pipeline(loss_fn, params, batch, mesh=_mesh(2), schedule=jp.OneFOneB(2, M),
                       cut="markers", runtime="reference")
    assert_matches(pipe.value_and_grad(params, batch), reference(loss_fn, params, batch, M))


def test_reversed_scan_is_refused(model):
    _, params, batch = model

    def loss_fn(p, b):
        h = b["x"] @ p["embed"]
        h, _ = lax.scan(lambda h, w: (jp.boundary(jnp.tanh(h @ w)), None), h,
                        p["layers"]["w"], reverse=True)
        return jnp.mean(h ** 2)

    with pytest.raises(jp.PipelineError, match=r"reversed lax.scan.*scan over the reversed"):
        jp.pipeline(loss_fn, params, batch, mesh=_mesh(2), schedule=jp.OneFOneB(2, M))


# ------------------------------------------------------------------- flax


def _tokens(n=BATCH, seq=5, vocab=11, seed=0):
    rng = np.random.default_rng(seed)
    t = rng.integers(0, vocab, size=(n, seq + 1)).astype(np.int32)
    return {"x": t[:, :-1], "y": t[:, 1:]}


def test_nnx_scan():
    from flax import nnx

    @jp.layer
    class Block(nnx.Module):
        def __init__(self, d, *, rngs):
            self.linear = nnx.Linear(d, d, rngs=rngs)

        def __call__(self, x):
            return x + jnp.tanh(self.linear(x))

    class LM(nnx.Module):
        def __init__(self, vocab=11, d=WIDTH, depth=3, *, rngs):
            self.embed = nnx.Param(jax.random.normal(rngs.params(), (vocab, d)) * 0.5)

            @nnx.split_rngs(splits=depth)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def create(rngs):
                return Block(d, rngs=rngs)

            self.blocks = create(rngs)

        def __call__(self, tokens):
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def forward(h, block):
                return block(h)

            return forward(self.embed[...][tokens], self.blocks) @ self.embed[...].T

    def loss_fn(model, mb):
        return optax.softmax_cross_entropy_with_integer_labels(model(mb["x"]), mb["y"]).mean()

    model, batch = LM(rngs=nnx.Rngs(0)), _tokens()
    pipe = jp.flax.pipeline(model, loss_fn, batch, mesh=_mesh(2), schedule=jp.OneFOneB(2, M),
                            cut="markers")
    assert [_layer_scans(st.fwd) for st in pipe.inspect.stages] == [[2], [1]]
    # the stage boundary carries the activation only (nnx.scan's weights-as-outputs are not
    # sent down the pipeline)
    assert [tuple(a.shape) for a in pipe.inspect.stages[1].in_avals] == [(BATCH // M, 5, WIDTH)]
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    # a mean loss over equal microbatches is the full batch's (nnx.scan does not vmap here)
    loss, grads = jax.value_and_grad(
        lambda s: loss_fn(nnx.merge(graphdef, s, rest), batch))(params)
    assert_matches(pipe.value_and_grad(model, batch), (loss, nnx.to_pure_dict(grads)))


def test_linen_scan():
    from flax import linen as nn

    @jp.layer
    class Block(nn.Module):
        features: int

        @nn.compact
        def __call__(self, x, _):
            return x + jnp.tanh(nn.Dense(self.features)(x)), None

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = x0 = nn.Dense(WIDTH)(x)
            x, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                           length=5)(WIDTH)(x, None)
            return nn.Dense(IN)(x + x0)

    def loss_fn(module, variables, mb):
        return jnp.mean((module.apply(variables, mb["x"]) - mb["y"]) ** 2)

    _, _, batch = scan_model()
    module = Net()
    variables = module.init(jax.random.key(0), batch["x"])
    pipe = jp.flax.pipeline_linen(module, variables, loss_fn, batch, mesh=_mesh(2),
                                  schedule=jp.GPipe(2, M), cut="markers")
    assert sorted(sum((_layer_scans(st.fwd) for st in pipe.inspect.stages), [])) == [2, 3]
    ref = reference(lambda prm, mb: loss_fn(module, {"params": prm}, mb), variables["params"],
                    batch, M)
    assert_matches(pipe.value_and_grad(variables["params"], batch), ref)


@pytest.fixture(scope="module")
def interleaved():
    """Embedding, 24 scanned layers and a head, 6 layers per stage, two stages per device
    (v=2): every stage is the embedding or head around one shared core."""
    ks = jax.random.split(jax.random.key(5), 4)
    params = {"embed": jax.random.normal(ks[0], (IN, WIDTH)),
              "layers": {"b": 0.1 * jax.random.normal(ks[1], (24, WIDTH)),
                         "w": jax.random.normal(ks[2], (24, WIDTH, WIDTH)) / WIDTH},
              "head": jax.random.normal(ks[3], (WIDTH, IN))}
    batch = {"x": jax.random.normal(ks[0], (BATCH, IN)),
             "y": jax.random.normal(ks[1], (BATCH, IN))}

    def loss_fn(p, b):
        def body(h, layer):
            return jp.boundary(jnp.tanh(h @ layer["w"] + layer["b"]), name="block"), None

        h, _ = lax.scan(body, jp.boundary(b["x"] @ p["embed"], name="embed"), p["layers"])
        return jnp.mean((h @ p["head"] - b["y"]) ** 2)

    pipe = jp.pipeline(loss_fn, params, batch, mesh=_mesh(2),
                       schedule=jp.Interleaved1F1B(2, M, stages_per_device=2),
                       cut=jp.Cut(indices=[6, 12, 18]))
    return pipe, loss_fn, params, batch


def test_core_parameters_take_the_same_slots_on_every_device(interleaved):
    """A stage split into parts takes slots for its core's parameters first. Here the
    embedding [6, 8] has the class of a 6-layer stage's stacked bias: taking slots in
    stage order, it shifted the first device's core slots, so the body shared by the
    four cores (two per device, v=2) picked the bias among three slots, not two, and the
    bias entered its slots through the per-device switch rather than one slice."""
    pipe, loss_fn, params, batch = interleaved
    assert [_layer_scans(st.fwd) for st in pipe.inspect.stages] == [[6]] * 4
    (core,) = pipe.inspect.executor.bodies
    assert core.stages == (0, 1, 2, 3)
    assert all(len(core.candidates(j)) == 2 for j in range(len(core.param_classes)))
    assert_matches(pipe.value_and_grad(params, batch), reference(loss_fn, params, batch, M))


def test_two_stages_of_one_body_pick_no_whole_slot(interleaved):
    """The core's two stages on a device keep their parameters in slots of their own. The
    layer scans pick the running stage's layer inside the loop, and its gradients go into
    a stacked group row by row (runtime/spmd/program/param_groups.py): no select over
    whole slots, which picking each parameter and adding each gradient into every
    candidate with a mask had cost (a kernel per leaf and branch). The staged program
    agrees with the public one, and both are exact."""
    pipe, loss_fn, params, batch = interleaved
    staged = pipe.shard(params)
    jaxpr = jax.make_jaxpr(pipe.inspect.staged_value_and_grad_fn)(staged, batch).jaxpr
    slot_shapes = {tuple(c.shape) for c in pipe.inspect.executor.layouts.slots.classes}
    picks = [e for e in _eqns(jaxpr, "select_n")
             if tuple(e.outvars[0].aval.shape) in slot_shapes]
    assert not picks
    loss, grads = pipe.staged_value_and_grad(staged, batch)
    assert_matches((loss, pipe.unshard(grads)), reference(loss_fn, params, batch, M))


def test_a_step_compares_nothing_on_the_device(interleaved):
    """Every gate of a step (which branch runs, the running stage's prologue or epilogue,
    an outbox write, an exchange) is a 0/1 trip count read from the table, and a row
    picked by the running stage is read without an index wrap: the tick scan holds no
    comparison outside its gated loops' counters. (XLA:CPU compiled each comparison
    against a different constant as a kernel of its own.)"""
    pipe, _, params, batch = interleaved
    jaxpr = jax.make_jaxpr(pipe.inspect.value_and_grad_fn)(params, batch).jaxpr
    steps = pipe.inspect.executor.lowering.table.num_steps
    (tick,) = [e for e in _eqns(jaxpr, "scan") if e.params["length"] == steps]
    compare = {"eq", "ne", "gt", "ge", "lt", "le"}

    def comparisons(j) -> list[str]:
        found = [e.primitive.name for e in j.eqns if e.primitive.name in compare]
        for e in j.eqns:
            inner = {k: v for k, v in e.params.items() if k != "cond_jaxpr"}
            for sub in jax.extend.core.jaxprs_in_params(inner):
                found += comparisons(sub)
        return found

    assert pipe.inspect.executor.bodies[0].members[0].parts is not None  # gated ends run here
    assert comparisons(tick.params["jaxpr"].jaxpr) == []


def test_public_moves_go_by_group(interleaved):
    """The public value_and_grad moves parameters in and gradients out by group, not slot
    by slot: the stacked weights, cut evenly and interleaved over the devices, enter as
    themselves (every device reads the running stage's rows of the whole leaf: no device
    slices its chunks out first), and each gradient group is gathered once and is the
    leaf's gradient transposed. No concatenation (of the gathered slots on the way out)
    and no slicing a group into slots."""
    pipe, loss_fn, params, batch = interleaved
    slots, groups = pipe.inspect.executor.layouts.slots, pipe.inspect.executor.groups
    assert len(groups.groups) == 2  # the stacked weight and bias, two rows each
    assert len(groups.whole) == 2  # both held whole
    public = pipe.inspect.value_and_grad_fn.lower(params, batch).as_text()
    grouped = sum(len(g) for g in groups.groups)
    assert public.count("stablehlo.all_gather") == len(slots) - grouped + len(groups.groups)
    assert public.count("stablehlo.concatenate") == 0
    # a stage's chunk is 6 layers: nothing slices [.., 6, 8(, 8)] out of the stack
    chunks = [line for line in public.splitlines() if "stablehlo.dynamic_slice" in line
              and re.search(r"-> tensor<(?:\d+x)*6x8x", line)]
    assert not chunks, chunks
    assert_matches(pipe.value_and_grad(params, batch), reference(loss_fn, params, batch, M))
