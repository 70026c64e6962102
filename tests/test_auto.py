"""schedule="auto": the schedule family and chunks chosen with the cut, for the budget.

The choice must be exact (it is a built-in schedule), explained (``pipe.plan`` lists every
candidate with its predicted time and memory and why it lost), consistent (the chosen one
is the best that fits by the objective) and deterministic; bad options name the fix.
"""

from __future__ import annotations

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
    choice = pipe.auto_choice
    assert pipe.schedule is choice.schedule and pipe.schedule.num_microbatches == 8
    chosen = [c for c in choice.candidates if c.verdict == "chosen"]
    assert len(chosen) == 1
    fitting = [c for c in choice.candidates if c.time is not None
               and not c.verdict.startswith(("does not", "cannot", "needs"))]
    assert chosen[0].time == min(c.time for c in fitting)
    assert all(c.verdict for c in choice.candidates)
    assert {c.family for c in choice.candidates} == {"1f1b", "gpipe", "interleaved"}
    text = str(pipe.plan)
    assert "schedule chosen by Auto" in text and "chosen" in text
    again = _pipe(jp.Auto())[0].auto_choice
    assert [(c.family, c.chunks, c.verdict) for c in again.candidates] == [
        (c.family, c.chunks, c.verdict) for c in choice.candidates]


def test_auto_under_a_budget_and_by_memory():
    """Under a budget every candidate kept fits it; objective='memory' takes the smallest
    predicted peak (GPipe, which holds every microbatch, never)."""
    first = _pipe(jp.Auto(objective="memory"))[0].auto_choice
    kept = [c for c in first.candidates if c.memory is not None
            and not c.verdict.startswith("does not")]
    best = min(kept, key=lambda c: c.memory)
    assert [c for c in first.candidates if c.verdict == "chosen"] == [best]
    assert best.family != "gpipe"
    budget = best.memory * 1.05
    pipe = _pipe(jp.Auto(), cut=jp.Cut(memory_budget=budget))[0]
    for c in pipe.auto_choice.candidates:
        if c.verdict == "chosen" or c.verdict in ("slower", "more memory"):
            assert c.memory <= budget, c


@pytest.mark.parametrize(("auto", "match"), [
    (lambda: jp.Auto(families=("zb",)), r"'zb'.*not one of"),
    (lambda: jp.Auto(families=()), "empty"),
    (lambda: jp.Auto(objective="speed"), "objective"),
    (lambda: jp.Auto(microbatches=0), "positive int"),
    (lambda: jp.Auto(microbatches=5), r"does not divide the batch's 16 rows"),
    (lambda: jp.Auto(num_devices=4), r"num_devices=4.*has 2 devices"),
    (lambda: jp.Auto(families=(int,)), "Schedule subclasses"),
])
def test_bad_auto_options_name_the_fix(auto, match):
    with pytest.raises(jp.PipelineError, match=match):
        _pipe(auto())


def test_a_family_of_your_own_is_a_candidate():
    """A Schedule subclass constructible as cls(p, m) (the gallery's Eager1F1B) competes
    with the built-ins and is named by its class."""
    eager = jp.load_schedule("schedules/eager_1f1b.py:Eager1F1B")
    pipe, loss_fn, params, batch = _pipe(jp.Auto(families=("gpipe", eager), microbatches=4))
    names = [(c.family, c.microbatches) for c in pipe.auto_choice.candidates]
    assert names == [("gpipe", 4), ("Eager1F1B", 4)]
    assert_matches(pipe.value_and_grad(params, batch), jax.value_and_grad(loss_fn)(params, batch))
