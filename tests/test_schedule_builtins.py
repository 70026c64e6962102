"""Built-in schedules: exact bubble and memory formulas, and properties for random sizes."""

from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpipe.schedule import Action, GPipe, Interleaved1F1B, OneFOneB, dependencies

UNIT = {"F": 1, "B": 1}


@pytest.mark.parametrize("p", range(1, 9))
def test_gpipe_and_1f1b_bubble_and_memory(p):
    for m in range(1, 33):
        bubble = (p - 1) / (m + p - 1)
        g = GPipe(p, m).simulate(UNIT)
        assert g.bubble_fraction == bubble
        assert g.makespan == 2 * (m + p - 1)
        assert g.peak_in_flight == [m] * p
        f = OneFOneB(p, m).simulate(UNIT)
        assert f.bubble_fraction == bubble
        assert f.makespan == 2 * (m + p - 1)
        assert f.peak_in_flight == [min(m, p - d) for d in range(p)]
        assert f.stage_peak_in_flight == {d: min(m, p - d) for d in range(p)}


def test_default_costs_1f1b_makespan():
    # F=1, B=2: every device does 3m work, and the pipeline fill/drain adds 3(p-1).
    t = OneFOneB(4, 8).simulate()
    assert t.makespan == 3 * (8 + 4 - 1)
    assert t.bubble_fraction == 3 / 11


@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_bubble_makespan_and_memory(v):
    for p in range(1, 9):
        for m in (p, 2 * p, 3 * p, 4 * p):
            s = Interleaved1F1B(p, m, v)
            unit = s.simulate(UNIT)
            assert unit.bubble_fraction == (p - 1) / (v * m + p - 1), (p, m)
            assert unit.makespan == 2 * (v * m + p - 1)

            # Same model cut into v times more, v times cheaper chunks: shorter step.
            chunked = s.simulate({"F": Fraction(1, v), "B": Fraction(2, v)})
            one_f_one_b = OneFOneB(p, m).simulate()
            if p > 1:
                assert chunked.makespan < one_f_one_b.makespan
            else:
                assert chunked.makespan == one_f_one_b.makespan

            # Residual memory of device 0 in whole-stage units (chunk sets / v).
            if m >= 2 * p:
                gpipe = GPipe(p, m).simulate()
                assert Fraction(unit.peak_in_flight[0], v) < gpipe.peak_in_flight[0]


def test_interleaved_megatron_order():
    # p=2, m=4, v=2: warm-up 2*(p-d-1) + (v-1)*p forwards, chunks advance in blocks of p.
    s = Interleaved1F1B(2, 4, 2)
    assert [str(a) for a in s.device_actions(0)] == [
        "0F0", "0F1", "2F0", "2F1", "0F2", "2B0", "0F3", "2B1",
        "2F2", "0B0", "2F3", "0B1", "2B2", "2B3", "0B2", "0B3",
    ]
    assert [str(a) for a in s.device_actions(1)][:6] == ["1F0", "1F1", "3F0", "3B0", "3F1", "3B1"]


def test_gpipe_order_is_documented_order():
    s = GPipe(2, 3, stages_per_device=2)
    assert [str(a) for a in s.device_actions(1)] == [
        "1F0", "1F1", "1F2", "3F0", "3F1", "3F2", "3B0", "3B1", "3B2", "1B0", "1B1", "1B2",
    ]


def test_1f1b_order():
    assert [str(a) for a in OneFOneB(3, 4).device_actions(0)] == [
        "0F0", "0F1", "0F2", "0B0", "0F3", "0B1", "0B2", "0B3",
    ]


@st.composite
def builtin_schedules(draw):
    kind = draw(st.sampled_from(["gpipe", "1f1b", "interleaved"]))
    p = draw(st.integers(1, 6))
    if kind == "interleaved":
        v = draw(st.integers(2, 4))
        return Interleaved1F1B(p, p * draw(st.integers(1, 4)), v)
    m = draw(st.integers(1, 16))
    if kind == "gpipe":
        return GPipe(p, m, draw(st.integers(1, 3)))
    return OneFOneB(p, m)


costs_strategy = st.fixed_dictionaries(
    {k: st.fractions(min_value=0, max_value=4, max_denominator=4) for k in "FB"}
)


@settings(max_examples=60, deadline=None)
@given(builtin_schedules(), costs_strategy)
def test_builtins_valid_and_simulation_is_exact(schedule, costs):
    schedule.validate()
    acts = schedule.actions()
    counts = Counter(a for lst in acts.values() for a in lst)
    expected = {
        Action(k, s, mb)
        for s in range(schedule.num_stages)
        for mb in range(schedule.num_microbatches)
        for k in "FB"
    }
    assert set(counts) == expected and set(counts.values()) == {1}
    for d, lst in acts.items():
        assert all(schedule.placement(a.stage) == d for a in lst)

    t = schedule.simulate(costs)  # no deadlock
    assert len(t.events) == len(expected)
    end = {e.action: e.end for e in t.events}
    for d in range(schedule.num_devices):
        evs = t.device_events(d)
        assert [e.action for e in evs] == acts[d]  # strict device order
        prev_end = 0
        for e in evs:
            ready = max([prev_end, *(end[x] for x in dependencies(e.action, schedule))])
            assert e.start == ready  # starts as soon as device and inputs allow
            assert e.end - e.start == costs[e.action.kind]
            prev_end = e.end
    busy = sum(costs[a.kind] for a in expected)
    if t.makespan:
        assert t.bubble_fraction == pytest.approx(
            1 - busy / (t.makespan * schedule.num_devices), rel=1e-12, abs=1e-15
        )
    assert t.idle_time == t.makespan * schedule.num_devices - busy
