"""Flax integration: ``@jp.layer`` on nnx / linen classes, and pipelined nnx / linen models.

A decorated module must be indistinguishable from the undecorated one outside a
pipeline (outputs, parameter trees, names, serialization); a pipelined model must give
the loss and gradients of ``jax.value_and_grad`` of the unpipelined model.
"""

from __future__ import annotations

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpipe as jp
from jaxpipe.jaxpr.markers import boundary_p

RTOL = 1e-5
ATOL = 1e-6


def _boundaries(jaxpr) -> list[str | None]:
    return [e.params.get("name") for e in jaxpr.jaxpr.eqns if e.primitive is boundary_p]


def _assert_trees_close(a, b, rtol=RTOL, atol=ATOL):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def _mesh(p: int) -> jax.sharding.Mesh:
    return jax.sharding.Mesh(np.array(jax.devices()[:p]), ("pipe",))


# ----------------------------------------------------------------------------- models


class NnxBlock(nnx.Module):
    def __init__(self, d: int, *, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.linear = nnx.Linear(d, d, rngs=rngs)

    def __call__(self, x):
        return x + jnp.tanh(self.linear(self.norm(x)))


LayerNnxBlock = jp.layer(NnxBlock)


class NnxLM(nnx.Module):
    """Tiny LM: tied embedding (first and last stage), decorated blocks."""

    def __init__(self, block_cls, vocab=11, d=8, depth=4, *, rngs: nnx.Rngs):
        self.embed = nnx.Param(jax.random.normal(rngs.params(), (vocab, d)) * 0.5)
        self.blocks = nnx.List([block_cls(d, rngs=rngs) for _ in range(depth)])

    def __call__(self, tokens):
        h = self.embed[...][tokens]
        for b in self.blocks:
            h = b(h)
        return h @ self.embed[...].T


def nnx_loss(model, mb):
    logits = model(mb["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, mb["y"]).mean()


class LinenBlock(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x):
        return x + jnp.tanh(nn.Dense(self.features)(x))


class LinenSetupBlock(nn.Module):
    features: int

    def setup(self):
        self.dense = nn.Dense(self.features)

    def __call__(self, x):
        return x + jnp.tanh(self.dense(x))


LayerLinenBlock = jp.layer(LinenBlock)
LayerLinenSetupBlock = jp.layer(LinenSetupBlock)


class LinenNet(nn.Module):
    block: type
    depth: int = 4
    width: int = 8

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.width)(x)
        for _ in range(self.depth):
            x = self.block(self.width)(x)
        return nn.Dense(3)(x)


def linen_loss(module, variables, mb):
    return jnp.mean((module.apply(variables, mb["x"]) - mb["y"]) ** 2)


def _tokens(n=16, seq=5, vocab=11, seed=0):
    rng = np.random.default_rng(seed)
    t = rng.integers(0, vocab, size=(n, seq + 1)).astype(np.int32)
    return {"x": t[:, :-1], "y": t[:, 1:]}


def _regression(n=16, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, 6)).astype(np.float32),
            "y": rng.normal(size=(n, 3)).astype(np.float32)}


# ------------------------------------------------------------- decorating, no pipeline


def test_nnx_decorated_identical_outputs_and_params():
    x = jnp.asarray(np.random.default_rng(1).normal(size=(3, 8)), jnp.float32)
    plain, marked = NnxBlock(8, rngs=nnx.Rngs(0)), LayerNnxBlock(8, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(plain(x), marked(x))
    sp, sm = nnx.state(plain), nnx.state(marked)
    assert jax.tree.structure(sp) == jax.tree.structure(sm)
    assert nnx.to_pure_dict(sp).keys() == nnx.to_pure_dict(sm).keys()
    for a, b in zip(jax.tree.leaves(sp), jax.tree.leaves(sm), strict=True):
        np.testing.assert_array_equal(a, b)
    # Same under jit / grad, and nnx split/merge round-trips the decorated class.
    np.testing.assert_array_equal(nnx.jit(lambda m, x: m(x))(plain, x),
                                  nnx.jit(lambda m, x: m(x))(marked, x))
    np.testing.assert_array_equal(jax.grad(lambda x: plain(x).sum())(x),
                                  jax.grad(lambda x: marked(x).sum())(x))
    g, s = nnx.split(marked)
    assert type(nnx.merge(g, s)) is LayerNnxBlock
    # The whole model: same parameter tree with or without decorated blocks.
    lm_a, lm_b = NnxLM(NnxBlock, rngs=nnx.Rngs(3)), NnxLM(LayerNnxBlock, rngs=nnx.Rngs(3))
    tok = _tokens()["x"]
    np.testing.assert_array_equal(lm_a(tok), lm_b(tok))
    _assert_trees_close(nnx.to_pure_dict(nnx.state(lm_a, nnx.Param)),
                        nnx.to_pure_dict(nnx.state(lm_b, nnx.Param)), rtol=0, atol=0)


def test_nnx_decorator_marks_each_call_and_keeps_class_identity():
    assert LayerNnxBlock.__name__ == "NnxBlock"
    assert LayerNnxBlock.__qualname__ == NnxBlock.__qualname__
    assert issubclass(LayerNnxBlock, NnxBlock)
    assert NnxBlock.__call__ is not LayerNnxBlock.__call__  # original class untouched
    lm = NnxLM(LayerNnxBlock, depth=3, rngs=nnx.Rngs(0))
    jaxpr = jax.make_jaxpr(lambda t: lm(t))(_tokens()["x"])
    assert _boundaries(jaxpr) == ["NnxBlock"] * 3
    # Undecorated: no markers at all.
    assert _boundaries(jax.make_jaxpr(lambda t: NnxLM(NnxBlock, rngs=nnx.Rngs(0))(t))(
        _tokens()["x"])) == []


def test_decorator_syntax_name_and_no_double_wrapping():
    @jp.layer(name="mlp")
    class Lin(nnx.Module):
        def __init__(self, *, rngs):
            self.w = nnx.Linear(2, 2, rngs=rngs)

        def __call__(self, x):
            return self.w(x)

    m = Lin(rngs=nnx.Rngs(0))
    assert _boundaries(jax.make_jaxpr(m)(jnp.ones((1, 2)))) == ["mlp"]
    relabelled = jp.layer(Lin, name="again")  # re-decorating replaces, never stacks
    assert _boundaries(jax.make_jaxpr(relabelled(rngs=nnx.Rngs(0)))(jnp.ones((1, 2)))) == [
        "again"]
    # Decorating a library class makes a cuttable copy without changing the library.
    CutLinear = jp.layer(nnx.Linear)
    lin = CutLinear(2, 2, rngs=nnx.Rngs(0))
    assert _boundaries(jax.make_jaxpr(lin)(jnp.ones((1, 2)))) == ["Linear"]
    assert _boundaries(jax.make_jaxpr(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))(jnp.ones((1, 2)))) == []


@pytest.mark.parametrize("plain_cls,marked_cls", [(LinenBlock, LayerLinenBlock),
                                                  (LinenSetupBlock, LayerLinenSetupBlock)])
def test_linen_decorated_identical_init_apply_and_serialization(plain_cls, marked_cls):
    x = jnp.asarray(np.random.default_rng(2).normal(size=(4, 6)), jnp.float32)
    a, b = LinenNet(plain_cls), LinenNet(marked_cls)
    va, vb = a.init(jax.random.key(0), x), b.init(jax.random.key(0), x)
    # Same auto-generated submodule names (e.g. LinenBlock_0), same values.
    assert jax.tree.structure(va) == jax.tree.structure(vb)
    assert list(vb["params"]) == list(va["params"])
    assert f"{plain_cls.__name__}_0" in vb["params"]
    _assert_trees_close(va, vb, rtol=0, atol=0)
    np.testing.assert_array_equal(a.apply(va, x), b.apply(vb, x))
    assert flax.serialization.to_bytes(va) == flax.serialization.to_bytes(vb)
    restored = flax.serialization.from_bytes(vb, flax.serialization.to_bytes(va))
    np.testing.assert_array_equal(b.apply(restored, x), a.apply(va, x))
    # Used on its own (not as a submodule) too.
    np.testing.assert_array_equal(
        plain_cls(6).apply(plain_cls(6).init(jax.random.key(1), x), x),
        marked_cls(6).apply(marked_cls(6).init(jax.random.key(1), x), x))
    assert _boundaries(jax.make_jaxpr(lambda v: b.apply(v, x))(vb)) == [plain_cls.__name__] * 4
    assert _boundaries(jax.make_jaxpr(lambda v: a.apply(v, x))(va)) == []
    # Dataclass fields, repr and clone behave as before.
    assert marked_cls(6).features == 6 and repr(marked_cls(6)) == repr(plain_cls(6))
    assert marked_cls(6).clone(features=3).features == 3


def test_linen_keyword_only_and_intermediates():
    @jp.layer
    class KW(nn.Module, kw_only=True):
        features: int

        @nn.compact
        def __call__(self, x):
            self.sow("intermediates", "pre", x)
            return nn.Dense(self.features)(x)

    x = jnp.ones((2, 3))
    v = KW(features=4).init(jax.random.key(0), x)
    assert list(v["params"]) == ["Dense_0"]
    y, state = KW(features=4).apply(v, x, mutable=["intermediates"])
    assert y.shape == (2, 4) and "pre" in state["intermediates"]
    with pytest.raises(TypeError):
        KW(4)  # still keyword-only


# ------------------------------------------------------------------------ pipelines

CASES = [("gpipe", 2), ("1f1b", 4), ("gpipe", 4), ("1f1b", 2)]


def _schedule(name: str, p: int, m: int):
    return (jp.GPipe if name == "gpipe" else jp.OneFOneB)(p, m)


@pytest.mark.parametrize("sched,p", CASES[:2])
def test_nnx_pipeline_matches_value_and_grad(sched, p):
    model = NnxLM(LayerNnxBlock, depth=4, rngs=nnx.Rngs(0))
    batch = _tokens(n=16)
    pipe = jp.flax.pipeline(model, nnx_loss, batch, mesh=_mesh(p), schedule=_schedule(sched, p, 4))
    loss, grads = pipe.value_and_grad(model, batch)

    params = nnx.state(model, nnx.Param)
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    ref_loss, ref_grads = jax.value_and_grad(
        lambda s: nnx_loss(nnx.merge(graphdef, s, rest), batch))(params)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=RTOL)
    _assert_trees_close(grads, nnx.to_pure_dict(ref_grads))
    # Passing the State or the pure dict instead of the model gives the same result.
    loss2, grads2 = pipe.value_and_grad(nnx.to_pure_dict(params), batch)
    np.testing.assert_allclose(float(loss2), float(loss), rtol=RTOL)
    _assert_trees_close(grads2, grads)
    assert str(pipe.plan)  # printable


class SowingBlock(NnxBlock):
    def __call__(self, x):
        h = super().__call__(x)
        self.sow(nnx.Intermediate, "h", h)  # as flax's examples record intermediates
        return h


def test_nnx_sow_is_refused_with_the_fix_and_the_fix_is_exact():
    """A block that sows intermediates adds variables while the loss runs: refused by
    name (the build crashed in a zip of the variables' paths), and popping them inside
    loss_fn, the fix the error gives, pipelines exactly."""
    model = NnxLM(jp.layer(SowingBlock), depth=4, rngs=nnx.Rngs(0))
    batch = _tokens(n=16)
    with pytest.raises(jp.PipelineError, match=r"adds variables to the model while it runs "
                                               r"\(\['blocks'\]\[0\]\['h'\].*nnx.pop"):
        jp.flax.pipeline(model, nnx_loss, batch, mesh=_mesh(2), schedule=jp.GPipe(2, 4))

    def popping(model, mb):
        loss = nnx_loss(model, mb)
        nnx.pop(model, nnx.Intermediate)
        return loss

    pipe = jp.flax.pipeline(model, popping, batch, mesh=_mesh(2), schedule=jp.GPipe(2, 4))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    want = jax.value_and_grad(lambda s: popping(nnx.merge(graphdef, s, rest), batch))(params)
    loss, grads = pipe.value_and_grad(model, batch)
    np.testing.assert_allclose(float(loss), float(want[0]), rtol=RTOL)
    _assert_trees_close(grads, nnx.to_pure_dict(want[1]))


_LIFTS = {"remat": nnx.remat, "jit": nnx.jit}


class LiftedNet(nnx.Module):
    """Blocks called through an nnx lifted transform, the markers outside it; ``scanned``:
    the blocks stacked (nnx.vmap) and run by nnx.scan, the transform inside its body (as
    flax's docs remat a scanned block)."""

    def __init__(self, lift: str, bump: bool = False, scanned: bool = False, *,
                 rngs: nnx.Rngs):
        if scanned:
            @nnx.split_rngs(splits=4)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return NnxBlock(8, rngs=rngs)
            self.blocks = make(rngs)
        else:
            self.blocks = nnx.List([NnxBlock(8, rngs=rngs) for _ in range(4)])
        self.lift, self.bump, self.scanned = lift, bump, scanned

    def __call__(self, x):
        def call(block, x):
            if self.bump:  # an update the pipeline would lose, made inside the transform
                block.linear.bias[...] = block.linear.bias[...] + 1.0
            return block(x)
        if self.scanned:
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def step(x, block):
                return jp.boundary(_LIFTS[self.lift](call)(block, x))
            return step(x, self.blocks)
        for b in self.blocks:
            x = jp.boundary(_LIFTS[self.lift](call)(b, x))
        return x


@pytest.mark.parametrize("scanned", [False, True], ids=["list", "nnx.scan"])
@pytest.mark.parametrize("lift", sorted(_LIFTS))
def test_nnx_lifted_transforms_in_the_model_pipeline(lift, scanned):
    """nnx.remat / nnx.jit write every variable back into the model (new tracers, same
    values), inside nnx.scan too (the stacked blocks it returns): that is not an update,
    and the pipeline gives nnx.value_and_grad's loss and gradients (it was refused as
    'assigns to the parameter'); an assignment made inside the transform still is
    refused."""
    def loss(model, mb):
        return jnp.mean((model(mb["x"]) - mb["y"]) ** 2)

    rng = np.random.default_rng(0)
    batch = {k: rng.normal(size=(16, 8)).astype(np.float32) for k in ("x", "y")}
    model = LiftedNet(lift, scanned=scanned, rngs=nnx.Rngs(0))
    pipe = jp.flax.pipeline(model, loss, batch, mesh=_mesh(4), schedule=jp.OneFOneB(4, 4))
    got_loss, got = pipe.value_and_grad(model, batch)
    mbs = [jax.tree.map(lambda x, i=i: x[4 * i:4 * (i + 1)], batch) for i in range(4)]
    want_loss, want = nnx.value_and_grad(
        lambda m: sum(loss(m, mb) for mb in mbs) / 4)(model)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=RTOL)
    _assert_trees_close(got, nnx.to_pure_dict(want))
    with pytest.raises(jp.PipelineError, match=r"assigns to the parameter .*bias"):
        jp.flax.pipeline(LiftedNet(lift, bump=True, scanned=scanned, rngs=nnx.Rngs(0)),
                         loss, batch, mesh=_mesh(4), schedule=jp.OneFOneB(4, 4))


@pytest.mark.parametrize("sched,p", CASES[2:])
def test_linen_pipeline_matches_value_and_grad(sched, p):
    model = LinenNet(LayerLinenBlock, depth=4)
    batch = _regression(n=16)
    variables = model.init(jax.random.key(0), batch["x"])
    pipe = jp.flax.pipeline_linen(model, variables, linen_loss, batch, mesh=_mesh(p),
                                  schedule=_schedule(sched, p, 4))
    loss, grads = pipe.value_and_grad(variables["params"], batch)
    ref_loss, ref_grads = jax.value_and_grad(
        lambda prm: linen_loss(model, {"params": prm}, batch))(variables["params"])
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=RTOL)
    _assert_trees_close(grads, ref_grads)
    # The full variables dict is accepted too.
    loss2, _ = pipe.value_and_grad(variables, batch)
    np.testing.assert_allclose(float(loss2), float(loss), rtol=RTOL)


def test_nnx_train_step_matches_optax_and_updates_model():
    model = NnxLM(LayerNnxBlock, depth=4, rngs=nnx.Rngs(1))
    batch = _tokens(n=8, seed=3)
    opt = optax.adamw(1e-2, weight_decay=0.1)
    pipe = jp.flax.pipeline(model, nnx_loss, batch, mesh=_mesh(2), schedule=jp.OneFOneB(2, 4))
    state = pipe.init(model, opt)
    for _ in range(2):
        state, metrics = pipe.train_step(state, batch)

    # Reference: the same two adamw steps with plain autodiff on the pure dict.
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ref = nnx.to_pure_dict(params)
    opt_state = opt.init(ref)
    template = params

    def ref_loss(pure):
        s = jax.tree.map(lambda v: v, template)
        nnx.replace_by_pure_dict(s, pure)
        return nnx_loss(nnx.merge(graphdef, s, rest), batch)

    for _ in range(2):
        ref_l, g = jax.value_and_grad(ref_loss)(ref)
        upd, opt_state = opt.update(g, opt_state, ref)
        ref = optax.apply_updates(ref, upd)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_l), rtol=RTOL)
    trained = pipe.params(state)
    _assert_trees_close(trained, ref, rtol=1e-4, atol=1e-6)

    before = model(batch["x"])
    assert pipe.update_model(model, trained) is model
    _assert_trees_close(nnx.to_pure_dict(nnx.state(model, nnx.Param)), ref, rtol=1e-4, atol=1e-6)
    assert not np.allclose(before, model(batch["x"]))
    # A train state is accepted directly as well.
    pipe.update_model(model, state)
    _assert_trees_close(nnx.to_pure_dict(nnx.state(model, nnx.Param)), trained, rtol=0, atol=0)


def test_linen_update_variables_after_training():
    model = LinenNet(LayerLinenBlock, depth=4)
    batch = _regression(n=16, seed=5)
    variables = model.init(jax.random.key(0), batch["x"])
    pipe = jp.flax.pipeline_linen(model, variables, linen_loss, batch, mesh=_mesh(2),
                                  schedule=jp.GPipe(2, 4))
    state = pipe.init(variables, optax.sgd(0.1))
    losses = []
    for _ in range(3):
        state, metrics = pipe.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    new_vars = pipe.update_variables(variables, state)
    assert jax.tree.structure(new_vars) == jax.tree.structure(variables)
    assert float(linen_loss(model, new_vars, batch)) < losses[0]


@jp.layer
class _LogicalBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                                         ("embed", "mlp")), (8, 8))
        return jnp.tanh(x @ w)


class _LogicalNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            x = _LogicalBlock()(x)
        return x


def test_linen_logical_boxes_need_rules_and_boxed_params():
    """Logical names with no nn.logical_axis_rules active, on a mesh with other axes,
    mapped to nothing: every parameter silently replicated; refused. A pipeline built
    from the boxed params given unboxed ones (MaxText holds them so) says which."""
    x = jax.random.normal(jax.random.key(1), (8, 8))
    batch = {"x": x, "y": jnp.tanh(x)}
    model = _LogicalNet()
    variables = model.init(jax.random.key(0), x)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("pipe", "fsdp"))

    def loss(module, v, mb):
        return jnp.mean((module.apply(v, mb["x"]) - mb["y"]) ** 2)

    def build(mesh):
        return jp.flax.pipeline_linen(model, variables, loss, batch, mesh=mesh,
                                      schedule=jp.GPipe(2, 2), cut="markers")

    with pytest.raises(jp.PipelineError, match=r"no nn.logical_axis_rules are active.*"
                                               r"replicated over \['fsdp'\]"):
        build(mesh)
    build(_mesh(2))  # nothing else to map to on a pipe-only mesh
    with nn.logical_axis_rules((("embed", "fsdp"), ("mlp", None))):
        pipe = build(mesh)
    assert jax.tree.leaves(pipe.inspect.param_specs) == [P("fsdp")] * 2
    with pytest.raises(jp.PipelineError, match=r"built from boxed linen params.*"
                                               r"these are unboxed"):
        pipe.value_and_grad(nn.meta.unbox(variables["params"]), batch)
    loss_value, _ = pipe.value_and_grad(variables["params"], batch)
    np.testing.assert_allclose(loss_value, loss(model, variables, batch), rtol=1e-6)


def test_bad_inputs_are_named():
    with pytest.raises(TypeError, match="nnx.Module"):
        jp.flax.pipeline(object(), nnx_loss, _tokens(), mesh=_mesh(2), schedule=jp.GPipe(2, 2))
    with pytest.raises(TypeError, match="params"):
        jp.flax.pipeline_linen(LinenNet(LinenBlock), {"batch_stats": {}}, linen_loss,
                               _regression(), mesh=_mesh(2), schedule=jp.GPipe(2, 2))
    with pytest.raises(TypeError, match="class"):
        jp.flax.layer_class(lambda x: x)
