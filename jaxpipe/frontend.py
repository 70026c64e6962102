"""``jp.pipeline``: trace, cut and split a loss, then hand the stages to a runtime.

:class:`Pipeline` is the frontend. It does the layers above the runtime seam, in order:

1. trace ``loss_fn`` to a flat jaxpr with its candidate cuts (:mod:`jaxpipe.trace`);
2. choose the cut and split the jaxpr into stage functions (:mod:`jaxpipe.cut_and_split`:
   the cutter of :mod:`jaxpipe.cut` with the runtime's memory model, then
   :mod:`jaxpipe.stages.stage_fn`; a scanned layer stack is cut between its iterations and run as
   one scan per stage, :mod:`jaxpipe.stacks`);
3. build the runtime's executor from one :class:`~jaxpipe.runtime.RuntimeSpec`.

Everything about where values live on devices and how the schedule runs is the
executor's (``pipe.executor``); the frontend checks inputs, reshapes batches into
microbatches and maps between the user's pytrees and flat leaves, and between the
user's leaves and the stages' parameter views (:mod:`jaxpipe.param_views`: a stacked weight
split over stages is passed as each stage's rows, its gradient gathered back).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxpipe.auto import AutoChoice, choose, placeholder, resolve_auto
from jaxpipe.avals import to_boundary
from jaxpipe.build_times import BuildTimes
from jaxpipe.compile_watch import CompileWatch
from jaxpipe.constraints import without_constrained_batch_axes
from jaxpipe.cut_and_split import cut_and_split, cut_only
from jaxpipe.errors import PipelineTypeError
from jaxpipe.input_placement import Placement, live_state
from jaxpipe.inputs import (
    check_alive,
    check_batch,
    check_key,
    check_mesh,
    check_microbatch_rows,
    check_no_keys,
    check_objective,
    check_params,
    check_pipeline_args,
    leaf_paths,
)
from jaxpipe.objective import Objective
from jaxpipe.param_views import ParamViews
from jaxpipe.runtime import Executor, Runtime, resolve
from jaxpipe.schedule import Schedule
from jaxpipe.sharding import (
    MeshAxes,
    placed_batch_axes,
    resolve_mesh_axes,
    to_spec,
    trace_context,
    typed_shardings,
)
from jaxpipe.stacks import Stack
from jaxpipe.stages.stage_fn import StageFn
from jaxpipe.trace import Traced, microbatch_like, trace_shard
from jaxpipe.xla_flags import compiler_options

__all__ = ["Pipeline", "pipeline"]


class Pipeline:
    """A loss function compiled for pipelined execution under one schedule.

    Build it with :func:`pipeline`. ``value_and_grad(params, batch)`` returns the mean loss
    over microbatches and its gradient, equal to ``jax.value_and_grad`` of the unpipelined
    mean loss. ``shard``/``unshard`` move parameters into and out of the runtime's stage
    layout; ``init``/``train_step`` train with optax keeping parameters resident.

    Attributes:
      loss_fn, schedule, mesh, axis: as passed to :func:`pipeline`.
      batch_axes: the mesh axes the batch is split over (gradients are averaged over
        them).
      mesh_axes: the roles of the mesh axes (:class:`jaxpipe.sharding.MeshAxes`).
      param_dims: per user parameter leaf, its sharding over the non-pipe axes
        (:data:`jaxpipe.sharding.Dims`; :attr:`param_specs` as ``PartitionSpec`` s).
      traced: the traced loss (:class:`jaxpipe.trace.Traced`).
      stacks: the scanned layer stacks found in it (:class:`jaxpipe.stacks.Stack`; each
        is cut between its iterations).
      cut_traced: the loss the cutter sees: ``traced`` with a cut marker after every
        iteration of every stack (``traced`` itself when there are none).
      cuts: marker indices (into ``cut_traced.markers``) after which a new stage begins.
      views: the stages' parameter inputs over the user's leaves
        (:class:`jaxpipe.param_views.ParamViews`; each stage gets its own rows of a stacked
        weight).
      cut_report: the cutter's :class:`jaxpipe.cut.CutResult` (predicted costs, memory).
      stages: the stage functions (:class:`jaxpipe.stages.stage_fn.StageFn`).
      runtime: the :class:`jaxpipe.runtime.Runtime` that runs them.
      executor: the runtime bound to this pipeline (``pipe.executor.lowering`` holds the
        SPMD runtime's tick tables).
    """

    def __init__(self, loss_fn: Callable[..., jax.Array], params: Any, batch: Any, *,
                 mesh: Mesh, schedule: Schedule, cut: Any = "auto", axis: str = "pipe",
                 runtime: str | Runtime = "spmd", rng: bool = False,
                 batch_axes: Any = None, param_specs: Any = None, has_aux: bool = False,
                 reduction: str = "mean") -> None:
        auto = resolve_auto(schedule)
        if auto is not None:  # traced with m of the choice; the family chosen after the trace
            schedule = placeholder(auto, mesh, axis, batch)
        check_pipeline_args(loss_fn, schedule, axis, rng)
        objective = check_objective(has_aux, reduction)
        self.runtime: Runtime = resolve(runtime)
        schedule.validate()
        self.loss_fn = loss_fn
        self.schedule = schedule
        self.mesh = mesh
        self.axis = axis
        self.rng = rng
        check_mesh(mesh, axis, schedule)
        check_no_keys(params)
        param_leaves, param_tree = jax.tree.flatten(params)
        placed = None if batch_axes is not None else placed_batch_axes(batch, mesh, axis)
        mesh_axes, self.param_dims = resolve_mesh_axes(
            mesh, axis, batch_axes, param_specs, params, param_tree,
            [tuple(np.shape(x)) for x in param_leaves], placed)
        self.num_microbatches = schedule.num_microbatches
        mb = microbatch_like(batch, self.num_microbatches)
        self._mb_shapes = [a.shape for a in jax.tree.leaves(mb)]
        self._batch_shapes = [tuple(np.shape(x)) for x in jax.tree.leaves(batch)]
        self._batch_treedef = jax.tree.structure(batch)
        self._batch_dtypes = [a.dtype for a in jax.tree.leaves(mb)]
        self.key_dtype = jax.random.key(0).dtype if rng else None
        self._times = BuildTimes()
        with self._times.phase("trace"):
            self.traced = self._trace(mesh_axes, loss_fn, params, mb, objective)
        # Batch axes the model's own sharding constraints name stay under JAX's sharding.
        kept = without_constrained_batch_axes(mesh_axes, self.traced.jaxpr,
                                              batch_axes is None and placed is None)
        if kept is not None:
            with self._times.phase("trace"):
                self.traced = self._trace(kept, loss_fn, params, mb, objective)
        self.objective: Objective = self.traced.objective
        self.param_avals = tuple(v.aval for v in self.traced.jaxpr.invars[
            : self.traced.num_params])
        #: what schedule="auto" chose and why (None: the schedule was given)
        self.auto_choice: AutoChoice | None = None
        if auto is not None:
            with trace_context(mesh, self.mesh_axes), self._times.phase("cut"):
                memory = self.runtime.memory_model_for(mesh)
                self.auto_choice = choose(
                    auto, schedule.num_devices, schedule.num_microbatches,
                    lambda s: cut_only(self.traced, s, cut, memory, mesh, self.param_dims,
                                       self.runtime.in_flight(s, mesh, self.mesh_axes)),
                    lambda s, r: self.runtime.predicted_time(s, r.action_cost, mesh,
                                                             self.mesh_axes))
            self.schedule = schedule = self.auto_choice.schedule
        with trace_context(mesh, self.mesh_axes), self._times.phase("cut"):
            st = cut_and_split(self.traced, schedule, cut,
                               self.runtime.memory_model_for(mesh), mesh, self.param_dims,
                               share_cores=self.runtime.shares_cores(),
                               split_backward=self.runtime.splits_backward(mesh, self.mesh_axes),
                               in_flight=self.runtime.in_flight(schedule, mesh, self.mesh_axes),
                               cut_report=self.auto_choice and self.auto_choice.cut_report)
        self.stacks: tuple[Stack, ...] = st.stacks
        self.cut_traced: Traced = st.cut_traced
        self.cuts, self.cut_report = st.cuts, st.cut_report
        self.views: ParamViews = st.views
        self.stages: list[StageFn] = st.stages
        with self._times.phase("schedule"):
            self.executor: Executor = self.runtime.build(st.runtime_spec(
                self.traced, schedule, mesh, axis, self.mesh_axes, self.param_dims))
        self._param_paths = leaf_paths(self.traced.params_treedef)
        # XLA options for the mesh's platform (GPU: the permutes' overlap), per compile
        jit = functools.partial(jax.jit, compiler_options=compiler_options(
            mesh.devices.flat[0].platform))
        self._vg = jit(self._value_and_grad)
        self._staged_vg = jit(self._staged_value_and_grad)
        self._loss_jit = jit(self._loss)
        self._staged_loss_jit = jit(self._staged_loss)
        check = self.executor.compiled_check()
        self._vg_watch = CompileWatch(self._vg, "pipe.value_and_grad", check, self._times)
        self._staged_vg_watch = CompileWatch(self._staged_vg, "pipe.staged_value_and_grad",
                                             check, self._times)
        self._loss_watch = CompileWatch(self._loss_jit, "pipe.loss", check, self._times)
        self._staged_loss_watch = CompileWatch(self._staged_loss_jit, "pipe.loss", check,
                                               self._times)
        self._shard_jit = jax.jit(self.executor.shard)
        self._unshard_jit = jax.jit(self.executor.unshard)
        self._plan = None
        if jax.process_count() > 1:
            # Every process must build the same program, or its collectives never match.
            from jaxpipe.distributed import check_consistent

            check_consistent(self)

    # ---------------------------------------------------------------- properties
    @property
    def data_axes(self) -> tuple[str, ...]:
        """Alias of :attr:`batch_axes`."""
        return self.batch_axes

    @property
    def batch_shards(self) -> int:
        """How many pieces the batch axes split every microbatch into."""
        return self._shards(self.batch_axes)

    @property
    def batch_sharding(self) -> Any:
        """The ``NamedSharding`` batches are placed with: axis 0 split over the batch axes
        (those the program is manual over first), replicated over the pipe axis. Build
        multi-process batches with it to skip a reshard at every call."""
        return self.placement.batch

    def _trace(self, mesh_axes: MeshAxes, loss_fn: Callable, params: Any, mb: Any,
               objective: Objective) -> Traced:
        """Take ``mesh_axes`` as the mesh's roles and trace one microbatch's data shard."""
        self.mesh_axes, self.batch_axes = mesh_axes, mesh_axes.batch_axes
        self.placement = Placement(self.mesh, mesh_axes, self.param_dims)
        check_microbatch_rows(self._mb_shapes, self.num_microbatches, self.batch_shards,
                              self.batch_axes)
        with trace_context(self.mesh, mesh_axes):
            return trace_shard(loss_fn, params, mb, self._shards(mesh_axes.manual_batch_axes),
                               self._shards(mesh_axes.auto_batch_axes) if self.rng else 0,
                               self.key_dtype, objective,
                               typed_shardings(self.mesh, mesh_axes, self.param_dims))

    def _shards(self, axes: tuple[str, ...]) -> int:
        return int(np.prod([self.mesh.shape[a] for a in axes])) if axes else 1

    @property
    def param_specs(self) -> Any:
        """The parameters' sharding over the non-pipe mesh axes: a pytree of
        ``PartitionSpec`` with the structure of ``params`` (``P()``: replicated)."""
        return jax.tree.unflatten(self.traced.params_treedef,
                                  [to_spec(d) for d in self.param_dims])

    @property
    def param_owners(self) -> dict[int, tuple[int, ...]]:
        """Parameter leaf -> the stages that read it (a tied leaf has several; a stacked
        weight split over stages lists the stages holding its rows)."""
        owners: dict[int, set[int]] = {}
        for pid, stages in self.executor.spec.param_owners.items():
            owners.setdefault(self.views.views[pid].leaf, set()).update(stages)
        return {leaf: tuple(sorted(s)) for leaf, s in sorted(owners.items())}

    # ---------------------------------------------------------------- checks
    def check_params(self, params: Any, what: str = "params") -> list:
        """The flat leaves of ``params``; a clear error unless it is the traced structure
        (and not, say, a train state or the stage layout)."""
        return check_params(params, self.traced.params_treedef, self.param_avals,
                            self.staged_shapes(), what)

    def check_batch(self, batch: Any) -> list:
        """The flat leaves of ``batch``; a clear error unless it has the structure, shapes
        and dtypes the pipeline was built for."""
        return check_batch(batch, self._batch_treedef, self._mb_shapes, self._batch_dtypes,
                           self.num_microbatches, multiprocess=jax.process_count() > 1)

    def microbatches(self, batch: Any, key: Any = None) -> list:
        """The batch's flat leaves reshaped to ``[num_microbatches, microbatch, ...]``.

        Checks the structure, shapes and dtypes against what the pipeline was built for.
        With ``rng=True`` the per-microbatch keys derived from ``key`` follow as one more
        leaf (``[m, data shards, key data]``). Key-typed leaves are passed as key data.
        """
        m = self.num_microbatches
        leaves = [to_boundary(x) for x in self.check_batch(batch)]
        out = [jnp.reshape(x, (m, -1, *jnp.shape(x)[1:])) for x in leaves]
        if self.rng:
            if key is None:
                check_key(key, True, self.key_dtype, "this call")
            pieces = jnp.arange(m * self.batch_shards, dtype=jnp.uint32)
            keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(pieces)
            out.append(jnp.reshape(jax.random.key_data(keys), (m, self.batch_shards, -1)))
        return out

    def _user_tree(self, leaves: list) -> Any:
        """Flat leaves from a runtime -> the user's pytree, each leaf in its traced dtype
        (a runtime's cross-device sum turns a bool leaf into int32)."""
        leaves = [x if x.dtype == a.dtype else x.astype(a.dtype)
                  for x, a in zip(leaves, self.param_avals, strict=True)]
        return jax.tree.unflatten(self.traced.params_treedef, leaves)

    def _place_params(self, params: Any, what: str = "params") -> Any:
        """``params`` checked, alive and on the mesh (same pytree)."""
        leaves = self.check_params(params, what)
        check_alive(leaves, what, "Pass parameters that are still alive, e.g. "
                    "pipe.params(state) of the state the last train_step returned.")
        placed = self.placement.params(leaves, self._param_paths)
        return jax.tree.unflatten(self.traced.params_treedef, placed)

    def _place_batch(self, batch: Any) -> Any:
        leaves = self.check_batch(batch)
        check_alive(leaves, "batch", "Pass a batch whose arrays are alive.")
        placed = self.placement.batch_leaves(leaves, leaf_paths(self._batch_treedef))
        return jax.tree.unflatten(self._batch_treedef, placed)

    def _place_key(self, key: Any, what: str) -> Any:
        key = check_key(key, self.rng, self.key_dtype, what)
        if key is None:
            return None
        return self.placement.put(key, self.placement.replicated, "key")

    def _place_staged(self, staged: Any, what: str) -> list:
        from jaxpipe.train import TrainState

        if isinstance(staged, TrainState):
            raise PipelineTypeError(
                f"{what} expects staged parameters (pipe.shard(params) or state.params), got "
                "a TrainState; use pipe.params(state) for the user pytree, or state.params.")
        self.executor.check_staged(staged, what)
        check_alive(list(staged), what, "Use the state the last train_step returned.")
        return self.placement.like(list(staged), self.executor.staged_abstract(), what)

    # ---------------------------------------------------------------- layout
    def shard(self, params: Any) -> Any:
        """Move ``params`` into the executor's stage layout (resident on the devices).

        For the SPMD runtime: one array ``[devices, *shape]`` per parameter slot, sharded
        over the pipe axis; tied parameters are copied onto every stage that reads them.
        """
        placed = self._place_params(params, "pipe.shard(params)")
        return self._shard_jit(jax.tree.leaves(placed))

    def unshard(self, staged: Any) -> Any:
        """Inverse of :meth:`shard`: the user's parameter pytree (replicated)."""
        staged = self._place_staged(staged, "unshard")
        return self._user_tree(self._unshard_jit(staged))

    def staged_shapes(self) -> list[tuple[int, ...]]:
        """Global shapes of the staged parameter arrays."""
        return [tuple(a.shape) for a in jax.tree.leaves(self.executor.staged_abstract())]

    def stage_params(self, staged: Any) -> list[list[jax.Array]]:
        """Every stage's parameter inputs as its device holds them (tied: each copy; a
        stacked weight split over stages: the stage's rows)."""
        return self.executor.stage_params(self._place_staged(staged, "stage_params"))

    # ---------------------------------------------------------------- compute
    def _value(self, loss: jax.Array, aux: list) -> Any:
        """``loss``, or ``(loss, aux)`` with ``has_aux`` (aux as the user's pytree)."""
        if not self.objective.has_aux:
            return loss
        return loss, jax.tree.unflatten(self.objective.aux_treedef, aux)

    def _value_and_grad(self, params: Any, batch: Any, key: Any = None
                        ) -> tuple[Any, Any]:
        loss, aux, grads = self.executor.value_and_grad(self.check_params(params),
                                                        self.microbatches(batch, key))
        return self._value(loss, aux), self._user_tree(grads)

    def _staged_value_and_grad(self, staged: Any, batch: Any, key: Any = None
                               ) -> tuple[Any, Any]:
        loss, aux, grads = self.executor.staged_value_and_grad(
            staged, self.microbatches(batch, key))
        return self._value(loss, aux), grads

    def _loss(self, params: Any, batch: Any, key: Any = None) -> Any:
        return self._value(*self.executor.loss(self.check_params(params),
                                               self.microbatches(batch, key)))

    def _staged_loss(self, staged: Any, batch: Any, key: Any = None) -> Any:
        return self._value(*self.executor.staged_loss(staged, self.microbatches(batch, key)))

    def loss(self, params_or_state: Any, batch: Any, key: Any = None) -> Any:
        """The pipelined loss, forward only: evaluation and batched inference.

        Runs the schedule's forward actions only (each device's F actions in its order):
        no residual is kept and no backward is compiled. ``params_or_state``: the user's
        parameter pytree, or a :class:`~jaxpipe.train.TrainState` (evaluated in the stage
        layout, nothing gathered). Returns the loss reduced as the pipeline's
        ``reduction`` says, or ``(loss, aux)`` with ``has_aux`` (each aux leaf stacked
        over microbatches, as :meth:`value_and_grad` returns it). ``key``: with
        ``rng=True``, the PRNG key of this call.

        Example::

            eval_loss = pipe.loss(state, eval_batch)      # no gradient, no gather
            loss, aux = pipe.loss(params, batch)          # with has_aux=True
        """
        from jaxpipe.train import TrainState

        batch = self._place_batch(batch)
        key = self._place_key(key, "pipe.loss")
        if isinstance(params_or_state, TrainState):
            staged = self._live_state(params_or_state, "pipe.loss").params
            if self.executor.eager:
                return self._staged_loss(staged, batch, key)
            return self._staged_loss_watch(staged, batch, key)
        params = self._place_params(params_or_state, "pipe.loss(params, ...)")
        if self.executor.eager:
            return self._loss(params, batch, key)
        return self._loss_watch(params, batch, key)

    def value_and_grad(self, params: Any, batch: Any, key: Any = None
                       ) -> tuple[jax.Array, Any]:
        """Mean loss over microbatches and its gradient w.r.t. ``params`` (same pytree).

        ``key``: with ``rng=True``, the PRNG key of this call (microbatch ``i`` gets
        ``jax.random.fold_in(key, i)``); otherwise ``None``. Inputs are moved onto the
        pipeline's mesh first, wherever they are. It may be called inside your own
        ``jax.jit`` (e.g. with an optax update around it); inputs are then placed by
        sharding constraints.
        """
        params = self._place_params(params)
        batch = self._place_batch(batch)
        key = self._place_key(key, "pipe.value_and_grad")
        if self.executor.eager:
            return self._value_and_grad(params, batch, key)
        return self._vg_watch(params, batch, key)

    def staged_value_and_grad(self, staged: Any, batch: Any, key: Any = None
                              ) -> tuple[jax.Array, Any]:
        """As :meth:`value_and_grad`, with parameters and gradients in the stage layout
        (what a training loop keeps resident; no gather of gradients)."""
        staged = self._place_staged(staged, "staged_value_and_grad")
        batch = self._place_batch(batch)
        key = self._place_key(key, "pipe.staged_value_and_grad")
        if self.executor.eager:
            return self._staged_value_and_grad(staged, batch, key)
        return self._staged_vg_watch(staged, batch, key)

    @property
    def value_and_grad_fn(self) -> Any:
        """The ``jax.jit`` object behind :meth:`value_and_grad` (for ``.lower``/AOT)."""
        return self._vg

    @property
    def eval_fn(self) -> Any:
        """The ``jax.jit`` object behind :meth:`loss` with a parameter pytree (for
        ``.lower``/AOT: the forward-only program)."""
        return self._loss_jit

    @property
    def staged_value_and_grad_fn(self) -> Any:
        """The ``jax.jit`` object behind :meth:`staged_value_and_grad`."""
        return self._staged_vg

    @functools.cached_property
    def _reference(self) -> Executor:
        from jaxpipe.runtime.reference import ReferenceRuntime

        return ReferenceRuntime().build(self.executor.spec)

    def reference_value_and_grad(self, params: Any, batch: Any, key: Any = None
                                 ) -> tuple[jax.Array, Any]:
        """Same as :meth:`value_and_grad`, run by the sequential reference executor."""
        params = self._place_params(params)
        key = self._place_key(key, "pipe.reference_value_and_grad")
        loss, aux, grads = self._reference.value_and_grad(
            self.check_params(params), self.microbatches(self._place_batch(batch), key))
        return self._value(loss, aux), self._user_tree(grads)

    def lower_step(self, params: Any, batch: Any) -> Any:
        """``jax.jit(...).lower`` of the value-and-grad step (for memory/cost inspection)."""
        return self._vg.lower(params, batch)

    # ---------------------------------------------------------------- ahead of time
    def lower(self, program: str = "train_step", *, optimizer: Any = None,
              skip_nonfinite: bool = False, clip_global_norm: float | None = None) -> Any:
        """One of the pipeline's programs lowered from abstract inputs, no data needed.

        The ahead-of-time path, as ``jax.jit(f).trace(...).lower()``: the inputs are the
        ``jax.ShapeDtypeStruct`` s of the parameters and batch the pipeline was built
        with (placed as a call would place them), so nothing is put on a device. Build
        the pipeline on a mesh of compile-only devices (:func:`jaxpipe.aot.target`) and
        ``.compile()`` the result to compile for a TPU or GPU this machine does not have.

        Args:
          program: ``"train_step"`` (needs ``optimizer``; the state is abstract too),
            ``"value_and_grad"`` or ``"loss"`` (the forward-only program).
          optimizer, skip_nonfinite, clip_global_norm: as :meth:`init` takes them.

        Returns:
          ``jax.stages.Lowered``: ``.compile()`` it, then ``.memory_analysis()``,
          ``.as_text()`` (or :func:`jaxpipe.aot.compile_report` for all of it).

        Example::

            mesh = jaxpipe.aot.target("gpu:h200:8").mesh((8,), ("pipe",))
            pipe = jp.pipeline(loss_fn, abstract_params, abstract_batch, mesh=mesh,
                               schedule=jp.OneFOneB(8, 16))
            compiled = pipe.lower("train_step", optimizer=optax.adamw(1e-3)).compile()
        """
        programs = ("train_step", "value_and_grad", "loss")
        if program not in programs:
            raise PipelineTypeError(f"program must be one of {', '.join(map(repr, programs))}"
                                    f", got {program!r}.")
        if (optimizer is None) != (program != "train_step"):
            raise PipelineTypeError(
                "pipe.lower('train_step', optimizer=...) needs the optax optimizer the "
                "state trains with" if optimizer is None else
                f"pipe.lower({program!r}) takes no optimizer (only 'train_step' has "
                "optimizer state).")
        placement = self.placement
        params = jax.tree.unflatten(self.traced.params_treedef, [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s or placement.replicated)
            for a, s in zip(self.param_avals, placement.param_shardings
                            or [None] * len(self.param_avals), strict=True)])
        batch = jax.tree.unflatten(self._batch_treedef, [
            jax.ShapeDtypeStruct(shape, dtype, sharding=placement.batch)
            for shape, dtype in zip(self._batch_shapes, self._batch_dtypes, strict=True)])
        key = (jax.ShapeDtypeStruct((), self.key_dtype, sharding=placement.replicated)
               if self.rng else None)
        if program == "value_and_grad":
            return self._vg.trace(params, batch, key).lower()
        if program == "loss":
            return self._loss_jit.trace(params, batch, key).lower()
        from jaxpipe.train import Trainer, TrainState
        from jaxpipe.train_options import TrainOptions

        options = TrainOptions(skip_nonfinite=skip_nonfinite, clip_global_norm=clip_global_norm)
        trainer = Trainer(self.executor, optimizer, options, self.microbatches,
                          self._times)
        state = TrainState(self.executor.staged_abstract(), trainer.abstract_opt_state(),
                           jax.ShapeDtypeStruct((), np.int32, sharding=placement.replicated),
                           trainer)
        return trainer.step_fn.trace(state, batch, key).lower()

    # ---------------------------------------------------------------- training
    def init(self, params: Any, optimizer: Any, *, skip_nonfinite: bool = False,
             clip_global_norm: float | None = None) -> Any:
        """Train state for :meth:`train_step`: parameters and per-stage optax state.

        The state owns its optimizer: :meth:`train_step` always trains it with
        ``optimizer``, whatever else is initialised on this pipeline later.

        Args:
          params: the user parameter pytree.
          optimizer: any ``optax.GradientTransformation``; it runs per stage on that
            stage's parameter pytree (other stages' leaves are ``None``).
          skip_nonfinite: if the loss or gradient norm is NaN/inf, leave the state
            unchanged for that step (``metrics["skipped"] == 1``).
          clip_global_norm: clip gradients by their true global norm (over all stages)
            before the optimizer.
        """
        from jaxpipe.train import Trainer, TrainState
        from jaxpipe.train_options import TrainOptions

        options = TrainOptions(skip_nonfinite=skip_nonfinite, clip_global_norm=clip_global_norm)
        trainer = Trainer(self.executor, optimizer, options, self.microbatches,
                          self._times)
        params = self._place_params(params, "pipe.init(params, ...)")
        # Replicated over the mesh, as train_step returns it (else the 2nd step recompiles).
        step = self.placement.put(np.zeros((), np.int32), self.placement.replicated, "step")
        return TrainState(self._shard_jit(jax.tree.leaves(params)),
                          trainer.init_opt_state(jax.tree.leaves(params)),
                          step, trainer)

    def train_step(self, state: Any, batch: Any, key: Any = None) -> tuple[Any, dict]:
        """One optimizer step: ``(state, batch) -> (state, metrics)``; jitted, state donated.

        ``state`` must be the one the previous step returned (its buffers are reused);
        ``key`` is the step's PRNG key with ``rng=True`` (split a fresh one every step).
        """
        state = self._live_state(state, "train_step")
        batch = self._place_batch(batch)
        key = self._place_key(key, "pipe.train_step")
        state, metrics = state.trainer.step(state, batch, key)
        aux = metrics.pop("aux", [])
        if self.objective.has_aux:
            metrics["aux"] = jax.tree.unflatten(self.objective.aux_treedef, aux)
        return state, metrics

    def _live_state(self, state: Any, what: str) -> Any:
        """``state`` checked (type, owner, layout, not donated) and placed on the mesh."""
        return live_state(state, self.executor, self.placement, what)

    def params(self, state: Any) -> Any:
        """The user parameter pytree held by a train state."""
        state = self._live_state(state, "pipe.params")
        return self._user_tree(self._unshard_jit(state.params))

    # ---------------------------------------------------------------- reports
    @property
    def build_times(self) -> BuildTimes:
        """Seconds of each phase of building this pipeline (trace, cut, schedule) and of
        each program's first call (building and lowering the program, XLA's compile),
        filled in as they happen; ``pipe.plan`` prints them."""
        return self._times

    @property
    def plan(self) -> Any:
        """Per-stage layers, FLOPs, bytes, in-flight counts and predicted memory/bubble."""
        if self._plan is None:
            from jaxpipe.plan import Plan

            self._plan = Plan.build(self)
        return self._plan

    def compare_compiled(self, params: Any, batch: Any, optimizer: Any = None) -> dict:
        """Predicted per-device bytes next to the compiled program's ``memory_analysis()``."""
        from jaxpipe.plan import Plan

        return Plan.compare_compiled(self, params, batch, optimizer)

    def layout_summary(self) -> dict[str, Any]:
        """Schedule, sizes and cut: what a checkpoint in the stage layout depends on."""
        sched = self.schedule
        return {
            "schedule": type(sched).__qualname__,
            "num_devices": sched.num_devices,
            "num_microbatches": sched.num_microbatches,
            "stages_per_device": sched.stages_per_device,
            "cuts": [int(c) for c in self.cuts],
            "runtime": self.runtime.name,
        }

    def fingerprint(self) -> dict[str, Any]:
        """A JSON-able summary of everything the compiled program depends on.

        Schedule (class, p, m, v, a digest of every device's action list), cut, mesh,
        parameter and microbatch shapes, and the executor's own digests (e.g. of the
        lowered tick table). Processes compare it before running collectives
        (:func:`jaxpipe.distributed.config_summary`).
        """
        from jaxpipe.distributed import config_summary

        return config_summary(self)


def pipeline(
    loss_fn: Callable[[Any, Any], jax.Array],
    params: Any,
    batch: Any,
    *,
    mesh: Mesh,
    schedule: Schedule,
    cut: Any = "auto",
    axis: str = "pipe",
    runtime: str | Runtime = "spmd",
    rng: bool = False,
    batch_axes: Any = None,
    param_specs: Any = None,
    has_aux: bool = False,
    reduction: str = "mean",
) -> Pipeline:
    """Compile ``loss_fn`` for pipelined execution under ``schedule`` on ``mesh``.

    Args:
      loss_fn: ``loss_fn(params, microbatch) -> scalar``, the per-microbatch loss. Mark
        candidate cuts with :func:`jaxpipe.boundary` or :func:`jaxpipe.layer`.
      params: parameter pytree (arrays or ``jax.ShapeDtypeStruct``) to trace with.
      batch: a full batch pytree (arrays or ``ShapeDtypeStruct``); every leaf is split
        into ``schedule.num_microbatches`` along axis 0.
      mesh: a mesh with a pipeline axis of size ``schedule.num_devices``. Its other axes
        split the batch (``batch_axes``) or shard parameters (``param_specs``), or both.
      schedule: any validated :class:`jaxpipe.Schedule`.
      cut: ``"auto"`` (memory-aware cutter), ``"markers"`` (markers grouped evenly into
        ``num_stages`` stages, the outer ones taking any extra), or a :class:`jaxpipe.Cut`.
      axis: name of the pipeline mesh axis.
      runtime: ``"spmd"`` (one jit(shard_map) program), ``"reference"`` (sequential), or
        a :class:`jaxpipe.runtime.Runtime` instance.
      rng: ``True`` for a loss that draws random numbers (dropout):
        ``loss_fn(params, microbatch, key)`` then gets microbatch ``i``'s key
        ``jax.random.fold_in(key, i)`` of the key passed to ``value_and_grad`` /
        ``train_step`` (with ``n`` data shards: piece ``j`` of microbatch ``i`` gets
        ``fold_in(key, i * n + j)``; over batch axes that also shard parameters the
        stage runs on their whole piece and draws with its first key).
      batch_axes: the mesh axes that split the batch (data parallelism; gradients are
        averaged over them). Default: the axes the batch is placed split over along its
        axis 0 (``jax.device_put(batch, NamedSharding(mesh, P('fsdp')))``, as ``jax.jit``
        keeps an input's sharding); for a batch not placed so, every axis but ``axis``
        that no parameter is sharded over and no activation constraint of the model
        names. An axis may also
        shard parameters (FSDP: ``batch_axes=('fsdp',)`` with ``P('fsdp', None)``
        weights).
      param_specs: how parameters are sharded over the non-pipe axes. Default: as they
        are placed, like ``jax.jit`` keeps an input's sharding (a ``NamedSharding`` on
        ``mesh`` keeps its spec; host or single-device arrays are replicated; a
        parameter on another mesh is an error). Or a pytree with the structure of
        ``params`` of ``PartitionSpec`` (``None`` / ``P()``: replicated), e.g.
        ``{'w1': P(None, 'model'), 'w2': P('model', None)}`` for tensor parallelism.
        Staged parameters, gradients and optimizer state keep these shardings (a slot
        array is ``P(axis, *spec)``); the stages run under JAX's sharding over these
        axes, the model's own ``with_sharding_constraint`` s included (see
        docs/multihost.md).

      has_aux: ``loss_fn`` returns ``(loss, aux)``, ``aux`` any pytree of arrays computed
        on whichever stage computes it (logged values, predictions): ``value_and_grad``
        returns ``((loss, aux), grads)`` as ``jax.value_and_grad(has_aux=True)`` does,
        ``loss`` returns ``(loss, aux)``, ``train_step`` puts it in ``metrics["aux"]``.
        Each aux leaf comes back stacked over microbatches on a leading axis of size
        ``num_microbatches``, in microbatch order; over batch axes the program splits by
        hand (data parallelism), a second axis holds each data shard's value. Aux values
        never enter the gradient.
      reduction: how the microbatches' losses combine: ``"mean"`` (default), ``"sum"``, or
        ``"weighted"``: ``loss_fn`` returns ``(loss_sum, weight)`` (with ``has_aux``,
        ``((loss_sum, weight), aux)``) and the pipeline's loss is ``sum(loss_sum) /
        sum(weight)`` over every microbatch and data shard, with exactly that quotient's
        gradient (the weights are not differentiated; the division happens once, after
        the last microbatch). E.g. a per-token loss over padded sequences: return the
        summed loss of the real tokens and their count.

    Example::

        mesh = jax.make_mesh((4,), ("pipe",))
        pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh,
                           schedule=jp.OneFOneB(4, 8), cut="markers")
        loss, grads = pipe.value_and_grad(params, batch)
    """
    return Pipeline(loss_fn, params, batch, mesh=mesh, schedule=schedule, cut=cut, axis=axis,
                    runtime=runtime, rng=rng, batch_axes=batch_axes, param_specs=param_specs,
                    has_aux=has_aux, reduction=reduction)
