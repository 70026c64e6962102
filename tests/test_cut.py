"""The cutter: exact optima against brute force, memory balancing, budgets, errors, speed."""

from __future__ import annotations

import itertools
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpipe.cut import SPMD_MEMORY, Cut, CutError, Remat, choose_cuts, partition
from jaxpipe.cut.cost import RematCost, SegmentCost
from jaxpipe.cut.memory_model import TPU_MEMORY

# ---------------------------------------------------------------------------
# An independent brute force: enumerate every contiguous cut, sum things directly.

LEAF_BYTES = {0: 7, 1: 13, 2: 40}  # shareable parameter leaves (tied weights)


def _workspace(cut, residual_set, params):
    """Transient bytes of a running stage: residual sets plus parameter sets."""
    model = cut.resolve_memory_model(SPMD_MEMORY)
    return (model.workspace_residual_sets * residual_set
            + model.workspace_param_sets * params)


def _stage_stats(costs, bounds, in_flight, cut):
    """Per stage: time (F + B), parameter bytes, activation bytes, residual set, all."""
    times, params, acts, sets = [], [], [], []
    for k in range(len(bounds) - 1):
        segs = costs[bounds[k] : bounds[k + 1]]
        times.append(sum(3 * c.flops for c in segs))  # F + B, B = 2F
        leaves = set().union(*(c.param_leaf_bytes for c in segs))
        params.append(sum(c.private_param_bytes for c in segs)
                      + sum(LEAF_BYTES[i] for i in leaves))
        recv = costs[bounds[k] - 1].out_bytes if bounds[k] > 0 else 0
        send = segs[-1].out_bytes if bounds[k + 1] < len(costs) else 0
        sets.append(sum(c.residual_bytes for c in segs))
        acts.append(in_flight[k] * sets[-1] + 2 * (recv + send))
    a = 1 + cut.grad_bytes_per_param_byte + cut.optimizer_bytes_per_param_byte
    mems = [a * p + x + _workspace(cut, r, p) for p, x, r in zip(params, acts, sets, strict=True)]
    return times, params, acts, sets, mems


def _peak(costs, bounds, placement, in_flight, cut):
    """Peak bytes per device under the cut's memory model, summed the slow way."""
    _, params, acts, sets, _ = _stage_stats(costs, bounds, in_flight, cut)
    a = 1 + cut.grad_bytes_per_param_byte + cut.optimizer_bytes_per_param_byte
    own: dict[int, float] = {}
    par: dict[int, float] = {}
    act: dict[int, float] = {}
    work: dict[int, float] = {}
    for k, d in enumerate(placement):
        own[d] = own.get(d, 0) + a * params[k] + acts[k]
        par[d] = par.get(d, 0) + params[k]
        act[d] = act.get(d, 0) + acts[k]
        work[d] = max(work.get(d, 0), _workspace(cut, sets[k], params[k]))  # one at a time
    if cut.memory_model == "device":
        return max(own[d] + work[d] for d in own)
    # SPMD: every device allocates the largest of each kind of buffer
    return (a * max(par.values()) + max(act.values())
            + max(_workspace(cut, r, p) for r, p in zip(sets, params, strict=True)))


def _all_cuts(costs, placement, in_flight, cut):
    """(max stage time, peak memory) of every contiguous cut."""
    n, S = len(costs), len(placement)
    out = []
    for inner in itertools.combinations(range(1, n), S - 1):
        bounds = (0, *inner, n)
        times = _stage_stats(costs, bounds, in_flight, cut)[0]
        out.append((max(times), _peak(costs, bounds, placement, in_flight, cut), bounds))
    return out


@st.composite
def problems(draw, shared_devices: bool = False):
    n = draw(st.integers(1, 8))
    costs = []
    for k in range(n):
        leaves = draw(st.sets(st.sampled_from(sorted(LEAF_BYTES)), max_size=2))
        private = draw(st.integers(0, 30))
        costs.append(
            SegmentCost(
                flops=float(draw(st.integers(0, 20))),
                param_bytes=private + sum(LEAF_BYTES[i] for i in leaves),
                residual_bytes=draw(st.integers(0, 50)),
                out_bytes=draw(st.integers(0, 10)),
                param_leaf_bytes={i: LEAF_BYTES[i] for i in leaves},
                name=f"s{k}",
            )
        )
    if shared_devices:
        D = draw(st.integers(1, 2))
        v = draw(st.integers(2, 3))
        if D * v > n:
            D, v = 1, min(2, n)
        S = D * v
        if draw(st.booleans()):
            placement = [s % D for s in range(S)]  # loop
        else:  # V / zig-zag
            placement = [s % D if (s // D) % 2 == 0 else D - 1 - s % D for s in range(S)]
    else:
        S = draw(st.integers(1, min(n, 4)))
        placement = list(range(S))
    in_flight = draw(st.lists(st.integers(0, 5), min_size=S, max_size=S))
    return costs, placement, in_flight


SETTINGS = settings(max_examples=40, deadline=None)
WORKSPACE = st.sampled_from([0.0, 1.0, 5.0])


def _check_result_consistent(res, costs, placement, in_flight, cut):
    bounds = [a for a, _ in res.stage_segments] + [len(costs)]
    times, _, _, _, mems = _stage_stats(costs, bounds, in_flight, cut)
    assert res.stage_time == pytest.approx(times)
    assert [m.total for m in res.stage_memory] == pytest.approx(mems)
    assert res.cuts == tuple(b - 1 for b in bounds[1:-1])
    peak = _peak(costs, bounds, placement, in_flight, cut)
    assert res.peak_memory == pytest.approx(peak)
    return max(times), peak


MODELS = pytest.mark.parametrize("model", ["spmd", "device"])
SHARED = pytest.mark.parametrize("shared", [False, True], ids=["one-stage-per-device", "shared"])


@MODELS
@SHARED
@SETTINGS
@given(data=st.data(), kw=WORKSPACE)
def test_time_objective_is_brute_force_optimum(model, shared, data, kw):
    costs, placement, in_flight = data.draw(problems(shared))
    cut = Cut(memory_model=model, workspace_residual_sets=kw)
    res = partition(costs, placement, in_flight, cut)
    t, m = _check_result_consistent(res, costs, placement, in_flight, cut)
    every = _all_cuts(costs, placement, in_flight, cut)
    t_opt = min(x[0] for x in every)
    assert t == t_opt == res.time_optimum
    # tie-break: least memory among the time-optimal cuts
    assert m == min(x[1] for x in every if x[0] == t_opt)
    assert res.exact


@MODELS
@SHARED
@SETTINGS
@given(data=st.data(), slack=st.sampled_from([0.0, 0.1, 0.5, 2.0]), kw=WORKSPACE)
def test_memory_objective_is_brute_force_optimum(model, shared, data, slack, kw):
    costs, placement, in_flight = data.draw(problems(shared))
    cut = Cut(objective="memory", time_slack=slack, memory_model=model,
              workspace_residual_sets=kw)
    res = partition(costs, placement, in_flight, cut)
    t, m = _check_result_consistent(res, costs, placement, in_flight, cut)
    every = _all_cuts(costs, placement, in_flight, cut)
    cap = (1 + slack) * min(x[0] for x in every)
    assert t <= cap
    m_opt = min(x[1] for x in every if x[0] <= cap)
    assert m == m_opt
    # tie-break: fastest among the memory-optimal cuts
    assert t == min(x[0] for x in every if x[0] <= cap and x[1] == m_opt)


@MODELS
@SHARED
@SETTINGS
@given(data=st.data(), frac=st.floats(-0.2, 1.0), kw=WORKSPACE)
def test_memory_budget_is_brute_force_optimum(model, shared, data, frac, kw):
    costs, placement, in_flight = data.draw(problems(shared))
    every = _all_cuts(costs, placement, in_flight,
                      Cut(memory_model=model, workspace_residual_sets=kw))
    lo, hi = min(x[1] for x in every), max(x[1] for x in every)
    budget = max(1, int(lo + frac * (hi - lo)))
    cut = Cut(memory_budget=budget, memory_model=model, workspace_residual_sets=kw)
    if budget < lo:
        with pytest.raises(CutError, match=rf"smallest feasible budget is .*\({math.ceil(lo)} "):
            partition(costs, placement, in_flight, cut)
        return
    res = partition(costs, placement, in_flight, cut)
    t, m = _check_result_consistent(res, costs, placement, in_flight, cut)
    assert m <= budget
    assert t == min(x[0] for x in every if x[1] <= budget)


def _uniform(n, flops=1.0, residual=100, params=10, out=1):
    return [
        SegmentCost(flops=flops, param_bytes=params, residual_bytes=residual, out_bytes=out)
        for _ in range(n)
    ]


@MODELS
def test_memory_objective_gives_later_1f1b_stages_more_layers(model):
    p, m, n = 4, 8, 40
    in_flight = [min(m, p - i) for i in range(p)]  # 1F1B: 4, 3, 2, 1
    costs = _uniform(n)
    by_time = partition(costs, range(p), in_flight, Cut(memory_model=model))
    by_mem = partition(costs, range(p), in_flight,
                       Cut(objective="memory", time_slack=0.2, memory_model=model))
    layers_time = [b - a for a, b in by_time.stage_segments]
    layers_mem = [b - a for a, b in by_mem.stage_segments]
    assert layers_time == [10, 10, 10, 10]
    assert layers_mem == sorted(layers_mem) and layers_mem[0] < layers_mem[-1]
    assert by_mem.peak_memory < by_time.peak_memory
    assert by_mem.max_device_memory < by_time.max_device_memory
    assert by_mem.max_stage_time <= 1.2 * by_time.max_stage_time
    # Residuals dominate, so stage 0 (4 in flight) is the bottleneck of the time cut.
    mems = [d.total for d in by_time.device_memory]
    assert mems == sorted(mems, reverse=True)


@MODELS
def test_infeasible_budget_names_smallest_feasible_budget_and_that_budget_works(model):
    p, m = 4, 8
    in_flight = [min(m, p - i) for i in range(p)]
    costs = _uniform(24, residual=1000, params=300, out=8)
    smallest = partition(costs, range(p), in_flight,
                         Cut(objective="memory", time_slack=math.inf, memory_model=model))
    need = math.ceil(smallest.peak_memory)
    with pytest.raises(CutError) as err:
        partition(costs, range(p), in_flight, Cut(memory_budget=need - 1, memory_model=model))
    msg = str(err.value)
    assert "infeasible" in msg and "smallest feasible budget is" in msg
    assert f"({need} bytes)" in msg
    ok = partition(costs, range(p), in_flight, Cut(memory_budget=need, memory_model=model))
    assert ok.peak_memory <= need
    # A looser budget is never slower.
    loose = partition(costs, range(p), in_flight,
                      Cut(memory_budget=2 * need, memory_model=model))
    assert loose.max_stage_time <= ok.max_stage_time


def test_shared_parameters_count_once_per_stage():
    tied = {0: 1000}
    costs = [
        SegmentCost(flops=1, param_bytes=1000 + 5, param_leaf_bytes=tied),  # embedding
        SegmentCost(flops=1, param_bytes=5),
        SegmentCost(flops=1, param_bytes=1000 + 5, param_leaf_bytes=tied),  # tied head
    ]
    one = partition(costs, [0], [1], Cut(optimizer_bytes_per_param_byte=0))
    assert one.stage_memory[0].params == 1015
    assert one.stage_memory[0].grads == 1015
    assert one.stage_memory[0].optimizer == 0
    two = partition(costs, [0, 1], [1, 1], Cut(indices=[0]))
    assert [s.params for s in two.stage_memory] == [1005, 1010]
    # Interleaved on one device: both stages' copies live there.
    v = partition(costs, [0, 0], [1, 1], Cut(indices=[1]))
    assert v.device_memory[0].params == 1010 + 1005
    s0, s1 = v.stage_memory
    assert v.device_memory[0].residuals == s0.residuals + s1.residuals
    assert v.device_memory[0].workspace == max(s0.workspace, s1.workspace)


def test_spmd_padding_by_parameter_class():
    """Embedding and head are one slot each on every device; blocks pad to the most."""
    emb, head, blk = 1000, 700, 100
    shape = {"emb": ((250,), "float32"), "blk": ((25,), "float32"), "head": ((175,), "float32")}
    costs = [SegmentCost(flops=1, param_leaf_bytes={0: emb, 1: blk},
                         param_leaf_shapes={0: shape["emb"], 1: shape["blk"]})]
    costs += [SegmentCost(flops=1, param_leaf_bytes={i: blk}, param_leaf_shapes={i: shape["blk"]})
              for i in range(2, 6)]
    costs += [SegmentCost(flops=1, param_leaf_bytes={6: blk, 7: head},
                          param_leaf_shapes={6: shape["blk"], 7: shape["head"]})]
    cut = Cut(indices=[1, 3], optimizer_bytes_per_param_byte=0, grad_bytes_per_param_byte=0,
              workspace_residual_sets=0)
    res = partition(costs, [0, 1, 2], [1, 1, 1], cut)
    assert [b - a for a, b in res.stage_segments] == [2, 2, 2]
    assert res.padded_memory.params == emb + head + 2 * blk
    # the largest stage alone would say emb + 2 blk; per-class slots add the head
    assert max(s.params for s in res.stage_memory) == emb + 2 * blk
    # memory objective: emb and head are constant, so it balances the blocks
    best = partition(costs, [0, 1, 2], [1, 1, 1],
                     Cut(objective="memory", time_slack=1.0, workspace_residual_sets=0))
    assert best.exact
    assert best.padded_memory.params == emb + head + 2 * blk


def test_memory_breakdown_formula():
    costs = [
        SegmentCost(flops=2, param_bytes=100, residual_bytes=10, out_bytes=3),
        SegmentCost(flops=4, param_bytes=50, residual_bytes=20, out_bytes=0),
    ]
    res = partition(costs, [0, 1], [2, 1], Cut(indices=[0], optimizer_bytes_per_param_byte=2,
                                                workspace_residual_sets=3,
                                                workspace_param_sets=0.5))
    s0, s1 = res.stage_memory
    # workspace: 3 residual sets + half the stage's parameter bytes
    assert (s0.params, s0.grads, s0.optimizer, s0.residuals, s0.transfers, s0.workspace) == (
        100, 100, 200, 20, 6, 30 + 50)
    assert (s1.params, s1.grads, s1.optimizer, s1.residuals, s1.transfers, s1.workspace) == (
        50, 50, 100, 20, 6, 60 + 25)
    # SPMD padding: the largest stage's params, busiest device's activations, the largest
    # workspace
    pad = res.padded_memory
    assert (pad.params, pad.residuals, pad.transfers, pad.workspace) == (100, 20, 6, 85)
    assert res.peak_memory == pad.total == 4 * 100 + 26 + 85
    assert res.stage_fwd == (2, 4) and res.stage_bwd == (4, 8)
    assert res.objective == "explicit"


@pytest.mark.parametrize("placement", [[0, 1, 2, 0, 1, 2], [0, 1, 2, 2, 1, 0]],
                         ids=["loop", "V"])
@MODELS
def test_local_search_fallback_matches_enumeration_on_uniform_layers(
        model, placement, monkeypatch):
    import jaxpipe.cut.virtual_stages as cut_mod

    costs = _uniform(14)
    in_flight = [max(1, 12 - s) for s in range(6)]
    for slack in (0.1, 0.5):
        cut = Cut(objective="memory", time_slack=slack, memory_model=model)
        exact = partition(costs, placement, in_flight, cut)
        monkeypatch.setattr(cut_mod, "_ENUM_LIMIT", 0)
        heur = partition(costs, placement, in_flight, cut)
        monkeypatch.undo()
        assert exact.exact and not heur.exact
        if model == "device":
            assert heur.peak_memory == exact.peak_memory
        else:  # three separate maxima: the local search may stop a little short
            assert exact.peak_memory <= heur.peak_memory <= 1.05 * exact.peak_memory
        assert heur.max_stage_time <= (1 + cut.time_slack) * exact.time_optimum


@MODELS
@settings(max_examples=25, deadline=None)
@given(data=st.data(), slack=st.sampled_from([0.0, 0.2]))
def test_local_search_fallback_respects_the_time_cap_and_beats_compute_balance(
        model, data, slack):
    import jaxpipe.cut.virtual_stages as cut_mod

    costs, placement, in_flight = data.draw(problems(shared_devices=True))
    old = cut_mod._ENUM_LIMIT
    cut_mod._ENUM_LIMIT = 0
    try:
        res = partition(costs, placement, in_flight,
                        Cut(objective="memory", time_slack=slack, memory_model=model))
        by_time = partition(costs, placement, in_flight, Cut(memory_model=model))
    finally:
        cut_mod._ENUM_LIMIT = old
    assert res.max_stage_time <= (1 + slack) * res.time_optimum
    assert by_time.max_stage_time == res.time_optimum  # time stays exact
    assert res.peak_memory <= by_time.peak_memory


def test_more_stages_than_segments_is_an_error_naming_the_markers_needed():
    with pytest.raises(CutError, match=r"8 stages .* only 5 .*4 markers.* at least 7 markers"):
        partition(_uniform(5), range(8), [1] * 8)


def test_bad_explicit_cuts():
    with pytest.raises(CutError, match="exactly 3"):
        partition(_uniform(10), range(4), [1] * 4, Cut(indices=[1, 2]))
    with pytest.raises(CutError, match=r"\[0, 8\]"):
        partition(_uniform(10), range(2), [1] * 2, Cut(indices=[9]))
    with pytest.raises(CutError, match="increasing"):
        Cut(indices=[3, 1])
    with pytest.raises(CutError, match="objective"):
        Cut(objective="speed")  # type: ignore[arg-type]
    with pytest.raises(CutError, match="budget"):
        partition(_uniform(4), range(2), [2, 1], Cut(indices=[1], memory_budget=10))


def test_profiled_times_replace_flops():
    costs = [SegmentCost(flops=1e9, fwd_time=1.0, bwd_time=5.0),
             SegmentCost(flops=1.0, fwd_time=3.0, bwd_time=3.0),
             SegmentCost(flops=1.0, fwd_time=1.0, bwd_time=1.0)]
    res = partition(costs, [0, 1], [1, 1])
    assert res.time_unit == "s" and res.stage_segments == ((0, 1), (1, 3))


@MODELS
@pytest.mark.parametrize("objective", ["time", "memory", "budget"])
@pytest.mark.parametrize("v", [1, 2])
def test_200_segments_16_stages(model, objective, v):
    """A cluster-sized problem is solved and its answer obeys the objective (how long it
    takes is a benchmark, not a test)."""
    rng = np.random.default_rng(0)
    n, S = 200, 16
    D = S // v
    costs = [
        SegmentCost(
            flops=float(rng.integers(1, 100)) * 1e9,
            param_bytes=int(rng.integers(1, 50)) << 20,
            residual_bytes=int(rng.integers(1, 50)) << 20,
            out_bytes=int(rng.integers(1, 4)) << 20,
        )
        for _ in range(n)
    ]
    placement = [s % D for s in range(S)]
    in_flight = [max(1, 2 * S - s) for s in range(S)]
    base = partition(costs, placement, in_flight, Cut(objective="memory", memory_model=model))
    cut = {
        "time": Cut(memory_model=model),
        "memory": Cut(objective="memory", memory_model=model),
        "budget": Cut(memory_budget=int(base.peak_memory * 1.3), memory_model=model),
    }[objective]
    res = partition(costs, placement, in_flight, cut)
    assert len(res.stage_segments) == S
    assert res.stage_segments[0][0] == 0 and res.stage_segments[-1][1] == n
    assert all(a < b for a, b in res.stage_segments)
    if objective == "time":
        assert res.max_stage_time == pytest.approx(res.time_optimum)
    elif objective == "memory":
        assert res.max_stage_time <= (1 + cut.time_slack) * res.time_optimum * (1 + 1e-9)
        assert res.peak_memory <= base.peak_memory * (1 + 1e-9)
    else:
        assert res.peak_memory <= cut.memory_budget


class _FakeTimeline:
    def __init__(self, schedule, costs):
        self.stage_peak_in_flight = {
            s: min(schedule.num_microbatches, schedule.num_stages - s)
            for s in range(schedule.num_stages)
        }
        self.peak_in_flight = list(self.stage_peak_in_flight.values())  # a stage a device
        per_stage = [costs(_A("F", s)) + costs(_A("B", s)) for s in range(schedule.num_stages)]
        self.makespan = sum(per_stage) + (schedule.num_microbatches - 1) * max(per_stage)
        self.bubble_fraction = 0.0


class _A:
    def __init__(self, kind, stage):
        self.kind, self.stage, self.microbatch = kind, stage, 0


class _Fake1F1B:
    """Duck-typed stand-in so this test does not depend on jaxpipe.schedule."""

    def __init__(self, p, m):
        self.num_devices = self.num_stages = p
        self.num_microbatches = m
        self.calls = []

    def placement(self, stage):
        return stage

    def simulate(self, costs=None):
        self.calls.append(costs)
        if costs is None:
            def costs(a):
                return {"F": 1.0, "B": 2.0}[a.kind]
        return _FakeTimeline(self, costs)


def test_choose_cuts_takes_in_flight_from_the_simulator():
    sched = _Fake1F1B(p=4, m=8)
    res = choose_cuts(_uniform(40), sched, Cut(objective="memory", time_slack=0.2))
    assert res.in_flight == (4, 3, 2, 1)
    layers = [b - a for a, b in res.stage_segments]
    assert layers[0] < layers[-1]
    # predicted step time comes from simulating with the chosen stage costs
    assert res.makespan == pytest.approx(sum(res.stage_time) + 7 * max(res.stage_time))
    assert callable(sched.calls[-1])


def test_choose_cuts_with_the_real_1f1b_schedule():
    from jaxpipe.schedule import OneFOneB

    sched = OneFOneB(4, 8)
    res = choose_cuts(_uniform(40), sched, Cut(objective="memory", time_slack=0.2))
    assert res.in_flight == (4, 3, 2, 1)
    layers = [b - a for a, b in res.stage_segments]
    assert layers == sorted(layers) and layers[0] < layers[-1]
    assert res.makespan is not None and res.makespan > 0
    assert 0 <= res.bubble_fraction < 1


def test_budget_search_message_uses_ceil_bytes():
    # The smallest budget is printed both human-readable and in exact bytes.
    costs = _uniform(4, residual=1 << 20, params=1 << 20)
    with pytest.raises(CutError) as err:
        partition(costs, range(2), [2, 1], Cut(memory_budget=1))
    assert re.search(r"\d+\.\d\d MiB \(\d+ bytes\)", str(err.value))


def test_pipeline_with_memory_cut_matches_jax_gradients():
    import jax
    import jax.numpy as jnp

    import jaxpipe as jp

    def loss(p, b):
        h = b["x"]
        for w in p["ws"]:
            h = jp.boundary(jnp.tanh(h @ w))
        return jnp.mean((h - b["y"]) ** 2)

    rng = np.random.default_rng(0)
    params = {"ws": [jnp.asarray(rng.normal(size=(16, 16)) * 0.3, jnp.float32)
                     for _ in range(12)]}
    batch = {"x": jnp.asarray(rng.normal(size=(32, 16)), jnp.float32),
             "y": jnp.ones((32, 16), jnp.float32)}
    mesh = jax.make_mesh((4,), ("pipe",))
    pipe = jp.pipeline(loss, params, batch, mesh=mesh, schedule=jp.OneFOneB(4, 8),
                       cut=jp.Cut(objective="memory", time_slack=0.5))
    report = pipe.inspect.cut_report
    assert list(report.cuts) == list(pipe.inspect.cuts)
    layers = [b - a for a, b in report.stage_segments]
    assert layers[0] <= layers[-1] and sum(layers) == 13
    got_loss, got = pipe.value_and_grad(params, batch)
    want_loss, want = jax.value_and_grad(loss)(params, batch)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)


def test_memory_model_comes_from_the_caller_unless_the_cut_names_one():
    from jaxpipe.cut import DEVICE_MEMORY, SPMD_MEMORY, MemoryModel

    p, m = 4, 8
    in_flight = [min(m, p - i) for i in range(p)]
    costs = _uniform(24, residual=1000, params=300, out=8)
    memory = Cut(objective="memory", time_slack=0.3)
    by_runtime = partition(costs, range(p), in_flight, memory, memory_model=DEVICE_MEMORY)
    named = partition(costs, range(p), in_flight,
                      Cut(objective="memory", time_slack=0.3, memory_model="device"))
    assert by_runtime.memory_model == named.memory_model == "device"
    assert by_runtime.stage_segments == named.stage_segments
    assert by_runtime.peak_memory == by_runtime.max_device_memory
    # The cut's explicit model wins over the runtime's.
    spmd = partition(costs, range(p), in_flight,
                     Cut(objective="memory", time_slack=0.3, memory_model="spmd"),
                     memory_model=DEVICE_MEMORY)
    assert spmd.memory_model == "spmd" and spmd.peak_memory == spmd.padded_memory.total
    assert partition(costs, range(p), in_flight, memory).memory_model == SPMD_MEMORY.name
    # A runtime's own model: its name, its padding, its workspace.
    mpmd = MemoryModel("mpmd", padded=False, param_class=None, workspace_residual_sets=2.5)
    res = partition(costs, range(p), in_flight, Cut(indices=[5, 11, 17]), memory_model=mpmd)
    assert res.memory_model == "mpmd" and res.peak_memory == res.max_device_memory
    assert res.stage_memory[0].workspace == 2.5 * 6 * 1000
    res = partition(costs, range(p), in_flight, Cut(indices=[5, 11, 17], memory_model=mpmd,
                                                    workspace_residual_sets=0))
    assert res.memory_model == "mpmd" and res.stage_memory[0].workspace == 0


def test_parameter_classes_come_from_the_memory_model():
    """Without per-class padding (param_class=None) parameters pad as one group."""
    from jaxpipe.cut import MemoryModel

    emb, blk = 1000, 100
    costs = [SegmentCost(flops=1, param_leaf_bytes={0: emb},
                         param_leaf_shapes={0: ((250,), "float32")})]
    costs += [SegmentCost(flops=1, param_leaf_bytes={i: blk},
                          param_leaf_shapes={i: ((25,), "float32")}) for i in range(1, 4)]
    cut = Cut(indices=[1], optimizer_bytes_per_param_byte=0, grad_bytes_per_param_byte=0,
              workspace_residual_sets=0)
    per_class = partition(costs, [0, 1], [1, 1], cut)  # SPMD: emb slot + 2 block slots
    assert per_class.padded_memory.params == emb + 2 * blk
    one_group = MemoryModel("padded-flat", padded=True, param_class=None)
    flat = partition(costs, [0, 1], [1, 1], cut, memory_model=one_group)
    assert flat.padded_memory.params == emb + blk  # the bigger device's bytes
    by_dtype = MemoryModel("by-dtype", padded=True, param_class=lambda shape, dtype: dtype)
    merged = partition(costs, [0, 1], [1, 1], cut, memory_model=by_dtype)
    assert merged.padded_memory.params == emb + blk


def test_bad_memory_models():
    from jaxpipe.cut import MemoryModel

    with pytest.raises(CutError, match="memory_model"):
        Cut(memory_model="mpmd")
    with pytest.raises(CutError, match="workspace_residual_sets"):
        Cut(workspace_residual_sets=-1.0)
    with pytest.raises(CutError, match="MemoryModel"):
        partition(_uniform(4), range(2), [1, 1], memory_model="spmd")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="workspace_residual_sets"):
        MemoryModel("x", False, None, -1.0)


@given(n=st.integers(1, 200), S=st.integers(1, 16))
def test_markers_cut_groups_evenly_with_the_larger_stages_outside(n, S):
    """cut="markers": sizes differ by at most one and the extra segments go to the outer
    stages, so with up to two extra (an embedding before the blocks, a head after them)
    every middle stage holds as many segments as the others and they share one body."""
    from jaxpipe.cut.resolve import even_cuts

    if S > n:
        return
    cuts = even_cuts(n, S)
    sizes = np.diff([-1, *cuts, n - 1])
    assert len(cuts) == S - 1 and sizes.sum() == n and sizes.min() >= 1
    assert sizes.max() - sizes.min() <= (1 if n % S else 0)
    big = [s for s in range(S) if sizes[s] > n // S]
    assert len(big) == n % S
    # outermost first: the larger stages are the r stages closest to either end
    dist = sorted(min(s, S - 1 - s) for s in range(S))
    assert sorted(min(s, S - 1 - s) for s in big) == dist[: n % S]
    if n % S <= 2 and S > 2:
        assert len(set(sizes[1:-1].tolist())) == 1


def test_an_explicit_cuts_own_peak_is_a_budget_it_fits_under_the_tpu_model():
    """The TPU memory model's workspace grows with what a stage stores
    (``workspace_stored_sets``): an explicit cut with the policies given was measured with
    the view's policies' workspace instead, so its reported peak, given back as its
    budget, was refused as needing more."""
    costs = [SegmentCost(flops=10.0, param_bytes=10, residual_bytes=1000, out_bytes=10,
                         name=f"s{k}", remat={Remat.BOUNDARY: RematCost(100, 10.0)})
             for k in range(4)]
    policies = (Remat.NONE, Remat.BOUNDARY)
    given = partition(costs, [0, 1], [2, 1], Cut(indices=[0], remat=policies,
                                                  memory_model=TPU_MEMORY))
    again = partition(costs, [0, 1], [2, 1], Cut(indices=[0], remat=policies,
                                                  memory_model=TPU_MEMORY,
                                                  memory_budget=given.peak_memory))
    assert again.peak_memory == given.peak_memory
    assert list(again.remat) == list(policies)
