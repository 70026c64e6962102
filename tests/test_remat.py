"""Recomputation chosen per stage together with the cut (issue 17).

Stage functions apply each policy with ``jax.checkpoint`` (gradients stay exact, stored
residuals shrink), the cost model predicts what each policy stores and recomputes, the
cutter's budget search is the brute-force optimum over cuts *and* policies, and
``cut="auto"`` budgets the device's reported memory limit.
"""

from __future__ import annotations

import functools
import itertools
import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from models import assert_matches, reference, reference_per_microbatch, tiny_lm
from split_schedule import DeferredW1F1B

import jaxpipe as jp
from jaxpipe.cut import SPMD_MEMORY, Cut, CutError, Remat, auto_cut, partition
from jaxpipe.cut.cost import RematCost, SegmentCost, segment_costs
from jaxpipe.cut.flops import jaxpr_flops
from jaxpipe.cut.memory_model import TPU_MEMORY
from jaxpipe.jaxpr.avals import aval_bytes
from jaxpipe.jaxpr.interpret import sub_jaxprs
from jaxpipe.jaxpr.trace import microbatch_like, trace
from jaxpipe.runtime.reference import run_reference
from jaxpipe.stages import split

M = 4  # microbatches


def _stored(stage):
    return sum(aval_bytes(a) for a in stage.residual_avals)


@pytest.fixture(scope="module")
def lm():
    loss_fn, params, batch = tiny_lm(4, vocab=32, width=16, seq=8, batch=16)
    return loss_fn, params, batch, trace(loss_fn, params, microbatch_like(batch, M))


# ---------------------------------------------------------------------------------------
# stage functions


def test_each_policy_stores_less_and_recomputes_more(lm):
    *_, t = lm
    stored, recompute = {}, {}
    base = None
    for policy in Remat:
        stages = split(t, [1, 3], [policy] * 3)
        stored[policy] = [_stored(s) for s in stages]
        flops = [jaxpr_flops(s.bwd) for s in stages]
        base = base or flops
        recompute[policy] = [f - b for f, b in zip(flops, base, strict=True)]
        assert all(s.remat is policy for s in stages)
    order = [Remat.NONE, Remat.DOTS, Remat.DOTS_NO_BATCH, Remat.BOUNDARY, Remat.FULL]
    for k in range(3):
        seq = [stored[p][k] for p in order]
        assert seq == sorted(seq, reverse=True) and seq[0] > 2 * seq[3], seq
        rec = [recompute[p][k] for p in order]
        assert rec[0] == 0 and rec == sorted(rec), rec
    # the middle stage (two blocks) stores two boundary activations, or one when it is
    # recomputed as a whole (plus the attention mask every block reads)
    act = 4 * 8 * 16 * 4  # microbatch [4, 8, 16] float32
    mask = 8 * 8  # [8, 8] bool
    assert stored[Remat.BOUNDARY][1] == 2 * act + mask
    assert stored[Remat.FULL][1] == act + mask


#: Every policy on both schedule kinds (whole and split backward), on first, middle and
#: last stages of one or two segments.
MIXED = [
    pytest.param([Remat.FULL, Remat.DOTS, Remat.BOUNDARY, Remat.DOTS_NO_BATCH],
                 DeferredW1F1B(4, M), id="split-backward"),
    pytest.param([Remat.DOTS_NO_BATCH, Remat.BOUNDARY, Remat.FULL, Remat.DOTS],
                 jp.OneFOneB(4, M), id="1f1b"),
]
CUTS = [1, 3, 4]  # stages of 2, 2, 1 and 2 segments


@pytest.fixture(scope="module")
def lm6():
    loss_fn, params, batch = tiny_lm(6, vocab=32, width=16, seq=8, batch=16)
    return loss_fn, params, batch, trace(loss_fn, params, microbatch_like(batch, M))


@pytest.mark.parametrize(("policies", "schedule"), MIXED)
def test_every_policy_gives_exact_gradients_on_the_reference_runtime(lm6, policies, schedule):
    loss_fn, params, batch, t = lm6
    stages = split(t, CUTS, policies)
    assert [_stored(s) for s in stages] < [_stored(s) for s in split(t, CUTS)]
    mbs = [x.reshape(M, -1, *x.shape[1:]) for x in jax.tree.leaves(batch)]
    loss, _, grads, _ = run_reference(stages, schedule, jax.tree.leaves(params), mbs)
    assert_matches((loss, jax.tree.unflatten(t.params_treedef, grads)),
                   reference(loss_fn, params, batch, M))


def _user_checkpointed(policy):
    """A 3-block MLP whose middle block the user wrapped in jax.checkpoint."""
    ks = jax.random.split(jax.random.key(3), 5)
    params = [jax.random.normal(k, (16, 16)) / 4 for k in ks[:3]]
    batch = {"x": jax.random.normal(ks[3], (8, 16)), "y": jax.random.normal(ks[4], (8, 16))}

    def block(w, h):
        return jnp.tanh(jnp.tanh(h @ w) @ w)

    def loss_fn(p, b):
        h = b["x"]
        for i, w in enumerate(p):
            f = jax.checkpoint(block, policy=policy) if i == 1 else block
            h = jp.boundary(f(w, h))
        return jnp.mean((h - b["y"]) ** 2)

    return loss_fn, params, batch


def _count(jaxpr, name, depth=0):
    """(checkpoint equations, deepest nesting of checkpoints) in a jaxpr."""
    n, deepest = 0, depth
    for e in jaxpr.eqns:
        inner_depth = depth + (e.primitive.name == name)
        n += e.primitive.name == name
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            k, d = _count(getattr(sub, "jaxpr", sub), name, inner_depth)
            n, deepest = n + k, max(deepest, d)
        deepest = max(deepest, inner_depth)
    return n, deepest


@pytest.mark.parametrize("user_policy", [jax.checkpoint_policies.dots_saveable,
                                         jax.checkpoint_policies.nothing_saveable])
def test_a_users_own_checkpoint_is_never_wrapped_again(user_policy):
    loss_fn, params, batch = _user_checkpointed(user_policy)
    t = trace(loss_fn, params, microbatch_like(batch, 2))
    costs = segment_costs(t)
    assert [c.user_remat for c in costs] == [False, True, False, False]
    assert all(c.remat_cost(p) == RematCost(costs[1].residual_bytes, 0.0) for p in Remat
               for c in costs[1:2])
    plain = split(t, [0, 1, 2])
    mbs = [x.reshape(2, -1, *x.shape[1:]) for x in jax.tree.leaves(batch)]
    want = reference(loss_fn, params, batch, 2)
    for policy in (Remat.BOUNDARY, Remat.FULL, Remat.DOTS):
        stages = split(t, [0, 1, 2], [policy] * 4)
        # the user's segment stores exactly what the user's own policy stores ...
        assert _stored(stages[1]) == _stored(plain[1])
        # ... and no checkpoint ends up inside another one
        assert _count(stages[1].fwd.jaxpr, "checkpoint")[1] <= 1
        loss, _, grads, _ = run_reference(stages, jp.GPipe(4, 2), list(params), mbs)
        assert_matches((loss, grads), want)
    # Recomputed as a whole, a stage around the user's block stores the inputs of the
    # wrapped runs before and after it, plus what the user's block stores itself.
    one = split(t, [], [Remat.FULL])[0]
    pred = partition(costs, [0], [1], Cut(indices=[], remat="full")).stage_memory[0]
    assert pred.residuals == _stored(one)


@pytest.mark.parametrize("user_policy", [None, jax.checkpoint_policies.dots_saveable],
                         ids=["nothing_saveable", "dots_saveable"])
def test_a_checkpointed_marked_layer_is_cut_and_keeps_its_recomputation(user_policy):
    """``jax.checkpoint`` (linen's ``nn.remat``) around a ``@jp.layer``: the markers
    inside become cuts (JAX names the primitive ``remat2``; it was refused), and what lies
    between them stays checkpointed with the user's policy: each layer stores what the
    checkpoint keeps, not every residual, and gradients stay exact."""
    ks = jax.random.split(jax.random.key(4), 6)
    params = [jax.random.normal(k, (16, 16)) / 4 for k in ks[:4]]
    batch = {"x": jax.random.normal(ks[4], (8, 16)), "y": jax.random.normal(ks[5], (8, 16))}

    @jp.layer
    def block(w, h):
        return jnp.tanh(jnp.tanh(h @ w) @ w)

    def make(wrap):
        def loss_fn(p, b):
            h = b["x"]
            for w in p:
                h = wrap(block)(w, h)
            return jnp.mean((h - b["y"]) ** 2)
        return loss_fn

    checkpointed = make(lambda f: jax.checkpoint(f, policy=user_policy))
    t = trace(checkpointed, params, microbatch_like(batch, 2))
    plain_t = trace(make(lambda f: f), params, microbatch_like(batch, 2))
    assert len(t.markers) == len(plain_t.markers) == 4
    assert [c.user_remat for c in segment_costs(t)] == [True] * 4 + [False]
    stages, plain = split(t, [0, 1, 2]), split(plain_t, [0, 1, 2])
    assert all(_stored(a) < _stored(b) for a, b in zip(stages, plain, strict=True))
    mesh = jax.make_mesh((4,), ("pipe",))
    pipe = jp.pipeline(checkpointed, params, batch, mesh=mesh, schedule=jp.OneFOneB(4, 2))
    assert_matches(pipe.value_and_grad(params, batch), reference(checkpointed, params, batch, 2))

    # a checkpoint around a whole scanned stack cannot be kept once the stack is cut
    def scanned(p, b):
        body = jax.checkpoint(lambda x, ws: jax.lax.scan(
            lambda h, w: (jp.boundary(jnp.tanh(h @ w)), None), x, ws)[0], policy=user_policy)
        return jnp.mean((body(b["x"], jnp.stack(p)) - b["y"]) ** 2)
    with pytest.raises(jp.PipelineError, match=r"inside a jax\.checkpoint.*inside the scan"):
        trace(scanned, params, microbatch_like(batch, 2))


# ---------------------------------------------------------------------------------------
# cost model


@pytest.mark.parametrize("policy", list(Remat))
def test_cost_model_predicts_what_each_policy_stores_and_recomputes(lm, policy):
    *_, t = lm
    costs = segment_costs(t)
    indices = [1, 3]
    res = partition(costs, [0, 1, 2], [3, 2, 1], Cut(indices=indices, remat=policy))
    stages = split(t, indices, res.remat)
    assert res.remat == (policy,) * 3
    for k, stage in enumerate(stages):
        pred = res.stage_memory[k].residuals / res.in_flight[k]
        got = _stored(stage)
        # per-segment sums count a value two segments both store (the mask) twice
        assert got <= pred <= 1.02 * got + 1, (k, pred, got)
        fwd = res.stage_fwd[k]
        if policy in (Remat.BOUNDARY, Remat.FULL):  # the forward again, less what the
            assert 0.9 * fwd <= res.stage_recompute[k] <= 1.01 * fwd  # gradient ignores
        elif policy is Remat.NONE:
            assert res.stage_recompute[k] == 0
        else:
            assert 0 < res.stage_recompute[k] < 0.5 * fwd
    if policy in (Remat.NONE, Remat.FULL):  # no value is stored by two segments
        assert [m.residuals / f for m, f in zip(res.stage_memory, res.in_flight, strict=True)
                ] == [_stored(s) for s in stages]


# ---------------------------------------------------------------------------------------
# the cutter: brute force over cuts and policies

POLICIES = (Remat.NONE, Remat.DOTS, Remat.BOUNDARY)


@st.composite
def remat_problems(draw, shared=False):
    n = draw(st.integers(1, 6))
    costs = []
    for k in range(n):
        flops = float(draw(st.integers(1, 20)))
        residual = draw(st.integers(0, 60))
        dots = draw(st.integers(0, residual))
        boundary = draw(st.integers(0, dots))
        costs.append(SegmentCost(
            flops=flops, param_bytes=draw(st.integers(0, 40)), residual_bytes=residual,
            out_bytes=draw(st.integers(0, 8)), name=f"s{k}",
            remat={Remat.DOTS: RematCost(dots, float(draw(st.integers(0, int(flops))))),
                   Remat.BOUNDARY: RematCost(boundary, flops)}))
    if shared and n >= 2:
        placement = [0, 1, 1, 0][: draw(st.integers(2, min(n, 4)))]
    else:
        placement = list(range(draw(st.integers(1, min(n, 3)))))
    in_flight = draw(st.lists(st.integers(1, 5), min_size=len(placement),
                              max_size=len(placement)))
    return costs, placement, in_flight


def _brute(costs, placement, in_flight, cut):
    """(max stage time, padded peak, bounds, policies) of every cut and policy choice."""
    model = cut.resolve_memory_model(SPMD_MEMORY)
    bpp = cut.bytes_per_param_byte
    n, S = len(costs), len(placement)
    out = []
    for inner in itertools.combinations(range(1, n), S - 1):
        bounds = (0, *inner, n)
        segs = [costs[bounds[k]:bounds[k + 1]] for k in range(S)]
        for pols in itertools.product(POLICIES, repeat=S):
            times, par, act, work = [], {}, {}, []
            for k, (seg, pol) in enumerate(zip(segs, pols, strict=True)):
                times.append(sum(3 * c.flops + c.remat_cost(pol).recompute_flops for c in seg))
                p = sum(c.param_bytes for c in seg)
                recv = costs[bounds[k] - 1].out_bytes if bounds[k] > 0 else 0
                send = seg[-1].out_bytes if bounds[k + 1] < n else 0
                stored = sum(c.remat_cost(pol).residual_bytes for c in seg)
                d = placement[k]
                par[d] = par.get(d, 0) + p
                act[d] = act.get(d, 0) + in_flight[k] * stored + 2 * (recv + send)
                work.append(model.workspace_residual_sets * sum(c.residual_bytes for c in seg)
                            + model.workspace_param_sets * p
                            + model.workspace_stored_sets * stored)
            peak = bpp * max(par.values()) + max(act.values()) + max(work)
            out.append((max(times), peak, bounds, pols))
    return out


def _check(res, costs, placement, in_flight, cut):
    """The result's own time and memory, recomputed the slow way."""
    bounds = tuple([a for a, _ in res.stage_segments] + [len(costs)])
    match = [x for x in _brute(costs, placement, in_flight, cut)
             if x[2] == bounds and x[3] == res.remat]
    assert len(match) == 1
    t, m = match[0][:2]
    assert res.max_stage_time == pytest.approx(t)
    assert res.peak_memory == pytest.approx(m)
    return t, m


@pytest.mark.parametrize("model", ["spmd", TPU_MEMORY], ids=["spmd", "tpu"])
@pytest.mark.parametrize("shared", [False, True], ids=["one-stage-per-device", "shared"])
@settings(max_examples=40, deadline=None)
@given(data=st.data(), frac=st.floats(-0.2, 1.0))
def test_budget_search_is_the_brute_force_optimum_over_cuts_and_policies(shared, model, data,
                                                                          frac):
    """Also under XLA:TPU's model, whose workspace copies what the policy stores: the
    least-storing policy within a time cap still minimises every memory term."""
    costs, placement, in_flight = data.draw(remat_problems(shared))
    cut0 = Cut(memory_model=model)
    every = _brute(costs, placement, in_flight, cut0)
    lo, hi = min(x[1] for x in every), max(x[1] for x in every)
    budget = max(1, int(lo + frac * (hi - lo)))
    cut = Cut(memory_budget=budget, memory_model=model)
    if budget < lo:
        with pytest.raises(CutError, match=rf"smallest feasible budget is .*\({math.ceil(lo)} "
                                           r"bytes\), cut after markers .* recomputation"):
            partition(costs, placement, in_flight, cut)
        return
    res = partition(costs, placement, in_flight, cut)
    t, m = _check(res, costs, placement, in_flight, cut)
    assert m <= budget
    assert t == pytest.approx(min(x[0] for x in every if x[1] <= budget))
    # Placement alone can never beat placement and recomputation together.
    try:
        alone = partition(costs, placement, in_flight, Cut(memory_budget=budget,
                                                           memory_model=model, remat="none"))
    except CutError:
        return
    assert t <= alone.max_stage_time


@settings(max_examples=40, deadline=None)
@given(data=st.data(), slack=st.sampled_from([0.0, 0.1, 0.5]))
def test_memory_objective_with_recomputation_is_the_brute_force_optimum(data, slack):
    costs, placement, in_flight = data.draw(remat_problems())
    cut = Cut(objective="memory", time_slack=slack, memory_model="spmd")
    res = partition(costs, placement, in_flight, cut)
    t, m = _check(res, costs, placement, in_flight, cut)
    every = _brute(costs, placement, in_flight, cut)
    cap = (1 + slack) * min(x[0] for x in every if all(p is Remat.NONE for p in x[3]))
    assert t <= cap * (1 + 1e-12)
    assert m == pytest.approx(min(x[1] for x in every if x[0] <= cap * (1 + 1e-12)))


def test_time_objective_never_recomputes():
    costs = [SegmentCost(flops=1.0, residual_bytes=100, out_bytes=1,
                         remat={Remat.BOUNDARY: RematCost(1, 1.0)}) for _ in range(8)]
    res = partition(costs, [0, 1], [2, 1], Cut())
    assert res.remat == (Remat.NONE,) * 2 and sum(res.stage_recompute) == 0


def test_budget_recomputes_only_where_memory_is_short():
    # 1F1B-like in-flight counts: stage 0 holds 4 residual sets, stage 3 one. A budget
    # between the all-boundary and the no-recompute peak makes the early stages
    # recompute; the last one has room and stays fast.
    costs = [SegmentCost(flops=10.0, param_bytes=1, residual_bytes=100, out_bytes=1,
                         remat={Remat.DOTS: RematCost(60, 1.0),
                                Remat.BOUNDARY: RematCost(5, 10.0)}) for _ in range(8)]
    in_flight = [4, 3, 2, 1]
    none = partition(costs, range(4), in_flight, Cut(remat="none"))
    res = partition(costs, range(4), in_flight, Cut(memory_budget=int(0.6 * none.peak_memory)))
    assert res.peak_memory <= 0.6 * none.peak_memory
    assert res.remat[0] is not Remat.NONE and res.remat[-1] is Remat.NONE
    every = partition(costs, range(4), in_flight, Cut(remat="boundary"))
    assert res.max_stage_time <= every.max_stage_time
    assert sum(res.stage_time) < 0.85 * sum(every.stage_time)  # the total work
    with pytest.raises(CutError, match="remat='auto'"):
        partition(costs, range(4), in_flight,
                  Cut(memory_budget=int(0.6 * none.peak_memory), remat="none"))


def test_explicit_cut_with_a_budget_gets_the_fastest_policies_that_fit():
    costs = [SegmentCost(flops=10.0, residual_bytes=100, out_bytes=1,
                         remat={Remat.DOTS: RematCost(60, 1.0),
                                Remat.BOUNDARY: RematCost(5, 10.0)}) for _ in range(4)]
    none = partition(costs, [0, 1], [2, 1], Cut(indices=[1]))
    budget = int(none.peak_memory) - 50
    res = partition(costs, [0, 1], [2, 1], Cut(indices=[1], memory_budget=budget))
    assert res.peak_memory <= budget and res.remat[1] is Remat.NONE
    assert res.remat[0] in (Remat.DOTS, Remat.BOUNDARY)
    with pytest.raises(CutError, match=r"explicit cut \[1\] with recomputation .* needs"):
        partition(costs, [0, 1], [2, 1], Cut(indices=[1], memory_budget=50))


def test_bad_remat_options_name_the_choices():
    with pytest.raises(CutError, match="'none', 'dots'.*'full'"):
        Cut(remat="sometimes")
    with pytest.raises(CutError, match="explicit Cut.indices"):
        partition([SegmentCost(flops=1.0)] * 2, [0, 1], [1, 1],
                  Cut(remat=["none", "dots"]))
    with pytest.raises(CutError, match="no data for it"):
        partition([SegmentCost(flops=1.0)] * 2, [0, 1], [1, 1], Cut(remat="dots"))


# ---------------------------------------------------------------------------------------
# cut="auto": the device's memory limit


class _Device:
    process_index = 0
    device_kind = "FakeGPU"

    def __init__(self, limit):
        self.limit = limit

    def memory_stats(self):
        return None if self.limit is None else {"bytes_limit": self.limit, "bytes_in_use": 0}


def test_auto_cut_budgets_the_smallest_device_limit_minus_the_reserve():
    cut = auto_cut([_Device(100 << 20), _Device(80 << 20)], held_bytes=1 << 20)
    assert cut.memory_budget == int(0.9 * (80 << 20)) - (1 << 20)
    assert cut.remat == "auto"
    assert "FakeGPU bytes_limit 80.00 MiB minus a 10% reserve and 1.00 MiB of batch" in (
        cut.budget_source)
    assert auto_cut([_Device(100 << 20), _Device(None)]) == Cut()  # CPU: as before
    assert auto_cut(jax.devices()[:2]) == Cut()


# ---------------------------------------------------------------------------------------
# pipelines (compiled)


@pytest.mark.parametrize(("policies", "schedule"), MIXED)
def test_spmd_gradients_are_exact_with_every_policy(lm6, policies, schedule):
    loss_fn, params, batch, _ = lm6
    pipe = jp.pipeline(loss_fn, params, batch, mesh=jax.make_mesh((4,), ("pipe",)),
                       schedule=schedule, cut=jp.Cut(indices=CUTS, remat=policies))
    assert [st.remat for st in pipe.inspect.stages] == policies
    assert list(pipe.inspect.cut_report.remat) == policies
    assert_matches(pipe.value_and_grad(params, batch), reference(loss_fn, params, batch, M))


def test_pipeline_fits_a_budget_by_recomputing_and_the_plan_says_so(monkeypatch):
    loss_fn, params, batch = tiny_lm(8, vocab=64, width=32, seq=16, batch=32)
    mesh = jax.make_mesh((4,), ("pipe",))
    plain = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=jp.OneFOneB(4, 8))
    need = plain.inspect.cut_report.peak_memory
    # cut="auto" on a device that reports a limit 70% of what no recomputation needs
    import jaxpipe.cut.budget as budget

    monkeypatch.setattr(budget, "device_memory_limit",
                        lambda devices: (int(0.7 * need / 0.9), "FakeGPU bytes_limit"))
    pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=jp.OneFOneB(4, 8))
    res = pipe.inspect.cut_report
    assert res.memory_budget is not None and res.peak_memory <= res.memory_budget
    assert "FakeGPU bytes_limit" in res.budget_source
    assert any(p is not Remat.NONE for p in res.remat)
    assert [st.remat for st in pipe.inspect.stages] == list(res.remat)
    text = str(pipe.plan)
    assert "memory budget:" in text and "FakeGPU" in text
    for r, policy in zip(pipe.plan.stage_rows, res.remat, strict=True):
        assert r["remat"] == policy.value and r["remat"] in text


def test_a_budget_that_fits_without_recomputation_changes_nothing(lm, monkeypatch):
    import jaxpipe.cut.budget as budget
    import jaxpipe.cut.resolve as resolve

    loss_fn, params, batch, _ = lm
    mesh = jax.make_mesh((4,), ("pipe",))
    plain = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=jp.OneFOneB(4, M))
    monkeypatch.setattr(budget, "device_memory_limit",
                        lambda devices: (1 << 40, "FakeGPU bytes_limit"))
    costed = []
    real = resolve.segment_costs
    monkeypatch.setattr(resolve, "segment_costs",
                        lambda *a, **k: costed.append(k.get("remat")) or real(*a, **k))
    pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=jp.OneFOneB(4, M))
    res = pipe.inspect.cut_report
    assert res.remat == (Remat.NONE,) * 4 and res.objective == "budget"
    assert res.max_stage_time == plain.inspect.cut_report.max_stage_time == res.time_optimum
    assert costed == [(Remat.NONE,)]  # the other policies were never measured


@pytest.mark.parametrize("policy", ["dots", "boundary", "full"])
def test_plan_predicts_compiled_memory_within_15_percent_with_recomputation(policy):
    loss_fn, params, batch = tiny_lm(8, vocab=512, width=64, seq=32, batch=32)
    pipe = jp.pipeline(loss_fn, params, batch, mesh=jax.make_mesh((4,), ("pipe",)),
                       schedule=jp.OneFOneB(4, 8), cut=jp.Cut(remat=policy))
    r = pipe.inspect.compare_compiled(params, batch)
    ratio = r["compiled_bytes"] / r["predicted_bytes"]
    assert abs(ratio - 1.0) <= 0.15, r


def test_fake_devices_are_only_read_on_this_process():
    remote = SimpleNamespace(process_index=99, memory_stats=lambda: 1 / 0)
    assert budget_limit([remote, _Device(64)]) == (64, "FakeGPU bytes_limit")


def budget_limit(devices):
    from jaxpipe.cut import device_memory_limit

    return device_memory_limit(devices)


def _eqns(jaxpr):
    """Every equation of ``jaxpr``, those of the jaxprs its equations hold included."""
    for e in jaxpr.eqns:
        yield e
        for sub in sub_jaxprs(e.params):
            yield from _eqns(sub)


def _bf16_compute(scanned: bool):
    """f32 weights and bf16 compute (flax's ``param_dtype=float32, dtype=bfloat16``):
    each matmul reads a bf16 copy of its weight, which autodiff keeps for the backward."""
    width, rows = 16, 4
    ks = jax.random.split(jax.random.key(3), 6)
    ws = [jax.random.normal(k, (width, width)) / 4 for k in ks[:4]]
    batch = {"x": jax.random.normal(ks[4], (M * rows, width)),
             "y": jax.random.normal(ks[5], (M * rows, width))}

    def layer(h, w):
        return jp.boundary(jnp.tanh(h @ w.astype(jnp.bfloat16)))

    def head(h, b):
        return jnp.mean((h.astype(jnp.float32) - b["y"]) ** 2)

    if scanned:
        def loss_fn(params, b):
            h, _ = jax.lax.scan(lambda h, w: (layer(h, w), None),
                                b["x"].astype(jnp.bfloat16), params)
            return head(h, b)
        return loss_fn, jnp.stack(ws), batch, width

    def loss_fn(params, b):
        h = b["x"].astype(jnp.bfloat16)
        for w in params:
            h = layer(h, w)
        return head(h, b)
    return loss_fn, ws, batch, width


@pytest.mark.parametrize("scanned", [False, True], ids=["unrolled", "scanned"])
def test_a_weights_compute_copy_is_recomputed_not_stored_per_microbatch(scanned):
    """A value computed from the parameters alone (here the bf16 copy of an f32 weight;
    an FSDP gather alike) is the same for every microbatch: the stages recompute it in the
    backward instead of storing one per microbatch in flight, with and without the I / W
    split, and the gradients stay exact."""
    loss_fn, params, batch, width = _bf16_compute(scanned)
    mesh = jax.make_mesh((2,), ("pipe",))
    for schedule in (jp.OneFOneB(2, M), DeferredW1F1B(2, M)):
        pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=schedule,
                           cut="markers")
        for stage in pipe.inspect.stages:
            stored = [a.shape for a in (*stage.residual_avals, *stage.w_residual_avals)
                      if a.dtype == jnp.bfloat16]
            assert stored and all(s[-2:] != (width, width) for s in stored), stored
            assert all(a.shape[-2:] == (width, width) and a.dtype == jnp.bfloat16
                       for a in stage.derived_avals) and stage.derived_avals
            # the backward casts the weights again (a scanned stack: in its scan)
            assert any(e.primitive.name == "convert_element_type"
                       and e.outvars[0].aval.shape[-2:] == (width, width)
                       for e in _eqns(stage.bwd.jaxpr)), stage.bwd
        assert_matches(pipe.value_and_grad(params, batch),
                       reference_per_microbatch(loss_fn, params, batch, M))


def test_a_policy_offloading_residuals_to_the_host_is_refused_with_the_fix():
    """MaxText's offload (save_and_offload_only_these_names to pinned_host): the stage's
    residual storage is device memory, and the first call failed in JAX's words
    (memory_space of all inputs to dynamic_update_slice must be the same)."""
    from jax.ad_checkpoint import checkpoint_name

    policy = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["proj"],
        offload_src="device", offload_dst="pinned_host")

    @functools.partial(jax.checkpoint, policy=policy)
    def block(w, h):
        return jnp.tanh(checkpoint_name(h @ w, "proj")) @ w.T * 0.5 + h

    def loss_fn(params, b):
        h = b["x"]
        for w in params:
            h = jp.boundary(block(w, h))
        return jnp.mean((h - b["y"]) ** 2)

    ks = jax.random.split(jax.random.key(5), 6)
    params = [jax.random.normal(k, (16, 16)) / 4 for k in ks[:4]]
    batch = {"x": jax.random.normal(ks[4], (16, 16)), "y": jax.random.normal(ks[5], (16, 16))}
    with pytest.raises(jp.PipelineError, match=r"offloads residuals to host memory.*"
                                               r"save_only_these_names"):
        jp.pipeline(loss_fn, params, batch, mesh=jax.make_mesh((2,), ("pipe",)),
                    schedule=jp.OneFOneB(2, M), cut="markers")


def _weight_norm_model(callback=None):
    """Weight normalisation (``w / |w|``): a parameter-derived value both backward halves
    read (the input gradient through it, the weight gradient of it)."""
    width = 16
    ks = jax.random.split(jax.random.key(6), 6)
    params = [jax.random.normal(k, (width, width)) for k in ks[:4]]
    batch = {"x": jax.random.normal(ks[4], (M * 4, width)),
             "y": jax.random.normal(ks[5], (M * 4, width))}

    def loss_fn(params, b):
        h = b["x"]
        for w in params:
            wn = w / jnp.linalg.norm(w)
            if callback is not None:
                jax.debug.callback(callback, jnp.sum(wn))
            h = jp.boundary(jnp.tanh(h @ wn))
        return jnp.mean((h - b["y"]) ** 2)
    return loss_fn, params, batch, width


def test_the_weight_half_recomputes_parameter_derived_values_too():
    """Under the I / W split a value the backward recomputes from the parameters was
    handed from I to W, held once per microbatch between them; W computes it again."""
    loss_fn, params, batch, width = _weight_norm_model()
    pipe = jp.pipeline(loss_fn, params, batch, mesh=jax.make_mesh((2,), ("pipe",)),
                       schedule=DeferredW1F1B(2, M), cut="markers")
    for stage in pipe.inspect.stages:
        # only activations (a microbatch's 4 rows) are stored or handed over: no weight
        # and none of the norms (scalars), which W computes again from the weights
        held = [a.shape for a in (*stage.residual_avals, *stage.w_residual_avals)]
        assert all(s == (4, width) for s in held), held
        assert stage.derived_avals
    assert_matches(pipe.value_and_grad(params, batch), reference(loss_fn, params, batch, M))


def test_a_parameter_derived_value_with_an_effect_is_stored_not_recomputed():
    """A callback on parameters alone ran again in every backward that recomputed its
    value (and a callback's result would be read twice): such values stay stored, and
    the callback runs once per microbatch's forward."""
    calls = []
    loss_fn, params, batch, _ = _weight_norm_model(lambda x: calls.append(float(x)))
    pipe = jp.pipeline(loss_fn, params, batch, mesh=jax.make_mesh((2,), ("pipe",)),
                       schedule=jp.OneFOneB(2, M), cut="markers")
    jax.block_until_ready(pipe.value_and_grad(params, batch))
    assert len(calls) == len(params) * M, len(calls)
