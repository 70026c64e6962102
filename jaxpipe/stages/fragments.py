"""Building the :class:`~jaxpipe.stages.stage_fn.StageFn` of any range of a traced loss's equations.

:class:`Fragments` cuts a traced jaxpr into fragments and traces each one's forward and
backward once (fragments computing the same function share the trace); the stage
contract it fills in is :mod:`jaxpipe.stages.stage_fn`.

**Recomputation.** ``jaxpipe.stages.split(..., remat=...)`` gives every stage a
:class:`~jaxpipe.stages.remat.Remat` policy. The forward is then traced with the stage's
segments (or, for ``Remat.FULL``, runs of segments) wrapped in ``jax.checkpoint`` with
that policy, so the stored residuals are what the policy keeps and the backward
recomputes the rest; the runtimes size their storage from ``residual_avals`` and need
to know nothing else. Segments holding a user's own ``jax.checkpoint`` are never wrapped.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.extend import core as jcore

from jaxpipe.errors import PipelineError
from jaxpipe.jaxpr.avals import (
    boundary_aval,
    from_boundary,
    is_differentiable,
    is_key,
    to_boundary,
    typed_sds,
)
from jaxpipe.jaxpr.identity import fragment_key
from jaxpipe.jaxpr.interpret import read
from jaxpipe.jaxpr.markers import boundary_p
from jaxpipe.jaxpr.trace import Traced, segments
from jaxpipe.sharding.constraints import stage_as_fun
from jaxpipe.stages.backward_split import split_backward
from jaxpipe.stages.param_derived import param_derived
from jaxpipe.stages.remat import Remat, group_io, remat_groups, run_groups
from jaxpipe.stages.stage_fn import StageFn

__all__ = ["Fragments"]


class Fragments:
    """Builds the :class:`StageFn` of any range of a traced loss's equations.

    A fragment ``[a, b)`` reads the parameter and microbatch leaves its equations use and
    the *carry* at ``a`` (every value defined before ``a`` and read at or after it), and
    outputs the carry at ``b`` (the last fragment: the loss). Fragments computing the same
    function of their inputs (the blocks of a deep model) are traced once; the others take
    its jaxprs with their own bookkeeping.
    """

    def __init__(self, traced: Traced) -> None:
        jaxpr = self.jaxpr = traced.jaxpr
        self.eqns = jaxpr.eqns
        self.n_p = traced.num_params
        self.segs = segments(traced)
        self.markers = traced.markers
        self.marker_names = traced.marker_names
        self.param_index = {v: i for i, v in enumerate(jaxpr.invars[:self.n_p])}
        self.batch_index = {v: i for i, v in enumerate(jaxpr.invars[self.n_p:])}
        self.const_vals = dict(zip(jaxpr.constvars, traced.closed_jaxpr.consts, strict=True))
        self._texts: dict = {}  # printed sub-jaxprs, shared by every fragment's key
        # where each intermediate value is defined, and the last equation that reads it
        self.defined: dict = {}
        self.last_use: dict = {}
        for k, eqn in enumerate(self.eqns):
            for v in eqn.invars:
                if isinstance(v, jcore.Var):
                    self.last_use[v] = k
            for v in eqn.outvars:
                self.defined[v] = k
        # the loss, then the weight and aux leaves (jaxpipe.jaxpr.objective), all "read" by the
        # output: one computed in an earlier stage is carried to the last
        self.out_vars = list(jaxpr.outvars)
        for v in self.out_vars:
            if isinstance(v, jcore.Var):
                self.last_use[v] = len(self.eqns)
        # Parameter leaves the loss never reads still belong to a stage (the first): they
        # keep their values through shard/unshard and training and get zero gradients, as
        # with jax.grad; an optimizer may still change them (weight decay).
        read_anywhere = {v for e in self.eqns for v in e.invars if isinstance(v, jcore.Var)}
        read_anywhere |= {v for v in jaxpr.outvars if isinstance(v, jcore.Var)}
        self.unread = [v for v in jaxpr.invars[:self.n_p] if v not in read_anywhere]
        self.built: dict = {}
        self._fragments: dict = {}

    def carry_at(self, e: int) -> list:
        """Values defined before equation ``e`` that it or a later one (or the output)
        reads, in definition order."""
        return [v for v, k in self.defined.items() if k < e and self.last_use.get(v, -1) >= e]

    def effective(self, a: int, b: int) -> list[int]:
        """The equations of ``[a, b)`` that compute (cut markers do not)."""
        return [k for k in range(a, b) if self.eqns[k].primitive is not boundary_p]

    def through_markers(self, a: int, b: int) -> dict:
        """Within ``[a, b)``: each cut marker's output -> the value it passes on."""
        alias: dict = {}
        for e in self.eqns[a:b]:
            if e.primitive is boundary_p:
                # (a constant passed through a marker is a Literal: nothing to alias)
                alias.update((o, alias.get(i, i)) for o, i in zip(e.outvars, e.invars,
                                                                   strict=True)
                             if isinstance(i, jcore.Var))
        return alias

    def _fragment(self, a: int, b: int, policy: Remat, is_last: bool,
                  carry_in: list | None, carry_out: list | None) -> tuple:
        if carry_in is None:
            carry_in = self.carry_at(a) if a > 0 else []
        if carry_out is None:
            carry_out = list(self.out_vars) if is_last else self.carry_at(b)
        # a key prints the fragment: matching cores asks for a few of them twice
        memo = (a, b, policy, is_last, tuple(carry_in), tuple(carry_out))
        if memo not in self._fragments:
            self._fragments[memo] = self._describe(a, b, policy, is_last, carry_in, carry_out)
        return self._fragments[memo]

    def _describe(self, a: int, b: int, policy: Remat, is_last: bool, carry_in: list,
                  carry_out: list) -> tuple:
        eqns, jaxpr = self.eqns, self.jaxpr
        used = [v for e in eqns[a:b] for v in e.invars if isinstance(v, jcore.Var)]
        if is_last:
            used += [v for v in self.out_vars if isinstance(v, jcore.Var)]
        used = set(used) | set(carry_out) | (set(self.unread) if a == 0 else set())
        p_ids = tuple(sorted(self.param_index[v] for v in used if v in self.param_index))
        b_ids = tuple(sorted(self.batch_index[v] for v in used if v in self.batch_index))
        groups = remat_groups(eqns, [(max(x, a), min(y, b)) for x, y in self.segs
                                      if x < b and y > a], policy)
        p_vars = [jaxpr.invars[i] for i in p_ids]
        b_vars = [jaxpr.invars[self.n_p + i] for i in b_ids]
        # Cut markers compute nothing (stage functions skip them: remat.run_groups), so the key
        # reads through them: the blocks of a model marked after every block but the last
        # match whether or not a marker follows them.
        alias = self.through_markers(a, b)
        body = [e.replace(invars=[alias.get(v, v) if isinstance(v, jcore.Var) else v
                                  for v in e.invars])
                if any(v in alias for v in e.invars if isinstance(v, jcore.Var)) else e
                for e in eqns[a:b] if e.primitive is not boundary_p]
        effective = self.effective(a, b)
        rank = {k: i for i, k in enumerate(effective)}
        rank[b] = len(effective)

        def at(k: int) -> int:  # the position of equation k among the effective ones
            while k not in rank:
                k += 1
            return rank[k]

        key = (fragment_key(jaxpr, body, p_vars + b_vars + list(carry_in),
                            [alias.get(v, v) for v in carry_out], self.const_vals,
                            self._texts),
               len(p_vars), len(b_vars), tuple((at(x), at(y), pol) for x, y, pol in groups),
               policy, is_last)
        return key, p_ids, b_ids, list(carry_in), list(carry_out), groups

    def names(self, a: int, b: int) -> tuple[str, ...]:
        """The names of the cut markers in ``[a, b)``."""
        return tuple(
            str(self.marker_names[i]) if self.marker_names[i] is not None else f"marker{i}"
            for i, m in enumerate(self.markers) if a <= m < b)

    def key(self, a: int, b: int, policy: Remat, is_last: bool, carry_in: list | None = None,
            carry_out: list | None = None) -> tuple:
        """Equal for two fragments exactly when :meth:`build` traces them once."""
        return self._fragment(a, b, policy, is_last, carry_in, carry_out)[0]

    def build(self, s: int, a: int, b: int, policy: Remat, is_last: bool,
              carry_in: list | None = None, carry_out: list | None = None) -> StageFn:
        """The fragment ``[a, b)`` as stage ``s`` under ``policy`` (``is_last``: it
        outputs the loss). ``carry_in`` / ``carry_out`` replace the carries at ``a`` and
        ``b`` (the same values in another order, or more of them: a part of a stage that
        matches another stage's function takes that stage's signature)."""
        key, p_ids, b_ids, carry_in, carry_out, groups = self._fragment(
            a, b, policy, is_last, carry_in, carry_out)
        names = self.names(a, b)
        if key in self.built:
            return dataclasses.replace(self.built[key], index=s, eqn_range=(a, b),
                                       param_ids=p_ids, batch_ids=b_ids, names=names)
        st = self.built[key] = _keys_as_data(_build_stage(
            s, (a, b), self.eqns[a:b], self.jaxpr, self.n_p, p_ids, b_ids, carry_in,
            carry_out, self.const_vals, is_last, names, groups, policy))
        return st


def _build_stage(s, eqn_range, eqns, jaxpr, n_p, p_ids, b_ids, carry_in, carry_out, const_vals,
                 is_last, names, groups, policy) -> StageFn:
    p_vars = [jaxpr.invars[i] for i in p_ids]
    b_vars = [jaxpr.invars[n_p + i] for i in b_ids]
    p_avals = [v.aval for v in p_vars]
    b_avals = [v.aval for v in b_vars]
    in_avals = [v.aval for v in carry_in]
    out_avals = [v.aval if isinstance(v, jcore.Var) else jcore.get_aval(v.val) for v in carry_out]
    dp = tuple(is_differentiable(a) for a in p_avals)
    di = tuple(is_differentiable(a) for a in in_avals)
    do = tuple(is_differentiable(a) for a in out_avals)
    if is_last and not do[0]:
        raise PipelineError("the loss must be a floating-point scalar.")
    if is_last:  # a weight or an aux output is never differentiated
        do = do[:1] + (False,) * (len(do) - 1)

    io = group_io(eqns, groups, eqn_range[0], carry_out)

    def run(params, batch, carry):
        env = dict(const_vals)
        env.update(zip(p_vars, params, strict=True))
        env.update(zip(b_vars, batch, strict=True))
        env.update(zip(carry_in, carry, strict=True))
        run_groups(eqns, groups, io, eqn_range[0], env)
        return [read(env, v) for v in carry_out]

    def pick(xs, mask, keep):
        return [x for x, m in zip(xs, mask, strict=True) if m == keep]

    def merge(diff, nondiff, mask):
        it_d, it_n = iter(diff), iter(nondiff)
        return [next(it_d) if m else next(it_n) for m in mask]

    res_tree: list = []

    def fwd(params, batch, carry):
        def f(diff):
            dpar, dcar = diff
            outs = run(merge(dpar, pick(params, dp, False), dp), batch,
                       merge(dcar, pick(carry, di, False), di))
            return pick(outs, do, True), pick(outs, do, False)

        diff = (pick(params, dp, True), pick(carry, di, True))
        outs_f, vjp_fn, outs_n = jax.vjp(f, diff, has_aux=True)
        leaves, tree = jax.tree.flatten(vjp_fn)
        res_tree.append(tree)
        return merge(outs_f, outs_n, do), leaves

    fwd_raw = jax.make_jaxpr(fwd)(
        [typed_sds(a) for a in p_avals], [typed_sds(a) for a in b_avals],
        [typed_sds(a) for a in in_avals])
    n_out = len(out_avals)
    # Residual leaves that are parameters or microbatch leaves are re-read, not stored;
    # those computed from the parameters alone are recomputed (stages.param_derived).
    fj = fwd_raw.jaxpr
    in_pos = {v: i for i, v in enumerate(fj.invars)}
    n_pi, n_bi = len(p_avals), len(b_avals)
    computed = list(dict.fromkeys(v for v in fj.outvars[n_out:] if isinstance(v, jcore.Var)
                                  and in_pos.get(v, n_pi + n_bi) >= n_pi + n_bi))
    derived = param_derived(fwd_raw, n_pi, computed)
    derived_vars = list(derived.values) if derived else []
    stored_vars = [v for v in computed if v not in set(derived_vars)]
    res_src = []  # per residual leaf: (kind, index into params / batch / stored / derived)
    for v in fj.outvars[n_out:]:
        if isinstance(v, jcore.Literal):
            res_src.append(("lit", v.val))
        elif v in in_pos and in_pos[v] < n_pi:
            res_src.append(("param", in_pos[v]))
        elif v in in_pos and in_pos[v] < n_pi + n_bi:
            res_src.append(("batch", in_pos[v] - n_pi))
        elif v in derived_vars:
            res_src.append(("derived", derived_vars.index(v)))
        else:
            res_src.append(("stored", stored_vars.index(v)))
    fwd_jaxpr = jcore.ClosedJaxpr(
        fj.replace(outvars=fj.outvars[:n_out] + stored_vars), fwd_raw.consts
    )
    residual_avals = [v.aval for v in stored_vars]
    _refuse_offloaded(residual_avals)
    tree = res_tree[0]

    def rebuild(params, batch, stored):
        again = (jcore.jaxpr_as_fun(derived.jaxpr)(*[params[i] for i in derived.param_pos])
                 if derived else [])
        sources = {"param": params, "batch": batch, "stored": stored, "derived": again}
        out = [x if kind == "lit" else sources[kind][x] for kind, x in res_src]
        return jax.tree.unflatten(tree, out)

    def bwd(params, batch, stored, ct_out):
        ((ct_par, ct_car),) = rebuild(params, batch, stored)(list(ct_out))
        return list(ct_par), list(ct_car)

    ct_out_avals = [a for a, d in zip(out_avals, do, strict=True) if d]
    bwd_jaxpr = jax.make_jaxpr(bwd)(
        [typed_sds(a) for a in p_avals], [typed_sds(a) for a in b_avals],
        [typed_sds(a) for a in residual_avals], [typed_sds(a) for a in ct_out_avals],
    )
    n_ctp = sum(dp)
    bwd_i, bwd_w, w_avals, w_res_ids = split_backward(
        bwd_jaxpr, n_ctp, len(p_avals) + len(b_avals), len(ct_out_avals), len(p_avals))
    return StageFn(
        index=s, eqn_range=eqn_range, param_ids=p_ids, batch_ids=b_ids, in_avals=in_avals,
        out_avals=out_avals, residual_avals=residual_avals, w_residual_avals=w_avals,
        fwd=fwd_jaxpr, bwd=bwd_jaxpr, bwd_i=bwd_i, bwd_w=bwd_w, diff_param_mask=dp,
        diff_in_mask=di, diff_out_mask=do, names=names, is_last=is_last, w_res_ids=w_res_ids,
        remat=policy,
        stored_in=tuple(sorted(in_pos[v] - n_pi - n_bi for v in stored_vars if v in in_pos)),
        stored_out=tuple(j for j, v in enumerate(fj.outvars[:n_out]) if v in stored_vars),
        derived_avals=[v.aval for v in derived_vars],
    )


def _refuse_offloaded(residual_avals: list) -> None:
    """Residuals a ``jax.checkpoint`` policy offloads to host memory cannot be stored: a
    stage's residual storage is device memory (the first call failed in JAX's words)."""
    host = [a for a in residual_avals
            if str(getattr(a, "memory_space", "")).endswith(("Host", "host"))]
    if host:
        raise PipelineError(
            f"a jax.checkpoint policy offloads residuals to host memory ({host[0]}: "
            "save_and_offload_only_these_names or offload_dot_with_no_batch_dims with "
            "offload_dst='pinned_host'); jaxpipe stores a stage's residuals in device "
            "memory and does not offload them. Use save_only_these_names (or "
            "jp.Cut(remat=...): recomputation instead of offloading) for those names.")


def _keys_as_data(st: StageFn) -> StageFn:
    """``st`` with every key-typed boundary value passed as key data (the rule:
    :mod:`jaxpipe.stages.stage_fn`)."""
    jaxprs = (st.fwd, st.bwd, st.bwd_i, st.bwd_w)
    if not any(is_key(a) for cj in jaxprs for a in (*cj.in_avals, *cj.out_avals)):
        return st

    def convert(cj: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
        def fn(*args):
            inner = [from_boundary(x, a) for x, a in zip(args, cj.in_avals, strict=True)]
            return [to_boundary(y) for y in stage_as_fun(cj)(*inner)]

        return jax.make_jaxpr(fn)(*[typed_sds(boundary_aval(a)) for a in cj.in_avals])

    def avals(xs: list) -> list:
        return [boundary_aval(a) for a in xs]

    return dataclasses.replace(
        st, fwd=convert(st.fwd), bwd=convert(st.bwd), bwd_i=convert(st.bwd_i),
        bwd_w=convert(st.bwd_w), in_avals=avals(st.in_avals), out_avals=avals(st.out_avals),
        residual_avals=avals(st.residual_avals),
        w_residual_avals=avals(st.w_residual_avals), derived_avals=avals(st.derived_avals))
