"""Sequential single-device executor for any validated schedule: the ground truth in tests.

It runs the schedule's actions one at a time in a dependency-respecting order (the
simulator's start times), evaluating the same stage jaxprs the SPMD runtime uses, keeps
residuals per (stage, microbatch) and frees them after the last backward action.
Parameters stay plain leaves (the staged layout is the user's flat leaf list).
"""

from __future__ import annotations

from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import jaxpr_as_fun

from jaxpipe.cut.memory_model import DEVICE_MEMORY, MemoryModel
from jaxpipe.errors import PipelineError
from jaxpipe.jaxpr.objective import MEAN, Objective, sum_dtype
from jaxpipe.runtime.base import Executor, Runtime, RuntimeSpec, StepFn
from jaxpipe.schedule import Schedule
from jaxpipe.schedule.forward import ForwardOnly
from jaxpipe.schedule.liveness import peak_overlap, unit_lifetimes
from jaxpipe.stages.stage_fn import StageFn
from jaxpipe.train.options import TrainOptions, global_norm_scale, sq_norm
from jaxpipe.train.state import StageOptimizer

__all__ = ["ReferenceExecutor", "ReferenceRuntime", "reduce_shards", "run_reference"]


def run_reference(
    stages: list[StageFn], schedule: Schedule, param_leaves: list, batch_mb: list,
    objective: Objective = MEAN, forward_only: bool = False, reduce: bool = True,
    total: jax.Array | None = None,
) -> tuple[jax.Array, list, list, list[int]]:
    """Run ``schedule`` on ``stages``; ``batch_mb`` leaves are shaped ``[m, microbatch, ...]``.

    Returns ``(loss, aux leaves, gradient per param leaf, peak live residual sets per
    device)``, the loss reduced and the gradients scaled as ``objective`` says, each aux
    leaf stacked over microbatches. ``forward_only``: run the schedule's forward actions
    only (:class:`~jaxpipe.schedule.forward.ForwardOnly`); no gradients (``[]``).
    ``reduce=False``: the sum of the microbatches' losses, the weight leaf (if any) among
    the stacked outputs and the gradients not divided by the total weight (data shards
    run one by one are reduced together: :func:`reduce_shards`). ``total``: a weighted
    loss's total weight, known before the run (``RuntimeSpec.batch_weight``): each loss
    is seeded with ``1 / total`` and the gradients are not divided at the end.
    """
    m = schedule.num_microbatches
    run = ForwardOnly(schedule) if forward_only else schedule
    timeline = run.simulate(costs={"F": 1, "B": 1, "I": 1, "W": 1})
    order = sorted(timeline.events, key=lambda e: (e.start, e.device))
    fns = {
        st.index: {k: jax.jit(jaxpr_as_fun(getattr(st, k))) for k in ("fwd", "bwd", "bwd_i",
                                                                        "bwd_w")}
        for st in stages
    }
    grads = [jnp.zeros(jnp.shape(x), jnp.result_type(x)) for x in param_leaves]
    acts: dict = {}  # (stage, mb) -> carry received by that stage
    cts: dict = {}  # (stage, mb) -> cotangent received by that stage
    res: dict = {}
    handoff: dict = {}
    extras: dict = {}  # mb -> the last stage's outputs after the loss
    last = next(st for st in stages if st.is_last)
    acc = sum_dtype(last.out_avals[0].dtype)
    loss = jnp.zeros((), acc)

    def add_grads(st, ct_par):
        it = iter(ct_par)
        for pid, diff in zip(st.param_ids, st.diff_param_mask, strict=True):
            if diff:
                grads[pid] = grads[pid] + next(it)

    for ev in order:
        a = ev.action
        st = stages[a.stage]
        key = (a.stage, a.microbatch)
        params = [param_leaves[i] for i in st.param_ids]
        batch = [batch_mb[i][a.microbatch] for i in st.batch_ids]
        seed = objective.seed(m) if total is None else 1.0 / total
        ct = [jnp.asarray(seed, st.out_avals[0].dtype)] if st.is_last else None
        if a.kind == "F":
            outs = fns[a.stage]["fwd"](*params, *batch, *acts.pop(key, []))
            n = len(st.out_avals)
            if not forward_only:
                res[key] = outs[n:]
            if st.is_last:
                loss = loss + outs[0].astype(acc)
                extras[a.microbatch] = outs[1:n]
            else:
                acts[(a.stage + 1, a.microbatch)] = outs[:n]
            continue
        if a.kind in ("B", "I"):
            ct = ct if ct is not None else cts.pop(key)
            fn = fns[a.stage]["bwd" if a.kind == "B" else "bwd_i"]
            outs = fn(*params, *batch, *res[key], *ct)
            if a.kind == "B":
                n = sum(st.diff_param_mask)
                add_grads(st, outs[:n])
                ct_in = outs[n:]
            else:
                n = len(st.ct_in_avals())
                ct_in, handoff[key] = outs[:n], outs[n:]
            if a.stage > 0:
                cts[(a.stage - 1, a.microbatch)] = ct_in
        else:  # W
            stored = [res[key][i] for i in st.w_res_ids]
            add_grads(st, fns[a.stage]["bwd_w"](*params, *batch, *stored, *handoff.pop(key)))
        if a.kind in ("B", "W"):
            del res[key]
    assert not res and not acts and not cts, "schedule left work undone"
    rows = [jnp.stack([extras[i][k] for i in range(m)]) for k in range(len(extras[0]))]
    if reduce and objective.weighted:
        seeded = total is not None
        total = jnp.sum(rows[0].astype(acc))
        loss, rows = loss / total, rows[1:]
        if not seeded:
            grads = [(g / total.astype(g.dtype)).astype(g.dtype) for g in grads]
    elif reduce and objective.reduction == "mean":
        loss = loss / m
    # residual sets live from F to the last backward action, counted in execution order
    peaks = []
    for d in range(schedule.num_devices):
        mine = [(e.action, i) for i, e in enumerate(o for o in order if o.device == d)]
        peaks.append(peak_overlap(unit_lifetimes(mine).values()))
    return loss, rows, [] if forward_only else grads, peaks


def reduce_shards(runs: list[tuple[jax.Array, list, list]], objective: Objective, m: int,
                  seeded: bool = False) -> tuple[jax.Array, list, list]:
    """``(loss, aux leaves, gradients)`` of the data shards' unreduced runs (``run_reference(
    ..., reduce=False)``, one a shard in mesh order), reduced as the SPMD program reduces
    over its manual batch axes: a weighted loss is the quotient of the shards' totals
    (``seeded``: the runs were seeded with ``1 / total``; their gradients are summed, not
    divided), a mean or sum the mean of the shards' values; an aux leaf is ``[m, shards,
    *shape]``."""
    losses, rows, grads = zip(*runs, strict=True)
    rows = [jnp.stack(r, axis=1) for r in zip(*rows, strict=True)]
    if objective.weighted:
        total = jnp.sum(rows[0].astype(sum_dtype(rows[0].dtype)))
        grads = [(sum(g) / (1 if seeded else total.astype(g[0].dtype))).astype(g[0].dtype)
                 for g in zip(*grads, strict=True)]
        return sum(losses) / total, rows[1:], grads
    loss = sum(losses) / len(losses) / (m if objective.reduction == "mean" else 1)
    return loss, rows, [(sum(g) / len(g)).astype(g[0].dtype) for g in zip(*grads, strict=True)]


class ReferenceRuntime(Runtime):
    """Run the schedule's actions one after another on one device (for checking)."""

    name: ClassVar[str] = "reference"

    @property
    def memory_model(self) -> MemoryModel:
        return DEVICE_MEMORY

    def build(self, spec: RuntimeSpec) -> ReferenceExecutor:
        return ReferenceExecutor(spec)

    def __repr__(self) -> str:
        return "ReferenceRuntime()"


class ReferenceExecutor(Executor):
    """Plain leaves in, plain leaves out; :meth:`value_and_grad` runs eagerly."""

    #: ``Pipeline`` calls :meth:`value_and_grad` directly instead of jitting it (each
    #: stage function is jitted on its own; the schedule runs op by op).
    eager: ClassVar[bool] = True

    def __init__(self, spec: RuntimeSpec) -> None:
        self.spec = spec

    def shard(self, param_leaves: list) -> list:
        """The stages' parameter inputs (views of the user's leaves), as arrays."""
        return [jnp.asarray(x) for x in self.spec.views.take(param_leaves)]

    def unshard(self, staged: Any) -> list:
        return self.spec.views.gather(list(staged))

    def staged_abstract(self) -> list[jax.ShapeDtypeStruct]:
        return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in self.spec.param_avals]

    def check_staged(self, staged: Any, what: str) -> None:
        want = [(tuple(a.shape), a.dtype) for a in self.spec.param_avals]
        ok = isinstance(staged, (list, tuple)) and [
            (tuple(np.shape(x)), jnp.result_type(x)) for x in staged] == want
        if not ok:
            raise PipelineError(
                f"{what} expects the reference runtime's staged layout (the flat list of "
                f"parameter leaves {[w[0] for w in want]}), got {type(staged).__name__}.")

    def value_and_grad(self, param_leaves: list, batch_mb: list
                       ) -> tuple[jax.Array, list, list]:
        loss, aux, grads = self.staged_value_and_grad(self.spec.views.take(param_leaves),
                                                      batch_mb)
        return loss, aux, self.spec.views.gather(grads)

    def staged_value_and_grad(self, staged: Any, batch_mb: list
                              ) -> tuple[jax.Array, list, list]:
        return self._run(staged, batch_mb, forward_only=False)

    def _run(self, staged: Any, batch_mb: list, forward_only: bool
             ) -> tuple[jax.Array, list, list]:
        """Every data shard of the manual batch axes run on its own (a stage is traced on
        one shard's rows), then reduced together as the program reduces them."""
        spec = self.spec
        # whole microbatches on one device (the placed batch is split over the data axes)
        batch_mb = [jnp.asarray(jax.device_get(x)) for x in batch_mb]
        shards = spec.shards((spec.mesh_axes.manual_batch_axes,))
        rows = [a.shape[0] for a in spec.microbatch_avals]  # one shard's, per leaf
        pieces = [[x[:, j * r:(j + 1) * r] for x, r in zip(batch_mb, rows, strict=True)]
                  for j in range(shards)]
        total = None  # a weight from the batch alone: totalled first, as the program does
        if spec.batch_weight is not None and not forward_only:
            weight = jaxpr_as_fun(spec.batch_weight)
            per = [jax.vmap(lambda *xs: weight(*xs)[0])(*piece) for piece in pieces]
            total = sum(jnp.sum(w.astype(sum_dtype(w.dtype)))
                        for w in per)
        run = (lambda mbs, reduce=True: run_reference(
            list(spec.stages), spec.schedule, list(staged), mbs, spec.objective,
            forward_only=forward_only, reduce=reduce, total=total)[:3])
        if shards == 1:
            return run(batch_mb)
        return reduce_shards([run(piece, reduce=False) for piece in pieces], spec.objective,
                             spec.schedule.num_microbatches, seeded=total is not None)

    def loss(self, param_leaves: list, batch_mb: list) -> tuple[jax.Array, list]:
        return self.staged_loss(self.spec.views.take(param_leaves), batch_mb)

    def staged_loss(self, staged: Any, batch_mb: list) -> tuple[jax.Array, list]:
        loss, aux, _ = self._run(staged, batch_mb, forward_only=True)
        return loss, aux

    def make_train_step(self, optimizer: Any, options: TrainOptions) -> tuple[StepFn, Any]:
        spec = self.spec
        stage_opt = StageOptimizer(optimizer, spec)

        def init_opt_state(param_leaves: list) -> list:
            inputs = spec.views.take(param_leaves)
            return [stage_opt.init(st.index, [inputs[i] for i in st.param_ids])
                    for st in spec.stages]

        def step(staged: list, opt_state: list, batch_mb: list) -> tuple:
            loss, aux, grads = self.staged_value_and_grad(staged, batch_mb)
            gnorm, scale = global_norm_scale(sq_norm(grads), options)
            grads = [(g * scale).astype(g.dtype) for g in grads]
            new_p, new_o = list(staged), []
            for st in spec.stages:
                ids = st.param_ids
                params, state = stage_opt.update(st.index, [staged[i] for i in ids],
                                                 [grads[i] for i in ids], opt_state[st.index])
                new_o.append(state)
                for pid, x in zip(ids, params, strict=True):
                    if spec.param_owners[pid][0] == st.index:  # tied: the first owner's copy
                        new_p[pid] = x
            finite = jnp.isfinite(loss) & jnp.isfinite(gnorm)
            if options.skip_nonfinite:
                new_p = [jnp.where(finite, a, b) for a, b in zip(new_p, staged, strict=True)]
                new_o = jax.tree.map(lambda a, b: jnp.where(finite, a, b), new_o, opt_state)
            metrics = {"loss": loss, "grad_norm": gnorm,
                       "skipped": jnp.logical_and(options.skip_nonfinite,
                                                  ~finite).astype(jnp.int32),
                       "aux": aux}
            return new_p, new_o, metrics

        return step, init_opt_state

    def opt_state_abstract(self, init_opt_state: Any) -> Any:
        return jax.eval_shape(init_opt_state, [
            jax.ShapeDtypeStruct(a.shape, a.dtype) for a in self.spec.views.leaf_avals])

    def memory_report(self) -> dict[str, Any]:
        return {"buffer_bytes": 0, "device_rows": [
            {"residual_peak": p, "residual_bytes": 0}
            for p in self.spec.schedule.simulate().peak_in_flight]}

    def fingerprint(self) -> dict[str, str]:
        return {}
