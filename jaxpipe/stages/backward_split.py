"""Splitting a stage's backward into its input-gradient (I) and weight-gradient (W) halves.

Zero-bubble schedules run the two halves as separate actions; the split is a pure jaxpr
transformation with no stage bookkeeping, so it lives apart from the stage builder
(:mod:`jaxpipe.stages.fragments`), which calls it once per traced stage.
"""

from __future__ import annotations

from jax.extend import core as jcore

from jaxpipe.jaxpr.interpret import from_parameters

__all__ = ["split_backward"]


def split_backward(bwd: jcore.ClosedJaxpr, n_ctp: int, n_pb: int, n_ct_out: int,
                   n_params: int = 0):
    """Split the backward into I (input cotangents) and W (parameter cotangents).

    I keeps every equation the input cotangents need. W keeps the remaining equations the
    parameter cotangents need; values it would otherwise recompute from I's equations are
    handed over as ``w_residuals`` (I's extra outputs), so no work is done twice. The
    incoming cotangents W needs are handed over the same way, so the message buffer is
    free once I has run. The exception: values computed from the first ``n_params``
    inputs (the parameters) alone, without effects (a weight's bf16 copy, its
    transpose), W computes again, as the backward recomputes them: handed over, they
    would be held once per microbatch between I and W.
    """
    j = bwd.jaxpr
    ct_p, ct_c = j.outvars[:n_ctp], j.outvars[n_ctp:]
    param_only = set(from_parameters(j, n_params))

    def needed(roots, skip=frozenset()):
        live = {v for v in roots if isinstance(v, jcore.Var)}
        keep = []
        for idx in range(len(j.eqns) - 1, -1, -1):
            e = j.eqns[idx]
            if idx in skip or not any(v in live for v in e.outvars):
                continue
            keep.append(idx)
            live.update(v for v in e.invars if isinstance(v, jcore.Var))
        return sorted(keep)

    i_idx = needed(ct_c)
    i_set = set(i_idx)
    w_idx = needed(ct_p, skip=frozenset(i_set - param_only))
    ct_in = j.invars[len(j.invars) - n_ct_out:]
    w_defined = {v for k in w_idx for v in j.eqns[k].outvars}
    i_defined = {v for k in i_idx for v in j.eqns[k].outvars if v not in w_defined}
    i_defined |= set(ct_in)
    w_reads = [v for k in w_idx for v in j.eqns[k].invars if isinstance(v, jcore.Var)]
    w_reads += [v for v in ct_p if isinstance(v, jcore.Var)]
    handoff = []
    for v in w_reads:
        if v in i_defined and v not in handoff:
            handoff.append(v)
    eqns_i = [j.eqns[k] for k in i_idx]
    eqns_w = [j.eqns[k] for k in w_idx]
    jaxpr_i = j.replace(eqns=eqns_i, outvars=list(ct_c) + handoff)
    # W reads parameters, the microbatch, the stored residuals it needs and the hand-off;
    # residuals only I needs can be freed as soon as I has run.
    w_used = set(w_reads)
    stored = j.invars[n_pb: len(j.invars) - n_ct_out]
    w_res_ids = tuple(i for i, v in enumerate(stored) if v in w_used)
    jaxpr_w = j.replace(invars=list(j.invars[:n_pb]) + [stored[i] for i in w_res_ids] + handoff,
                        eqns=eqns_w, outvars=list(ct_p))
    return (
        jcore.ClosedJaxpr(jaxpr_i, bwd.consts),
        jcore.ClosedJaxpr(jaxpr_w, bwd.consts),
        [v.aval for v in handoff],
        w_res_ids,
    )
