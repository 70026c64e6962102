"""A stage as a chain of parts: a prologue, a core other stages share, an epilogue.

The first stage of a transformer runs the embedding and then blocks, the last runs blocks
and then the head and loss, the middle stages run blocks only. As whole functions the
three differ, so a program would compile the blocks three times (once per distinct stage
body). When the first stage's trailing blocks (or the last stage's leading ones) compute
the same function as a middle stage, :func:`share_cores` splits that stage into parts:
a *prologue* (the embedding), a *core* built once with the middle stages' jaxprs, an
*epilogue* (the head and loss). With no middle stage (two stages), the first stage's
trailing equations and the last stage's leading ones are matched with each other.

The stage stays one :class:`~jaxpipe.stages.StageFn` (:func:`compose`): its jaxprs run
the parts one after the other and its residuals are the parts' residuals, the core's
first, so every runtime can run it whole. :attr:`StageFn.parts` tells a runtime where each part's
parameters, residuals and hand-off values sit in the stage's, so it can run the core of
every stage with one compiled body and the prologue or epilogue around it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jcore

from jaxpipe.jaxpr.avals import aval_bytes, typed_sds
from jaxpipe.sharding.constraints import stage_as_fun
from jaxpipe.stages.fragments import Fragments
from jaxpipe.stages.remat import Remat
from jaxpipe.stages.stage_fn import StageFn, StageParts

__all__ = ["compose", "share_cores"]

#: Candidate core lengths tried when two stages are matched with each other.
_MAX_TRIES = 8


def compose(parts: Sequence[StageFn], core: int, index: int, eqn_range: tuple[int, int],
            names: tuple[str, ...], is_last: bool, remat: Remat) -> StageFn:
    """One stage running ``parts`` in order; its residuals and hand-off values are the
    core's, then the other parts' in order."""
    parts = tuple(parts)
    p_ids = tuple(sorted({i for pt in parts for i in pt.param_ids}))
    b_ids = tuple(sorted({i for pt in parts for i in pt.batch_ids}))
    param_pos = tuple(tuple(p_ids.index(i) for i in pt.param_ids) for pt in parts)
    batch_pos = tuple(tuple(b_ids.index(i) for i in pt.batch_ids) for pt in parts)
    p_avals: list = [None] * len(p_ids)
    dp: list = [False] * len(p_ids)
    b_avals: list = [None] * len(b_ids)
    for pt, pp, bp in zip(parts, param_pos, batch_pos, strict=True):
        for j, q in enumerate(pp):
            p_avals[q], dp[q] = pt.fwd.in_avals[j], pt.diff_param_mask[j]
        for j, q in enumerate(bp):
            b_avals[q] = pt.fwd.in_avals[len(pp) + j]
    order = [core] + [k for k in range(len(parts)) if k != core]
    res_ids: list = [()] * len(parts)
    w_ids: list = [()] * len(parts)
    n_res = n_w = 0
    for k in order:
        res_ids[k] = tuple(range(n_res, n_res + len(parts[k].residual_avals)))
        w_ids[k] = tuple(range(n_w, n_w + len(parts[k].w_residual_avals)))
        n_res += len(res_ids[k])
        n_w += len(w_ids[k])
    residual_avals = [a for k in order for a in parts[k].residual_avals]
    w_avals = [a for k in order for a in parts[k].w_residual_avals]
    w_res_ids = tuple(sorted(res_ids[k][i] for k, pt in enumerate(parts) for i in pt.w_res_ids))
    w_pos = {r: i for i, r in enumerate(w_res_ids)}

    def own(k, params, batch):
        return [params[q] for q in param_pos[k]] + [batch[q] for q in batch_pos[k]]

    def add_grads(grads, k, cts):
        diff = [q for j, q in enumerate(param_pos[k]) if parts[k].diff_param_mask[j]]
        for q, g in zip(diff, cts, strict=True):
            grads[q] = g if q not in grads else grads[q] + g

    def diff_grads(grads):
        return [grads[q] for q in range(len(p_ids)) if dp[q]]

    def fwd(params, batch, carry):
        res: list = [[] for _ in parts]
        for k, pt in enumerate(parts):
            outs = stage_as_fun(pt.fwd)(*own(k, params, batch), *carry)
            n = len(pt.out_avals)
            carry, res[k] = outs[:n], outs[n:]
        return [*carry, *[x for k in order for x in res[k]]]

    def bwd(params, batch, stored, ct):
        grads: dict = {}
        for k in reversed(range(len(parts))):
            pt = parts[k]
            outs = stage_as_fun(pt.bwd)(*own(k, params, batch),
                                        *[stored[i] for i in res_ids[k]], *ct)
            n = sum(pt.diff_param_mask)
            add_grads(grads, k, outs[:n])
            ct = outs[n:]
        return [*diff_grads(grads), *ct]

    def bwd_i(params, batch, stored, ct):
        hand: list = [[] for _ in parts]
        for k in reversed(range(len(parts))):
            pt = parts[k]
            outs = stage_as_fun(pt.bwd_i)(*own(k, params, batch),
                                          *[stored[i] for i in res_ids[k]], *ct)
            n = len(pt.ct_in_avals())
            ct, hand[k] = outs[:n], outs[n:]
        return [*ct, *[x for k in order for x in hand[k]]]

    def bwd_w(params, batch, stored_w, hand):
        grads: dict = {}
        for k, pt in enumerate(parts):
            outs = stage_as_fun(pt.bwd_w)(
                *own(k, params, batch), *[stored_w[w_pos[res_ids[k][i]]] for i in pt.w_res_ids],
                *[hand[i] for i in w_ids[k]])
            add_grads(grads, k, outs)
        return diff_grads(grads)

    def sds(avals):
        return [typed_sds(a) for a in avals]

    first, last = parts[0], parts[-1]
    ct_out = sds(last.ct_out_avals())
    ps, bs = sds(p_avals), sds(b_avals)
    return StageFn(
        index=index, eqn_range=eqn_range, param_ids=p_ids, batch_ids=b_ids,
        in_avals=list(first.in_avals), out_avals=list(last.out_avals),
        residual_avals=residual_avals, w_residual_avals=w_avals,
        fwd=jax.make_jaxpr(fwd)(ps, bs, sds(first.in_avals)),
        bwd=jax.make_jaxpr(bwd)(ps, bs, sds(residual_avals), ct_out),
        bwd_i=jax.make_jaxpr(bwd_i)(ps, bs, sds(residual_avals), ct_out),
        bwd_w=jax.make_jaxpr(bwd_w)(ps, bs, sds([residual_avals[i] for i in w_res_ids]),
                                    sds(w_avals)),
        diff_param_mask=tuple(dp), diff_in_mask=first.diff_in_mask,
        diff_out_mask=last.diff_out_mask, names=names, is_last=is_last, w_res_ids=w_res_ids,
        remat=remat,
        parts=StageParts(parts, core, param_pos, batch_pos, tuple(res_ids), tuple(w_ids)),
        derived_avals=[a for pt in parts for a in pt.derived_avals],
    )


def _tokens(frags: Fragments, ks: Sequence[int]) -> list[tuple]:
    """A cheap structural summary of equations ``ks`` (to propose core lengths)."""
    return [(e.primitive.name, tuple(str(getattr(v, "aval", v)) for v in e.invars),
             tuple(str(v.aval) for v in e.outvars)) for e in (frags.eqns[k] for k in ks)]


class _Match:
    """Fragment ``cand`` against fragment ``ref`` equation by equation (markers skipped):
    which of ``cand``'s values plays the role of each of ``ref``'s (``None``: they
    differ in shape)."""

    def __init__(self, frags: Fragments, ref: tuple[int, int], cand: tuple[int, int]) -> None:
        self.ref_alias = frags.through_markers(*ref)
        self.cand_alias = frags.through_markers(*cand)
        self.to_cand: dict | None = {}
        er, ec = frags.effective(*ref), frags.effective(*cand)
        if len(er) != len(ec):
            self.to_cand = None
            return
        for i, j in zip(er, ec, strict=True):
            x, y = frags.eqns[i], frags.eqns[j]
            if (x.primitive is not y.primitive or len(x.invars) != len(y.invars)
                    or len(x.outvars) != len(y.outvars)
                    or not all(self._bind(u, v) for u, v in zip(
                        [*x.invars, *x.outvars], [*y.invars, *y.outvars], strict=True))):
                self.to_cand = None
                return

    def _bind(self, u: Any, v: Any) -> bool:
        if isinstance(u, jcore.Literal) or isinstance(v, jcore.Literal):
            return isinstance(u, jcore.Literal) and isinstance(v, jcore.Literal)
        u, v = self.ref_alias.get(u, u), self.cand_alias.get(v, v)
        return self.to_cand.setdefault(u, v) is v

    def cand(self, ref_vars: Sequence[Any]) -> list | None:
        """``cand``'s values in the roles of ``ref_vars`` (``None``: one has no role in the
        equations, e.g. passed through unread)."""
        try:
            return [self.to_cand[self.ref_alias.get(v, v)] for v in ref_vars]
        except KeyError:
            return None

    def ref(self, cand_vars: Sequence[Any]) -> list | None:
        back = {v: u for u, v in self.to_cand.items()}
        try:
            return [back[self.cand_alias.get(v, v)] for v in cand_vars]
        except KeyError:
            return None


def _live_names(frags: Fragments, vals: list, e: int, alias: dict) -> list:
    """``vals`` (marker-resolved) named as the values live at equation ``e`` that the
    equations after it read (a marker's output rather than its input)."""
    named = {alias.get(v, v): v for v in frags.carry_at(e)}
    return [named.get(v, v) for v in vals]


def _covers(frags: Fragments, vals: list, e: int, alias: dict) -> bool:
    """``vals`` are values computed before ``e`` and hold everything live there."""
    return (all(v in frags.defined for v in vals)
            and {alias.get(v, v) for v in frags.carry_at(e)} <= set(vals))


def _ref_carries(frags: Fragments, ref: tuple[int, int], span: tuple[int, int]
                 ) -> tuple[list | None, list | None, dict] | None:
    """If the equations ``span`` match the middle stage ``ref`` one to one: ``ref``'s
    carries in and out as ``span``'s values (``None`` where one has no counterpart) and
    ``span``'s aliases; else ``None``."""
    match = _Match(frags, ref, span)
    if match.to_cand is None:
        return None
    return (match.cand(frags.carry_at(ref[0])), match.cand(frags.carry_at(ref[1])),
            match.cand_alias)


def _first_core(frags: Fragments, ref: tuple[int, int], ref_key: tuple, x: int, b0: int,
                policy: Remat) -> tuple[int, list] | None:
    """``(x, carry at x)`` if the first stage's equations ``[x, b0)`` compute the middle
    stage ``ref``'s function (``ref_key``) with its signature; else ``None``."""
    matched = _ref_carries(frags, ref, (x, b0))
    if matched is None:
        return None
    cin, cout, alias = matched
    if (cin is None or cout != [alias.get(v, v) for v in frags.carry_at(b0)]
            or not _covers(frags, cin, x, alias)
            or frags.key(x, b0, policy, False, cin) != ref_key):
        return None
    return x, cin


def _last_core(frags: Fragments, ref: tuple[int, int], ref_key: tuple, aL: int, y: int,
               policy: Remat) -> tuple[int, list] | None:
    """``(y, carry at y)`` if the last stage's equations ``[aL, y)`` compute the middle
    stage ``ref``'s function (``ref_key``) with its signature; else ``None``."""
    matched = _ref_carries(frags, ref, (aL, y))
    if matched is None:
        return None
    cin, cout, alias = matched
    if cout is None or cin != frags.carry_at(aL) or not _covers(frags, cout, y, alias):
        return None
    cout = _live_names(frags, cout, y, alias)
    if frags.key(aL, y, policy, False, None, cout) != ref_key:
        return None
    return y, cout


def _pair_core(frags: Fragments, e0: list[int], b0: int, aL: int, eL: list[int],
               policy0: Remat, policyL: Remat) -> tuple[tuple | None, tuple | None]:
    """With two stages: the longest run that ends the first stage (computing equations
    ``e0``) and begins the last (``eL``) as one function; ``((x, carry at x), (y, carry
    at y))`` for the first's core ``[x, b0)`` and the last's ``[aL, y)``, or ``None``s.
    Equation summaries propose the lengths; at most ``_MAX_TRIES`` are checked."""
    t0, t1 = _tokens(frags, e0), _tokens(frags, eL)
    boundary = frags.carry_at(b0)
    tries = 0
    for n in range(min(len(e0), len(eL)) - 1, 0, -1):
        if t0[-n:] != t1[:n]:
            continue
        tries += 1
        x, y = e0[-n], eL[n]
        match = _Match(frags, (aL, y), (x, b0))  # the last stage's core as reference
        if match.to_cand is not None:
            cin = match.cand(boundary)
            cout = match.ref([match.cand_alias.get(v, v) for v in boundary])
            if (cin is not None and cout is not None
                    and _covers(frags, cin, x, match.cand_alias)
                    and _covers(frags, cout, y, match.ref_alias)):
                cout = _live_names(frags, cout, y, match.ref_alias)
                if frags.key(x, b0, policy0, False, cin) == \
                        frags.key(aL, y, policyL, False, None, cout):
                    return (x, cin), (y, cout)
        if tries == _MAX_TRIES:
            break
    return None, None


def share_cores(frags: Fragments, ranges: Sequence[tuple[int, int]],
                policies: Sequence[Remat], split_backward: bool = False) -> list[StageFn]:
    """The stages of equation ``ranges``, the first and last split into parts where that
    lets them share their core with another stage (see the module docstring).

    Lengths count computing equations only (a core may end with or without a cut
    marker), and a core takes the signature of the stage it matches: its carries in that
    stage's order, and the values that stage passes on unread (a mask every block reads)
    passed on too. A stage stays whole where its parts would store more per microbatch
    (:func:`_parted_or_whole`; with ``split_backward`` the I -> W hand-off counts too).
    """
    S = len(ranges)

    def whole(s: int) -> StageFn:
        return frags.build(s, *ranges[s], policies[s], is_last=s == S - 1)

    if S < 2:
        return [whole(s) for s in range(S)]
    out: list = [None] + [whole(s) for s in range(1, S - 1)] + [None]
    (a0, b0), (aL, bL) = ranges[0], ranges[-1]
    e0, eL = frags.effective(a0, b0), frags.effective(aL, bL)
    first = last = None  # (core start, carry at it) / (core end, carry at it)
    if S >= 3:
        tried: set = set()
        for s in range(1, S - 1):
            ref, policy = ranges[s], policies[s]
            ref_key = frags.key(*ref, policy, False)
            if ref_key in tried:  # a middle stage like one already matched against
                continue
            tried.add(ref_key)
            n = len(frags.effective(*ref))
            if first is None and n < len(e0):
                first = _first_core(frags, ref, ref_key, e0[-n], b0, policies[0])
            if last is None and n < len(eL):
                last = _last_core(frags, ref, ref_key, aL, eL[n], policies[-1])
            if first is not None and last is not None:
                break
    else:
        first, last = _pair_core(frags, e0, b0, aL, eL, policies[0], policies[-1])
    if first is not None:
        x, cin = first
        parts = [frags.build(0, a0, x, policies[0], False, carry_out=cin),
                 frags.build(0, x, b0, policies[0], False, carry_in=cin)]
        out[0] = _parted_or_whole(frags, parts, 1, 0, ranges[0], False, policies[0],
                                  split_backward, lambda: whole(0))
    if last is not None:
        y, cout = last
        parts = [frags.build(S - 1, aL, y, policies[-1], False, carry_out=cout),
                 frags.build(S - 1, y, bL, policies[-1], True, carry_in=cout)]
        out[-1] = _parted_or_whole(frags, parts, 0, S - 1, ranges[-1], True, policies[-1],
                                   split_backward, lambda: whole(S - 1))
    return [st if st is not None else whole(s) for s, st in enumerate(out)]


def _parted_or_whole(frags: Fragments, parts: list[StageFn], core: int, s: int,
                     eqn_range: tuple[int, int], is_last: bool, policy: Remat,
                     split_backward: bool, whole: Callable[[], StageFn]) -> StageFn:
    """Stage ``s`` as ``parts``, unless that stores more per microbatch than the whole
    stage: sharing a compiled body must not cost memory.

    Without recomputation the parts store what the whole stage stores, but for a value
    between two parts that both keep (one as an output, the other as an input): then the
    stage stays whole, and no whole stage is traced to find that out. Under a
    recomputation policy the value between two parts can become a residual the whole
    stage recomputes, and with ``split_backward`` the first stage's input-gradient half
    computes nothing whole (it has no input) while its core's hands values to the weight
    half; there the whole stage is traced and compared.
    """
    if policy is Remat.NONE and not split_backward:
        twice = any(set(a.stored_out) & set(b.stored_in)
                    for a, b in zip(parts, parts[1:], strict=False))
        if twice:
            return whole()
        return compose(parts, core, s, eqn_range, frags.names(*eqn_range), is_last, policy)
    parted = compose(parts, core, s, eqn_range, frags.names(*eqn_range), is_last, policy)
    w = whole()

    def stored(st: StageFn) -> list[int]:
        lists = [st.residual_avals] + ([st.w_residual_avals] if split_backward else [])
        return [sum(aval_bytes(a) for a in avals) for avals in lists]

    heavier = any(p > q for p, q in zip(stored(parted), stored(w), strict=True))
    return w if heavier else parted
