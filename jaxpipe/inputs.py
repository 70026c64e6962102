"""What the frontend does to a call's inputs before any compiled program sees them.

Four jobs, each a small class or function used by :class:`jaxpipe.Pipeline`:

- :func:`check_params` / :func:`check_batch` / :func:`check_key`: the type, structure,
  shapes and dtypes of what a call passes, checked against what the pipeline was built
  for, with the argument named and the fix given (a train state where parameters are
  expected, the stage layout passed as a pytree, a batch of another size, ...).
- :func:`check_alive`: arrays whose buffers were donated to an earlier ``train_step``
  (or deleted) are refused with a clear error before XLA reads freed memory.
- :class:`Placement`: every input goes onto the pipeline's mesh first, in one canonical
  sharding per kind of input, so a batch built with numpy, committed to one device,
  placed on another mesh or restored from a checkpoint runs, and runs the *same*
  compiled program as a batch that was placed globally.
- :class:`CompileWatch`: a jitted entry point that says, once, when it compiles again
  for inputs of the same shapes, and why.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe.errors import PipelineError, PipelineTypeError
from jaxpipe.objective import REDUCTIONS, Objective
from jaxpipe.sharding import Dims, MeshAxes, to_spec

if TYPE_CHECKING:
    from jaxpipe.schedule import Schedule

__all__ = ["CompileWatch", "Placement", "RecompileWarning", "check_alive", "check_batch",
           "check_key", "check_mesh", "check_no_keys", "check_params", "leaf_paths",
           "live_state"]


def leaf_paths(treedef: Any) -> list[str]:
    """``keystr`` of every leaf position of ``treedef`` (``"['w'][0]"``)."""
    tree = jax.tree.unflatten(treedef, list(range(treedef.num_leaves)))
    return [jax.tree_util.keystr(p) for p, _ in jax.tree.flatten_with_path(tree)[0]]


def _kind(x: Any) -> str:
    from jaxpipe.train import TrainState

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
    from jaxpipe.trace import microbatch_like

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
            raise PipelineError(
                f"microbatch leaf shape {w.shape} (batch{path}) differs from the {shape} the "
                f"pipeline was built for; rebuild the pipeline for a new batch size.{hint}"
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
                f"{key_dtype}; make keys with the same implementation.")
        return key
    impl = key_dtype._impl
    if (dtype is not None and np.dtype(dtype) == np.uint32
            and tuple(np.shape(key)) == tuple(impl.key_shape)):
        return jax.random.wrap_key_data(key, impl=impl)  # a raw jax.random.PRNGKey
    raise PipelineTypeError(
        f"{what} needs a PRNG key made by jax.random.key(seed), got "
        f"{type(key).__name__}{' ' + str(np.shape(key)) if dtype is not None else ''}.")


class RecompileWarning(UserWarning):
    """A pipeline entry point compiled again for inputs of the same shapes."""


def check_alive(tree: Any, what: str, fix: str) -> None:
    """Raise :class:`PipelineError` if an array of ``tree`` was donated or deleted."""
    for path, x in jax.tree.flatten_with_path(tree)[0]:
        # a tracer (the caller's own jit) has no buffers to lose
        if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted():
            raise PipelineError(
                f"{what}{jax.tree_util.keystr(path)} was donated to an earlier train_step "
                f"(or deleted): its buffers are gone. {fix}"
            )


def _devices(x: Any) -> str:
    sharding = getattr(x, "sharding", None)
    ids = sorted(d.id for d in sharding.device_set) if sharding is not None else []
    return f"devices {ids}" if ids else "the host"


class Placement:
    """Canonical shardings of a pipeline's inputs on its mesh.

    - parameters (the user's pytree): sharded as the pipeline's ``param_specs`` say;
      without specs, replicated, unless already on this mesh with a sharding of the
      user's own (kept);
    - batch leaves: split along axis 0 over the batch axes, replicated over the pipe
      axis (what :func:`jaxpipe.distributed.global_batch` builds);
    - anything in a runtime's layout (staged parameters, optimizer state): the sharding
      the runtime gives it.

    A host (numpy) array is the whole global value, as with ``jax.device_put``; in a
    multi-process run every process passes the same values (build per-process rows
    into a global batch with :func:`jaxpipe.distributed.global_batch`).
    """

    def __init__(self, mesh: Mesh, axes: MeshAxes, param_dims: tuple[Dims, ...] = ()
                 ) -> None:
        self.mesh = mesh
        self.replicated = NamedSharding(mesh, P())
        self.batch = NamedSharding(mesh, axes.batch_spec())
        #: per user parameter leaf, its sharding (None: as before, see the class doc)
        self.param_shardings = [NamedSharding(mesh, to_spec(d)) if any(d) else None
                                for d in param_dims]

    def on_mesh(self, x: Any) -> bool:
        sharding = getattr(x, "sharding", None)
        return isinstance(sharding, NamedSharding) and sharding.mesh == self.mesh

    def put(self, x: Any, sharding: jax.sharding.Sharding, what: str) -> jax.Array:
        """``x`` on ``sharding``; a clear error if it cannot get there."""
        if isinstance(x, jax.core.Tracer):  # inside the caller's jit: a sharding constraint
            return jax.device_put(x, sharding)
        if isinstance(x, jax.Array) and x.sharding == sharding:
            return x
        if jax.dtypes.issubdtype(getattr(x, "dtype", None) or np.float32, jax.dtypes.prng_key):
            # PRNG keys move as their key data (numpy cannot hold them)
            data = self.put(jax.random.key_data(x), sharding, what)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        try:
            if isinstance(x, jax.Array) and not x.is_fully_addressable:
                return jax.device_put(x, sharding)  # a global array: reshard
            if jax.process_count() > 1:
                # The whole value on every process: each takes the shards it holds.
                host = np.asarray(x)
                return jax.make_array_from_callback(host.shape, sharding,
                                                    lambda index: host[index])
            if isinstance(x, jax.Array) and x.sharding.device_set != sharding.device_set:
                x = np.asarray(x)  # other devices (another mesh): through the host
            return jax.device_put(x, sharding)
        except (ValueError, RuntimeError, TypeError) as err:
            raise PipelineError(
                f"{what} lives on {_devices(x)} and cannot be moved onto the pipeline's "
                f"mesh (devices {sorted(d.id for d in self.mesh.devices.flat)}): "
                f"{' '.join(str(err).split())[:300]}. Build it on this mesh, e.g. with "
                "jaxpipe.distributed.replicate / global_batch, or jax.device_get it first."
            ) from err

    def params(self, leaves: list, paths: list[str]) -> list:
        if any(self.param_shardings):
            return [self.put(x, s or self.replicated, f"params{p}")
                    for x, s, p in zip(leaves, self.param_shardings, paths, strict=True)]
        return [x if self.on_mesh(x) else self.put(x, self.replicated, f"params{p}")
                for x, p in zip(leaves, paths, strict=True)]

    def batch_leaves(self, leaves: list, paths: list[str]) -> list:
        return [self.put(x, self.batch, f"batch{p}") for x, p in zip(leaves, paths,
                                                                      strict=True)]

    def like(self, tree: Any, abstract: Any, what: str) -> Any:
        """``tree`` placed like ``abstract`` (``ShapeDtypeStruct`` s with shardings)."""
        def one(path, x, a):
            sharding = getattr(a, "sharding", None)
            if sharding is None:
                return x
            return self.put(x, sharding, f"{what}{jax.tree_util.keystr(path)}")

        return jax.tree.map_with_path(one, tree, abstract)


def _signature(args: Any) -> list[tuple[str, str]]:
    """(path, 'shape dtype weak sharding') of every array leaf of ``args``."""
    out = []
    for path, x in jax.tree.flatten_with_path(args)[0]:
        weak = " weak_type" if getattr(getattr(x, "aval", None), "weak_type", False) else ""
        out.append((jax.tree_util.keystr(path),
                    f"{getattr(x, 'shape', ())} {getattr(x, 'dtype', type(x).__name__)}"
                    f"{weak} {getattr(x, 'sharding', 'host')}"))
    return out


class CompileWatch:
    """A jitted function that warns once when it compiles a second time.

    Inputs are placed canonically before the call, so a second compilation for the same
    shapes means something else changed (a parameter sharding of the user's own, a
    weak type, a jax config flag). The warning names the entry point and the first input
    whose signature differs from the first call's.
    """

    def __init__(self, fn: Any, name: str,
                 check: Callable[[Any, str], None] | None = None) -> None:
        self.fn = fn
        self.name = name
        #: ``check(compiled, name)`` runs once, on the program compiled for the first call
        #: (a runtime's refusal of a program it cannot run, before it runs)
        self.check = check
        self._first: list | None = None
        self._warned = False

    def __call__(self, *args: Any) -> Any:
        if self._first is None and self.check is not None:
            # jit reuses this compilation for the call below
            self.check(self.fn.lower(*args).compile(), self.name)
        before = self._cache_size()
        out = self.fn(*args)
        if self._first is None:
            self._first = _signature(args)
        elif not self._warned and self._cache_size() > max(before, 1):
            self._warned = True
            now = _signature(args)
            diff = next((f"{p}: {b} (first call: {a})" for (p, a), (_, b) in zip(
                self._first, now, strict=False) if a != b), "no input signature changed")
            warnings.warn(
                f"{self.name} compiled again for inputs of the same shapes ({diff}); every "
                "new input signature costs a full compilation. Pass inputs with the same "
                "dtypes and shardings at every call (jaxpipe places batches and "
                "parameters on the pipeline's mesh itself). This warning is shown once.",
                RecompileWarning, stacklevel=3)
        return out

    def _cache_size(self) -> int:
        size: Callable[[], int] | None = getattr(self.fn, "_cache_size", None)
        return size() if size is not None else 0

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn.lower(*args, **kwargs)


def check_pipeline_args(loss_fn: Any, schedule: Any, axis: Any, rng: Any) -> None:
    """The types of ``jp.pipeline``'s plain arguments, each with the fix in its error."""
    from jaxpipe.schedule import Schedule

    if not isinstance(schedule, Schedule):
        raise PipelineTypeError(
            f"schedule must be a jaxpipe.Schedule instance, got {type(schedule).__name__};"
            " e.g. jp.OneFOneB(num_devices=4, num_microbatches=8).")
    if not callable(loss_fn):
        raise PipelineTypeError(
            f"loss_fn must be a function loss_fn(params, microbatch) -> scalar, got "
            f"{type(loss_fn).__name__}; jp.pipeline(loss_fn, params, batch, ...).")
    if not isinstance(axis, str):
        raise PipelineTypeError(f"axis must be the name (str) of the pipeline mesh axis, "
                                f"got {axis!r}.")
    if not isinstance(rng, bool):
        raise PipelineTypeError(f"rng must be True or False, got {rng!r}.")


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
    from jaxpipe.avals import is_key

    for path, x in jax.tree.flatten_with_path(params)[0]:
        if is_key(x):
            raise PipelineTypeError(
                f"params leaf {jax.tree_util.keystr(path)} is a PRNG key; keys are not "
                "parameters. Build the pipeline with rng=True and pass a key to each call "
                "(loss_fn(params, microbatch, key)), or close over a fixed key in loss_fn.")


def live_state(state: Any, executor: Any, placement: Placement, what: str) -> Any:
    """A :class:`~jaxpipe.train.TrainState` checked for ``executor`` and placed on its mesh.

    Refused: not a TrainState, a state of another pipeline, a state not in the stage
    layout, a state whose buffers were donated.
    """
    from jaxpipe.train import TrainState

    if not isinstance(state, TrainState):
        hint = ("call pipe.init(params, optimizer) before pipe.train_step(state, batch)"
                if state is None or what == "train_step" else
                "pass the TrainState from pipe.init / train_step (for staged parameters "
                "use pipe.unshard)")
        raise PipelineTypeError(
            f"{what} needs the TrainState returned by pipe.init, got "
            f"{type(state).__name__}; {hint}."
        )
    if state.trainer.executor is not executor:
        raise PipelineError(
            "this TrainState was made by another pipeline: its state layout belongs to "
            "that pipeline's stages and optimizer, not this pipeline's. Train it with "
            "that pipeline, or start from its parameters here with "
            "pipe.init(other.params(state), optimizer)."
        )
    executor.check_staged(state.params, f"{what} (state.params)")
    check_alive(state, "state", "Use the state the last train_step returned: "
                "state, metrics = pipe.train_step(state, batch).")
    placed = placement.like(
        (state.params, state.opt_state, state.step),
        (executor.staged_abstract(), state.trainer.abstract_opt_state(),
         jax.ShapeDtypeStruct((), np.int32, sharding=placement.replicated)), "state")
    return TrainState(*placed, state.trainer)
