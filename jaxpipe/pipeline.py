"""``jp.pipeline``: trace, cut and split a loss, then hand the stages to a runtime.

:class:`Pipeline` is the frontend. It does the layers above the runtime seam, in order:

1. trace ``loss_fn`` to a flat jaxpr with its candidate cuts (:mod:`jaxpipe.trace`);
2. choose the cut (:mod:`jaxpipe.cut`, with the runtime's memory model);
3. split the jaxpr into stage functions (:mod:`jaxpipe.stages`);
4. build the runtime's executor from one :class:`~jaxpipe.runtime.RuntimeSpec`.

Everything about where values live on devices and how the schedule runs is the
executor's (``pipe.executor``); the frontend checks inputs, reshapes batches into
microbatches and maps between the user's pytrees and flat leaves.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxpipe.errors import PipelineError
from jaxpipe.runtime import Executor, Runtime, RuntimeSpec, resolve
from jaxpipe.schedule import Schedule
from jaxpipe.stages import StageFn, param_owners, split
from jaxpipe.trace import Traced, microbatch_like, trace

__all__ = ["Pipeline", "pipeline"]


def _check_mesh(mesh: Mesh, axis: str, schedule: Schedule) -> tuple[str, ...]:
    if not isinstance(mesh, Mesh):
        raise PipelineError(
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


def _resolve_cuts(traced: Traced, schedule: Schedule, cut: Any, memory_model: Any,
                  devices: tuple = ()) -> tuple[list[int], Any]:
    """Marker positions after which a new stage starts, plus the cutter's report.

    ``cut="auto"`` budgets the memory ``devices`` report (``jaxpipe.cut.auto_cut``).
    """
    from jaxpipe import cut as cutmod
    from jaxpipe.avals import aval_bytes
    from jaxpipe.cost import segment_costs

    S = schedule.num_stages
    n_seg = len(traced.markers) + 1
    if S > n_seg:
        raise PipelineError(
            f"the schedule needs {S} stages but the loss has only {n_seg} cuttable segments "
            f"({len(traced.markers)} markers); add jaxpipe.boundary / @jaxpipe.layer markers "
            "or use fewer stages."
        )
    if isinstance(cut, str) and cut == "markers":
        # Group segments evenly: segment boundaries at round(i * n_seg / S).
        cut = cutmod.Cut(indices=[round(i * n_seg / S) - 1 for i in range(1, S)])
    if isinstance(cut, str) and cut == "auto":
        # every pipeline device also holds the whole batch (its data shard)
        batch = sum(aval_bytes(v.aval) for v in traced.jaxpr.invars[traced.num_params:])
        cut = cutmod.auto_cut(devices, held_bytes=batch * schedule.num_microbatches)
    if isinstance(cut, cutmod.Cut):
        if cut.indices is not None and len(cut.indices) != S - 1:
            raise PipelineError(
                f"Cut(indices={list(cut.indices)}) gives {len(cut.indices) + 1} stages but "
                f"the schedule has {S}; pass {S - 1} marker indices."
            )
        # Explicit cuts go through the cutter too: it reports their predicted costs.
        policies = cut.costed_policies()
        costs = segment_costs(traced, profile=cut.profile, remat=policies[:1])
        if len(policies) > 1 and cut.remat == "auto" and cut.memory_budget is not None:
            # Recomputation only adds time: when placement alone reaches the fastest
            # cut within the budget, measuring the other policies buys nothing.
            try:
                plain = cutmod.choose_cuts(costs, schedule, replace(cut, remat="none"),
                                           memory_model=memory_model)
                if plain.max_stage_time <= plain.time_optimum:
                    return list(plain.cuts), plain
            except cutmod.CutError:
                pass
        if len(policies) > 1:
            costs = segment_costs(traced, profile=cut.profile, remat=policies)
        result = cutmod.choose_cuts(costs, schedule, cut, memory_model=memory_model)
        return list(result.cuts), result
    raise PipelineError(
        f"cut must be 'auto', 'markers' or a jaxpipe.Cut, got {cut!r}."
    )


class Pipeline:
    """A loss function compiled for pipelined execution under one schedule.

    Build it with :func:`pipeline`. ``value_and_grad(params, batch)`` returns the mean loss
    over microbatches and its gradient, equal to ``jax.value_and_grad`` of the unpipelined
    mean loss. ``shard``/``unshard`` move parameters into and out of the runtime's stage
    layout; ``init``/``train_step`` train with optax keeping parameters resident.

    Attributes:
      loss_fn, schedule, mesh, axis: as passed to :func:`pipeline`.
      batch_axes: the mesh axes other than ``axis``: the batch is split over them and
        gradients are averaged.
      traced: the traced loss (:class:`jaxpipe.trace.Traced`).
      cuts: marker indices after which a new stage begins.
      cut_report: the cutter's :class:`jaxpipe.cut.CutResult` (predicted costs, memory).
      stages: the stage functions (:class:`jaxpipe.stages.StageFn`).
      runtime: the :class:`jaxpipe.runtime.Runtime` that runs them.
      executor: the runtime bound to this pipeline (``pipe.executor.lowering`` holds the
        SPMD runtime's tick tables).
    """

    def __init__(self, loss_fn: Callable[[Any, Any], jax.Array], params: Any, batch: Any, *,
                 mesh: Mesh, schedule: Schedule, cut: Any = "auto", axis: str = "pipe",
                 runtime: str | Runtime = "spmd") -> None:
        if not isinstance(schedule, Schedule):
            raise PipelineError(
                f"schedule must be a jaxpipe.Schedule instance, got {type(schedule).__name__};"
                " e.g. jp.OneFOneB(num_devices=4, num_microbatches=8)."
            )
        self.runtime: Runtime = resolve(runtime)
        schedule.validate()
        self.loss_fn = loss_fn
        self.schedule = schedule
        self.mesh = mesh
        self.axis = axis
        self.batch_axes = _check_mesh(mesh, axis, schedule)
        self.num_microbatches = schedule.num_microbatches
        mb = microbatch_like(batch, self.num_microbatches)
        self._mb_shapes = [a.shape for a in jax.tree.leaves(mb)]
        n = self.batch_shards
        for leaf in jax.tree.leaves(mb):
            if leaf.shape[0] % n:
                raise PipelineError(
                    f"microbatch size {leaf.shape[0]} is not divisible by the {n} devices of "
                    f"the data axes {self.batch_axes}; use a batch size divisible by "
                    f"{n * self.num_microbatches}."
                )
        # Stage functions run on one batch shard of a microbatch: trace at that size.
        self.traced = trace(loss_fn, params, jax.tree.map(
            lambda a: jax.ShapeDtypeStruct((a.shape[0] // n, *a.shape[1:]), a.dtype), mb))
        self.param_avals = tuple(v.aval for v in self.traced.jaxpr.invars[
            : self.traced.num_params])
        self.cuts, self.cut_report = _resolve_cuts(self.traced, schedule, cut,
                                                   self.runtime.memory_model,
                                                   tuple(mesh.devices.flat))
        self.stages: list[StageFn] = split(self.traced, self.cuts, remat=self.cut_report.remat)
        self.executor: Executor = self.runtime.build(RuntimeSpec(
            stages=tuple(self.stages),
            schedule=schedule,
            mesh=mesh,
            axis=axis,
            batch_axes=self.batch_axes,
            param_avals=self.param_avals,
            params_treedef=self.traced.params_treedef,
            microbatch_avals=tuple(v.aval for v in self.traced.jaxpr.invars[
                self.traced.num_params:]),
            param_owners=param_owners(self.stages),
        ))
        self._vg = jax.jit(self._value_and_grad)
        self._staged_vg = jax.jit(self._staged_value_and_grad)
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
        return int(np.prod([self.mesh.shape[a] for a in self.batch_axes])) if self.batch_axes \
            else 1

    @property
    def param_owners(self) -> dict[int, tuple[int, ...]]:
        """Parameter leaf -> the stages that read it (a tied leaf has several)."""
        return dict(self.executor.spec.param_owners)

    # ---------------------------------------------------------------- checks
    def check_params(self, params: Any) -> list:
        """The flat leaves of ``params``; a clear error unless it is the traced structure."""
        leaves, tree = jax.tree.flatten(params)
        if tree != self.traced.params_treedef:
            raise PipelineError(
                "params do not have the structure the pipeline was built with:\n"
                f"  expected {self.traced.params_treedef}\n  got      {tree}\n"
                "pass the same parameter pytree (or rebuild the pipeline)."
            )
        for i, (x, a) in enumerate(zip(leaves, self.param_avals, strict=True)):
            if jnp.shape(x) != a.shape or jnp.result_type(x) != a.dtype:
                raise PipelineError(
                    f"parameter leaf {i} has shape {jnp.shape(x)} dtype {jnp.result_type(x)}, "
                    f"but the pipeline was traced with {a.shape} {a.dtype}."
                )
        return leaves

    def microbatches(self, batch: Any) -> list:
        """The batch's flat leaves reshaped to ``[num_microbatches, microbatch, ...]``.

        Checks the structure, shapes and dtypes against what the pipeline was built for.
        """
        m = self.num_microbatches
        mb = microbatch_like(batch, m)
        leaves, tree = jax.tree.flatten(batch)
        if tree != self.traced.batch_treedef:
            raise PipelineError(
                f"batch structure {tree} differs from the traced {self.traced.batch_treedef}."
            )
        dtypes = [v.aval.dtype for v in self.traced.jaxpr.invars[self.traced.num_params:]]
        for w, shape, dt in zip(jax.tree.leaves(mb), self._mb_shapes, dtypes, strict=True):
            if w.shape != shape:
                raise PipelineError(
                    f"microbatch leaf shape {w.shape} differs from the {shape} the pipeline "
                    "was built for; rebuild the pipeline for a new batch size."
                )
            if w.dtype != dt:
                raise PipelineError(
                    f"batch leaf has dtype {w.dtype} but the pipeline was traced with {dt}; "
                    f"cast it (x.astype(jnp.{dt})) or rebuild the pipeline for this dtype."
                )
        return [jnp.reshape(x, (m, -1, *jnp.shape(x)[1:])) for x in leaves]

    # ---------------------------------------------------------------- layout
    def shard(self, params: Any) -> Any:
        """Move ``params`` into the executor's stage layout (resident on the devices).

        For the SPMD runtime: one array ``[devices, *shape]`` per parameter slot, sharded
        over the pipe axis; tied parameters are copied onto every stage that reads them.
        """
        return self._shard_jit(self.check_params(params))

    def unshard(self, staged: Any) -> Any:
        """Inverse of :meth:`shard`: the user's parameter pytree (replicated)."""
        self.executor.check_staged(staged, "unshard")
        return jax.tree.unflatten(self.traced.params_treedef, self._unshard_jit(list(staged)))

    def staged_shapes(self) -> list[tuple[int, ...]]:
        """Global shapes of the staged parameter arrays."""
        return [tuple(a.shape) for a in jax.tree.leaves(self.executor.staged_abstract())]

    def stage_params(self, staged: Any) -> list[list[jax.Array]]:
        """Every stage's parameter leaves as its device holds them (tied: each copy)."""
        self.executor.check_staged(staged, "stage_params")
        if hasattr(self.executor, "stage_params"):
            return self.executor.stage_params(staged)
        leaves = self.executor.unshard(staged)
        return [[leaves[i] for i in st.param_ids] for st in self.stages]

    # ---------------------------------------------------------------- compute
    def _value_and_grad(self, params: Any, batch: Any) -> tuple[jax.Array, Any]:
        loss, grads = self.executor.value_and_grad(self.check_params(params),
                                                   self.microbatches(batch))
        return loss, jax.tree.unflatten(self.traced.params_treedef, grads)

    def _staged_value_and_grad(self, staged: Any, batch: Any) -> tuple[jax.Array, Any]:
        return self.executor.staged_value_and_grad(staged, self.microbatches(batch))

    def value_and_grad(self, params: Any, batch: Any) -> tuple[jax.Array, Any]:
        """Mean loss over microbatches and its gradient w.r.t. ``params`` (same pytree)."""
        if getattr(self.executor, "eager", False):
            return self._value_and_grad(params, batch)
        return self._vg(params, batch)

    def staged_value_and_grad(self, staged: Any, batch: Any) -> tuple[jax.Array, Any]:
        """As :meth:`value_and_grad`, with parameters and gradients in the stage layout
        (what a training loop keeps resident; no gather of gradients)."""
        self.executor.check_staged(staged, "staged_value_and_grad")
        if getattr(self.executor, "eager", False):
            return self._staged_value_and_grad(staged, batch)
        return self._staged_vg(staged, batch)

    @property
    def value_and_grad_fn(self) -> Any:
        """The ``jax.jit`` object behind :meth:`value_and_grad` (for ``.lower``/AOT)."""
        return self._vg

    @property
    def staged_value_and_grad_fn(self) -> Any:
        """The ``jax.jit`` object behind :meth:`staged_value_and_grad`."""
        return self._staged_vg

    @functools.cached_property
    def _reference(self) -> Executor:
        from jaxpipe.runtime.reference import ReferenceRuntime

        return ReferenceRuntime().build(self.executor.spec)

    def reference_value_and_grad(self, params: Any, batch: Any) -> tuple[jax.Array, Any]:
        """Same as :meth:`value_and_grad`, run by the sequential reference executor."""
        loss, grads = self._reference.value_and_grad(self.check_params(params),
                                                     self.microbatches(batch))
        return loss, jax.tree.unflatten(self.traced.params_treedef, grads)

    def lower_step(self, params: Any, batch: Any) -> Any:
        """``jax.jit(...).lower`` of the value-and-grad step (for memory/cost inspection)."""
        return self._vg.lower(params, batch)

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
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from jaxpipe.train import Trainer, TrainOptions, TrainState

        if not hasattr(optimizer, "init") or not hasattr(optimizer, "update"):
            raise PipelineError(
                f"optimizer must be an optax.GradientTransformation, got "
                f"{type(optimizer).__name__}; e.g. optax.adamw(1e-3)."
            )
        options = TrainOptions(skip_nonfinite=skip_nonfinite, clip_global_norm=clip_global_norm)
        leaves = self.check_params(params)
        trainer = Trainer(self.executor, optimizer, options, self.microbatches)
        # Replicated over the mesh, as train_step returns it (else the 2nd step recompiles).
        step = jax.make_array_from_process_local_data(NamedSharding(self.mesh, P()),
                                                      np.zeros((), np.int32))
        return TrainState(self.shard(params), trainer.init_opt_state(leaves), step, trainer)

    def train_step(self, state: Any, batch: Any) -> tuple[Any, dict]:
        """One optimizer step: ``(state, batch) -> (state, metrics)``; jitted, state donated."""
        from jaxpipe.train import TrainState

        if not isinstance(state, TrainState):
            raise PipelineError(
                f"train_step needs the TrainState returned by pipe.init, got "
                f"{type(state).__name__}; call pipe.init(params, optimizer) before "
                "pipe.train_step(state, batch)."
            )
        if state.trainer.executor is not self.executor:
            raise PipelineError(
                "this TrainState was made by another pipeline: its state layout belongs to "
                "that pipeline's stages and optimizer, not this pipeline's. Train it with "
                "that pipeline, or start from its parameters here with "
                "pipe.init(other.params(state), optimizer)."
            )
        self.executor.check_staged(state.params, "train_step (state.params)")
        return state.trainer.step_fn(state, batch)

    def params(self, state: Any) -> Any:
        """The user parameter pytree held by a train state."""
        return self.unshard(state.params)

    # ---------------------------------------------------------------- reports
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
        lowered tick table). Processes compare it before running collectives.
        """
        import hashlib
        import json

        def sha(data: str) -> str:
            return hashlib.sha256(data.encode()).hexdigest()[:16]

        sched = self.schedule
        actions = {str(d): [str(a) for a in acts] for d, acts in sched.actions().items()}
        avals = self.traced.jaxpr.invars
        n = self.traced.num_params
        return {
            "schedule": f"{type(sched).__module__}.{type(sched).__qualname__}",
            "num_devices": sched.num_devices,
            "num_microbatches": sched.num_microbatches,
            "stages_per_device": sched.stages_per_device,
            "actions_sha256": sha(json.dumps(actions, sort_keys=True)),
            "cuts": [int(c) for c in self.cuts],
            "mesh": {str(k): int(v) for k, v in self.mesh.shape.items()},
            "axis": self.axis,
            "params": [f"{tuple(v.aval.shape)}:{v.aval.dtype}" for v in avals[:n]],
            "params_tree_sha256": sha(str(self.traced.params_treedef)),
            "microbatch": [f"{tuple(v.aval.shape)}:{v.aval.dtype}" for v in avals[n:]],
            "runtime": self.runtime.name,
            **self.executor.fingerprint(),
        }


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
) -> Pipeline:
    """Compile ``loss_fn`` for pipelined execution under ``schedule`` on ``mesh``.

    Args:
      loss_fn: ``loss_fn(params, microbatch) -> scalar``, the per-microbatch loss. Mark
        candidate cuts with :func:`jaxpipe.boundary` or :func:`jaxpipe.layer`.
      params: parameter pytree (arrays or ``jax.ShapeDtypeStruct``) to trace with.
      batch: a full batch pytree (arrays or ``ShapeDtypeStruct``); every leaf is split
        into ``schedule.num_microbatches`` along axis 0.
      mesh: a mesh with a pipeline axis of size ``schedule.num_devices``. Other axes are
        data-parallel: the batch is sharded over them and gradients averaged.
      schedule: any validated :class:`jaxpipe.Schedule`.
      cut: ``"auto"`` (memory-aware cutter), ``"markers"`` (markers grouped evenly into
        ``num_stages`` stages), or a :class:`jaxpipe.Cut`.
      axis: name of the pipeline mesh axis.
      runtime: ``"spmd"`` (one jit(shard_map) program), ``"reference"`` (sequential), or
        a :class:`jaxpipe.runtime.Runtime` instance.

    Example::

        mesh = jax.make_mesh((4,), ("pipe",))
        pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh,
                           schedule=jp.OneFOneB(4, 8), cut="markers")
        loss, grads = pipe.value_and_grad(params, batch)
    """
    return Pipeline(loss_fn, params, batch, mesh=mesh, schedule=schedule, cut=cut, axis=axis,
                    runtime=runtime)
