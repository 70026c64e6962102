"""What a built pipeline holds, and the programs it runs: ``pipe.inspect``.

:class:`Internals` does the layers above the runtime seam, in order:

1. trace ``loss_fn`` to a flat jaxpr with its candidate cuts (:mod:`jaxpipe.jaxpr.trace`;
   the batch axes the model shards itself left automatic, :mod:`jaxpipe.api.trace_loss`);
2. choose the cut and split the jaxpr into stage functions
   (:mod:`jaxpipe.api.cut_and_split`: the cutter of :mod:`jaxpipe.cut` with the runtime's
   memory model, then :mod:`jaxpipe.stages.stage_fn`; a scanned layer stack is cut between
   its iterations and run as one scan per stage, :mod:`jaxpipe.stages.stacks`);
3. build the runtime's executor from one :class:`~jaxpipe.runtime.RuntimeSpec`.

Everything about where values live on devices and how the schedule runs is the
executor's (``pipe.inspect.executor``); this module checks inputs, reshapes batches into
microbatches and maps between the user's pytrees and flat leaves, and between the user's
leaves and the stages' parameter views (:mod:`jaxpipe.sharding.param_views`: a stacked
weight split over stages is passed as each stage's rows, its gradient gathered back).
:class:`jaxpipe.api.pipeline.Pipeline` is the narrow face a training loop uses; this is
the rest, for tables, lowered views and debugging (those: :mod:`jaxpipe.api.reports`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxpipe.api.auto import AutoChoice, choose, placeholder, resolve_auto
from jaxpipe.api.cut_and_split import cut_and_split, cut_only, num_segments
from jaxpipe.api.input_placement import Placement, live_state, microbatch_rows
from jaxpipe.api.inputs import (
    check_batch,
    check_key,
    check_mesh,
    check_no_keys,
    check_objective,
    check_params,
    check_pipeline_args,
    check_traced_alike,
    check_usable,
    leaf_paths,
)
from jaxpipe.api.reports import InternalsReports
from jaxpipe.api.trace_loss import shards, trace_on_mesh
from jaxpipe.build_times import BuildTimes
from jaxpipe.compile_watch import CompileWatch
from jaxpipe.cut import CutError
from jaxpipe.cut.resolve import check_cut
from jaxpipe.errors import PipelineTypeError
from jaxpipe.jaxpr.avals import from_boundary, to_boundary
from jaxpipe.jaxpr.objective import Objective
from jaxpipe.jaxpr.trace import Traced, microbatch_like
from jaxpipe.runtime import Executor, Runtime, resolve
from jaxpipe.schedule import Schedule
from jaxpipe.sharding.mesh_axes import placed_batch_axes, resolve_mesh_axes
from jaxpipe.sharding.param_views import ParamViews
from jaxpipe.sharding.typed import trace_context
from jaxpipe.stages.stacks import Stack
from jaxpipe.stages.stage_fn import StageFn
from jaxpipe.train.options import TrainOptions
from jaxpipe.train.state import Trainer, TrainState
from jaxpipe.xla_flags import compiler_options

__all__ = ["Internals"]


class Internals(InternalsReports):
    """A built pipeline's parts: what ``pipe.inspect`` returns.

    Made by :func:`jaxpipe.pipeline` behind the :class:`~jaxpipe.api.pipeline.Pipeline` it
    returns. Read it for the stages, the cut, the executor's tick tables, build times and
    the jitted programs; the ``place_*`` and ``run_*`` methods are the steps the
    ``Pipeline`` methods are made of.

    Attributes:
      loss_fn, schedule, mesh, axis: as passed to :func:`pipeline`.
      batch_axes: the mesh axes the batch is split over (gradients averaged over them).
      mesh_axes: the roles of the mesh axes (:class:`jaxpipe.sharding.mesh_axes.MeshAxes`).
      param_dims: per user parameter leaf, its sharding over the non-pipe axes
        (:data:`jaxpipe.sharding.mesh_axes.Dims`; :attr:`param_specs` as ``PartitionSpec`` s).
      traced: the traced loss (:class:`jaxpipe.jaxpr.trace.Traced`).
      stacks: the scanned layer stacks found in it (:class:`jaxpipe.stages.stacks.Stack`; each
        is cut between its iterations).
      cut_traced: the loss the cutter sees: ``traced`` with a cut marker after every
        iteration of every stack (``traced`` itself when there are none).
      cuts: marker indices (into ``cut_traced.markers``) after which a new stage begins.
      views: the stages' parameter inputs over the user's leaves (:class:`jaxpipe.sharding.
        param_views.ParamViews`; each stage gets its own rows of a stacked weight).
      cut_report: the cutter's :class:`jaxpipe.cut.CutResult` (predicted costs, memory).
      stages: the stage functions (:class:`jaxpipe.stages.stage_fn.StageFn`).
      runtime: the :class:`jaxpipe.runtime.Runtime` that runs them.
      executor: the runtime bound to this pipeline (``executor.lowering`` holds the
        SPMD runtime's tick tables).
      auto_choice: what ``schedule="auto"`` chose and why (``None``: the schedule was
        given).
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
        if auto is not None:  # an m whose microbatches split over the data axes too
            schedule = placeholder(auto, mesh, axis, batch, self._shards(mesh_axes.batch_axes))
        self.num_microbatches = schedule.num_microbatches
        mb = microbatch_like(batch, self.num_microbatches)
        self._mb_shapes = [a.shape for a in jax.tree.leaves(mb)]
        #: the batch a call takes: its structure, its leaves' shapes and dtypes
        self.batch_treedef = jax.tree.structure(batch)
        self.batch_shapes = [tuple(np.shape(x)) for x in jax.tree.leaves(batch)]
        self.batch_dtypes = [a.dtype for a in jax.tree.leaves(mb)]
        self.key_dtype = jax.random.key(0).dtype if rng else None
        self._times = BuildTimes()
        #: the matmul precision the stages are traced under (a call must run under it)
        self.matmul_precision = jax.config.jax_default_matmul_precision
        with self._times.phase("trace"):
            self.traced, mesh_axes = trace_on_mesh(
                loss_fn, params, mb, mesh=mesh, mesh_axes=mesh_axes, param_dims=self.param_dims,
                num_microbatches=self.num_microbatches, mb_shapes=self._mb_shapes,
                key_dtype=self.key_dtype, objective=objective,
                axes_free=batch_axes is None and placed is None)
        self.mesh_axes, self.batch_axes = mesh_axes, mesh_axes.batch_axes
        self.placement = Placement(mesh, mesh_axes, self.param_dims)
        self.objective: Objective = self.traced.objective
        self.param_avals = tuple(v.aval for v in self.traced.jaxpr.invars[
            : self.traced.num_params])
        #: what schedule="auto" chose and why (None: the schedule was given)
        self.auto_choice: AutoChoice | None = None
        if auto is not None:
            self.schedule = schedule = self._choose(auto, schedule, cut)
        try:
            self._cut_and_build(schedule, cut, self.auto_choice and self.auto_choice.cut_report)
        except CutError:
            # (the budget was infeasible for the program the runtime wanted; another of
            # its programs may hold less, e.g. the SPMD runtime without lanes)
            instead = self.runtime.instead_of_infeasible(mesh, self.mesh_axes)
            if instead is None:
                raise
            self.runtime = instead
            self._cut_and_build(schedule, cut, None)
        again = self.runtime.instead_of(self.executor)
        if again is not None:  # (the runtime turned down the program the cut was made for)
            self.runtime = again
            if auto is not None:  # every candidate priced again, for the program that runs
                self.schedule = schedule = self._choose(auto, schedule, cut)
            self._cut_and_build(schedule, cut, self.auto_choice and self.auto_choice.cut_report)
        self._param_paths = leaf_paths(self.traced.params_treedef)
        # XLA options for the mesh's platform (GPU: the permutes' overlap), per compile
        opts = compiler_options(mesh.devices.flat[0].platform)
        check = self.executor.compiled_check()

        def watch(fn: Callable, name: str) -> CompileWatch:
            return CompileWatch(fn, name, check, self._times, compiler_options=opts)

        self._vg_watch = watch(self._value_and_grad, "pipe.value_and_grad")
        self._staged_vg_watch = watch(self._staged_value_and_grad, "pipe.staged_value_and_grad")
        self._loss_watch = watch(self._loss, "pipe.loss")
        self._staged_loss_watch = watch(self._staged_loss, "pipe.loss")
        self._shard_jit = jax.jit(self.executor.shard)
        self._unshard_jit = jax.jit(self.executor.unshard)
        if jax.process_count() > 1:
            # Every process must build the same program, or its collectives never match.
            from jaxpipe.distributed.agreement import check_consistent

            check_consistent(self)

    def _choose(self, auto: Any, placeholder: Schedule, cut: Any) -> Schedule:
        """The schedule ``schedule="auto"`` takes (:func:`~jaxpipe.api.auto.choose`),
        each candidate cut for the runtime's program, or where a budget does not fit that
        program, for the one the runtime would build instead (the SPMD runtime without
        lanes), as a given schedule is."""
        mesh, axes, costs = self.mesh, self.mesh_axes, {}
        fallback = self.runtime.instead_of_infeasible(mesh, axes)
        priced_by: dict[int, Runtime] = {}  # id(cut report) -> the runtime it was cut for
        instead: dict[int, str] = {}  # id(schedule) -> why it was cut for the other program

        def cut_report(s: Schedule) -> Any:
            def cut_for(rt: Runtime) -> Any:
                report = cut_only(self.traced, s, cut, rt.memory_model_for(mesh), mesh,
                                  self.param_dims, rt.in_flight(s, mesh, axes), costs,
                                  self._shards(axes.auto_batch_axes))
                priced_by[id(report)] = rt
                return report

            try:
                return cut_for(self.runtime)
            except CutError:
                if fallback is None:
                    raise
            instead[id(s)] = (f"cut for {fallback!r}: the budget does not fit the runtime's "
                              "own program")
            return cut_for(fallback)

        check_cut(cut)  # once, not as every candidate's verdict
        with trace_context(mesh, axes), self._times.phase("cut"):
            choice = choose(auto, placeholder.num_devices, placeholder.num_microbatches,
                            cut_report, lambda s, r: self._predicted_time(priced_by[id(r)], s, r),
                            num_segments(self.traced, mesh, self.param_dims))
        self.auto_choice = choice.noted(instead)
        self.runtime = priced_by[id(choice.cut_report)]
        return choice.schedule

    def _predicted_time(self, runtime: Runtime, schedule: Schedule, report: Any) -> float:
        return runtime.predicted_time(schedule, report.action_cost, self.mesh, self.mesh_axes,
                                      stored_bytes=report.padded_memory.residuals)

    # ---------------------------------------------------------------- properties
    def _cut_and_build(self, schedule: Schedule, cut: Any, cut_report: Any) -> None:
        """Cut and split the traced loss for ``schedule`` and build the runtime's executor."""
        mesh, axes = self.mesh, self.mesh_axes
        with trace_context(mesh, axes), self._times.phase("cut"):
            st = cut_and_split(self.traced, schedule, cut, self.runtime.memory_model_for(mesh),
                               mesh, self.param_dims, share_cores=self.runtime.shares_cores(),
                               split_backward=self.runtime.splits_backward(mesh, axes),
                               in_flight=self.runtime.in_flight(schedule, mesh, axes),
                               cut_report=cut_report,
                               batch_shards=self._shards(axes.auto_batch_axes))
        self.stacks: tuple[Stack, ...] = st.stacks
        self.cut_traced: Traced = st.cut_traced
        self.cuts, self.cut_report = st.cuts, st.cut_report
        self.views: ParamViews = st.views
        self.stages: list[StageFn] = st.stages
        with self._times.phase("schedule"):
            self.executor: Executor = self.runtime.build(st.runtime_spec(
                self.traced, schedule, mesh, self.axis, axes, self.param_dims))

    @property
    def batch_shards(self) -> int:
        """How many pieces the batch axes split every microbatch into."""
        return self._shards(self.batch_axes)

    @property
    def build_times(self) -> BuildTimes:
        """Seconds of each phase of building this pipeline (trace, cut, schedule) and of
        each program's first call (building and lowering the program, XLA's compile),
        filled in as they happen; ``pipe.plan`` prints them."""
        return self._times

    def _shards(self, axes: tuple[str, ...]) -> int:
        return shards(self.mesh, axes)

    # ---------------------------------------------------------------- checks
    def check_params(self, params: Any, what: str = "params") -> list:
        """The flat leaves of ``params``; a clear error unless it is the traced structure
        (and not, say, a train state or the stage layout)."""
        return check_params(params, self.traced.params_treedef, self.param_avals,
                            self.staged_shapes(), what)

    def check_batch(self, batch: Any) -> list:
        """The flat leaves of ``batch``; a clear error unless it has the structure, shapes
        and dtypes the pipeline was built for."""
        return check_batch(batch, self.batch_treedef, self._mb_shapes, self.batch_dtypes,
                           self.num_microbatches, multiprocess=jax.process_count() > 1)

    def microbatches(self, batch: Any, key: Any = None) -> list:
        """The batch's flat leaves reshaped to ``[num_microbatches, microbatch, ...]``.

        Checks the structure, shapes and dtypes against what the pipeline was built for.
        With ``rng=True`` the per-microbatch keys derived from ``key`` follow as one more
        leaf (``[m, data shards, key data]``). Key-typed leaves are passed as key data.
        """
        m = self.num_microbatches
        leaves = [to_boundary(x) for x in self.check_batch(batch)]
        out = [microbatch_rows(x, m) for x in leaves]
        if self.rng:
            if key is None:
                check_key(key, True, self.key_dtype, "this call")
            pieces = jnp.arange(m * self.batch_shards, dtype=jnp.uint32)
            keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(pieces)
            out.append(jnp.reshape(jax.random.key_data(keys), (m, self.batch_shards, -1)))
        return out

    def user_tree(self, leaves: list) -> Any:
        """Flat leaves from a runtime -> the user's pytree, each leaf in its traced dtype
        (a runtime's cross-device sum turns a bool leaf into int32)."""
        leaves = [x if x.dtype == a.dtype else x.astype(a.dtype)
                  for x, a in zip(leaves, self.param_avals, strict=True)]
        return jax.tree.unflatten(self.traced.params_treedef, leaves)

    def place_params(self, params: Any, what: str = "params") -> Any:
        """``params`` checked, alive and on the mesh (same pytree)."""
        leaves = self.check_params(params, what)
        check_usable(leaves, what, "Pass parameters that are still alive, e.g. "
                     "pipe.params(state) of the state the last train_step returned.")
        placed = self.placement.params(leaves, self._param_paths)
        return jax.tree.unflatten(self.traced.params_treedef, placed)

    def place_batch(self, batch: Any) -> Any:
        leaves = self.check_batch(batch)
        check_usable(jax.tree.unflatten(self.batch_treedef, leaves), "batch",
                     "Pass a batch whose arrays are alive.")
        placed = self.placement.batch_leaves(leaves, leaf_paths(self.batch_treedef))
        return jax.tree.unflatten(self.batch_treedef, placed)

    def check_context(self, what: str) -> None:
        """A clear error where ``what`` runs under another ``jax.default_matmul_precision``
        than the build's (the stages were traced then; it would not apply)."""
        check_traced_alike(self.matmul_precision, what)

    def place_key(self, key: Any, what: str) -> Any:
        key = check_key(key, self.rng, self.key_dtype, what)
        if key is None:
            return None
        return self.placement.put(key, self.placement.replicated, "key")

    def place_staged(self, staged: Any, what: str) -> list:
        if isinstance(staged, TrainState):
            raise PipelineTypeError(
                f"{what} expects staged parameters (pipe.shard(params) or state.params), got "
                "a TrainState; use pipe.params(state) for the user pytree, or state.params.")
        self.executor.check_staged(staged, what)
        check_usable(list(staged), what, "Use the state the last train_step returned.")
        return self.placement.like(list(staged), self.executor.staged_abstract(), what)

    # ---------------------------------------------------------------- layout
    def staged_shapes(self) -> list[tuple[int, ...]]:
        """Global shapes of the staged parameter arrays."""
        return [tuple(a.shape) for a in jax.tree.leaves(self.executor.staged_abstract())]

    # ---------------------------------------------------------------- compute
    def value(self, loss: jax.Array, aux: list) -> Any:
        """``loss``, or ``(loss, aux)`` with ``has_aux`` (aux as the user's pytree)."""
        if not self.objective.has_aux:
            return loss
        return loss, self.aux_tree(aux)

    def aux_tree(self, aux: list) -> Any:
        """A runtime's aux leaves as the user's pytree (a key leaf came back as its key
        data, stacked over microbatches: a key again)."""
        aux = [from_boundary(x, a) for x, a in zip(aux, self.objective.aux_avals, strict=True)]
        return jax.tree.unflatten(self.objective.aux_treedef, aux)

    def _value_and_grad(self, params: Any, batch: Any, key: Any = None
                        ) -> tuple[Any, Any]:
        loss, aux, grads = self.executor.value_and_grad(self.check_params(params),
                                                        self.microbatches(batch, key))
        return self.value(loss, aux), self.user_tree(grads)

    def _staged_value_and_grad(self, staged: Any, batch: Any, key: Any = None
                               ) -> tuple[Any, Any]:
        loss, aux, grads = self.executor.staged_value_and_grad(
            staged, self.microbatches(batch, key))
        return self.value(loss, aux), grads

    def _loss(self, params: Any, batch: Any, key: Any = None) -> Any:
        return self.value(*self.executor.loss(self.check_params(params),
                                               self.microbatches(batch, key)))

    def _staged_loss(self, staged: Any, batch: Any, key: Any = None) -> Any:
        return self.value(*self.executor.staged_loss(staged, self.microbatches(batch, key)))

    @property
    def value_and_grad_fn(self) -> Any:
        """The ``jax.jit`` object behind :meth:`value_and_grad` (for ``.lower``/AOT)."""
        return self._vg_watch.fn

    @property
    def eval_fn(self) -> Any:
        """The ``jax.jit`` object behind :meth:`loss` with a parameter pytree (for
        ``.lower``/AOT: the forward-only program)."""
        return self._loss_watch.fn

    @property
    def staged_value_and_grad_fn(self) -> Any:
        """The ``jax.jit`` object behind :meth:`staged_value_and_grad`."""
        return self._staged_vg_watch.fn

    # ---------------------------------------------------------------- entry points
    def run_value_and_grad(self, params: Any, batch: Any, key: Any) -> tuple[Any, Any]:
        """The value-and-grad program on placed inputs (compiled once, or eager)."""
        if self.executor.eager:
            return self._value_and_grad(params, batch, key)
        return self._vg_watch(params, batch, key)

    def run_staged_value_and_grad(self, staged: list, batch: Any, key: Any
                                  ) -> tuple[Any, Any]:
        """As :meth:`run_value_and_grad`, parameters and gradients in the stage layout."""
        if self.executor.eager:
            return self._staged_value_and_grad(staged, batch, key)
        return self._staged_vg_watch(staged, batch, key)

    def run_loss(self, params: Any, batch: Any, key: Any) -> Any:
        """The forward-only program on placed inputs."""
        if self.executor.eager:
            return self._loss(params, batch, key)
        return self._loss_watch(params, batch, key)

    def run_staged_loss(self, staged: list, batch: Any, key: Any) -> Any:
        """The forward-only program on staged parameters."""
        if self.executor.eager:
            return self._staged_loss(staged, batch, key)
        return self._staged_loss_watch(staged, batch, key)

    def shard_leaves(self, leaves: list) -> Any:
        """Placed parameter leaves -> the executor's stage layout."""
        return self._shard_jit(leaves)

    def unshard_leaves(self, staged: Any) -> list:
        """The stage layout -> the parameter leaves (replicated)."""
        return self._unshard_jit(staged)

    def trainer(self, optimizer: Any, options: TrainOptions) -> Trainer:
        """The compiled optimizer step a :class:`~jaxpipe.train.state.TrainState` of
        ``optimizer`` trains with."""
        return Trainer(self.executor, optimizer, options, self.microbatches, self._times)

    def live_state(self, state: Any, what: str) -> Any:
        """``state`` checked (type, owner, layout, not donated) and placed on the mesh."""
        return live_state(state, self.executor, self.placement, what)
