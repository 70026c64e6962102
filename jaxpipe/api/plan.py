"""``Pipeline.plan``: what each stage and device holds, and what the schedule predicts.

Two memory figures are shown per device:

- *predicted*: the cutter's model (parameters, gradients and optimizer state of the
  device's stages + in-flight x residual bytes + transfers + workspace), per device and
  padded to the one buffer shape SPMD needs (the number the cutter minimises);
- *buffers*: what the lowered SPMD program actually allocates for parameters, gradients,
  residual pools and message slots (liveness-sized, padded to one shape on every device).

Per stage the plan also shows its recomputation policy (:class:`jaxpipe.stages.remat.Remat`),
what the policy costs (recomputed FLOPs, as a share of the stage's forward) and the
stage's predicted bytes; and which memory budget the cut was chosen under and where it
came from (``jp.Cut(memory_budget=...)``, or the device's limit for ``cut="auto"``).

``compare_compiled`` puts the compiled program's ``memory_analysis()`` next to them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jaxpipe.cut.budget import device_memory_limit
from jaxpipe.jaxpr.avals import aval_bytes, shard_bytes
from jaxpipe.jaxpr.avals import format_bytes as _fmt

__all__ = ["Plan", "predicted_with_optimizer"]


def _batch_split(mesh: Any, mesh_axes: Any) -> str:
    """A line saying which of the mesh's other axes split the batch (data parallelism)
    and which repeat each microbatch on every device; empty for a pipe-only mesh."""
    others = [a for a in mesh.axis_names if a != mesh_axes.axis and mesh.shape[a] > 1]
    if not others:
        return ""
    split = [a for a in others if a in mesh_axes.batch_axes]
    whole = [a for a in others if a not in split]
    line = f"batch: split over {tuple(split)}" if split else "batch: not split"
    if whole:
        line += (f"; the devices along {tuple(whole)} each compute every microbatch whole "
                 "(sharding parameters or activations; for data parallelism place the batch "
                 "over an axis or pass batch_axes=)")
    return line


def _device_limit(mesh: Any) -> tuple[int, str] | None:
    """The mesh's smallest device memory and its source; ``None`` where unknown (CPU)."""
    try:
        return device_memory_limit(mesh.devices.flat)
    except ValueError:  # a compile-only device of a kind without a known capacity
        return None


@dataclass
class Plan:
    """Per-stage and per-device summary of a pipeline; ``print(plan)`` shows a table."""

    stage_rows: list[dict]
    device_rows: list[dict]
    makespan: float
    bubble_fraction: float
    schedule_name: str
    objective: str
    buffer_bytes: int  # what the lowered program allocates per device (same on all)
    predicted_padded_bytes: float  # the cutter's SPMD prediction + the batch, per device
    batch_bytes: int  # the (data-shard of the) batch every pipeline device holds
    memory_budget: float | None = None  # the budget the cut was chosen under (bytes/device)
    budget_source: str | None = None  # where that budget came from
    lowered: str | None = None  # the runtime's timing report under the cost model (if any)
    # seconds per build phase and per program's first compile, filled as they happen
    build_times: Any = None
    program: str | None = None  # the runtime's program, and where the stages' compute sits
    auto: Any = None  # what schedule="auto" chose among (jaxpipe.api.auto.AutoChoice)
    device_limit: tuple[int, str] | None = None  # the devices' memory and its source, if known
    batch_split: str = ""  # how the batch is split over the mesh's other axes

    @classmethod
    def build(cls, pipe) -> Plan:
        res = pipe.cut_report
        sched = pipe.schedule
        report = pipe.executor.memory_report()
        total_flops = sum(res.stage_fwd) or 1.0
        stage_rows = []
        for st in pipe.stages:
            s = st.index
            stage_rows.append({
                "stage": s,
                "device": sched.placement(s),
                "layers": ",".join(st.names) if st.names else "-",
                "flops_share": res.stage_fwd[s] / total_flops,
                # its device's shard (parameters sharded over other mesh axes)
                "param_bytes": int(sum(pipe.executor.spec.device_bytes(i)
                                       for i in st.param_ids)),
                "residual_bytes": int(sum(shard_bytes(a) for a in st.residual_avals)),
                "in_flight": res.in_flight[s],
                "remat": str(st.remat.value),
                "recompute_flops": res.stage_recompute[s],
                "recompute_share": res.stage_recompute[s] / (res.stage_fwd[s] or 1.0),
                "predicted_bytes": res.stage_memory[s].total,
            })
        device_rows = []
        for d in range(sched.num_devices):
            device_rows.append({
                "device": d,
                "stages": list(sched.device_stages(d)),
                "predicted_bytes": res.device_memory[d].total,
                **report["device_rows"][d],
            })
        # Every device also holds the whole batch (its data shard), replicated over pipe.
        # (microbatch avals are one manual batch shard; automatic batch axes split it too)
        auto = pipe.executor.spec.shards((pipe.mesh_axes.auto_batch_axes,))
        batch_bytes = sum(aval_bytes(a) for a in pipe.executor.spec.microbatch_avals) * (
            pipe.num_microbatches) // auto
        return cls(stage_rows, device_rows, float(res.makespan or 0.0),
                   float(res.bubble_fraction or 0.0), type(sched).__name__, res.objective,
                   int(report["buffer_bytes"]), float(res.padded_memory.total) + batch_bytes,
                   batch_bytes, res.memory_budget, res.budget_source,
                   # the cutter simulated the schedule under these costs already
                   pipe.executor.timing_report(res.action_cost,
                                               schedule_makespan=res.makespan),
                   pipe.build_times, pipe.executor.program_report(), pipe.auto_choice,
                   _device_limit(pipe.mesh), _batch_split(pipe.mesh, pipe.mesh_axes))

    def __str__(self) -> str:
        head = (f"{'stage':>5} {'dev':>3} {'flops':>6} {'params':>10} {'resid/mb':>10} "
                f"{'in-flight':>9} {'remat':>13} {'recomp':>6} {'memory':>10}  layers")
        lines = [f"jaxpipe plan: {self.schedule_name}, cut objective '{self.objective}', "
                 f"predicted bubble {self.bubble_fraction:.3f}", head]
        for r in self.stage_rows:
            layers = r["layers"] if len(r["layers"]) <= 40 else r["layers"][:37] + "..."
            lines.append(f"{r['stage']:>5} {r['device']:>3} {r['flops_share']:>6.1%} "
                         f"{_fmt(r['param_bytes']):>10} {_fmt(r['residual_bytes']):>10} "
                         f"{r['in_flight']:>9.4g} {r['remat']:>13} {r['recompute_share']:>6.0%} "
                         f"{_fmt(r['predicted_bytes']):>10}  {layers}")
        lines.append(f"{'dev':>5} {'stages':>10} {'predicted':>11} {'live resid':>10} "
                     f"{'resid bytes':>11}")
        for r in self.device_rows:
            lines.append(f"{r['device']:>5} {str(r['stages']):>10} "
                         f"{_fmt(r['predicted_bytes']):>11} {r['residual_peak']:>10} "
                         f"{_fmt(r['residual_bytes']):>11}")
        lines.append(f"predicted per device (SPMD, one buffer shape on all devices, incl. "
                     f"{_fmt(self.batch_bytes)} of batch): {_fmt(self.predicted_padded_bytes)}")
        lines.append(f"runtime buffers per device (params+grads+residual pools+messages): "
                     f"{_fmt(self.buffer_bytes)}")
        if self.memory_budget is None and self.device_limit is None:
            lines.append("memory budget: none (no device memory limit reported, none given)")
        elif self.memory_budget is None:
            limit, where = self.device_limit
            lines.append(f"memory budget: none (the cut was given without one, so the devices' "
                         f"{_fmt(limit)} ({where}) were not checked; cut='auto' or "
                         f"jp.Cut(memory_budget=...) checks them)")
        else:
            lines.append(f"memory budget: {_fmt(self.memory_budget)} per device for the cutter's "
                         f"prediction, from {self.budget_source}")
        if self.batch_split:
            lines.append(self.batch_split)
        if self.auto is not None:
            lines.append(str(self.auto))
        if self.program:
            lines.append(self.program)
        if self.lowered:
            lines.append(self.lowered)
        if self.build_times is not None:
            lines.append(str(self.build_times))
        lines.append("in-flight: residual sets (one a microbatch) the stage holds at its "
                     "device's peak (several stages a device share the device's peak: "
                     "fractions); remat: recomputation policy per stage; recomp: recomputed "
                     "FLOPs / stage forward; memory: the stage's predicted bytes")
        return "\n".join(lines)

    __repr__ = __str__

    @staticmethod
    def compare_compiled(pipe, params: Any, batch: Any, optimizer: Any = None) -> dict:
        """Compile a train step and return predicted vs compiled per-device bytes.

        The cutter models parameters + gradients + optimizer state (Adam's by default);
        the comparison compiles ``train_step`` with ``optimizer`` (default
        ``optax.adam``) and predicts with that optimizer's state
        (:func:`predicted_with_optimizer`). ``compiled_bytes`` = arguments + outputs +
        temporaries - aliased (donated) bytes of that one SPMD program, i.e. one
        device's footprint.
        """
        import optax

        pipe.check_params(params, "compare_compiled(params, ...)")
        pipe.check_batch(batch)
        # Compiled from the pipeline's abstract inputs (the shapes checked above): no
        # state is made, so this works on an ahead-of-time target's mesh too.
        optimizer = optimizer if optimizer is not None else optax.adam(1e-3)
        lowered = pipe.lower("train_step", optimizer)
        ma = lowered.compile().memory_analysis()
        arg, out = int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes)
        temp, alias = int(ma.temp_size_in_bytes), int(ma.alias_size_in_bytes)
        plan = pipe.plan
        return {
            # with this optimizer's state, not the one the cut assumed
            "predicted_bytes": predicted_with_optimizer(pipe, optimizer)[0],
            "predicted_max_device_bytes": max(r["predicted_bytes"] for r in plan.device_rows),
            "runtime_buffer_bytes": plan.buffer_bytes,
            "compiled_bytes": arg + out + temp - alias,
            "argument_bytes": arg, "output_bytes": out, "temp_bytes": temp,
            "alias_bytes": alias,
        }


def predicted_with_optimizer(inspect: Any, optimizer: Any) -> tuple[float, str | None]:
    """The plan's per-device prediction with ``optimizer``'s state in place of the one the
    cut assumed (``Cut.optimizer_bytes_per_param_byte``, Adam's 2 by default): its bytes
    per parameter byte from ``optimizer.init`` of the parameters' shapes. Returns the
    prediction and, where the two differ, a line saying so (else ``None``). ``inspect``:
    a pipeline's ``pipe.inspect``."""
    import jax

    def nbytes(tree: Any) -> int:
        return sum(aval_bytes(x) for x in jax.tree.leaves(tree))

    params = inspect.abstract_inputs()[0]
    per_param = nbytes(jax.eval_shape(optimizer.init, params)) / max(1, nbytes(params))
    padded = inspect.cut_report.padded_memory
    assumed = padded.optimizer / padded.params if padded.params else per_param
    predicted = float(inspect.plan.predicted_padded_bytes)
    if abs(per_param - assumed) < 0.01:
        return predicted, None
    return predicted + (per_param - assumed) * padded.params, (
        f"{per_param:.3g} x the parameters' bytes, in the prediction (the cut assumed "
        f"{assumed:.3g}: jp.Cut(optimizer_bytes_per_param_byte={per_param:.3g}) budgets "
        "this optimizer)")
