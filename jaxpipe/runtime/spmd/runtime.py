"""The SPMD runtime: what users pass (``runtime="spmd"``, the default).

:class:`SpmdRuntime` is :class:`~.options.SpmdOptions` under the :class:`Runtime`
contract: its memory model, the peaks and time it predicts for the cutter and
``schedule="auto"``, and :meth:`SpmdRuntime.build`, which returns the pipeline's
:class:`~.executor.SpmdExecutor`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from jaxpipe.cut.memory_model import ACCELERATOR_MEMORY, SPMD_MEMORY, TPU_MEMORY, MemoryModel
from jaxpipe.runtime.base import Runtime, RuntimeSpec
from jaxpipe.runtime.spmd.backends import concurrent, platform_of
from jaxpipe.runtime.spmd.executor import SpmdExecutor
from jaxpipe.runtime.spmd.lowering.lanes import lanes_in_flight
from jaxpipe.runtime.spmd.options import SpmdOptions
from jaxpipe.runtime.spmd.predict import predicted_time

__all__ = ["SpmdRuntime"]


class SpmdRuntime(SpmdOptions, Runtime):
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

    def instead_of(self, executor: SpmdExecutor) -> SpmdRuntime | None:
        """Without the lanes where they were wanted but the stages turned them down: the
        cut assumed the lanes' peaks, and the accelerator program then splits its
        backwards (``split_backward="auto"`` split none for the lanes)."""
        if self.lanes != "auto" or executor.lanes_refused is None:
            return None
        instead = SpmdRuntime(**{**self.options(), "lanes": False})
        instead.lanes_declined = executor.lanes_refused  # (the plan still says why)
        return instead

    def instead_of_infeasible(self, mesh: Any = None, mesh_axes: Any = None
                              ) -> SpmdRuntime | None:
        """Without the lanes where ``lanes="auto"`` wanted them: the cut budgeted the
        lanes program's peaks (one more set on 1F1B's first devices), and the program
        without lanes holds the schedule's own."""
        if self.lanes != "auto" or not self.wants_lanes(mesh, mesh_axes):
            return None
        instead = SpmdRuntime(**{**self.options(), "lanes": False})
        instead.lanes_declined = ("the memory budget does not fit the residual sets the "
                                  "lanes program holds")
        return instead

    def __repr__(self) -> str:
        return "SpmdRuntime(" + ", ".join(f"{k}={v!r}" for k, v in self.options().items()) + ")"
