"""Sequential single-device executor for any validated schedule: the ground truth in tests.

It runs the schedule's actions one at a time in a dependency-respecting order (the
simulator's start times), evaluating the same stage jaxprs the SPMD runtime uses, keeps
residuals per (stage, microbatch) and frees them after the last backward action.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import jaxpr_as_fun

from jaxpipe.schedule import Schedule
from jaxpipe.stages import StageFn

__all__ = ["run_reference"]


def run_reference(
    stages: list[StageFn], schedule: Schedule, param_leaves: list, batch_mb: list
) -> tuple[jax.Array, list, list[int]]:
    """Run ``schedule`` on ``stages``; ``batch_mb`` leaves are shaped ``[m, microbatch, ...]``.

    Returns ``(mean loss, gradient per param leaf, peak live residual sets per device)``.
    """
    m = schedule.num_microbatches
    timeline = schedule.simulate(costs={"F": 1, "B": 1, "I": 1, "W": 1})
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
    live = [0] * schedule.num_devices
    peak = [0] * schedule.num_devices
    loss = jnp.zeros((), jnp.float32)

    def add_grads(st, ct_par):
        it = iter(ct_par)
        for pid, diff in zip(st.param_ids, st.diff_param_mask, strict=True):
            if diff:
                grads[pid] = grads[pid] + next(it)

    for ev in order:
        a, d = ev.action, ev.device
        st = stages[a.stage]
        key = (a.stage, a.microbatch)
        params = [param_leaves[i] for i in st.param_ids]
        batch = [batch_mb[i][a.microbatch] for i in st.batch_ids]
        ct = [jnp.full((), 1.0 / m, st.out_avals[0].dtype)] if st.is_last else None
        if a.kind == "F":
            outs = fns[a.stage]["fwd"](*params, *batch, *acts.pop(key, []))
            n = len(st.out_avals)
            res[key] = outs[n:]
            live[d] += 1
            peak[d] = max(peak[d], live[d])
            if st.is_last:
                loss = loss + outs[0] / m
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
            live[d] -= 1
    assert not res and not acts and not cts, "schedule left work undone"
    return loss, grads, peak
