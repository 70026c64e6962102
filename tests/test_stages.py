"""Issue 3: markers, tracing, stage splitting and the reference executor."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxpr_as_fun
from models import MODELS, assert_matches, reference, reference_per_microbatch
from split_schedule import DeferredW1F1B

import jaxpipe as jp
from jaxpipe.jaxpr.trace import trace
from jaxpipe.stages import split


def _with_and_without_markers(x, w):
    def f(w, x, mark):
        b = jp.boundary if mark else (lambda v: v)
        h = b(jnp.tanh(x @ w))
        h = b({"a": h * 2.0, "n": 3})["a"]
        return jnp.sum(h**2)

    return (lambda w, x: f(w, x, True)), (lambda w, x: f(w, x, False))


def test_boundary_is_identity_under_transforms():
    w = jax.random.normal(jax.random.key(0), (4, 4))
    x = jax.random.normal(jax.random.key(1), (3, 4))
    f, g = _with_and_without_markers(x, w)
    for tf in (jax.jit, jax.grad, lambda h: jax.jit(jax.grad(h))):
        np.testing.assert_array_equal(tf(f)(w, x), tf(g)(w, x))
    vf = jax.vmap(f, in_axes=(None, 0))(w, x[:, None])
    vg = jax.vmap(g, in_axes=(None, 0))(w, x[:, None])
    np.testing.assert_array_equal(vf, vg)
    # and it really is in the jaxpr, so the tracer can find it
    assert "jaxpipe_boundary" in str(jax.make_jaxpr(f)(w, x))


def test_a_marker_over_one_value_twice_and_a_constant():
    """jp.boundary((h, h, 0.5)): the same array twice crossed as two names of one value
    (KeyError building a stage) and a constant as a jaxpr Literal (TypeError: unhashable);
    the value crosses once, the constant not at all, and the pipeline is exact."""
    def loss_fn(params, b):
        h = b["x"]
        for w in params:
            a, c, scale, one = jp.boundary((jnp.tanh(h @ w), jnp.tanh(h @ w) * 0 + 1, 0.5,
                                            jnp.ones(())))
            a2, a3 = jp.boundary((a, a))
            h = (a2 + a3) * scale * c * one
        return jnp.mean((h - b["y"]) ** 2)

    ks = jax.random.split(jax.random.key(0), 6)
    params = [jax.random.normal(k, (8, 8)) / 3 for k in ks[:4]]
    batch = {"x": jax.random.normal(ks[4], (8, 8)), "y": jax.random.normal(ks[5], (8, 8))}
    pipe = jp.pipeline(loss_fn, params, batch, mesh=jax.make_mesh((2,), ("pipe",)),
                       schedule=jp.GPipe(2, 2), cut="markers")
    assert_matches(pipe.value_and_grad(params, batch),
                   reference(loss_fn, params, batch, 2))


def test_layer_decorator_marks_each_call():
    @jp.layer
    def block(w, h):
        return jnp.tanh(h @ w)

    w = jnp.eye(3)
    assert block.__name__ == "block"
    jaxpr = jax.make_jaxpr(lambda h: block(w, block(w, h)))(jnp.ones((2, 3)))
    assert str(jaxpr).count("jaxpipe_boundary") == 2
    np.testing.assert_array_equal(block(w, jnp.ones((2, 3))), jnp.tanh(jnp.ones((2, 3))))


def test_markers_inside_jit_are_inlined_and_scan_kept():
    loss_fn, params, batch = MODELS["mlp"](3)
    jitted = jax.jit(loss_fn)
    t = trace(lambda p, b: jitted(p, b), params, batch)
    assert len(t.markers) == 3

    def scanned(p, b):
        ws = jnp.stack([layer["w"] for layer in p])
        return jax.lax.scan(lambda h, w: (jp.boundary(h @ w), None), b["x"], ws)[0].sum()

    # a scan over layers stays one equation (a stack, cut by jaxpipe.stages.stacks)
    t = trace(scanned, params, batch)
    assert [e.primitive.name for e in t.jaxpr.eqns].count("scan") == 1
    assert t.markers == ()


@pytest.mark.parametrize("model", sorted(MODELS))
def test_stages_do_not_duplicate_compute(model):
    loss_fn, params, batch = MODELS[model](4)
    t = trace(loss_fn, params, jax.tree.map(lambda x: x[:4], batch))
    stages = split(t, [0, 1, 2])
    ranges = [st.eqn_range for st in stages]
    assert ranges[0][0] == 0 and ranges[-1][1] == len(t.jaxpr.eqns)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))

    def count(jaxpr, prim):
        return sum(e.primitive.name == prim for e in jaxpr.eqns)

    for prim in ("dot_general", "tanh", "exp"):
        orig = count(t.jaxpr, prim)
        assert sum(count(st.fwd.jaxpr, prim) for st in stages) == orig, prim


def test_identical_blocks_are_traced_once(monkeypatch):
    """Stages computing the same function (the blocks of a deep model) share one trace;
    the roles of their inputs (a batch leaf vs a carry), constants and custom rules keep
    otherwise equal fragments apart."""
    import jaxpipe.stages.fragments as stages_mod

    built = []
    real = stages_mod._build_stage
    monkeypatch.setattr(stages_mod, "_build_stage",
                        lambda s, *a: built.append(s) or real(s, *a))
    loss_fn, params, batch = MODELS["mlp"](8)
    t = trace(loss_fn, params, jax.tree.map(lambda x: x[:4], batch))
    stages = split(t, list(range(7)))
    # stage 0 reads x (a batch leaf), 1..6 a carry, the last one also y and the loss
    assert built == [0, 1, 7]
    assert [st.index for st in stages] == list(range(8))
    assert [st.param_ids for st in stages] == [(2 * i, 2 * i + 1) for i in range(8)]

    w = jnp.ones((4, 4))

    @jax.custom_vjp
    def double(x):
        return 2 * x

    double.defvjp(lambda x: (2 * x, None), lambda _, g: (2 * g,))

    @jax.custom_vjp
    def double_other_rule(x):
        return 2 * x

    double_other_rule.defvjp(lambda x: (2 * x, None), lambda _, g: (3 * g,))

    def loss(p, b):
        h = jp.boundary(jnp.tanh(b["x"] @ p[0]))
        h = jp.boundary(jnp.tanh(h @ p[1]) * np.arange(4, dtype=np.float32))
        h = jp.boundary(jnp.tanh(h @ p[2]) * np.arange(1, 5, dtype=np.float32))  # other values
        h = jp.boundary(double(h @ p[3]))
        h = jp.boundary(double_other_rule(h @ p[4]))            # another backward rule
        return jnp.mean(h ** 2)

    built.clear()
    p5, b = [w] * 5, {"x": jnp.ones((4, 4))}
    t = trace(loss, p5, b)
    stages = split(t, [0, 1, 2, 3])
    assert built == [0, 1, 2, 3, 4]
    got = _run_stages(stages, p5, b)
    want = jax.value_and_grad(loss)(p5, b)
    assert_matches(got, want)


def _act(scale):
    """tanh with a custom derivative scaled by ``scale`` (a rule printing cannot show)."""
    @jax.custom_jvp
    def f(x):
        return jnp.tanh(x)

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return f(x), scale * (1 - jnp.tanh(x) ** 2) * t

    return f


@pytest.mark.parametrize("case", ["custom_jvp_rule", "array_literal"])
def test_fragments_differing_only_where_printing_is_blind_are_not_merged(case):
    """Two middle stages print alike but compute different things: a custom_jvp rule
    closed over another scale, or (with simplified jaxpr constants) an array literal of
    other values, printed as ``[...]``. Each must be traced on its own; gradients exact."""
    w = [jnp.full((4, 4), 0.1 * (i + 1)) for i in range(4)]
    b = {"x": jnp.ones((4, 4))}
    acts = [_act(1.0), _act(5.0)]
    scales = [np.full(4, 1.0, np.float32), np.full(4, 3.0, np.float32)]

    def loss(p, b):
        h = jp.boundary(jnp.tanh(b["x"] @ p[0]))
        for i in range(2):
            h = h @ p[i + 1]
            h = jp.boundary(acts[i](h) if case == "custom_jvp_rule" else jnp.tanh(h) * scales[i])
        return jnp.mean(jnp.tanh(h @ p[3]) ** 2)

    before = jax.config.jax_use_simplified_jaxpr_constants
    jax.config.update("jax_use_simplified_jaxpr_constants", case == "array_literal")
    try:
        t = trace(loss, w, b)
        stages = split(t, [0, 1, 2])
        assert stages[1].fwd is not stages[2].fwd
        assert_matches(_run_stages(stages, w, b), jax.value_and_grad(loss)(w, b))
    finally:
        jax.config.update("jax_use_simplified_jaxpr_constants", before)


def test_equation_context_enters_the_key():
    """The same random draw under another PRNG partitioning (an equation context, which
    the printed jaxpr does not show) computes other bits: other key."""
    from jaxpipe.jaxpr.identity import fragment_key

    def key_of(fn):
        cj = jax.make_jaxpr(fn)(jax.random.key_data(jax.random.key(0)))
        j = cj.jaxpr
        consts = dict(zip(j.constvars, cj.consts, strict=True))
        return fragment_key(j, j.eqns, j.invars, j.outvars, consts)

    def draw(kd):
        return jax.random.bits(jax.random.wrap_key_data(kd), (8,))

    def other(kd):
        with jax.threefry_partitionable(not jax.config.jax_threefry_partitionable):
            return draw(kd)

    assert key_of(draw) == key_of(draw)
    assert key_of(draw) != key_of(other)


def test_scan_bodies_enter_the_key_printed_once():
    """A scan's body enters the key as its own printed text, printed once per body object
    (``texts``): bodies computing other things give other keys, also one level down."""
    from jaxpipe.jaxpr.identity import fragment_key

    def scanned(inner):
        def fn(x):
            def body(c, _):
                return jax.lax.scan(lambda d, _: (inner(d), None), c, None, length=2)[0], None
            return jax.lax.scan(body, x, None, length=3)[0]
        return fn

    def key_of(fn, texts=None):
        cj = jax.make_jaxpr(fn)(jnp.ones(4))
        j = cj.jaxpr
        return fragment_key(j, j.eqns, j.invars, j.outvars,
                            dict(zip(j.constvars, cj.consts, strict=True)), texts)

    assert key_of(scanned(jnp.sin)) == key_of(scanned(jnp.sin))  # traced twice: equal
    assert key_of(scanned(jnp.sin)) != key_of(scanned(jnp.cos))  # the inner body differs
    cj = jax.make_jaxpr(scanned(jnp.sin))(jnp.ones(4))
    j, texts = cj.jaxpr, {}
    (body,) = [e.params["jaxpr"].jaxpr for e in j.eqns if e.primitive.name == "scan"]
    first = fragment_key(j, j.eqns, j.invars, j.outvars, {}, texts)
    assert list(texts) == [id(body)]  # the body, printed (inner scan and all) once
    assert fragment_key(j, j.eqns, j.invars, j.outvars, {}, texts) == first
    assert str(body) in first[1]


def _run_stages(stages, params, batch):
    """Loss and parameter gradients of ``stages`` run one after the other: every forward,
    then every backward in reverse (what a pipeline does for one microbatch)."""
    flat_p, flat_b = jax.tree.leaves(params), jax.tree.leaves(batch)
    carry, saved = [], []
    for st in stages:
        ps, bs = [flat_p[i] for i in st.param_ids], [flat_b[i] for i in st.batch_ids]
        outs = jaxpr_as_fun(st.fwd)(*ps, *bs, *carry)
        carry, res = outs[:len(st.out_avals)], outs[len(st.out_avals):]
        saved.append((ps, bs, res))
    loss, grads, ct = carry[0], [jnp.zeros_like(x) for x in flat_p], [jnp.ones(())]
    for st, (ps, bs, res) in zip(stages[::-1], saved[::-1], strict=True):
        outs = jaxpr_as_fun(st.bwd)(*ps, *bs, *res, *ct)
        n = sum(st.diff_param_mask)
        for i, g in zip(st.param_ids, outs[:n], strict=True):
            grads[i] = grads[i] + g
        ct = outs[n:]
    return loss, jax.tree.unflatten(jax.tree.structure(params), grads)


def test_skip_connection_is_carried_through_middle_stage():
    loss_fn, params, batch = MODELS["skip_mlp"](4)
    t = trace(loss_fn, params, jax.tree.map(lambda x: x[:4], batch))
    s0, s1, s2, s3 = split(t, [0, 1, 2])
    # stage 1 receives the first layer's output and must pass it on to stages 2 and 3
    assert len(s1.in_avals) == 1 and len(s1.out_avals) == 2 and len(s2.out_avals) == 2


def test_tied_embedding_is_read_by_first_and_last_stage():
    loss_fn, params, batch = MODELS["tiny_lm"](3)
    t = trace(loss_fn, params, jax.tree.map(lambda x: x[:4], batch))
    stages = split(t, [0, 1])
    embed_id = 0  # "blocks" < "embed" < "pos" in key order: find it by shape instead
    shapes = [v.aval.shape for v in t.jaxpr.invars[: t.num_params]]
    embed_id = shapes.index(params["embed"].shape)
    assert embed_id in stages[0].param_ids and embed_id in stages[-1].param_ids
    assert stages[0].batch_ids and stages[-1].batch_ids  # tokens first, targets last


def _run_chain(stages, params, batch):
    """Loss and parameter gradients of stages run one after the other, the backward once
    whole (``bwd``) and once split (``bwd_i`` then ``bwd_w``)."""
    carry, stored = [], []
    for st in stages:
        outs = jaxpr_as_fun(st.fwd)(*[params[i] for i in st.param_ids],
                                    *[batch[i] for i in st.batch_ids], *carry)
        carry, res = outs[:len(st.out_avals)], outs[len(st.out_avals):]
        stored.append(res)
    grads = ({}, {})
    cts = ([jnp.ones((), carry[0].dtype)],) * 2
    for st, res in zip(reversed(stages), reversed(stored), strict=True):
        ins = [params[i] for i in st.param_ids] + [batch[i] for i in st.batch_ids]
        whole = jaxpr_as_fun(st.bwd)(*ins, *res, *cts[0])
        n = sum(st.diff_param_mask)
        outs_i = jaxpr_as_fun(st.bwd_i)(*ins, *res, *cts[1])
        k = len(st.ct_in_avals())
        halves = jaxpr_as_fun(st.bwd_w)(*ins, *[res[i] for i in st.w_res_ids], *outs_i[k:])
        diff = [p for p, d in zip(st.param_ids, st.diff_param_mask, strict=True) if d]
        for g, cs in zip(grads, (whole[:n], halves), strict=True):
            for pid, c in zip(diff, cs, strict=True):
                g[pid] = g.get(pid, 0) + c
        cts = (whole[n:], outs_i[:k])
    return carry[0], grads


@pytest.mark.parametrize("cuts", [[1], [0, 1, 2]])
def test_first_and_last_stages_share_the_middle_core(cuts):
    """The embedding before the first stage's block and the head after the last stage's
    become a prologue and an epilogue; the block between is the middle stages' function,
    traced once, and the stages compute what they did whole."""
    loss_fn, params, batch = MODELS["tiny_lm"](4)
    t = trace(loss_fn, params, jax.tree.map(lambda x: x[:4], batch))
    whole = split(t, cuts)
    shared = split(t, cuts, share_cores=True)
    first, last = shared[0].parts, shared[-1].parts
    assert (first.core, len(first.parts), last.core, len(last.parts)) == (1, 2, 0, 2)
    assert all(st.parts is None for st in shared[1:-1])
    core = shared[1] if len(cuts) > 1 else last.core_fn
    assert first.core_fn.fwd is core.fwd and last.core_fn.fwd is core.fwd
    embed = [v.aval.shape for v in t.jaxpr.invars[:t.num_params]].index(params["embed"].shape)
    assert embed in first.parts[0].param_ids and embed not in first.core_fn.param_ids
    assert embed in last.parts[1].param_ids and embed not in last.core_fn.param_ids
    # the core's residuals come first in the stage's (a shared body reads them alike)
    n = len(first.core_fn.residual_avals)
    assert first.res_ids[1] == tuple(range(n))
    assert [len(st.residual_avals) for st in shared] == [len(st.residual_avals) for st in whole]
    p_in = [v.aval for v in t.jaxpr.invars[:t.num_params]]
    p_vals = [jax.random.normal(jax.random.key(i), a.shape, a.dtype) for i, a in enumerate(p_in)]
    b_vals = jax.tree.leaves(jax.tree.map(lambda x: x[:4], batch))
    loss0, (g0, _) = _run_chain(whole, p_vals, b_vals)
    loss1, (g1, g1_split) = _run_chain(shared, p_vals, b_vals)
    np.testing.assert_allclose(loss1, loss0, rtol=1e-6)
    assert sorted(g1) == sorted(g0) == sorted(g1_split)
    for pid in g0:
        np.testing.assert_allclose(g1[pid], g0[pid], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(g1_split[pid], g0[pid], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw", [{"split_backward": True}, {"remat": ["dots"] * 4}],
                         ids=["split_backward", "remat"])
def test_a_stage_stays_whole_where_its_parts_would_store_more(kw):
    """The first stage's input-gradient half has nothing to compute whole (no input),
    but its core's hands block values to the weight half; under a recomputation policy
    the embedding output between the parts becomes a residual. Either way the parted
    stage would store more per microbatch than the whole one: it stays whole."""
    loss_fn, params, batch = MODELS["tiny_lm"](4)
    t = trace(loss_fn, params, jax.tree.map(lambda x: x[:4], batch))
    parted = split(t, [0, 1, 2], share_cores=True)
    assert parted[0].parts is not None
    assert split(t, [0, 1, 2], share_cores=True, **kw)[0].parts is None


def test_a_value_both_parts_would_store_keeps_the_stage_whole():
    """A prologue ending in tanh stores its output (tanh's derivative reads it) and the
    block after it stores the same value as its input (the matmul's weight gradient reads
    it): as parts the stage would store it twice, so it stays whole; the last stage's
    parts store nothing twice and split."""
    ws = [jnp.eye(4) * (1 + i) for i in range(4)]

    def loss_fn(p, b):
        h = jnp.tanh(b["x"] @ p[0])
        for w in p[1:]:
            h = jp.boundary(jnp.tanh(h @ w))
        return jnp.mean(h ** 2)

    t = trace(loss_fn, ws, {"x": jnp.ones((2, 4))})
    stages = split(t, [0, 1], share_cores=True)
    assert [st.parts is not None for st in stages] == [False, False, True]
    whole = split(t, [0, 1])
    assert [len(st.residual_avals) for st in stages] == [len(st.residual_avals) for st in whole]


def test_cores_that_differ_are_not_shared():
    """A last stage whose block differs from the middle ones stays whole."""
    loss_fn, params, batch = MODELS["mlp"](4)
    t = trace(loss_fn, params, jax.tree.map(lambda x: x[:4], batch))
    stages = split(t, [0, 1, 2], share_cores=True)
    assert [st.parts is not None for st in stages] == [False, False, False, True]


SCHEDULES = {
    "gpipe": lambda p, m: jp.GPipe(p, m),
    "1f1b": lambda p, m: jp.OneFOneB(p, m),
    "interleaved": lambda p, m: jp.Interleaved1F1B(p, m, stages_per_device=2),
    "split_iw": lambda p, m: DeferredW1F1B(p, m),
}


# m < p included; interleaved 1F1B needs m % p == 0 (its own tests check the error).
CASES = [(s, model, p, m) for s in sorted(SCHEDULES) for model in sorted(MODELS)
         for p, m in [(1, 3), (2, 1), (4, 8)]
         if not (s == "interleaved" and m % p)]


@pytest.mark.parametrize("sched,model,p,m", CASES)
def test_reference_executor_matches_value_and_grad(sched, model, p, m):
    schedule = SCHEDULES[sched](p, m)
    loss_fn, params, batch = MODELS[model](max(schedule.num_stages, 3), batch=2 * m)
    mesh = jax.make_mesh((p,), ("pipe",))
    pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=schedule, cut="markers",
                       runtime="reference")
    assert_matches(pipe.value_and_grad(params, batch), reference(loss_fn, params, batch, m))


def test_pipeline_input_errors():
    loss_fn, params, batch = MODELS["mlp"](2, batch=6)
    mesh = jax.make_mesh((2,), ("pipe",))
    with pytest.raises(jp.PipelineError, match="not divisible by num_microbatches=4"):
        jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=jp.GPipe(2, 4), cut="markers")
    with pytest.raises(jp.PipelineError, match="needs 8 stages"):
        jp.pipeline(loss_fn, params, batch, mesh=mesh,
                    schedule=jp.Interleaved1F1B(2, 2, stages_per_device=4), cut="markers")


def _four_layers(seed: int, width: int, m: int):
    """Four (width, width) weights and a batch of m microbatches of 4 rows."""
    ks = jax.random.split(jax.random.key(seed), 6)
    params = [jax.random.normal(k, (width, width)) / 4 for k in ks[:4]]
    batch = {"x": jax.random.normal(ks[4], (m * 4, width)),
             "y": jax.random.normal(ks[5], (m * 4, width))}
    return params, batch


@pytest.mark.parametrize("cast", ["tree_map", "each"])
def test_weights_cast_at_the_top_of_the_loss_stay_with_their_stages(cast):
    """jmp's policy.cast_to_compute(params) at the top of the loss: cut as traced, the
    first stage owned every float32 weight and each bf16 copy travelled to its stage as
    an activation, once a microbatch. Each stage now reads its own layers' weights, only
    activations cross, and the gradients equal jax.value_and_grad's per microbatch."""
    width, m = 16, 4
    params, batch = _four_layers(8, width, m)

    def loss_fn(params, b):
        if cast == "tree_map":
            params = jax.tree.map(lambda w: w.astype(jnp.bfloat16), params)
        else:
            params = [jnp.asarray(w, jnp.bfloat16) * 1 for w in params]
        h = b["x"].astype(jnp.bfloat16)
        for w in params:
            h = jp.boundary(jnp.tanh(h @ w))
        return jnp.mean((h.astype(jnp.float32) - b["y"]) ** 2)

    pipe = jp.pipeline(loss_fn, params, batch, mesh=jax.make_mesh((4,), ("pipe",)),
                       schedule=jp.OneFOneB(4, m), cut="markers")
    assert [st.param_ids for st in pipe.inspect.stages] == [(0,), (1,), (2,), (3,)]
    for st in pipe.inspect.stages:
        assert all(a.shape == (4, width) for a in (*st.in_avals, *st.residual_avals)), st
    assert_matches(pipe.value_and_grad(params, batch),
                   reference_per_microbatch(loss_fn, params, batch, m))


@pytest.mark.parametrize("prep", ["cast", "scaled_cast", "clipped", "whole_stack_norm",
                                  "read_outside_too", "jit_closing_over_a_stack"])
def test_a_stacked_weight_cast_before_its_scan_is_cast_layer_by_layer(prep):
    """``ws.astype(bf16)`` before ``lax.scan`` over the layers: the scan read the whole
    cast stack, so the first stage owned every float32 layer and the bf16 stack travelled
    to the other stages once a microbatch. Cast in the scan's body instead (elementwise
    chains, jnp's jit-wrapped ones too), each stage owns its own layers' rows and only
    activations cross. A norm over the whole stack mixes layers, and a prepared stack
    read outside the scan too (an L2 penalty of it) would leave every stage owning the
    whole stack: both stay as traced (the first stage owns it and sends it), and exact."""
    L, width, m = 8, 16, 4
    ks = jax.random.split(jax.random.key(11), 4)
    params = {"w": jax.random.normal(ks[0], (L, width, width)) / 4,
              "b": jax.random.normal(ks[1], (L, width)) / 4}
    batch = {"x": jax.random.normal(ks[2], (m * 4, width)),
             "y": jax.random.normal(ks[3], (m * 4, width))}
    mask = np.tril(np.ones((L, width, width), np.float32))

    def loss_fn(params, b):
        ws = {"cast": lambda w: w.astype(jnp.bfloat16),
              "scaled_cast": lambda w: (w * 0.5).astype(jnp.bfloat16),
              "clipped": lambda w: jnp.clip(w, -0.3, 0.3),
              "whole_stack_norm": lambda w: w / jnp.sqrt(jnp.sum(w * w)),
              "read_outside_too": lambda w: w * 0.5,
              # a constant of the jit's own jaxpr, not sliced by the scan (it crashed)
              "jit_closing_over_a_stack": jax.jit(lambda w: w * mask),
              }[prep](params["w"])

        def block(h, wb):
            w, bias = wb
            return jp.boundary(jnp.tanh(h @ w + bias).astype(h.dtype)), None

        h, _ = jax.lax.scan(block, b["x"].astype(ws.dtype), (ws, params["b"]))
        penalty = 1e-3 * jnp.sum(ws.astype(jnp.float32) ** 2) if "outside" in prep else 0.0
        return jnp.mean((h.astype(jnp.float32) - b["y"]) ** 2) + penalty

    pipe = jp.pipeline(loss_fn, params, batch, mesh=jax.make_mesh((4,), ("pipe",)),
                       schedule=jp.OneFOneB(4, m), cut="markers")
    stages = pipe.inspect.stages
    if prep in ("whole_stack_norm", "read_outside_too", "jit_closing_over_a_stack"):
        # the first stage owns the stack (and its rows of b); the others their rows of b,
        # and receive the prepared stack
        assert [len(st.param_ids) for st in stages] == [2, 1, 1, 1]
        assert all(any(a.shape == (L, width, width) for a in st.in_avals)
                   for st in stages[1:])
    else:  # inputs and residuals are activations, every stage owns its rows of both
        assert all(a.shape[-2:] == (4, width) for st in stages
                   for a in (*st.in_avals, *st.residual_avals)), stages
        assert all(len(st.param_ids) == 2 for st in stages)
    exact = prep not in ("cast", "scaled_cast")  # float32 throughout
    assert_matches(pipe.value_and_grad(params, batch),
                   (reference if exact else reference_per_microbatch)(loss_fn, params, batch, m))


def test_a_penalty_of_every_weight_computed_at_the_top_stays_where_it_is():
    """An L2 penalty of all weights computed before the first layer is a small value of
    many parameters: computed again where it is read (the last stage), that stage would
    own every weight; it is carried as a scalar, as traced."""
    width, m = 16, 4
    params, batch = _four_layers(9, width, m)

    def loss_fn(params, b):
        l2 = sum(jnp.sum(w ** 2) for w in params)
        h = b["x"]
        for w in params:
            h = jp.boundary(jnp.tanh(h @ w))
        return jnp.mean((h - b["y"]) ** 2) + 1e-3 * l2

    pipe = jp.pipeline(loss_fn, params, batch, mesh=jax.make_mesh((4,), ("pipe",)),
                       schedule=jp.OneFOneB(4, m), cut="markers")
    assert [st.param_ids for st in pipe.inspect.stages] == [(0, 1, 2, 3), (1,), (2,), (3,)]
    assert_matches(pipe.value_and_grad(params, batch), reference(loss_fn, params, batch, m))
