"""The SPMD runtime: every schedule as one ``jax.jit(jax.shard_map(...))`` program.

:class:`SpmdRuntime` is what users pass (``runtime="spmd"``, the default);
:meth:`SpmdRuntime.build` lays out every stage's values (:mod:`.program.layout`), lowers
the schedule to static tables (:mod:`.lowering`) and builds the program
(:mod:`.program.build`).
The :class:`SpmdExecutor` it returns keeps parameters in slots, one array
``[devices, *shape]`` each, sharded over the pipe axis (see
:class:`~.program.layout.SlotLayout`).
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe.cut.memory_model import ACCELERATOR_MEMORY, SPMD_MEMORY, TPU_MEMORY, MemoryModel
from jaxpipe.errors import PipelineError
from jaxpipe.runtime.base import Executor, Runtime, RuntimeSpec, StepFn
from jaxpipe.runtime.spmd.backends import (
    BACKENDS,
    REFINE_EVALS,
    concurrent,
    exchange_flops,
    packed_w_error,
    platform_of,
)
from jaxpipe.runtime.spmd.lowering import Lowering, lower, lower_accelerator
from jaxpipe.runtime.spmd.lowering.lanes import lanes_in_flight, lanes_refusal, lower_lanes
from jaxpipe.runtime.spmd.predict import predicted_time
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

__all__ = ["SpmdExecutor", "SpmdRuntime"]


class SpmdRuntime(Runtime):
    """Run the pipeline as one SPMD program over the mesh's pipe axis (the default).

    Args:
      backend: the program to build: ``"cpu"`` (ticks run their branches in gated loops
        and exchange only where messages move: right where a collective costs ~75 us and
        a loop's trip count is read on the host anyway), or ``"gpu"`` / ``"tpu"`` (the
        accelerator program: straight-line ticks, one ``lax.switch`` per tick holding no
        collective, one unconditional permutation per direction, the buffers updated in
        place outside the switch; :mod:`.program.accelerator_ticks`). ``"auto"``
        (default): the mesh's platform. Either program builds and runs on any backend, so
        the accelerator program is tested on CPU.
      overlap: in the accelerator program, send each tick's message during the next tick
        (the permutation's operand comes from the loop's carry, so XLA can overlap it
        with the tick's compute), at one more tick before another device can read it.
        ``"auto"`` (default): where the sync model says that runs faster, with a
        permutation priced from the message's bytes and the stages' FLOPs
        (:data:`LINK_FLOPS_PER_BYTE`, :data:`EXCHANGE_LATENCY_FLOPS`); without the
        cutter's costs, off.
      share_bodies: run stages whose functions are identical up to their parameters
        through one compiled branch per action kind (smaller program, faster compile).
        ``True``: every such stage, the chunks of an interleaved schedule on one device
        among them; the branch then picks the running chunk's parameters and adds into a
        stacked gradient at run time, every step. ``"devices"``: only stages that read
        the same parameter slots (one chunk over the devices): no pick, one body per
        chunk. ``False``: a body per stage. ``"auto"`` (default): ``"devices"`` in the
        CPU program where devices run concurrently (several processes) and the lanes
        program is not wanted, ``True`` elsewhere. The per-step pick is most of what
        the CPU program costs beyond compute for interleaved schedules (8 x 512 MLP, p=2
        on one core, v=2: 1.43x plain JAX shared, 1.10x by devices;
        ``benchmarks/probes/step_overhead.py``), where one process' compile time matters
        less than the step. (In one process by devices steps 6-14% faster on the GPT
        benchmark model unrolled, p=2/4, but compiles a scanned stack 11% slower.)
      split_backward: run every full backward ``B`` as its input half ``I`` then its
        weight half ``W`` (same device order and memory; balanced steps when devices run
        concurrently). ``"auto"``: split in the accelerator program, where steps of equal
        cost keep the lock-step program at the schedule's speed; not in the CPU program,
        where the extra steps cost more than they save (2 gloo processes, p=2 m=8: GPipe
        0.41 of the ideal speed-up split vs 0.83 unsplit; benchmarks/README.md).
      iw_same_tick: run a W that directly follows its own I in the I's tick, the I's
        cotangent leaving after the W. Where every W of a stage directly follows its I
        (1F1B split into I + W), the pair runs as one step and the hand-off goes
        straight from I to W instead of through storage
        (:func:`.lowering.fusion.joined_weights`); other such Ws run as the tick's second
        step. ``"auto"`` (default): only in the CPU program where devices do not run
        concurrently (virtual CPU devices in one process), where the later cotangent
        costs nothing and the joined step removes the split's cost (1F1B p=4, I + W
        against B: 1.05 -> 0.995 on an MLP, 1.06 -> 1.01 on GPT blocks;
        benchmarks/sections/step.py). Where devices run concurrently the later cotangent
        delays the stage before; the accelerator program runs one step per tick.
      fuse_fb: run a B that directly follows its own F (the last stage's, whose cotangent
        is its loss, in 1F1B and at p=1) in the F's step as one forward and backward, as
        plain ``jax.value_and_grad`` does: that stage stores no residuals, the pair takes
        one step, and its F and B compile as one branch. Only for stages whose every B
        qualifies (see :func:`.lowering.fusion.fused_backwards`); not with
        ``split_backward`` (no B is left to fuse). ``"auto"`` (default): only where that
        does not raise the stored bytes (always at p=1; at p>=2 the busiest device is
        another and the FB step's scratch would add to it). ``True`` trades that memory
        for compile time (GPT benchmark model p=2: XLA -17%, compiled memory +4%).
      refine: evaluations of the local search over ticks under the sync model
        (:mod:`.lowering.refine`). ``"auto"``: :data:`REFINE_EVALS` where devices run
        concurrently (the accelerator program, or several processes), else none.
      lanes: build the lanes program (:mod:`.program.lane_ticks`) on any backend: where
        every stage is one shared body, each tick runs its forward then its backward on
        every device with no conditional around them, so the collectives XLA puts inside
        a stage (FSDP all-gathers, tensor-parallel reductions, resharding permutes) run
        unconditionally. Needs F and B actions (no split backward) and each direction
        of messages used by one kind (not V placements). A schedule whose device order
        waits for each backward (1F1B) idles more ticks than as one action a tick, a
        GPipe-like order none; ``pipe.plan`` shows the lowering. ``"auto"`` (default):
        where a stage holds such collectives (parameters sharded over a mesh axis other
        than pipe) and the schedule allows it; ``True`` raises where it does not.
    """

    name: ClassVar[str] = "spmd"

    def __init__(self, *, backend: str = "auto", overlap: bool | str = "auto",
                 share_bodies: bool | str = "auto", split_backward: bool | str = "auto",
                 iw_same_tick: bool | str = "auto", fuse_fb: bool | str = "auto",
                 refine: int | str = "auto", lanes: bool | str = "auto") -> None:
        if backend not in BACKENDS:
            raise PipelineError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, "
                                f"got {backend!r}.")
        for name, value in (("overlap", overlap), ("split_backward", split_backward),
                            ("iw_same_tick", iw_same_tick), ("fuse_fb", fuse_fb),
                            ("lanes", lanes)):
            if value not in (True, False, "auto"):
                raise PipelineError(f"{name} must be True, False or 'auto', got {value!r}.")
        if refine != "auto" and (isinstance(refine, bool) or not isinstance(refine, int)
                                 or refine < 0):
            raise PipelineError(
                f"refine must be 'auto' or a number of evaluations >= 0, got {refine!r}.")
        if backend in ("gpu", "tpu") and iw_same_tick is True:
            raise packed_w_error(backend)
        self.backend = backend
        self.overlap = overlap
        self.refine = refine
        self.fuse_fb = fuse_fb
        if share_bodies not in (True, False, "auto", "devices"):
            raise PipelineError(f"share_bodies must be True, False, 'devices' or 'auto', "
                                f"got {share_bodies!r}.")
        self.share_bodies = share_bodies
        self.split_backward = split_backward
        self.iw_same_tick = iw_same_tick
        self.lanes = lanes

    @property
    def memory_model(self) -> MemoryModel:
        return SPMD_MEMORY

    def memory_model_for(self, mesh: Any = None) -> MemoryModel:
        """:data:`SPMD_MEMORY` (CPU program), :data:`ACCELERATOR_MEMORY` (the accelerator
        program's switch outputs are buffers of their own), XLA:TPU's :data:`TPU_MEMORY`."""
        if not self.accelerated(mesh):
            return SPMD_MEMORY
        return TPU_MEMORY if platform_of(mesh) == "tpu" else ACCELERATOR_MEMORY

    def build(self, spec: RuntimeSpec) -> SpmdExecutor:
        return SpmdExecutor(spec, self)

    def resolve_backend(self, mesh: Any = None) -> str:
        """The program built for ``mesh`` (``backend="auto"``: its devices' platform)."""
        if self.backend != "auto":
            return self.backend
        platform = platform_of(mesh)
        return "cpu" if platform == "cpu" else ("tpu" if platform == "tpu" else "gpu")

    def accelerated(self, mesh: Any = None) -> bool:
        """Whether the accelerator program runs on ``mesh``."""
        return self.resolve_backend(mesh) != "cpu"

    def resolve_refine(self, mesh: Any = None) -> int:
        """Local-search evaluations the lowering runs (``refine="auto"`` resolved)."""
        if self.refine != "auto":
            return self.refine
        return REFINE_EVALS if self.accelerated(mesh) or concurrent(mesh) else 0

    def resolve_iw_same_tick(self, mesh: Any = None) -> bool:
        """Whether a W runs in its own I's tick (``iw_same_tick="auto"`` resolved)."""
        if self.iw_same_tick != "auto":
            return bool(self.iw_same_tick)
        return not (self.accelerated(mesh) or concurrent(mesh))

    def resolve_split(self, mesh: Any = None, mesh_axes: Any = None) -> bool:
        if self.split_backward != "auto":
            return bool(self.split_backward)
        return self.accelerated(mesh) and not self.wants_lanes(mesh, mesh_axes)

    def wants_lanes(self, mesh: Any = None, mesh_axes: Any = None) -> bool:
        """Whether the lanes program is wanted (``lanes=True``, or ``"auto"`` where a
        mesh axis left to JAX's sharding inside the stages has more than one device);
        the schedule may still refuse it (:func:`.lowering.lanes.lanes_refusal`)."""
        if self.lanes != "auto":
            return bool(self.lanes)
        if mesh is None or mesh_axes is None:
            return False
        return any(mesh.shape[a] > 1 for a in mesh.axis_names
                   if a not in mesh_axes.manual_axes)

    def resolve_share(self, mesh: Any = None, mesh_axes: Any = None) -> bool | str:
        """How stages share bodies (``share_bodies="auto"`` resolved)."""
        if self.share_bodies != "auto":
            return self.share_bodies
        by_devices = (not self.accelerated(mesh) and concurrent(mesh)
                      and not self.wants_lanes(mesh, mesh_axes))
        return "devices" if by_devices else True

    def shares_cores(self) -> bool:
        return self.share_bodies is not False

    def splits_backward(self, mesh: Any = None, mesh_axes: Any = None) -> bool:
        return self.resolve_split(mesh, mesh_axes)

    def in_flight(self, schedule: Any, mesh: Any = None, mesh_axes: Any = None
                  ) -> list[int] | None:
        """The lanes program's peaks where it will run (a forward runs before its tick's
        backward: one more set on 1F1B's first devices); else the schedule's."""
        if not self.wants_lanes(mesh, mesh_axes):
            return None
        return lanes_in_flight(schedule, self.resolve_split(mesh, mesh_axes))

    def predicted_time(self, schedule: Any, action_cost: Any, mesh: Any = None,
                       mesh_axes: Any = None, stored_bytes: float = 0.0) -> float:
        """The lowered program's time plus its costs a tick (:mod:`.predict`)."""
        return predicted_time(schedule, action_cost, self.resolve_backend(mesh),
                              self.wants_lanes(mesh, mesh_axes),
                              self.resolve_split(mesh, mesh_axes), self.resolve_refine(mesh),
                              concurrent(mesh), stored_bytes=stored_bytes)[0]

    def __repr__(self) -> str:
        return (f"SpmdRuntime(backend={self.backend!r}, overlap={self.overlap!r}, "
                f"share_bodies={self.share_bodies!r}, "
                f"split_backward={self.split_backward!r}, iw_same_tick={self.iw_same_tick!r}, "
                f"fuse_fb={self.fuse_fb!r}, refine={self.refine!r}, lanes={self.lanes!r})")


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

    def __init__(self, spec: RuntimeSpec, runtime: SpmdRuntime | None = None) -> None:
        runtime = runtime or SpmdRuntime()
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
        if self.accelerated and runtime.iw_same_tick is True:  # "auto" on a GPU/TPU mesh
            raise packed_w_error(self.backend)
        self._runtime, self._options = runtime, options
        self.lanes_refused: str | None = None  # why a wanted lanes program is not built
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
            **kind), epilogue)

    def _resolve_lanes(self, runtime: SpmdRuntime) -> bool:
        """Whether the lanes program runs (``SpmdRuntime(lanes=...)``; where it is wanted,
        ``split_backward="auto"`` split no backward already)."""
        spec = self.spec
        if not runtime.wants_lanes(spec.mesh, spec.mesh_axes):
            return False
        why = self.lanes_refused = lanes_refusal(spec.schedule, self.body_of_stage,
                                                 self._options["split_backward"])
        if why is not None:
            if runtime.lanes is True:
                raise PipelineError(
                    f"SpmdRuntime(lanes=True) cannot run this pipeline: {why}. Use "
                    "lanes='auto' or False, or a schedule and cut whose stages share one "
                    "body (repeated @jp.layer blocks, cut=\"markers\").")
            return False
        return True

    def _lower(self, schedule: Any, pool_counts: Any) -> Lowering:
        """The lowering of ``schedule`` for this executor's program."""
        runtime, options = self._runtime, self._options
        if self.lanes:
            return lower_lanes(schedule, pool_counts, self.body_of_stage)
        if not self.accelerated:
            return lower(schedule, pool_counts, self.body_of_stage, **options)
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
        mesh = self.spec.mesh
        return [jax.ShapeDtypeStruct(shape, np.dtype(c.dtype),
                                     sharding=NamedSharding(mesh, c.spec(self.spec.axis)))
                for shape, c in zip(self.staged_shapes(), self.layouts.slots.classes,
                                    strict=True)]

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
