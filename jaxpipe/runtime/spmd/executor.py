"""The SPMD runtime: every schedule as one ``jax.jit(jax.shard_map(...))`` program.

:class:`SpmdRuntime` is what users pass (``runtime="spmd"``, the default);
:meth:`SpmdRuntime.build` lays out every stage's values (:mod:`.layout`), lowers the
schedule to static tables (:mod:`.lowering`) and builds the program (:mod:`.program`).
The :class:`SpmdExecutor` it returns keeps parameters in per-device *slots*: one array
``[devices, *shape]`` per slot, sharded over the pipe axis (see
:class:`~.layout.ParamSlots`).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpipe.errors import PipelineError
from jaxpipe.runtime.base import Executor, Runtime, RuntimeSpec, StepFn
from jaxpipe.runtime.spmd.layout import StageLayouts
from jaxpipe.runtime.spmd.lowering import Lowering, lower
from jaxpipe.runtime.spmd.optimizer import OptimizerLayout, make_epilogue
from jaxpipe.runtime.spmd.program import build_step, place
from jaxpipe.train import StageOptimizer, TrainOptions

__all__ = ["SpmdExecutor", "SpmdRuntime"]


class SpmdRuntime(Runtime):
    """Run the pipeline as one SPMD program over the mesh's pipe axis (the default)."""

    name: ClassVar[str] = "spmd"

    @property
    def memory_model(self) -> Any:
        from jaxpipe.cut import SPMD_MEMORY

        return SPMD_MEMORY

    def build(self, spec: RuntimeSpec) -> SpmdExecutor:
        return SpmdExecutor(spec)

    def __repr__(self) -> str:
        return "SpmdRuntime()"


class SpmdExecutor(Executor):
    """A pipeline's SPMD program, its lowered tables and its parameter slots.

    Attributes:
      spec: what it was built from.
      layouts: where every stage's parameters, residuals and messages live.
      lowering: the schedule's static tables and buffer sizes (ticks, residual peaks).
    """

    def __init__(self, spec: RuntimeSpec) -> None:
        self.spec = spec
        sched = spec.schedule
        self.layouts = StageLayouts.build(
            spec.stages, spec.param_avals,
            [sched.device_stages(d) for d in range(sched.num_devices)])
        self.lowering: Lowering = lower(sched, self.layouts.pool_sizes())
        self._step = build_step(spec.stages, self.layouts, self.lowering, spec.mesh,
                                spec.axis, spec.batch_axes, len(spec.microbatch_avals))
        self._staged_sharding = NamedSharding(spec.mesh, P(spec.axis))

    # -- parameters -----------------------------------------------------------------
    def staged_shapes(self) -> list[tuple[int, ...]]:
        """Global shapes of the staged parameter arrays (one per slot)."""
        return [(self.spec.schedule.num_devices, *shape) for shape in self.layouts.slots.shapes]

    def staged_abstract(self) -> list[jax.ShapeDtypeStruct]:
        return [jax.ShapeDtypeStruct(shape, np.dtype(dt), sharding=self._staged_sharding)
                for shape, dt in zip(self.staged_shapes(), self.layouts.slots.dtypes,
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
        """User leaves (replicated) -> one ``[devices, *shape]`` array per parameter slot.

        Runs as a shard_map: each device copies just its own stages' leaves into its
        slots (one copy of its parameters), instead of XLA partitioning a global stack.
        """
        spec, slots = self.spec, self.layouts.slots
        sched = spec.schedule
        owner: list[list[int | None]] = [[None] * len(slots) for _ in range(sched.num_devices)]
        for st in spec.stages:
            for pid, n in zip(st.param_ids, slots.stage_slots[st.index], strict=True):
                owner[sched.placement(st.index)][n] = pid

        def branch(d: int):
            return lambda lv: [lv[pid].astype(dt) if pid is not None else jnp.zeros(shape, dt)
                               for pid, shape, dt in zip(owner[d], slots.shapes, slots.dtypes,
                                                         strict=True)]

        def local(lv):
            out = lax.switch(lax.axis_index(spec.axis),
                             [branch(d) for d in range(sched.num_devices)], lv)
            return [x[None] for x in out]

        fn = jax.shard_map(local, mesh=spec.mesh, in_specs=(P(),),
                           out_specs=[P(spec.axis)] * len(slots), check_vma=False)
        return fn([place(x, spec.mesh, P()) for x in param_leaves])

    def _gather(self, staged: list, owner_only: bool) -> list:
        """Slots -> user leaves, replicated: the sum over the stages holding each leaf
        (``owner_only``: the first such stage's copy, for parameters)."""
        spec, slots = self.spec, self.layouts.slots
        sched = spec.schedule
        avals = spec.param_avals

        def branch(d: int):
            def f(local):
                out: list = [None] * len(avals)
                for s in sched.device_stages(d):
                    for pid, n in zip(spec.stages[s].param_ids, slots.stage_slots[s],
                                      strict=True):
                        if owner_only and spec.param_owners[pid][0] != s:
                            continue
                        out[pid] = local[n] if out[pid] is None else out[pid] + local[n]
                return [jnp.zeros(a.shape, a.dtype) if x is None else x
                        for x, a in zip(out, avals, strict=True)]
            return f

        def local(buf):
            buf = [x[0] for x in buf]
            out = lax.switch(lax.axis_index(spec.axis),
                             [branch(d) for d in range(sched.num_devices)], buf)
            return [lax.psum(x, spec.axis) for x in out]

        fn = jax.shard_map(local, mesh=spec.mesh, in_specs=([P(spec.axis)] * len(slots),),
                           out_specs=[P()] * len(avals), check_vma=False)
        return fn([place(x, spec.mesh, P(spec.axis)) for x in staged])

    def unshard(self, staged: list) -> list:
        return self._gather(list(staged), owner_only=True)

    def stage_params(self, staged: list) -> list[list[jax.Array]]:
        """Each stage's parameter leaves as held on its device (tied leaves: every copy)."""
        staged = [place(v, self.spec.mesh, P()) for v in staged]
        sched, slots = self.spec.schedule, self.layouts.slots
        return [[staged[n][sched.placement(st.index)] for n in slots.stage_slots[st.index]]
                for st in self.spec.stages]

    # -- compute --------------------------------------------------------------------
    def staged_value_and_grad(self, staged: list, batch_mb: list) -> tuple[jax.Array, list]:
        gbuf, loss = self._step(staged, batch_mb)
        return loss, gbuf

    def value_and_grad(self, param_leaves: list, batch_mb: list) -> tuple[jax.Array, list]:
        gbuf, loss = self._step(self.shard(param_leaves), batch_mb)
        return loss, self._gather(gbuf, owner_only=False)

    # -- training -------------------------------------------------------------------
    def make_train_step(self, optimizer: Any, options: TrainOptions) -> tuple[StepFn, Any]:
        spec = self.spec
        stage_opt = StageOptimizer(optimizer, spec)
        layout = OptimizerLayout(stage_opt)
        spd = self.lowering.stages_per_device
        epilogue = make_epilogue(spec, self.layouts.slots, stage_opt, layout, options, spd)
        pspec = [P(spec.axis)] * len(self.layouts.slots)
        ospec = layout.specs(spec.axis)
        core = build_step(
            spec.stages, self.layouts, self.lowering, spec.mesh, spec.axis, spec.batch_axes,
            len(spec.microbatch_avals), epilogue=epilogue, extra_in_specs=(ospec,),
            epilogue_out_specs=(pspec, ospec, {"loss": P(), "grad_norm": P(), "skipped": P()}),
        )

        def step(staged: list, opt_state: dict, batch_mb: list) -> tuple:
            return core(staged, batch_mb, opt_state)

        def init_opt_state(param_leaves: list) -> dict:
            rows = []
            for st in spec.stages:
                leaves = stage_opt.init(st.index, [param_leaves[i] for i in st.param_ids])
                rows.append(layout.stage_layouts[st.index].pack(leaves, layout.width))
            return layout.pack_rows(spec, rows, spd)

        return step, init_opt_state

    def opt_state_abstract(self, init_opt_state: Any) -> Any:
        shapes = jax.eval_shape(init_opt_state, [
            jax.ShapeDtypeStruct(a.shape, a.dtype) for a in self.spec.param_avals])
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                           sharding=self._staged_sharding),
                            shapes)

    # -- reports --------------------------------------------------------------------
    def memory_report(self) -> dict[str, Any]:
        low, lay = self.lowering, self.layouts
        slot_bytes = lay.slots.nbytes()
        pool_bytes = sum(n * np.dtype(k).itemsize for k, n in low.storage.items())
        msg = sum(w * np.dtype(k).itemsize for k, w in lay.msg_width.items()) * (
            low.num_inbox + 1)
        return {
            "buffer_bytes": 2 * slot_bytes + pool_bytes + msg,
            "device_rows": [
                {"residual_peak": low.residual_peak[d],
                 "residual_bytes": sum(n * np.dtype(k).itemsize
                                       for k, n in low.storage_per_device[d].items())}
                for d in range(low.num_devices)],
            "stage_residual_bytes": [
                int(sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in r.avals))
                for r in lay.residuals],
        }

    def fingerprint(self) -> dict[str, str]:
        digest = hashlib.sha256(self.lowering.table.digest_bytes()).hexdigest()[:16]
        return {"table_sha256": digest, "num_ticks": str(self.lowering.num_ticks)}
