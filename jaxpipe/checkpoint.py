"""Checkpoint and resume pipeline training with orbax-checkpoint.

Two forms, for two purposes:

``save(path, state)`` / ``restore(path, pipe, like=state)``
    The :class:`~jaxpipe.train.state.TrainState` exactly as it lives on the devices: parameters
    and optimizer state in the per-stage layout ``{dtype: [devices, stages_per_device,
    width]}``, sharded over the pipe axis, plus the step counter. Each process writes and
    reads only its own shards. Restoring into a pipeline with the *same* layout (same
    schedule placement, cut, parameter shapes and optimizer) resumes bit-for-bit: the
    next steps are identical to never having stopped.

``save_params(path, pipe, state)`` / ``restore_params(path, pipe=..., like=...)``
    The plain, unsharded parameter pytree (the user's ``params``). Use it to change
    the pipeline layout (other ``p``, schedule or cut), to evaluate without a pipeline,
    or to hand the weights to other code. The optimizer state is not in this form:
    after ``restore_params`` call ``pipe.init(params, optimizer)`` for a fresh one.

Every path is a directory; with several processes it must be on a filesystem that all
of them see, and every process must make the same call (orbax coordinates the writes).

Example::

    from jaxpipe import checkpoint as jpc

    jpc.save("/ckpt/step_400", state, pipe=pipe)        # per-stage layout
    jpc.save_params("/ckpt/params_400", pipe, state)    # unsharded

    state = jpc.restore("/ckpt/step_400", pipe, like=pipe.init(params, tx))
    params = jpc.restore_params("/ckpt/params_400", pipe=other_pipe)
    state = other_pipe.init(params, tx)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxpipe.api.inputs import check_alive
from jaxpipe.checkpoint_files import (
    FORMAT,
    KIND_PARAMS,
    KIND_STATE,
    abspath,
    checkpointer,
    damaged,
    ocp_module,
    read_meta,
    write,
)
from jaxpipe.errors import PipelineError, PipelineTypeError

if TYPE_CHECKING:  # (imported where used: the checkpoint files need none of them)
    import optax

    from jaxpipe.api.pipeline import Pipeline
    from jaxpipe.train.state import TrainState

__all__ = ["restore", "restore_params", "save", "save_params"]

def _pipeline(pipe: Any, what: str, required: bool = True):
    """The :class:`jaxpipe.Pipeline` behind ``pipe`` (flax wrappers included), checked."""
    from jaxpipe.api.pipeline import Pipeline
    from jaxpipe.flax.delegating import Delegating

    if pipe is None and not required:
        return None
    inner = pipe.pipe if isinstance(pipe, Delegating) else pipe  # jp.flax's pipelines
    if not isinstance(inner, Pipeline):
        raise PipelineTypeError(
            f"{what} needs the pipeline (from jp.pipeline or jp.flax.pipeline), got "
            f"{type(pipe).__name__}.")
    return inner


def _layout_summary(pipe) -> dict[str, Any]:
    return pipe.inspect.layout_summary()


# ----------------------------------------------------------------------- train state
def save(path: str | os.PathLike, state: TrainState, *, pipe: Pipeline | None = None,
         overwrite: bool = False) -> None:
    """Save a :class:`~jaxpipe.train.state.TrainState` in its per-stage layout.

    Args:
      path: a new directory (``overwrite=True`` replaces an existing one).
      state: the state from ``pipe.init`` / ``pipe.train_step``.
      pipe: optional; also records the pipeline's schedule, p, m and cut, named when
        a restore finds another layout. (Where each parameter sits, stage by stage, is
        recorded from the state itself, and :func:`restore` refuses a pipeline that
        keeps it elsewhere.)
      overwrite: replace ``path`` if it exists.
    """
    from jaxpipe.distributed import fetch
    from jaxpipe.train.state import TrainState

    if not isinstance(state, TrainState):
        raise PipelineTypeError(
            f"save needs the TrainState from pipe.init/train_step, got {type(state).__name__};"
            " for a parameter pytree use jaxpipe.checkpoint.save_params."
        )
    pipe = _pipeline(pipe, "save(..., pipe=)", required=False)
    path = abspath(path)
    check_alive(state, "state", "Save the state the last train_step returned.")
    tree = {"params": state.params, "opt_state": state.opt_state,
            "step": np.asarray(fetch(state.step), np.int32)}
    meta = {"kind": KIND_STATE, "format": FORMAT,
            "layout": _layout_summary(pipe) if pipe is not None else None,
            "stage_layout": state.trainer.executor.stage_layout()}
    write(path, tree, meta, overwrite)


def _shape_map(tree: Any) -> dict[str, tuple]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(k): tuple(v.shape) for k, v in leaves}


def _check_dtypes(path: Path, saved: Any, target: Any) -> None:
    """Refuse a state saved in other dtypes: restoring would cast the parameters and the
    optimizer's moments without a word (a resume is bit-for-bit or refused)."""
    want = {jax.tree_util.keystr(k): np.dtype(v.dtype)
            for k, v in jax.tree_util.tree_flatten_with_path(target)[0]}
    for k, v in jax.tree_util.tree_flatten_with_path(saved)[0]:
        name = jax.tree_util.keystr(k)
        if name in want and np.dtype(v.dtype) != want[name]:
            raise PipelineError(
                f"the checkpoint at {str(path)!r} holds {name} as {np.dtype(v.dtype)}, "
                f"this pipeline's state as {want[name]}; restoring would cast the "
                "parameters and optimizer state. Build the pipeline with parameters of "
                "the saved dtypes, or, to change dtypes, save_params / restore_params, "
                "cast, and pipe.init a new optimizer state.")


def restore(path: str | os.PathLike, pipe: Pipeline, like: TrainState | None = None, *,
            optimizer: optax.GradientTransformation | None = None,
            skip_nonfinite: bool = False, clip_global_norm: float | None = None
            ) -> TrainState:
    """Restore a :class:`~jaxpipe.train.state.TrainState` saved by :func:`save`.

    The restored state trains with the optimizer of ``like`` (or ``optimizer``): a
    checkpoint holds arrays, not code.

    Args:
      path: the checkpoint directory.
      pipe: the pipeline to resume with; it must have the layout the state was saved
        in (same placement, cut, parameter shapes and optimizer state structure).
      like: a state of the right structure and sharding, e.g. ``pipe.init(params,
        optimizer)``; its values are ignored, its optimizer is kept.
      optimizer: instead of ``like``: the optimizer to resume with (its state layout is
        derived without touching parameters); ``skip_nonfinite`` and
        ``clip_global_norm`` as for ``Pipeline.init``.

    Returns:
      The TrainState, sharded like ``like`` (over the pipe axis), ready for
      ``pipe.train_step``.

    Raises:
      PipelineError: not a train-state checkpoint, or saved in another layout (then
        restore the unsharded parameters with :func:`restore_params` instead).
    """
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxpipe.train.state import TrainState

    pipe = _pipeline(pipe, "restore(path, pipe, ...)")
    path = abspath(path)
    meta, tree_meta = read_meta(path, KIND_STATE)
    if like is not None and optimizer is not None:
        raise PipelineError(
            "restore takes like= or optimizer=, not both: like's optimizer would be "
            "silently replaced (or optimizer ignored); pass one.")
    if like is None:
        like = _abstract_state(pipe, optimizer, skip_nonfinite, clip_global_norm)
    if not isinstance(like, TrainState):
        raise PipelineTypeError(
            f"like must be a TrainState (e.g. pipe.init(params, optimizer)), got "
            f"{type(like).__name__}.")
    if like.trainer.executor is not pipe.inspect.executor:
        raise PipelineError(
            "like is a TrainState of another pipeline; make it with this pipeline "
            "(pipe.init(params, optimizer)) so the restored state trains here.")

    def abstract(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    target = {"params": jax.tree.map(abstract, like.params),
              "opt_state": jax.tree.map(abstract, like.opt_state),
              "step": np.zeros((), np.int32)}
    saved_shapes = _shape_map(tree_meta)
    want_shapes = _shape_map(target)
    if saved_shapes != want_shapes:
        saved_layout = meta.get("layout")
        now = _layout_summary(pipe) if pipe is not None else None
        raise PipelineError(
            f"the checkpoint at {str(path)!r} was saved in another per-stage layout "
            f"(array shapes {saved_shapes}) than this pipeline's ({want_shapes})"
            + (f"; saved with {saved_layout}, this pipeline is {now}" if saved_layout else "")
            + ". To change p, schedule, cut or optimizer, save the unsharded parameters "
            "with save_params, restore them with restore_params and call pipe.init."
        )
    _check_stage_layout(path, meta.get("stage_layout"), pipe.inspect.executor.stage_layout())
    _check_dtypes(path, tree_meta, target)
    ocp = ocp_module()
    try:
        out = checkpointer().restore(
            path, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))["state"]
    except Exception as err:
        raise damaged(path, "its arrays cannot be read", err) from err
    # The step counter goes back replicated over the pipeline's mesh (as train_step
    # returns it); every process passes the same value.
    step = jax.make_array_from_process_local_data(
        NamedSharding(pipe.mesh, P()), np.asarray(out["step"], np.int32))
    return TrainState(out["params"], out["opt_state"], step, like.trainer)


def _check_stage_layout(path: Path, saved: Any, now: dict[str, Any]) -> None:
    """Refuse a state whose arrays have this pipeline's shapes but whose parameters sit
    elsewhere in them (another cut or placement): restored, every stage would train
    another stage's weights. Checkpoints written before the layout was recorded cannot
    be checked."""
    if saved is None or saved == now:
        return
    diff = next((f"stage {s}: saved {a}, this pipeline {b}" for s, (a, b) in enumerate(
        zip(saved.get("stages", []), now["stages"], strict=False)) if a != b),
        f"saved {saved}, this pipeline {now}")
    raise PipelineError(
        f"the checkpoint at {str(path)!r} keeps its parameters in another stage layout than "
        f"this pipeline, though its arrays have the same shapes (each stage: its device and "
        f"[leaf, rows] it holds; {diff}); restored, stages would train each other's "
        "weights. Build the pipeline with the cut and schedule placement it was saved with, "
        "or save_params / restore_params and pipe.init to change the layout.")


def _abstract_state(pipe, optimizer, skip_nonfinite: bool, clip_global_norm):
    """A shape/sharding-only TrainState for ``pipe`` training with ``optimizer``."""

    from jaxpipe.train.options import TrainOptions

    if optimizer is None:
        raise PipelineError(
            "restore needs to know which optimizer the state trains with: pass "
            "like=pipe.init(params, optimizer) (values are ignored) or optimizer=<the "
            "optax transformation>."
        )
    trainer = pipe.inspect.trainer(optimizer, TrainOptions(
        skip_nonfinite=skip_nonfinite, clip_global_norm=clip_global_norm))
    return trainer.abstract_state()


# ----------------------------------------------------------------------- parameters
def save_params(path: str | os.PathLike, pipe: Pipeline, state_or_params: Any, *,
                overwrite: bool = False) -> None:
    """Save the plain (unsharded) parameter pytree of a train state.

    Args:
      path: a new directory.
      pipe: the pipeline the state belongs to (it knows the stage layout).
      state_or_params: a :class:`~jaxpipe.train.state.TrainState`, the staged parameter list
        from ``pipe.shard``, or already the user's parameter pytree.
      overwrite: replace ``path`` if it exists.
    """
    from jaxpipe.flax.delegating import Delegating
    from jaxpipe.train.state import TrainState

    wrapper = pipe
    pipe = _pipeline(pipe, "save_params(path, pipe, state)")
    path = abspath(path)
    if isinstance(state_or_params, TrainState):
        params = pipe.params(state_or_params)
    elif _is_staged(pipe, state_or_params):
        params = pipe.unshard(state_or_params)
    else:
        if isinstance(wrapper, Delegating):  # a flax model, nnx State or variables dict
            state_or_params = wrapper.as_params(state_or_params)
        pipe.inspect.check_params(state_or_params, "save_params")
        check_alive(state_or_params, "params", "Save live parameters.")
        params = state_or_params
    meta = {"kind": KIND_PARAMS, "format": FORMAT,
            "treedef": str(jax.tree.structure(params)), "layout": _layout_summary(pipe)}
    write(path, params, meta, overwrite)


def _is_staged(pipe, x) -> bool:
    return (isinstance(x, (list, tuple))
            and [tuple(np.shape(v)) for v in x] == pipe.inspect.staged_shapes()
            and jax.tree.structure(x) != pipe.inspect.traced.params_treedef)


def restore_params(path: str | os.PathLike, *, pipe: Pipeline | None = None,
                   like: Any = None) -> Any:
    """Restore a parameter pytree saved by :func:`save_params`.

    Args:
      path: the checkpoint directory.
      pipe: restore in this pipeline's parameter structure, replicated over its mesh
        (global arrays; the right input for ``pipe.init`` in every process).
      like: or: a pytree of arrays / ``jax.ShapeDtypeStruct`` giving structure, shapes,
        dtypes and (optionally) shardings. Leaves are cast to its dtypes (with ``pipe``:
        the pipeline's), e.g. float32 weights into a bfloat16 model.

    With neither, returns numpy arrays in the saved structure (lists and dicts).

    Raises:
      PipelineError: not a params checkpoint, or shapes/structure differ from the target.
    """
    pipe = _pipeline(pipe, "restore_params(path, pipe=...)", required=False)
    path = abspath(path)
    meta, tree_meta = read_meta(path, KIND_PARAMS)
    if like is None and pipe is not None:
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        rep = NamedSharding(pipe.mesh, P())
        like = jax.tree.unflatten(
            pipe.inspect.traced.params_treedef,
            [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep)
             for a in pipe.inspect.param_avals])
    if like is None:
        target = jax.tree.map(lambda m: np.zeros(m.shape, m.dtype), tree_meta)
    else:
        def abstract(x):
            if isinstance(x, np.ndarray):
                return np.zeros(x.shape, x.dtype)
            return jax.ShapeDtypeStruct(np.shape(x), x.dtype,
                                        sharding=getattr(x, "sharding", None))

        target = jax.tree.map(abstract, like)
        saved_leaves = jax.tree.leaves(tree_meta)
        want_leaves = jax.tree.leaves(target)
        saved = [tuple(m.shape) for m in saved_leaves]
        want = [tuple(np.shape(x)) for x in want_leaves]
        if saved != want:
            raise PipelineError(
                f"the parameters at {str(path)!r} (structure {meta.get('treedef')}, shapes "
                f"{saved}) do not match the target (structure {jax.tree.structure(target)}, "
                f"shapes {want}); restore into the same model."
            )
    ocp = ocp_module()
    try:
        return checkpointer().restore(
            path, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))["state"]
    except Exception as err:
        saved, want = list(_shape_map(tree_meta)), list(_shape_map(target))
        if like is not None and saved != want:  # same shapes, another tree: not damage
            raise PipelineError(
                f"the parameters at {str(path)!r} are a tree of another structure than "
                f"like's (saved leaves {saved}, like's {want}); pass a like of the saved "
                "structure, pipe= of the model it was saved from, or neither (numpy "
                "arrays in the saved structure).") from err
        raise damaged(path, "its arrays cannot be read", err) from err
