"""The checks a pipeline call's inputs pass before any compiled program sees them.

Each raises :class:`~jaxpipe.errors.PipelineError` / :class:`~jaxpipe.errors.PipelineTypeError`
naming the argument and giving the fix:

- :func:`check_params` / :func:`check_batch` / :func:`check_key`: the type, structure,
  shapes and dtypes of what a call passes, checked against what the pipeline was built
  for (a train state where parameters are expected, the stage layout passed as a pytree,
  a batch of another size, ...);
- :func:`check_alive`: arrays whose buffers were donated to an earlier ``train_step``
  (or deleted) are refused before XLA reads freed memory;
- :func:`check_pipeline_args`, :func:`check_objective`, :func:`check_mesh`,
  :func:`check_microbatch_rows`, :func:`check_no_keys`: what ``jp.pipeline`` is built
  from.

Placing the checked inputs on the mesh is :mod:`jaxpipe.api.input_placement`'s job.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxpipe.errors import PipelineError, PipelineTypeError
from jaxpipe.jax_compat import key_impl
from jaxpipe.jaxpr.avals import is_key
from jaxpipe.jaxpr.objective import REDUCTIONS, Objective
from jaxpipe.jaxpr.trace import microbatch_like
from jaxpipe.schedule import Schedule
from jaxpipe.train.state import TrainState

__all__ = ["check_alive", "check_batch", "check_key", "check_mesh", "check_microbatch_rows",
           "check_no_keys", "check_not_differentiated", "check_objective", "check_params",
           "check_pipeline_args", "check_usable", "leaf_paths"]


def leaf_paths(treedef: Any) -> list[str]:
    """``keystr`` of every leaf position of ``treedef`` (``"['w'][0]"``)."""
    tree = jax.tree.unflatten(treedef, list(range(treedef.num_leaves)))
    return [jax.tree_util.keystr(p) for p, _ in jax.tree.flatten_with_path(tree)[0]]


def _kind(x: Any) -> str:
    if isinstance(x, TrainState):
        return "state"
    # An nnx object exists only once its module is imported; importing flax.nnx here
    # would add half a second to every pipeline's first call.
    nnx = sys.modules.get("flax.nnx")
    if nnx is not None and isinstance(x, nnx.Module | nnx.State):
        return "flax"
    return ""


def check_params(params: Any, treedef: Any, avals: tuple, staged_shapes: list, what: str
                 ) -> list:
    """The leaves of a user parameter pytree, or a :class:`PipelineError` saying what it is.

    A train state, the runtime's stage layout or a flax model where the user's pytree
    is expected each get their own message; so does a pytree of another structure, leaf
    shape or dtype.
    """

    kind = _kind(params)
    if kind == "state":
        raise PipelineTypeError(
            f"{what} expects the parameter pytree, got a TrainState; use pipe.params(state) "
            "for its parameters (pipe.train_step(state, batch) trains it)."
        )
    if kind == "flax":
        raise PipelineTypeError(
            f"{what} got a flax {type(params).__name__}, but this pipeline was built with "
            "jp.pipeline over a parameter pytree; build it with jp.flax.pipeline(model, "
            "loss_fn, batch, ...) to pass the model itself."
        )
    leaves, tree = jax.tree.flatten(params)
    if tree != treedef:
        if (isinstance(params, list | tuple) and staged_shapes
                and [tuple(np.shape(x)) for x in params] == staged_shapes):
            raise PipelineTypeError(
                f"{what} got parameters in the pipeline's stage layout (from pipe.shard or "
                "state.params); pass the user's parameter pytree (pipe.unshard(staged)), "
                "or use pipe.staged_value_and_grad for staged parameters."
            )
        raise PipelineError(
            "params do not have the structure the pipeline was built with:\n"
            f"  expected {treedef}\n  got      {tree}\n"
            "pass the same parameter pytree (or rebuild the pipeline)."
        )
    paths = leaf_paths(treedef)
    for i, (x, a) in enumerate(zip(leaves, avals, strict=True)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            if not isinstance(x, bool | int | float | complex):
                raise PipelineTypeError(
                    f"params leaf {paths[i]} is a {type(x).__name__}, not an array; params "
                    "leaves must be arrays (or jax.ShapeDtypeStruct for tracing).")
        shape, dtype = np.shape(x), jax.numpy.result_type(x)
        if shape != a.shape or dtype != a.dtype:
            raise PipelineError(
                f"parameter leaf {i} has shape {shape} dtype {dtype} (params{paths[i]}), "
                f"but the pipeline was traced with {a.shape} {a.dtype}."
            )
    return leaves


def check_batch(batch: Any, treedef: Any, mb_shapes: list, dtypes: list,
                num_microbatches: int, multiprocess: bool = False) -> list:
    """The leaves of ``batch``, checked against the batch the pipeline was built for."""
    if _kind(batch) == "state":
        raise PipelineTypeError("the batch is a TrainState; pass (state, batch) in that order.")
    mb = microbatch_like(batch, num_microbatches)
    leaves, tree = jax.tree.flatten(batch)
    if tree != treedef:
        raise PipelineError(f"batch structure {tree} differs from the traced {treedef}.")
    paths = leaf_paths(treedef)
    for path, w, shape, dt in zip(paths, jax.tree.leaves(mb), mb_shapes, dtypes, strict=True):
        if w.shape != shape:
            hint = (" In a multi-process run a numpy batch is the whole global batch on "
                    "every process; build one from each process's rows with "
                    "jaxpipe.distributed.global_batch.") if multiprocess else ""
            fix = ("rebuild the pipeline for a new batch size" if w.shape[1:] == shape[1:]
                   else f"a row of it is {w.shape[1:]}, where the pipeline was built for "
                        f"rows of {shape[1:]}: pass the batch's leaves in the shapes it was "
                        "built with, or rebuild the pipeline for these")
            raise PipelineError(
                f"microbatch leaf shape {w.shape} (batch{path}) differs from the {shape} the "
                f"pipeline was built for; {fix}.{hint}"
            )
        if w.dtype != dt:
            raise PipelineError(
                f"batch leaf batch{path} has dtype {w.dtype} but the pipeline was traced "
                f"with {dt}; cast it (x.astype(jnp.{dt})) or rebuild the pipeline for this "
                "dtype."
            )
    return leaves


def check_key(key: Any, rng: bool, key_dtype: Any, what: str) -> jax.Array | None:
    """The step's PRNG key as a typed key, or a clear error (missing, unexpected, wrong)."""

    if not rng:
        if key is not None:
            raise PipelineError(
                f"{what} got a key, but the pipeline was built without rng=True, so "
                "loss_fn takes no key; build it with jp.pipeline(..., rng=True) for a "
                "loss_fn(params, microbatch, key)."
            )
        return None
    if key is None:
        raise PipelineError(
            f"{what} needs a PRNG key: the pipeline was built with rng=True; pass "
            "jax.random.key(seed) (split a fresh one for every step)."
        )
    dtype = getattr(key, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        if np.shape(key) != ():
            raise PipelineError(
                f"{what} needs one PRNG key (shape ()), got a key array of shape "
                f"{np.shape(key)}; jaxpipe derives one key per microbatch itself.")
        if dtype != key_dtype:
            raise PipelineError(
                f"{what} got a key of type {dtype} but the pipeline was built for "
                f"{key_dtype} (JAX's default key implementation when it was built, "
                "jax_default_prng_impl); make keys with that implementation "
                f"(jax.random.key(seed, impl=...)), or build the pipeline under "
                "jax.config.update('jax_default_prng_impl', ...) for these keys.")
        return key
    impl = key_impl(key_dtype)
    if (dtype is not None and np.dtype(dtype) == np.uint32
            and tuple(np.shape(key)) == tuple(impl.key_shape)):
        return jax.random.wrap_key_data(key, impl=impl)  # a raw jax.random.PRNGKey
    raise PipelineTypeError(
        f"{what} needs a PRNG key made by jax.random.key(seed), got "
        f"{type(key).__name__}{' ' + str(np.shape(key)) if dtype is not None else ''}.")


def check_alive(tree: Any, what: str, fix: str) -> None:
    """Raise :class:`PipelineError` if an array of ``tree`` was donated or deleted."""
    for path, x in jax.tree.flatten_with_path(tree)[0]:
        # a tracer (the caller's own jit) has no buffers to lose
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted():
            raise PipelineError(
                f"{what}{jax.tree_util.keystr(path)} was deleted (donated to an earlier "
                f"call, such as train_step, or .delete()d): its buffers are gone. {fix}"
            )


def _not_differentiable(x: jax.Array, what: str) -> jax.Array:
    return x


# an identity whose derivative rule refuses: how a JAX transformation differentiating an
# entry point (jax.grad around pipe.loss) is told, before placement fails obscurely
_not_differentiable = jax.custom_jvp(_not_differentiable, nondiff_argnums=(1,))


@_not_differentiable.defjvp
def _refuse(what: str, primals: tuple, tangents: tuple) -> Any:
    raise PipelineError(
        f"a JAX transformation (jax.grad, jax.jvp, jax.vjp, ...) differentiates a pipeline "
        f"call with respect to {what}: a pipeline's programs compute gradients themselves "
        "and are not differentiable in turn. Call pipe.value_and_grad(params, batch) for "
        "the loss and its gradient (pipe.train_step to train) instead of differentiating "
        "pipe.loss; "
        "higher-order derivatives through a pipeline are not supported."
        + (" A gradient with respect to the batch is not returned either: compute what "
           "produces the batch (an embedding) inside loss_fn, its weights in params."
           if what == "batch" else ""))


def check_usable(tree: Any, what: str, fix: str) -> None:
    """What every entry point checks of the arrays it is passed: that no JAX
    transformation differentiates them (:func:`check_not_differentiated`) and that none
    was donated or deleted (:func:`check_alive`, ``fix`` saying what to pass instead)."""
    check_not_differentiated(tree, what)
    check_alive(tree, what, fix)


def check_traced_alike(built_precision: Any, what: str) -> None:
    """Raise :class:`PipelineError` if ``jax.default_matmul_precision`` differs from the one
    the pipeline was built under: its stages were traced then, and JAX fixes a matmul's
    precision when it traces it, so this call's would not apply."""
    now = jax.config.jax_default_matmul_precision
    if now != built_precision:
        def name(p: Any) -> str:
            return "None (XLA's default)" if p is None else repr(p)

        raise PipelineError(
            f"{what} runs under jax.default_matmul_precision {name(now)}, but the pipeline "
            f"was built under {name(built_precision)}: its stages were traced at build, "
            "when JAX fixes each matmul's precision, so this call's would not apply. Build "
            "the pipeline (jp.pipeline) inside the same `with jax.default_matmul_precision"
            "(...)`, or set jax.config.update('jax_default_matmul_precision', ...) before "
            "building it.")


@contextlib.contextmanager
def on_own_mesh(mesh: Any, what: str) -> Iterator[None]:
    """Run ``what`` under the pipeline's own mesh where the caller's ``jax.set_mesh``
    names another (a training job's global mesh): traced under it, the stages' types
    named the other mesh and every call failed inside JAX. Inside a ``jax.jit`` traced
    under the other mesh the inputs' types name it too: a clear error then."""
    ambient = jax.sharding.get_abstract_mesh()
    with contextlib.ExitStack() as stack:
        if isinstance(mesh, Mesh) and not ambient.empty and ambient != mesh.abstract_mesh:
            try:
                stack.enter_context(jax.set_mesh(mesh))
            except ValueError:  # set_mesh refuses to run under a jit's trace
                raise _under_another_mesh(ambient, mesh, what) from None
        yield


def _under_another_mesh(ambient: Any, mesh: Mesh, what: str) -> PipelineError:
    """The error for ``what`` traced under another mesh than the pipeline's."""
    manual = [a for a, t in zip(ambient.axis_names, ambient.axis_types, strict=True)
              if t == jax.sharding.AxisType.Manual]
    if manual:
        return PipelineError(
            f"{what} is called inside a jax.shard_map manual over {manual}: the pipeline "
            "is its own shard_map over the whole mesh; call it outside yours (its "
            "batch_axes= split the batch over data axes for you).")
    return PipelineError(
        f"{what} is traced inside a jax.jit under jax.set_mesh of another mesh "
        f"({dict(ambient.shape)}) than the pipeline's ({dict(mesh.shape)}): call it "
        "outside that jit, or trace that jit under the pipeline's mesh "
        "(jax.set_mesh(pipe.mesh)).")


def check_not_differentiated(tree: Any, what: str) -> None:
    """Raise :class:`PipelineError` if a JAX transformation differentiates ``tree``'s
    floating-point leaves (only tracers are looked at; nothing is added to a program)."""
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.core.Tracer) and jax.numpy.issubdtype(x.dtype, np.inexact):
            _not_differentiable(x, what)


def check_pipeline_args(loss_fn: Any, schedule: Any, axis: Any, rng: Any) -> None:
    """The types of ``jp.pipeline``'s plain arguments, each with the fix in its error."""
    if not isinstance(schedule, Schedule):
        named = (f" ({schedule!r} is not a name it takes: schedule='auto' chooses one, "
                 "jp.load_schedule(name)(num_devices, num_microbatches) builds one by "
                 "name)") if isinstance(schedule, str) else ""
        got = (f"the class {schedule.__name__}, not an instance of it"
               if isinstance(schedule, type) else f"{type(schedule).__name__}{named}")
        raise PipelineTypeError(
            f"schedule must be a jaxpipe.Schedule instance, 'auto' or jp.Auto(...), got "
            f"{got}; e.g. jp.OneFOneB(num_devices=4, num_microbatches=8) or jp.Auto().")
    if not callable(loss_fn):
        raise PipelineTypeError(
            f"loss_fn must be a function loss_fn(params, microbatch) -> scalar, got "
            f"{type(loss_fn).__name__}; jp.pipeline(loss_fn, params, batch, ...).")
    if not isinstance(axis, str):
        raise PipelineTypeError(f"axis must be the name (str) of the pipeline mesh axis, "
                                f"got {axis!r}.")
    if not isinstance(rng, bool):
        raise PipelineTypeError(f"rng must be True or False, got {rng!r}.")
    _check_key_argument(loss_fn, rng)


def _check_key_argument(loss_fn: Any, rng: bool) -> None:
    """``loss_fn`` takes a key exactly when ``rng=True`` (the trace would raise Python's
    TypeError about the call, which names neither)."""
    try:
        signature = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # (a callable Python cannot inspect: the call says)
        return
    args = ("params", "microbatch", "key") if rng else ("params", "microbatch")
    try:
        signature.bind(*args)
    except TypeError:
        fix = ("with rng=True the pipeline calls loss_fn(params, microbatch, key): take the "
               "key, or drop rng=True" if rng else
               "a loss_fn(params, microbatch, key) needs rng=True (jp.pipeline(..., "
               "rng=True)), which passes each microbatch its key; or give key a default")
        raise PipelineTypeError(
            f"loss_fn{signature} cannot be called as loss_fn({', '.join(args)}): "
            f"{fix}.") from None


def check_objective(has_aux: Any, reduction: Any) -> Objective:
    """``jp.pipeline``'s ``has_aux`` and ``reduction`` as an :class:`Objective`."""
    if not isinstance(has_aux, bool):
        raise PipelineTypeError(f"has_aux must be True or False, got {has_aux!r}.")
    if reduction not in REDUCTIONS:
        raise PipelineError(
            f"reduction must be one of {', '.join(map(repr, REDUCTIONS))}, got "
            f"{reduction!r}; 'weighted' takes loss_fn returning (loss_sum, weight).")
    return Objective(reduction=reduction, has_aux=has_aux)


def check_microbatch_rows(mb_shapes: Sequence[tuple[int, ...]], num_microbatches: int,
                          batch_shards: int, batch_axes: tuple[str, ...]) -> None:
    """Every microbatch leaf has rows, and as many as split evenly over the batch axes."""
    if any(shape[0] == 0 for shape in mb_shapes):
        raise PipelineError(
            "the batch is empty (batch size 0); pass at least num_microbatches="
            f"{num_microbatches} rows.")
    for shape in mb_shapes:
        if shape[0] % batch_shards:
            raise PipelineError(
                f"microbatch size {shape[0]} is not divisible by the {batch_shards} devices "
                f"of the data axes {batch_axes}; use a batch size divisible by "
                f"{batch_shards * num_microbatches}.")


def check_mesh(mesh: Mesh, axis: str, schedule: Schedule) -> tuple[str, ...]:
    """The batch axes of ``mesh`` (all but ``axis``); a clear error for a wrong mesh."""
    if not isinstance(mesh, Mesh):
        raise PipelineTypeError(
            f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}; build one with "
            f"jax.make_mesh(({schedule.num_devices},), ('{axis}',))."
        )
    if axis not in mesh.axis_names:
        raise PipelineError(
            f"the mesh has axes {tuple(mesh.axis_names)} but no '{axis}' axis to pipeline "
            f"over; build it with jax.make_mesh(({schedule.num_devices},), ('{axis}',)) or pass "
            "axis=<name of your pipeline axis>."
        )
    if mesh.shape[axis] != schedule.num_devices:
        raise PipelineError(
            f"mesh axis '{axis}' has size {mesh.shape[axis]} but the schedule has "
            f"num_devices={schedule.num_devices}; make them equal."
        )
    return tuple(a for a in mesh.axis_names if a != axis)


def check_no_keys(params: Any) -> None:
    """Refuse PRNG keys among the parameter leaves (they are not parameters)."""
    for path, x in jax.tree.flatten_with_path(params)[0]:
        if is_key(x):
            raise PipelineTypeError(
                f"params leaf {jax.tree_util.keystr(path)} is a PRNG key; keys are not "
                "parameters. Build the pipeline with rng=True and pass a key to each call "
                "(loss_fn(params, microbatch, key)), or close over a fixed key in loss_fn.")


