"""Every input of a pipeline call goes onto the pipeline's mesh, in one sharding per kind.

A batch built with numpy, committed to one device, placed on another mesh or restored
from a checkpoint runs, and runs the *same* compiled program as a batch that was placed
globally (:class:`Placement`). :func:`live_state` does the same for a
:class:`~jaxpipe.train.state.TrainState` after checking it belongs to the pipeline.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe.api.inputs import check_alive, check_not_differentiated
from jaxpipe.errors import PipelineError, PipelineTypeError
from jaxpipe.sharding.device_memory import is_compile_only
from jaxpipe.sharding.mesh_axes import Dims, MeshAxes, to_spec
from jaxpipe.train.state import TrainState

__all__ = ["Placement", "live_state", "microbatch_rows"]


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
        #: a mesh of an ahead-of-time target: nothing can be placed on it
        self.compile_only = is_compile_only(mesh.devices.flat[0])
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
        if isinstance(x, jax.ShapeDtypeStruct):
            raise PipelineError(
                f"{what} is a jax.ShapeDtypeStruct (a shape and dtype, no values): a call "
                "runs on arrays. To compile from abstract inputs, use pipe.lower(...) "
                "(docs/aot.md).")
        if isinstance(x, jax.Array) and x.sharding == sharding:
            return x
        if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
            # the same shards under another name (P('pipe', None) for P('pipe')): the
            # arrays again under the expected one, no copy and no dispatch (device_put
            # was ~0.5 ms a leaf across processes, every train_step)
            return jax.make_array_from_single_device_arrays(
                x.shape, sharding, [s.data for s in x.addressable_shards])
        if self.compile_only:
            raise PipelineError(
                f"{what} cannot be placed: this pipeline's mesh is of compile-only devices "
                f"({self.mesh.devices.flat[0].device_kind}, an ahead-of-time target), where "
                "nothing runs. Compile its programs instead: pipe.lower('train_step', "
                "optimizer=...).compile(), or jaxpipe.aot.compile_report(pipe, ...).")
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
        # a leaf on the mesh keeps its sharding, but a replicated one under another name
        # (P(None,) for P()) is named as the first call's was: jit would compile again
        return [x if self.on_mesh(x) and not x.sharding.is_equivalent_to(
                    self.replicated, np.ndim(x))
                else self.put(x, self.replicated, f"params{p}")
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


def live_state(state: Any, executor: Any, placement: Placement, what: str) -> Any:
    """A :class:`~jaxpipe.train.state.TrainState` checked for ``executor`` and placed on its mesh.

    Refused: not a TrainState, a state of another pipeline, a state not in the stage
    layout, a state whose buffers were donated.
    """
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
    check_not_differentiated(state, what)  # (named by the entry point, the state by name)
    check_alive(state, "state", "Use the state the last train_step returned: "
                "state, metrics = pipe.train_step(state, batch).")
    want = state.trainer.abstract_state()
    placed = placement.like((state.params, state.opt_state, state.step),
                            (want.params, want.opt_state, want.step), "state")
    return TrainState(*placed, state.trainer)


def microbatch_rows(x: Any, m: int) -> Any:
    """A batch leaf ``x`` as ``[m, rows / m, ...]``. Rows split over Explicit mesh axes
    stay split the same way within each microbatch: JAX keeps such a split on the
    leading dimension where ``m`` divides over it, and refuses the reshape where it does
    not (8 rows over ``data=2`` as 3 microbatches)."""
    shape = (m, jnp.shape(x)[0] // m, *jnp.shape(x)[1:])  # (not -1: a leaf may be empty)
    sharding = jax.typeof(x).sharding
    spec = getattr(sharding, "spec", None)
    if spec and spec[0] is not None:
        return jnp.reshape(x, shape, out_sharding=NamedSharding(sharding.mesh, P(None, *spec)))
    return jnp.reshape(x, shape)
