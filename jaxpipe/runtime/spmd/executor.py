"""The SPMD executor: one pipeline's ``jax.jit(jax.shard_map(...))`` programs.

:meth:`~.runtime.SpmdRuntime.build` returns a :class:`SpmdExecutor`, which lays out every
stage's values (:mod:`.program.layout`), lowers the schedule to static tables
(:mod:`.lowering`) and builds the program (:mod:`.program.build`) under the runtime's
resolved options (:mod:`.options`). It keeps parameters in slots, one array
``[devices, *shape]`` each, sharded over the pipe axis (see
:class:`~.program.layout.SlotLayout`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe.errors import PipelineError
from jaxpipe.runtime.base import Executor, RuntimeSpec, StepFn
from jaxpipe.runtime.spmd.backends import (
    concurrent,
    exchange_flops,
    packed_w_error,
    platform_of,
)
from jaxpipe.runtime.spmd.lowering import Lowering, lower, lower_accelerator
from jaxpipe.runtime.spmd.lowering.lanes import lanes_refusal, lower_lanes
from jaxpipe.runtime.spmd.options import SpmdOptions
from jaxpipe.runtime.spmd.predict import cpu_lowering
from jaxpipe.runtime.spmd.program.bodies import group_bodies
from jaxpipe.runtime.spmd.program.build import (
    Epilogue,
    ProgramKind,
    ProgramMesh,
    ProgramStages,
    build_step,
    check_stage_collectives,
)
from jaxpipe.runtime.spmd.program.layout import SlotLayout, StageLayouts
from jaxpipe.runtime.spmd.program.manual import manual_shard_map, place
from jaxpipe.runtime.spmd.program.optimizer import InitOptState, make_epilogue, opt_slots
from jaxpipe.runtime.spmd.program.param_groups import Groups
from jaxpipe.runtime.spmd.program.param_moves import (
    Crossing,
    from_slots,
    interleaved_leaf,
    slot_inputs,
    to_slots,
)
from jaxpipe.runtime.spmd.reports import ExecutorReports
from jaxpipe.schedule.forward import ForwardOnly
from jaxpipe.sharding.mesh_axes import to_spec
from jaxpipe.train.options import TrainOptions
from jaxpipe.train.state import StageOptimizer

__all__ = ["SpmdExecutor"]


class SpmdExecutor(ExecutorReports, Executor):
    """A pipeline's SPMD program, its lowered tables and its slot buffers.

    The staged layout of parameters (and of optimizer state) is a list of slots, each
    ``[devices, *shape]`` sharded over the pipe axis (``layouts.slots``).

    Attributes:
      spec: what it was built from.
      layouts: where every stage's parameters, residuals and messages live.
      bodies: the compiled stage bodies (stages with identical functions share one).
      lowering: the schedule's static tables and buffer sizes (ticks, residual peaks).
    """

    def __init__(self, spec: RuntimeSpec, runtime: SpmdOptions | None = None) -> None:
        runtime = runtime or SpmdOptions()
        self.spec = spec
        sched = spec.schedule
        device_stages = [sched.device_stages(d) for d in range(sched.num_devices)]
        self.layouts = StageLayouts.build(spec.stages, spec.param_avals, device_stages,
                                          spec.param_dims)
        self.bodies, self.body_of_stage = group_bodies(
            spec.stages, self.layouts.slots,
            share=runtime.resolve_share(spec.mesh, spec.mesh_axes))
        mesh = spec.mesh
        self.backend = runtime.resolve_backend(mesh)
        self.accelerated = self.backend != "cpu"
        options = dict(split_backward=runtime.resolve_split(mesh, spec.mesh_axes),
                       iw_same_tick=runtime.resolve_iw_same_tick(mesh),
                       fuse_fb=runtime.fuse_fb, costs=spec.action_cost,
                       refine=runtime.resolve_refine(mesh))
        _check_asked_for(runtime, self.backend, options["split_backward"])
        self._runtime, self._options = runtime, options
        # why a wanted lanes program is not built (here, or by the runtime this one
        # stands in for: SpmdRuntime.instead_of)
        self.lanes_refused: str | None = runtime.lanes_declined
        self.lanes = self._resolve_lanes(runtime)
        self.lowering: Lowering = self._lower(sched, self.layouts.pool_counts())
        holds = slot_inputs(spec, self.layouts.slots)
        self.groups = Groups(
            self.bodies, self.layouts.slots.classes, axis=spec.axis,
            placement=[sched.placement(s) for s in range(sched.num_stages)],
            whole=lambda g: interleaved_leaf(spec, self.layouts.slots, holds, g) is not None)
        self._stages = ProgramStages(self.bodies, self.layouts, self.groups)
        self._where = ProgramMesh(spec.mesh, spec.mesh_axes, len(spec.microbatch_avals))
        self._step = self._build(self.lowering)
        # value_and_grad moves parameters in and gradients out by group (.param_groups)
        self._step_grouped = self._build(self.lowering, grouped=True)
        #: what the value-and-grad programs run, for reports (grouped first)
        self.tick_loops = (self._step_grouped.tick_loop, self._step.tick_loop)

    def _build(self, lowering: Lowering, epilogue: Epilogue | None = None,
               **kind: bool) -> Any:
        """The program of ``lowering`` for this executor's stages and mesh."""
        return build_step(self._stages, lowering, self._where, ProgramKind(
            accelerator=self.accelerated, lanes=self.lanes, objective=self.spec.objective,
            weight=self.spec.batch_weight, **kind), epilogue)

    def _resolve_lanes(self, runtime: SpmdOptions) -> bool:
        """Whether the lanes program runs (``SpmdRuntime(lanes=...)``; where it is wanted,
        ``split_backward="auto"`` split no backward already)."""
        spec = self.spec
        if not runtime.wants_lanes(spec.mesh, spec.mesh_axes):
            return False
        why = self.lanes_refused = lanes_refusal(spec.schedule, self.body_of_stage,
                                                 self._options["split_backward"])
        if why is not None:
            if runtime.lanes is True:
                fix = ("a schedule and cut whose stages share one body (repeated @jp.layer "
                       "blocks, cut=\"markers\")" if why.startswith("its stages are") else
                       "a schedule of F and B actions only, with split_backward=False"
                       if "splits backwards" in why else
                       "a schedule whose devices' stages pass messages one way (no V)")
                raise PipelineError(
                    f"SpmdRuntime(lanes=True) cannot run this pipeline: {why}. Use "
                    f"lanes='auto' or False, or {fix}.")
            return False
        return True

    def _lower(self, schedule: Any, pool_counts: Any) -> Lowering:
        """The lowering of ``schedule`` for this executor's program."""
        runtime, options = self._runtime, self._options
        if self.lanes:
            return lower_lanes(schedule, pool_counts, self.body_of_stage)
        if not self.accelerated:
            return lower(schedule, pool_counts, self.body_of_stage, **options, **cpu_lowering(
                concurrent(self.spec.mesh), options["costs"] is not None))
        overlap = (runtime.overlap if self.spec.action_cost is not None
                   else runtime.overlap is True)
        return lower_accelerator(
            schedule, pool_counts, self.body_of_stage, overlap=overlap,
            transfer=exchange_flops(self.backend, self.layouts.unit_bytes()), **options)

    @functools.cached_property
    def forward_lowering(self) -> Lowering:
        """The lowering of the schedule's forward actions (:meth:`loss`): no residuals
        stored, so no storage at all (built on first use)."""
        return self._lower(ForwardOnly(self.spec.schedule), {})

    @functools.cached_property
    def _forward_steps(self) -> tuple[Any, Any]:
        """The evaluation programs: ``(from staged slots, from groups)``."""
        low = self.forward_lowering
        return (self._build(low, forward_only=True),
                self._build(low, forward_only=True, grouped=True))

    def _shard_map(self, fn: Any, in_specs: Any, out_specs: Any) -> Any:
        """``fn`` manual over the program's manual axes (:func:`.program.manual`)."""
        return manual_shard_map(fn, self.spec.mesh, self.spec.mesh_axes, in_specs, out_specs)

    def _slot_specs(self, slots: SlotLayout) -> list[P]:
        """Specs of a slot list's arrays: ``P(pipe, *dims)``."""
        return [c.spec(self.spec.axis) for c in slots.classes]

    @staticmethod
    def _crossing_specs(crossing: Crossing) -> list[P]:
        """Specs of what crosses into / out of the moves' shard_maps (non-pipe axes)."""
        return [to_spec(d) for d in crossing.dims()]

    # -- parameters -----------------------------------------------------------------
    def staged_shapes(self) -> list[tuple[int, ...]]:
        """Global shapes of the staged parameter arrays (one per slot)."""
        D = self.spec.schedule.num_devices
        return [(D, *c.shape) for c, _ in self.layouts.slots.slots]

    def staged_abstract(self) -> list[jax.ShapeDtypeStruct]:
        return list(self._staged_abstract)  # a new list: the caller may edit it

    @functools.cached_property
    def _staged_abstract(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        # built once: every train_step places its state against it (~0.2 ms to rebuild)
        mesh = self.spec.mesh
        return tuple(jax.ShapeDtypeStruct(shape, np.dtype(c.dtype),
                                          sharding=NamedSharding(mesh, c.spec(self.spec.axis)))
                     for shape, c in zip(self.staged_shapes(), self.layouts.slots.classes,
                                         strict=True))

    def check_staged(self, staged: Any, what: str) -> None:
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

    def shard(self, param_leaves: list) -> list:
        """User leaves -> one ``[devices, *shape]`` array per slot, sharded like them.

        Runs as a shard_map: each device fills its slots with its own stages' parameters
        (one copy of them), instead of XLA partitioning a global stack; a scanned stack's
        stacked weights come whole and each device slices its rows (:mod:`.program.param_moves`)."""
        return self._to_slots(param_leaves, grouped=False)

    def _to_slots(self, param_leaves: list, grouped: bool) -> Any:
        """:meth:`shard`; ``grouped``: ``(slots, group arrays)``, the slots of
        :attr:`groups` stacked by group (``None`` in the slot list)."""
        slots, crossing = self.layouts.slots, Crossing(self.spec)
        groups = self.groups if grouped else None
        specs = self._slot_specs(slots)
        fn = self._shard_map(lambda flat: to_slots(self.spec, slots, crossing, flat, groups),
                             (self._crossing_specs(crossing),),
                             self.groups.specs(specs, self.spec.axis, params=True)
                             if grouped else specs)
        return fn(crossing.flatten(list(param_leaves)))

    def _gather(self, staged: list, owner_only: bool, grouped: list | None = None) -> list:
        """Slots -> user leaves, replicated over the pipe axis
        (:func:`.program.param_moves.from_slots`). ``grouped``: the arrays of
        :attr:`groups`, whose slots ``staged`` holds as None."""
        slots, crossing = self.layouts.slots, Crossing(self.spec)
        groups = self.groups if grouped is not None else None
        specs = self._slot_specs(slots)
        fn = self._shard_map(
            lambda buf, arrays: from_slots(self.spec, slots, crossing, buf, owner_only,
                                           groups, arrays),
            self.groups.specs(specs, self.spec.axis) if groups else (specs, []),
            self._crossing_specs(crossing))
        return crossing.unflatten(fn(list(staged), list(grouped or [])))

    def unshard(self, staged: list) -> list:
        return self._gather(list(staged), owner_only=True)

    def stage_params(self, staged: list) -> list[list[jax.Array]]:
        """Each stage's parameter leaves as held on its device (tied leaves: every copy)."""
        staged = [place(v, self.spec.mesh, P()) for v in staged]
        sched, slots = self.spec.schedule, self.layouts.slots
        return [[staged[k][sched.placement(st.index)] for k in slots.where[st.index]]
                for st in self.spec.stages]

    # -- compute --------------------------------------------------------------------
    def staged_value_and_grad(self, staged: list, batch_mb: list
                              ) -> tuple[jax.Array, list, list]:
        gbuf, loss, aux = self._step(list(staged), batch_mb)
        return loss, aux, gbuf

    def value_and_grad(self, param_leaves: list, batch_mb: list
                       ) -> tuple[jax.Array, list, list]:
        (gslots, garrays), loss, aux = self._step_grouped(self._to_slots(param_leaves, True),
                                                          batch_mb)
        return loss, aux, self._gather(gslots, owner_only=False, grouped=garrays)

    def staged_loss(self, staged: list, batch_mb: list) -> tuple[jax.Array, list]:
        return self._forward_steps[0](list(staged), batch_mb)

    def loss(self, param_leaves: list, batch_mb: list) -> tuple[jax.Array, list]:
        return self._forward_steps[1](self._to_slots(param_leaves, True), batch_mb)

    # -- training -------------------------------------------------------------------
    def make_train_step(self, optimizer: Any, options: TrainOptions) -> tuple[StepFn, Any]:
        spec = self.spec
        stage_opt = StageOptimizer(optimizer, spec)
        ostate = opt_slots(spec, stage_opt)
        epilogue = make_epilogue(spec, self.layouts.slots, stage_opt, ostate, options)
        pspec = self._slot_specs(self.layouts.slots)
        ospec = self._slot_specs(ostate)
        core = self._build(self.lowering, Epilogue(
            epilogue, in_specs=(ospec,),
            out_specs=(pspec, ospec, {"loss": P(), "grad_norm": P(), "skipped": P()})))

        def step(staged: list, opt_state: list, batch_mb: list) -> tuple:
            (params, opt_state, metrics), aux = core(list(staged), batch_mb, list(opt_state))
            return params, opt_state, {**metrics, "aux": aux}

        return step, InitOptState(spec, stage_opt, ostate, ospec)

    def opt_state_abstract(self, init_opt_state: Any) -> Any:
        shapes = jax.eval_shape(init_opt_state, [
            jax.ShapeDtypeStruct(a.shape, a.dtype) for a in self.spec.views.leaf_avals])
        return [jax.ShapeDtypeStruct(s.shape, s.dtype,
                                     sharding=NamedSharding(self.spec.mesh, p))
                for s, p in zip(shapes, init_opt_state.specs, strict=True)]

    def compiled_check(self) -> Any:
        """On the CPU backend with parameters sharded over automatic axes: refuse a program
        in which XLA moved data inside a stage with a collective-permute (see
        :func:`.program.build.check_stage_collectives`)."""
        if not self.spec.param_axes or platform_of(self.spec.mesh) != "cpu" or self.lanes:
            return None  # (the lanes program runs every stage collective unconditionally)
        return check_stage_collectives


def _check_asked_for(runtime: SpmdOptions, backend: str, split: bool) -> None:
    """A clear error for an option set to ``True`` that the program built for ``backend``
    (with its backward ``split`` or not) would ignore ("auto" resolves to what it runs)."""
    if backend != "cpu" and runtime.iw_same_tick is True:
        raise packed_w_error(backend)
    if backend == "cpu" and runtime.overlap is True:
        raise PipelineError(
            "SpmdRuntime(overlap=True) overlaps the GPU/TPU program's permutes with the "
            "next tick's compute; this mesh runs the CPU program, which sends each message "
            "at the tick end its readers need. Use backend='gpu' or 'tpu' (the accelerator "
            "program runs on any mesh), or drop overlap.")
    if split and runtime.fuse_fb is True:
        raise PipelineError(
            "SpmdRuntime(fuse_fb=True) runs a last stage's B in its own F's step; with the "
            "backward split into I and W (split_backward) no B is left to fuse. Pass "
            "split_backward=False, or drop fuse_fb.")
