"""Checkpoint/resume with orbax: per-stage TrainState and unsharded parameters.

- Resuming from a per-stage checkpoint in a *fresh* Pipeline is bit-identical to never
  having stopped (losses and parameters after 4 + 4 steps == 8 uninterrupted steps).
- The unsharded parameter checkpoint restores into a pipeline with another ``p`` and
  schedule and gives the same loss and gradients.
- Misuse (wrong layout, wrong kind, existing path, missing path) raises PipelineError.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxpipe as jp
from jaxpipe import checkpoint as jpc

WIDTH, DEPTH, BATCH, M = 8, 4, 16, 4


def loss_fn(params, mb):
    h = mb["x"]
    for i, layer in enumerate(params["layers"]):
        h = jnp.tanh(h @ layer["w"] + layer["b"])
        if i < DEPTH - 1:
            h = jp.boundary(h)
    return jnp.mean((h - mb["y"]) ** 2)


def _model():
    k = jax.random.split(jax.random.key(0), 2 * DEPTH + 2)
    params = {"layers": [{"w": jax.random.normal(k[2 * i], (WIDTH, WIDTH)) * 0.5,
                          "b": jax.random.normal(k[2 * i + 1], (WIDTH,)) * 0.1}
                         for i in range(DEPTH)]}
    batch = {"x": jax.random.normal(k[-2], (BATCH, WIDTH)),
             "y": jax.random.normal(k[-1], (BATCH, WIDTH))}
    return params, batch


def _batches(n):
    return [{"x": jax.random.normal(jax.random.key(100 + i), (BATCH, WIDTH)),
             "y": jax.random.normal(jax.random.key(200 + i), (BATCH, WIDTH))} for i in range(n)]


def _pipe(p, schedule=None):
    params, batch = _model()
    mesh = jax.make_mesh((p,), ("pipe",), devices=jax.devices()[:p])
    return jp.pipeline(loss_fn, params, batch, mesh=mesh,
                       schedule=schedule or jp.OneFOneB(p, M), cut="markers")


def _tx():
    return optax.adamw(1e-2, weight_decay=1e-3)


def _np(tree):
    return jax.tree.map(np.asarray, tree)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """8 uninterrupted steps on p=4, saving both checkpoint forms after step 4."""
    d = tmp_path_factory.mktemp("ckpt")
    params, _ = _model()
    pipe = _pipe(4)
    state = pipe.init(params, _tx())
    losses = []
    for i, b in enumerate(_batches(8)):
        if i == 4:
            jpc.save(d / "state4", state, pipe=pipe)
            jpc.save_params(d / "params4", pipe, state)
            params4 = _np(pipe.params(state))
        state, metrics = pipe.train_step(state, b)
        losses.append(np.asarray(metrics["loss"]))
    return {"dir": d, "losses": np.stack(losses), "final": _np(pipe.params(state)),
            "step": int(state.step), "params4": params4, "pipe": pipe}


def test_resume_in_fresh_pipeline_is_bit_identical(run):
    params, _ = _model()
    fresh = _pipe(4)  # a new Pipeline object, compiled again
    like = fresh.init(params, _tx())
    state = jpc.restore(run["dir"] / "state4", fresh, like=like)
    assert int(state.step) == 4
    losses = []
    for b in _batches(8)[4:]:
        state, metrics = fresh.train_step(state, b)
        losses.append(np.asarray(metrics["loss"]))
    np.testing.assert_array_equal(np.stack(losses), run["losses"][4:])
    assert int(state.step) == run["step"] == 8
    got = _np(fresh.params(state))
    assert jax.tree.structure(got) == jax.tree.structure(run["final"])
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(run["final"]), strict=True):
        np.testing.assert_array_equal(a, b)  # bit-identical, not just close


def test_restore_with_optimizer_instead_of_like(run):
    params, _ = _model()
    fresh = _pipe(4)
    state = jpc.restore(run["dir"] / "state4", fresh, optimizer=_tx())
    assert int(state.step) == 4
    for i, v in enumerate(state.params):
        assert v.sharding.spec == jax.sharding.PartitionSpec("pipe"), i
    for a, b in zip(jax.tree.leaves(_np(fresh.params(state))),
                    jax.tree.leaves(run["params4"]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_unsharded_params_restore_into_other_p_and_schedule(run):
    saved = run["params4"]
    numpy_tree = jpc.restore_params(run["dir"] / "params4")
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(numpy_tree))
    for a, b in zip(jax.tree.leaves(numpy_tree), jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(a, b)

    batch = _batches(8)[4]

    def mean_loss(p):  # unpipelined: mean over the m contiguous microbatches
        mbs = [jax.tree.map(lambda x, i=i: x.reshape(M, -1, *x.shape[1:])[i], batch)
               for i in range(M)]
        return jnp.mean(jnp.stack([loss_fn(p, mb) for mb in mbs]))

    ref_loss, ref_grads = jax.value_and_grad(mean_loss)(saved)
    ref_loss4 = run["losses"][4]  # the p=4 pipeline's loss at these params on this batch
    # p=4 1F1B -> p=2 GPipe (other p and other schedule)
    other = _pipe(2, jp.GPipe(2, M))
    params = jpc.restore_params(run["dir"] / "params4", pipe=other)
    assert jax.tree.structure(params) == jax.tree.structure(saved)
    for x in jax.tree.leaves(params):
        assert x.sharding.mesh == other.mesh and x.sharding.is_fully_replicated
    loss, grads = other.value_and_grad(params, batch)
    np.testing.assert_allclose(loss, ref_loss4, rtol=1e-5)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    # and it trains from there (fresh optimizer state in the new layout)
    state, metrics = other.train_step(other.init(params, _tx()), batch)
    np.testing.assert_allclose(metrics["loss"], ref_loss4, rtol=1e-5)


def test_state_checkpoint_into_other_layout_names_the_fix(run):
    params, _ = _model()
    other = _pipe(2)
    like = other.init(params, _tx())
    with pytest.raises(jp.PipelineError, match=r"another per-stage layout.*restore_params"):
        jpc.restore(run["dir"] / "state4", other, like=like)


def test_a_state_saved_in_other_dtypes_is_refused_and_params_are_cast(run):
    """A float32 train state into a bfloat16 pipeline of the same layout: restore would
    cast the weights and Adam's moments without a word, so it is refused with the way to
    change dtypes; restore_params casts, as documented (into the pipeline's dtypes)."""
    params, batch = _model()
    low = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    mesh = jax.make_mesh((4,), ("pipe",), devices=jax.devices()[:4])
    bf16 = jp.pipeline(loss_fn, low, batch, mesh=mesh, schedule=jp.OneFOneB(4, M),
                       cut="markers")
    with pytest.raises(jp.PipelineError, match=r"as float32, this pipeline's state as "
                                               r"bfloat16.*save_params / restore_params"):
        jpc.restore(run["dir"] / "state4", bf16, optimizer=_tx())
    cast = jpc.restore_params(run["dir"] / "params4", pipe=bf16)
    for a, b in zip(jax.tree.leaves(cast), jax.tree.leaves(run["params4"]), strict=True):
        assert a.dtype == jnp.bfloat16
        np.testing.assert_array_equal(a, b.astype(jnp.bfloat16))


def test_state_checkpoint_into_another_cut_of_the_same_shapes_is_refused(tmp_path):
    """Stages of 1 and 3 layers, or 3 and 1: the staged arrays have the same shapes, but
    each device holds other layers. Restoring one into the other loaded every weight into
    another layer, silently; the recorded stage layout now refuses it."""
    params, _ = _model()
    mesh = jax.make_mesh((2,), ("pipe",), devices=jax.devices()[:2])

    def cut_after(i):
        return jp.pipeline(loss_fn, params, _model()[1], mesh=mesh, schedule=jp.OneFOneB(2, M),
                           cut=jp.Cut(indices=[i]))

    saved, other = cut_after(0), cut_after(2)
    state = saved.init(params, _tx())
    assert jax.tree.map(jnp.shape, state.params) == jax.tree.map(
        jnp.shape, other.init(params, _tx()).params)
    jpc.save(tmp_path / "s", state)  # no pipe=: the state knows its layout
    with pytest.raises(jp.PipelineError, match=r"another stage layout.*same shapes.*stage 0"):
        jpc.restore(tmp_path / "s", other, optimizer=_tx())
    same = cut_after(0)
    again = jpc.restore(tmp_path / "s", same, optimizer=_tx())
    for a, b in zip(jax.tree.leaves(_np(same.params(again))), jax.tree.leaves(_np(params)),
                    strict=True):
        np.testing.assert_array_equal(a, b)


def test_wrong_kind_missing_and_existing_paths(run, tmp_path):
    pipe = run["pipe"]
    with pytest.raises(jp.PipelineError,
                       match=r"holds a 'jaxpipe.params' checkpoint.*restore_params"):
        jpc.restore(run["dir"] / "params4", pipe)
    with pytest.raises(jp.PipelineError, match=r"holds a 'jaxpipe.train_state'.*restore\b"):
        jpc.restore_params(run["dir"] / "state4")
    with pytest.raises(jp.PipelineError, match="no checkpoint at"):
        jpc.restore_params(tmp_path / "nope")
    with pytest.raises(jp.PipelineError, match="already exists.*overwrite=True"):
        jpc.save_params(run["dir"] / "params4", pipe, run["params4"])
    with pytest.raises(jp.PipelineError, match="TrainState"):
        jpc.save(tmp_path / "x", run["params4"])
    bad = {"layers": run["params4"]["layers"][:2]}
    with pytest.raises(jp.PipelineError, match="do not match the target"):
        jpc.restore_params(run["dir"] / "params4", like=bad)


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_damaged_checkpoint_is_reported_as_damaged(run, tmp_path):
    import shutil

    pipe, like = run["pipe"], None
    broken_meta = _copy(run["dir"] / "state4", tmp_path / "meta")
    (broken_meta / "meta" / "metadata").write_text("{garbage")
    no_state = _copy(run["dir"] / "state4", tmp_path / "nostate")
    shutil.rmtree(no_state / "state")
    truncated = _copy(run["dir"] / "params4", tmp_path / "trunc")
    for f in (truncated / "state").rglob("*"):
        if f.is_file() and f.name.endswith(".ocdbt"):
            f.write_bytes(b"\0" * 4)
    like = pipe.init(_model()[0], _tx())
    for path, call in ((broken_meta, lambda p: jpc.restore(p, pipe, like=like)),
                       (no_state, lambda p: jpc.restore(p, pipe, like=like)),
                       (truncated, lambda p: jpc.restore_params(p, pipe=pipe))):
        with pytest.raises(jp.PipelineError, match=r"is damaged: .*Restore from another copy") \
                as err:
            call(path)
        message = str(err.value)
        assert "\n" not in message and len(message) < 600, message  # one readable sentence
        assert "tensorstore_spec" not in message and "not a jaxpipe" not in message


def test_params_restored_like_a_tree_of_another_structure_is_not_called_damaged(run):
    """Same shapes, another tree (the saved list of layers as a dict): the files are
    fine, so the message says the structures differ (it said the checkpoint was damaged)."""
    saved = run["params4"]
    like = {"layers": {str(i): layer for i, layer in enumerate(saved["layers"])}}
    with pytest.raises(jp.PipelineError, match=r"another structure than like's.*saved leaves "
                                               r"\[\"\['layers'\]\[0\]") as err:
        jpc.restore_params(run["dir"] / "params4", like=like)
    assert "damaged" not in str(err.value)


def test_overwrite_never_deletes_what_is_not_a_checkpoint(run, tmp_path):
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "keep.txt").write_text("important")
    with pytest.raises(jp.PipelineError, match=r"not a checkpoint; overwrite=True only "
                                               r"replaces checkpoints"):
        jpc.save_params(notes, run["pipe"], run["params4"], overwrite=True)
    assert (notes / "keep.txt").read_text() == "important"
    with pytest.raises(jp.PipelineError, match=r"not a jaxpipe checkpoint \(no checkpoint "
                                               r"files"):
        jpc.restore_params(notes)
    # a checkpoint is replaced
    target = _copy(run["dir"] / "params4", tmp_path / "again")
    jpc.save_params(target, run["pipe"], run["params4"], overwrite=True)


def test_argument_types_are_named(run, tmp_path):
    pipe = run["pipe"]
    state = pipe.init(_model()[0], _tx())
    with pytest.raises(jp.PipelineError, match=r"restore\(path, pipe, ...\) needs the "
                                               r"pipeline.*got NoneType"):
        jpc.restore(run["dir"] / "state4", None, like=state)
    with pytest.raises(jp.PipelineError, match=r"path must be a str or os.PathLike"):
        jpc.save(3, state)
    with pytest.raises(jp.PipelineError, match=r"like= or optimizer=, not both"):
        jpc.restore(run["dir"] / "state4", pipe, like=state, optimizer=_tx())
    with pytest.raises(TypeError, match=r"like must be a TrainState"):
        jpc.restore(run["dir"] / "state4", pipe, like=_model()[0])
    restored = jpc.restore(run["dir"] / "state4", pipe, like=state)  # all fine together
    assert int(restored.step) == 4
