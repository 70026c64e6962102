"""Liveness helpers: unit lifetimes from one device's actions, and peak overlap."""

from jaxpipe.schedule import Action, OneFOneB
from jaxpipe.schedule.liveness import peak_overlap, unit_lifetimes


def _events(*labels):
    return [(Action.parse(x), pos) for pos, x in enumerate(labels)]


def test_lifetime_ends_at_b_or_at_w_when_split():
    life = unit_lifetimes(_events("0F0", "0F1", "0I0", "0B1", "0W0"))
    assert life == {(0, 0): (0, 4), (0, 1): (1, 3)}


def test_missing_backward_lives_to_the_last_event():
    assert unit_lifetimes(_events("0F0", "1F0", "1B0")) == {(0, 0): (0, 2), (1, 0): (1, 2)}


def test_times_may_be_any_orderable_position():
    life = unit_lifetimes([(Action.parse("0F0"), 2.5), (Action.parse("0B0"), 7.0)])
    assert life == {(0, 0): (2.5, 7.0)}


def test_peak_overlap_counts_closed_intervals():
    assert peak_overlap([]) == 0
    assert peak_overlap([(0, 1), (2, 3)]) == 1
    assert peak_overlap([(0, 1), (1, 2)]) == 2  # touching intervals overlap
    assert peak_overlap([(0, 10), (1, 2), (3, 4), (2, 3)]) == 3


def test_split_units_are_cached_and_drive_uses_split_backward():
    s = OneFOneB(2, 3)
    assert s.split_units() == frozenset() and s.split_units() is s.split_units()
    assert not s.uses_split_backward(0, 0)
    t = s.simulate()
    assert t.split_units == frozenset()
    assert t.peak_in_flight == [2, 1]


def test_split_units_of_a_split_schedule_reach_the_timeline():
    from split_schedule import DeferredW1F1B

    s = DeferredW1F1B(2, 3)
    every = frozenset((stage, mb) for stage in range(2) for mb in range(3))
    assert s.split_units() == every and s.uses_split_backward(1, 2)
    assert s.simulate().split_units == every
