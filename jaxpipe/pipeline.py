"""``jp.pipeline``: trace, cut, split, lower and compile a loss for pipelined execution."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe.errors import PipelineError
from jaxpipe.lower import Lowered, lower
from jaxpipe.runtime.reference import run_reference
from jaxpipe.runtime.spmd import StageLayouts, build_step, place
from jaxpipe.schedule import Schedule
from jaxpipe.stages import StageFn, split
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


def _resolve_cuts(traced: Traced, schedule: Schedule, cut: Any) -> tuple[list[int], Any]:
    """Marker positions after which a new stage starts, plus the cutter's report if any."""
    S = schedule.num_stages
    n_seg = len(traced.markers) + 1
    if S > n_seg:
        raise PipelineError(
            f"the schedule needs {S} stages but the loss has only {n_seg} cuttable segments "
            f"({len(traced.markers)} markers); add jaxpipe.boundary / @jaxpipe.layer markers "
            "or use fewer stages."
        )
    from jaxpipe import cut as cutmod
    from jaxpipe.cost import segment_costs

    if cut == "markers":
        # Group segments evenly: segment boundaries at round(i * n_seg / S).
        cut = cutmod.Cut(indices=[round(i * n_seg / S) - 1 for i in range(1, S)])

    if cut == "auto":
        cut = cutmod.Cut()
    if isinstance(cut, cutmod.Cut):
        if cut.indices is not None and len(cut.indices) != S - 1:
            raise PipelineError(
                f"Cut(indices={list(cut.indices)}) gives {len(cut.indices) + 1} stages but "
                f"the schedule has {S}; pass {S - 1} marker indices."
            )
        # Explicit cuts go through the cutter too: it reports their predicted costs.
        result = cutmod.choose_cuts(segment_costs(traced, profile=cut.profile), schedule, cut)
        return list(result.cuts), result
    raise PipelineError(
        f"cut must be 'auto', 'markers' or a jaxpipe.Cut, got {cut!r}."
    )


class Pipeline:
    """A loss function compiled for pipelined execution under one schedule.

    Build it with :func:`pipeline`. ``value_and_grad(params, batch)`` returns the mean loss
    over microbatches and its gradient, equal to ``jax.value_and_grad`` of the unpipelined
    mean loss. ``shard``/``unshard`` move parameters into and out of the per-device stage
    layout; ``init``/``train_step`` train with optax keeping parameters resident.
    """

    def __init__(self, loss_fn: Callable[[Any, Any], jax.Array], params: Any, batch: Any, *,
                 mesh: Mesh, schedule: Schedule, cut: Any = "auto", axis: str = "pipe",
                 runtime: str = "spmd") -> None:
        if not isinstance(schedule, Schedule):
            raise PipelineError(
                f"schedule must be a jaxpipe.Schedule instance, got {type(schedule).__name__};"
                " e.g. jp.OneFOneB(num_devices=4, num_microbatches=8)."
            )
        if runtime not in ("spmd", "reference"):
            raise PipelineError(f"runtime must be 'spmd' or 'reference', got {runtime!r}.")
        schedule.validate()
        self.loss_fn = loss_fn
        self.schedule = schedule
        self.mesh = mesh
        self.axis = axis
        self.runtime = runtime
        self.data_axes = _check_mesh(mesh, axis, schedule)
        self.num_microbatches = schedule.num_microbatches
        mb = microbatch_like(batch, self.num_microbatches)
        self._check_data_split(mb)
        self._mb_shapes = [a.shape for a in jax.tree.leaves(mb)]
        # Stage functions run on one data shard of a microbatch: trace at that size.
        self.traced = trace(loss_fn, params, jax.tree.map(
            lambda a: jax.ShapeDtypeStruct((a.shape[0] // self._data_size, *a.shape[1:]),
                                           a.dtype), mb))
        self._param_avals = [v.aval for v in self.traced.jaxpr.invars[: self.traced.num_params]]
        self.cuts, self.cut_report = _resolve_cuts(self.traced, schedule, cut)
        self.stages: list[StageFn] = split(self.traced, self.cuts)
        self.layouts = StageLayouts.build(
            self.stages, self._param_avals,
            [schedule.device_stages(d) for d in range(schedule.num_devices)])
        self.lowered: Lowered = lower(schedule, {
            "resa": [lay.sizes for lay in self.layouts.resa],
            "resb": [lay.sizes for lay in self.layouts.resb],
            "wres": [lay.sizes for lay in self.layouts.wres],
        })
        self._spd = self.lowered.stages_per_device
        self._batch_ndims = [len(a.shape) for a in jax.tree.leaves(mb)]
        self._step = build_step(
            self.stages, self.layouts, self.lowered, mesh, axis, self.data_axes,
            self.num_microbatches, len(self._batch_ndims),
        )
        self._vg = jax.jit(self._value_and_grad)
        self._pbuf_sharding = NamedSharding(mesh, P(axis))
        self._shard_jit = jax.jit(
            self._pack,
            out_shardings=self._pbuf_sharding,
        )
        self._unshard_jit = jax.jit(lambda staged: self._gather(staged, owner_only=True))
        self._trainer = None
        self._plan = None
        if jax.process_count() > 1:
            # Every process must build the same program, or its collectives never match.
            from jaxpipe.distributed import check_consistent

            check_consistent(self)

    # ---------------------------------------------------------------- checks
    def _check_data_split(self, mb) -> None:
        n = int(np.prod([self.mesh.shape[a] for a in self.data_axes])) if self.data_axes else 1
        self._data_size = n
        for leaf in jax.tree.leaves(mb):
            if leaf.shape[0] % n:
                raise PipelineError(
                    f"microbatch size {leaf.shape[0]} is not divisible by the {n} devices of "
                    f"the data axes {self.data_axes}; use a batch size divisible by "
                    f"{n * self.num_microbatches}."
                )

    def _check_params(self, params) -> list:
        leaves, tree = jax.tree.flatten(params)
        if tree != self.traced.params_treedef:
            raise PipelineError(
                "params do not have the structure the pipeline was built with:\n"
                f"  expected {self.traced.params_treedef}\n  got      {tree}\n"
                "pass the same parameter pytree (or rebuild the pipeline)."
            )
        for i, (x, a) in enumerate(zip(leaves, self._param_avals, strict=True)):
            if jnp.shape(x) != a.shape or jnp.result_type(x) != a.dtype:
                raise PipelineError(
                    f"parameter leaf {i} has shape {jnp.shape(x)} dtype {jnp.result_type(x)}, "
                    f"but the pipeline was traced with {a.shape} {a.dtype}."
                )
        return leaves

    def staged_shapes(self) -> list[tuple[int, ...]]:
        """Global shapes of the staged parameter arrays (one per slot)."""
        return [(self.schedule.num_devices, *shape) for shape in self.layouts.slots.shapes]

    def _check_staged(self, staged, what: str) -> None:
        want = self.staged_shapes()
        got = ([tuple(np.shape(v)) for v in staged] if isinstance(staged, (list, tuple))
               else None)
        if got != want:
            raise PipelineError(
                f"{what} expects parameters in this pipeline's stage layout {want} (from "
                f"pipe.shard(params) or state.params), got "
                f"{got if got is not None else type(staged).__name__}; for a TrainState use "
                "pipe.params(state), and a user parameter pytree needs no unshard."
            )

    def _microbatches(self, batch) -> list:
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
    def shard(self, params) -> list[jax.Array]:
        """Move ``params`` into the per-device stage layout (sharded over the pipe axis).

        Returns one array ``[devices, *shape]`` per parameter slot (see
        :class:`jaxpipe.packing.ParamSlots`); tied parameters are copied onto every stage
        that reads them.
        """
        leaves = self._check_params(params)
        return self._shard_jit(leaves)

    def _pack(self, leaves) -> list:
        """User leaves (replicated) -> one ``[devices, *shape]`` array per parameter slot.

        Runs as a shard_map: each device copies just its own stages' leaves into its
        slots (one copy of its parameters), instead of XLA partitioning a global stack.
        """
        slots, sched = self.layouts.slots, self.schedule
        owner = [[None] * len(slots) for _ in range(sched.num_devices)]
        for st in self.stages:
            for pid, n in zip(st.param_ids, slots.stage_slots[st.index], strict=True):
                owner[sched.placement(st.index)][n] = pid

        def branch(d):
            return lambda lv: [lv[pid].astype(dt) if pid is not None else jnp.zeros(shape, dt)
                               for pid, shape, dt in zip(owner[d], slots.shapes, slots.dtypes,
                                                         strict=True)]

        def local(lv):
            out = lax.switch(lax.axis_index(self.axis),
                             [branch(d) for d in range(sched.num_devices)], lv)
            return [x[None] for x in out]

        fn = jax.shard_map(local, mesh=self.mesh, in_specs=(P(),),
                           out_specs=[P(self.axis)] * len(slots), check_vma=False)
        return fn([place(x, self.mesh, P()) for x in leaves])

    def _gather(self, staged, owner_only: bool) -> list:
        """Slots -> user leaves, replicated: the sum over the stages holding each leaf
        (``owner_only``: the first such stage's copy, for parameters)."""
        slots, sched = self.layouts.slots, self.schedule
        first: dict[int, int] = {}
        for st in self.stages:
            for pid in st.param_ids:
                first.setdefault(pid, st.index)
        avals = self._param_avals

        def branch(d):
            def f(local):
                out = [None] * len(avals)
                for s in sched.device_stages(d):
                    for pid, n in zip(self.stages[s].param_ids, slots.stage_slots[s],
                                      strict=True):
                        if owner_only and first[pid] != s:
                            continue
                        out[pid] = local[n] if out[pid] is None else out[pid] + local[n]
                return [jnp.zeros(a.shape, a.dtype) if x is None else x
                        for x, a in zip(out, avals, strict=True)]
            return f

        def local(buf):
            buf = [x[0] for x in buf]
            out = lax.switch(lax.axis_index(self.axis),
                             [branch(d) for d in range(sched.num_devices)], buf)
            return [lax.psum(x, self.axis) for x in out]

        fn = jax.shard_map(local, mesh=self.mesh, in_specs=([P(self.axis)] * len(slots),),
                           out_specs=[P()] * len(avals), check_vma=False)
        return fn([place(x, self.mesh, P(self.axis)) for x in staged])

    def _stack_rows(self, rows: list[dict], width: dict[str, int]) -> dict:
        """Per-stage flat rows -> ``{dtype: [devices, stages_per_device, width]}``."""
        sched = self.schedule
        out = {}
        for dt, w in width.items():
            zero = jnp.zeros((w,), dt)
            out[dt] = jnp.stack([
                jnp.stack([rows[s][dt] for s in sched.device_stages(d)]
                          + [zero] * (self._spd - len(sched.device_stages(d))))
                for d in range(sched.num_devices)
            ])
        return out

    def _per_stage(self, staged) -> list[list]:
        """Each stage's parameter leaves from a staged buffer (for inspection and tests)."""
        staged = [place(v, self.mesh, P()) for v in staged]
        return [[staged[n][self.schedule.placement(st.index)]
                 for n in self.layouts.slots.stage_slots[st.index]] for st in self.stages]

    def unshard(self, staged) -> Any:
        """Inverse of :meth:`shard`: the user's parameter pytree (replicated)."""
        self._check_staged(staged, "unshard")
        return jax.tree.unflatten(self.traced.params_treedef, self._unshard_jit(list(staged)))

    # ---------------------------------------------------------------- compute
    def _value_and_grad(self, params, batch):
        pbuf = self._pack(self._check_params(params))
        gbuf, loss = self._step(pbuf, self._microbatches(batch))
        grads = self._gather(gbuf, owner_only=False)
        return loss, jax.tree.unflatten(self.traced.params_treedef, grads)

    def value_and_grad(self, params, batch) -> tuple[jax.Array, Any]:
        """Mean loss over microbatches and its gradient w.r.t. ``params`` (same pytree)."""
        if self.runtime == "reference":
            return self.reference_value_and_grad(params, batch)
        return self._vg(params, batch)

    def reference_value_and_grad(self, params, batch) -> tuple[jax.Array, Any]:
        """Same as :meth:`value_and_grad`, run by the sequential reference executor."""
        leaves = self._check_params(params)
        loss, grads, _ = run_reference(self.stages, self.schedule, leaves,
                                       self._microbatches(batch))
        return loss, jax.tree.unflatten(self.traced.params_treedef, grads)

    def lower_step(self, params, batch):
        """``jax.jit(...).lower`` of the value-and-grad step (for memory/cost inspection)."""
        return self._vg.lower(params, batch)

    # ---------------------------------------------------------------- training
    def init(self, params, optimizer, *, skip_nonfinite: bool = False,
             clip_global_norm: float | None = None):
        """Train state for :meth:`train_step`: parameters and per-stage optax state.

        Args:
          params: the user parameter pytree.
          optimizer: any ``optax.GradientTransformation``; it runs per stage on that
            stage's parameter pytree (other stages' leaves are ``None``).
          skip_nonfinite: if the loss or gradient norm is NaN/inf, leave the state
            unchanged for that step (``metrics["skipped"] == 1``).
          clip_global_norm: clip gradients by their true global norm (over all stages)
            before the optimizer.
        """
        from jaxpipe.train import init_state

        return init_state(self, params, optimizer, skip_nonfinite=skip_nonfinite,
                          clip_global_norm=clip_global_norm)

    def train_step(self, state, batch):
        """One optimizer step: ``(state, batch) -> (state, metrics)``; jitted, state donated."""
        from jaxpipe.train import train_step

        return train_step(self, state, batch)

    def params(self, state) -> Any:
        """The user parameter pytree held by a train state."""
        return self.unshard(state.params)

    @property
    def plan(self):
        """Per-stage layers, FLOPs, bytes, in-flight counts and predicted memory/bubble."""
        if self._plan is None:
            from jaxpipe.plan import Plan

            self._plan = Plan.build(self)
        return self._plan

    def compare_compiled(self, params, batch) -> dict:
        """Predicted per-device bytes next to the compiled program's ``memory_analysis()``."""
        from jaxpipe.plan import Plan

        return Plan.compare_compiled(self, params, batch)


def pipeline(
    loss_fn: Callable[[Any, Any], jax.Array],
    params: Any,
    batch: Any,
    *,
    mesh: Mesh,
    schedule: Schedule,
    cut: Any = "auto",
    axis: str = "pipe",
    runtime: str = "spmd",
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
      runtime: ``"spmd"`` (one jit(shard_map) program) or ``"reference"`` (sequential).

    Example::

        mesh = jax.make_mesh((4,), ("pipe",))
        pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh,
                           schedule=jp.OneFOneB(4, 8), cut="markers")
        loss, grads = pipe.value_and_grad(params, batch)
    """
    return Pipeline(loss_fn, params, batch, mesh=mesh, schedule=schedule, cut=cut, axis=axis,
                    runtime=runtime)
