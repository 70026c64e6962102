"""schedule="auto": the schedule family and chunks chosen with the cut, for the budget.

The choice must be exact (it is a built-in schedule), explained (``pipe.plan`` lists every
candidate with its predicted time and memory and why it lost), consistent (the chosen one
is the best that fits by the objective) and deterministic; bad options name the fix.
"""

from __future__ import annotations

import re

import jax
import pytest
from models import MODELS, assert_matches

import jaxpipe as jp


def _model():
    return MODELS["tiny_lm"](8, batch=16, block_scale=0.3)


def _pipe(schedule, cut="auto"):
    loss_fn, params, batch = _model()
    pipe = jp.pipeline(loss_fn, params, batch, mesh=jax.make_mesh((2,), ("pipe",)),
                       schedule=schedule, cut=cut)
    return pipe, loss_fn, params, batch


def test_auto_is_exact_and_its_plan_explains_the_choice():
    """The chosen schedule runs exact; the plan's table has one chosen row, the fastest
    of those that fit, and a reason on every other row; m is the largest divisor of the
    batch up to 4p; the same inputs choose the same again."""
    pipe, loss_fn, params, batch = _pipe("auto")
    assert_matches(pipe.value_and_grad(params, batch), jax.value_and_grad(loss_fn)(params, batch))
    choice = pipe.inspect.auto_choice
    assert pipe.schedule is choice.schedule and pipe.schedule.num_microbatches == 8
    chosen = [c for c in choice.candidates if c.verdict == "chosen"]
    assert len(chosen) == 1
    fitting = [c for c in choice.candidates if c.time is not None
               and not c.verdict.startswith(("does not", "cannot", "needs"))]
    assert chosen[0].time == min(c.time for c in fitting)
    by_family = {c.family: c for c in choice.candidates}  # same work and ticks; GPipe
    assert by_family["gpipe"].time > by_family["1f1b"].time  # stores more, priced per tick
    assert all(c.verdict for c in choice.candidates)
    assert {c.family for c in choice.candidates} == {"1f1b", "gpipe", "interleaved"}
    text = str(pipe.plan)
    assert "schedule chosen by Auto" in text and "chosen" in text
    again = _pipe(jp.Auto())[0].inspect.auto_choice
    assert [(c.family, c.chunks, c.verdict) for c in again.candidates] == [
        (c.family, c.chunks, c.verdict) for c in choice.candidates]


def test_auto_under_a_budget_and_by_memory():
    """Under a budget every candidate kept fits it; objective='memory' takes the smallest
    predicted peak (GPipe, which holds every microbatch, never)."""
    first = _pipe(jp.Auto(objective="memory"))[0].inspect.auto_choice
    kept = [c for c in first.candidates if c.memory is not None
            and not c.verdict.startswith("does not")]
    best = min(kept, key=lambda c: c.memory)
    assert [c for c in first.candidates if c.verdict == "chosen"] == [best]
    assert best.family != "gpipe"
    budget = best.memory * 1.05
    pipe = _pipe(jp.Auto(), cut=jp.Cut(memory_budget=budget))[0]
    for c in pipe.inspect.auto_choice.candidates:
        if c.verdict == "chosen" or c.verdict in ("slower", "more memory"):
            assert c.memory <= budget, c


@pytest.mark.parametrize(("auto", "match"), [
    (lambda: jp.Auto(families=("zb",)), r"'zb'.*not one of"),
    (lambda: jp.Auto(families=()), "empty"),
    (lambda: jp.Auto(objective="speed"), "objective"),
    (lambda: jp.Auto(microbatches=0), "positive int"),
    (lambda: jp.Auto(microbatches="some"), "positive int, 'auto' or None"),
    (lambda: jp.Auto(microbatches=5), r"does not divide the batch's 16 rows"),
    (lambda: jp.Auto(num_devices=4), r"num_devices=4.*has 2 devices"),
    (lambda: jp.Auto(families=(int,)), "Schedule subclasses"),
    (lambda: jp.Auto(families=("gpipe", "gpipe")), "names a family twice"),
    (lambda: jp.Auto(families=("gpipe", jp.GPipe)), r"names a family twice \(by name or"),
    (lambda: jp.Auto(num_devices=0), r"num_devices=\.\.\.\) must be a positive int"),
])
def test_bad_auto_options_name_the_fix(auto, match):
    with pytest.raises(jp.PipelineError, match=match):
        _pipe(auto())


def test_an_infeasible_budget_names_each_candidates_smallest_budget():
    """Every candidate's reason keeps its figure, the smallest budget it would fit, and
    the error names the least of them (buried in the list, it was the figure to read)."""
    with pytest.raises(jp.PipelineError) as err:
        _pipe(jp.Auto(), cut=jp.Cut(memory_budget=1000))
    text = str(err.value)
    each = [int(b) for b in re.findall(r"v=\d: does not fit: the smallest budget it fits is "
                                       r"[\d.]+ [KMG]?i?B \((\d+) bytes\)", text)]
    assert len(each) == 4, text  # 1f1b, gpipe, interleaved v=2 and v=4 (8 segments, p=2)
    assert "The smallest budget a candidate fits: " in text
    assert re.search(rf"fits: [\d.]+ [KMG]?i?B \({min(each)} bytes\), \w+ v=\d\.", text)


def test_the_advice_follows_the_reasons():
    """No candidate fits the budget: the advice is a budget that fits or more, smaller
    microbatches (a 1F1B peak falls as m grows); a model with too few cut markers for
    every candidate gets markers as the advice (the reason came through the cutter's
    error, and the advice was a budget); a class of the user's that cannot be built for
    m (DualPipeV needs m >= 2p) is named without a chunk count it never had, and the
    advice is an m it accepts."""
    with pytest.raises(jp.PipelineError, match=r"Give a memory budget that fits .* or more, "
                                               r"smaller microbatches"):
        _pipe(jp.Auto(), cut=jp.Cut(memory_budget=1000))
    loss_fn, params, batch = MODELS["mlp"](2, batch=8)
    with pytest.raises(jp.PipelineError, match=r"1f1b v=1: needs 4 stages; the model has 3 "
                                               r"cuttable segments.* Give more cut markers"):
        jp.pipeline(loss_fn, params, batch, mesh=jax.make_mesh((4,), ("pipe",)),
                    schedule="auto")
    dualpipe = jp.load_schedule("schedules/dualpipe_v.py:DualPipeV")
    with pytest.raises(jp.PipelineError, match=r"candidate that can run: DualPipeV: cannot be "
                                               r"built: .*m >= 4\. Give a microbatch count the "
                                               r"families accept \(each reason above says "
                                               r"which\); or pass a schedule\.$"):
        _pipe(jp.Auto(microbatches=2, families=(dualpipe,)))


def test_a_family_of_your_own_is_a_candidate():
    """A Schedule subclass constructible as cls(p, m) (the gallery's Eager1F1B) competes
    with the built-ins and is named by its class."""
    eager = jp.load_schedule("schedules/eager_1f1b.py:Eager1F1B")
    pipe, loss_fn, params, batch = _pipe(jp.Auto(families=("gpipe", eager), microbatches=4))
    names = [(c.family, c.microbatches) for c in pipe.inspect.auto_choice.candidates]
    assert names == [("gpipe", 4), ("Eager1F1B", 4)]
    assert_matches(pipe.value_and_grad(params, batch), jax.value_and_grad(loss_fn)(params, batch))


def test_calibration_fits_the_rate_and_tick_cost_and_auto_reads_it(tmp_path, monkeypatch,
                                                                    capsys):
    """``jaxpipe calibrate`` times small pipelines, fits time = work / rate + ticks * cost
    and the cost a stored byte a tick (1F1B against GPipe of one model) and keeps them;
    the costs schedule='auto' adds are then the measured ones. The fit recovers known
    constants exactly and refuses measurements that give none."""
    from jaxpipe.runtime.spmd import calibrate as cal
    from jaxpipe.runtime.spmd.backends import TICK_OVERHEAD_FLOPS
    from jaxpipe.tools.cli import main

    exact = cal.fit("k", [(1e-3 * 10 + 5e6 / 1e9, 5e6, 10), (1e-3 * 20 + 8e9 / 1e9, 8e9, 20)],
                    stored=((1.0, 1e9), (1.5, 3e9)))
    assert abs(exact.flops_per_s - 1e9) < 1 and abs(exact.tick_overhead_s - 1e-3) < 1e-12
    assert exact.stored_byte_tick_s == 0.5 / 2e9
    assert abs(exact.stored_byte_tick_flops - 0.25) < 1e-12
    noisy = cal.fit("k", exact.samples, stored=((1.5, 1e9), (1.0, 3e9)))  # storing more
    assert noisy.stored_byte_tick_s == 0.0  # measured faster: noise, not a negative cost
    with pytest.raises(jp.PipelineError, match="no positive rate"):
        cal.fit("k", [(1.0, 1e9, 10), (0.5, 2e9, 10)])

    path = tmp_path / "calibration.json"
    monkeypatch.setenv("JAXPIPE_CALIBRATION", str(path))
    assert cal.tick_overhead_flops("cpu", False) == TICK_OVERHEAD_FLOPS["cpu"]
    assert main(["calibrate", "--devices", "2", "--repeats", "2"]) == 0
    assert "FLOP/s" in capsys.readouterr().out
    (kept,) = cal.load().values()
    assert kept.key.startswith("cpu:") and kept.key.endswith(":turns")
    assert kept.flops_per_s > 0 and kept.tick_overhead_s > 0 and len(kept.samples) == 2
    assert cal.tick_overhead_flops("cpu", False) == kept.tick_overhead_flops
    (fewer, more) = kept.stored_samples  # 1F1B and GPipe of one model: GPipe stores more
    assert more[1] > fewer[1] and kept.stored_byte_tick_s >= 0
    assert cal.stored_byte_flops("cpu", False) == kept.stored_byte_tick_flops
    assert main(["calibrate", "--devices", "0"]) == 2


def test_a_budget_only_recomputation_meets_gets_it_and_one_none_meets_is_refused():
    """Just under the smallest peak without recomputation, the chosen candidate fits by
    recomputing; under what any candidate can reach, the error lists every candidate
    and why."""
    free = _pipe("auto")[0].inspect.auto_choice
    low = min(c.memory for c in free.candidates if c.memory is not None)
    pipe = _pipe("auto", cut=jp.Cut(memory_budget=low * 0.9))[0]
    chosen = next(c for c in pipe.inspect.auto_choice.candidates if c.verdict == "chosen")
    assert chosen.memory <= low * 0.9
    assert any(st.remat.value != "none" for st in pipe.inspect.stages)
    with pytest.raises(jp.PipelineError, match=r"no candidate that can run: 1f1b v=1: does "
                                                r"not fit.*gpipe v=1"):
        _pipe("auto", cut=jp.Cut(memory_budget=low * 0.5))


def test_auto_costs_the_model_once_for_every_candidate(monkeypatch):
    """The segments' costs do not depend on the schedule: under a budget (which costs the
    recomputation policies too) every candidate reuses one costing per policy set."""
    import jaxpipe.cut.resolve as resolve

    free = _pipe("auto")[0].inspect.auto_choice
    low = min(c.memory for c in free.candidates if c.memory is not None)
    calls = []
    original = resolve.segment_costs
    monkeypatch.setattr(resolve, "segment_costs",
                        lambda *a, **k: calls.append(k.get("remat")) or original(*a, **k))
    choice = _pipe("auto", cut=jp.Cut(memory_budget=low * 0.9))[0].inspect.auto_choice
    assert sum(c.schedule is not None for c in choice.candidates) >= 3
    assert len(calls) == len({tuple(r) for r in calls}) <= 2, calls


def test_auto_ranks_the_users_schedule_classes_and_runs_the_choice_exact():
    """Schedule classes of one's own (the gallery's zero-bubble and V schedules, split
    backwards and V placements) are candidates like the built-ins: cut, priced, listed with
    their stages per device, and the chosen one runs exact."""
    zb = jp.load_schedule("schedules/zero_bubble.py:ZeroBubbleH1")
    dv = jp.load_schedule("schedules/dualpipe_v.py:DualPipeV")
    pipe, loss_fn, params, batch = _pipe(jp.Auto(families=(zb, dv)))
    rows = {c.family: c for c in pipe.inspect.auto_choice.candidates}
    assert set(rows) == {"ZeroBubbleH1", "DualPipeV"}
    assert (rows["ZeroBubbleH1"].chunks, rows["DualPipeV"].chunks) == (1, 2)
    assert all(c.time is not None for c in rows.values())
    assert type(pipe.schedule) in (zb, dv)
    assert_matches(pipe.value_and_grad(params, batch), jax.value_and_grad(loss_fn)(params, batch))


def test_auto_microbatches_tries_every_divisor_from_p_to_4p_and_takes_the_best():
    """microbatches="auto": the pipeline is traced and cut for every divisor of the batch
    from p to 4p; the table lists every m's candidates, the chosen one is the best over
    all of them, the others' best rows say which m won, and the choice runs exact."""
    pipe, loss_fn, params, batch = _pipe(jp.Auto(microbatches="auto"))
    rows = pipe.inspect.auto_choice.candidates
    assert sorted({c.microbatches for c in rows}) == [2, 4, 8]  # 16 rows, p=2
    (chosen,) = [c for c in rows if c.verdict == "chosen"]
    assert chosen.time == min(c.time for c in rows if c.time is not None)
    assert pipe.num_microbatches == chosen.microbatches == pipe.schedule.num_microbatches
    assert sum(c.verdict == f"slower than m={chosen.microbatches}" for c in rows) == 2
    assert_matches(pipe.value_and_grad(params, batch), jax.value_and_grad(loss_fn)(params, batch))


def test_auto_picks_microbatches_the_data_axes_can_split():
    """On a data x pipe mesh the chosen m leaves microbatches that split over the data
    shards: 16 rows over 4 shards and p=2 give m=4 (the largest divisor up to 4p, 8, left
    2-row microbatches and raised that they do not split over the 4 data devices)."""
    loss_fn, params, batch = _model()
    mesh = jax.make_mesh((4, 2), ("data", "pipe"))
    pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule="auto")
    assert pipe.num_microbatches == 4
    assert_matches(pipe.value_and_grad(params, batch), jax.value_and_grad(loss_fn)(params, batch))


def test_a_budget_only_a_v_schedule_meets_gets_it_chosen():
    """On 4 devices 1F1B's first device holds 4 microbatches' activations; a V placement
    (the gallery's DualPipeV) holds fewer. Under a budget between the two, without
    recomputation, only the V schedule fits: it is chosen, 1F1B is rejected with the
    reason, and the choice runs exact."""
    import jax.numpy as jnp

    def loss_fn(ws, batch):
        h = batch["x"]
        for w in ws:
            h = jp.boundary(jnp.tanh(h @ w))
        return jnp.mean((h - batch["y"]) ** 2)

    params = [jax.random.normal(jax.random.key(i), (64, 64)) / 8 for i in range(16)]
    batch = {"x": jnp.ones((64, 64)), "y": jnp.zeros((64, 64))}
    dv = jp.load_schedule("schedules/dualpipe_v.py:DualPipeV")
    mesh = jax.make_mesh((4,), ("pipe",))

    def build(cut):
        return jp.pipeline(loss_fn, params, batch, mesh=mesh, cut=cut,
                           schedule=jp.Auto(families=("1f1b", dv)))

    free = {c.family: c.memory for c in build(jp.Cut(remat="none")).inspect.auto_choice
            .candidates}
    assert free["DualPipeV"] < free["1f1b"]
    pipe = build(jp.Cut(remat="none", memory_budget=(free["DualPipeV"] + free["1f1b"]) / 2))
    rows = {c.family: c for c in pipe.inspect.auto_choice.candidates}
    assert rows["DualPipeV"].verdict == "chosen" and type(pipe.schedule) is dv
    assert rows["1f1b"].verdict.startswith("does not fit"), rows["1f1b"].verdict
    assert_matches(pipe.value_and_grad(params, batch), jax.value_and_grad(loss_fn)(params, batch))


def test_auto_takes_what_a_schedule_takes_and_checks_the_cut_once():
    """numpy integers are integers (jp.OneFOneB(4, np.int64(8)) is one); a bad cut= is
    the error an explicit schedule gets, not each candidate's verdict followed by memory
    advice; the class where an instance belongs is named."""
    import numpy as np

    assert jp.Auto(microbatches=np.int64(8)).microbatches == 8
    with pytest.raises(TypeError, match=r"^cut must be 'auto', 'markers' or a "
                                                   r"jaxpipe.Cut, got 'bogus'\.$"):
        _pipe("auto", cut="bogus")
    with pytest.raises(TypeError, match=r"got the class Auto, not an instance of it"):
        _pipe(jp.Auto)
