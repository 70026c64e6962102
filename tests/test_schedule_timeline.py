"""Timeline: costs handling, memory accounting, ASCII, Chrome trace and plot output."""

import json
from fractions import Fraction

import pytest

from jaxpipe.schedule import Action, GPipe, OneFOneB, Schedule, Timeline, TimelineEvent


class Listed(Schedule):
    def __init__(self, p, m, lists):
        super().__init__(p, m)
        self._lists = lists

    def device_actions(self, device):
        return [Action.parse(x) for x in self._lists[device]]


def test_exact_event_times_1f1b():
    t = OneFOneB(2, 2).simulate()  # F=1, B=2
    got = {(str(e.action), e.device): (e.start, e.end) for e in t.events}
    assert got == {
        ("0F0", 0): (0, 1), ("0F1", 0): (1, 2), ("1F0", 1): (1, 2), ("1B0", 1): (2, 4),
        ("1F1", 1): (4, 5), ("1B1", 1): (5, 7), ("0B0", 0): (4, 6), ("0B1", 0): (7, 9),
    }
    assert t.makespan == 9 and t.busy_time == [6, 6] and t.idle_time == 6
    assert t.bubble_fraction == 6 / 18
    assert isinstance(t.events[0], TimelineEvent) and t.events[0].duration == 1
    assert [e.start for e in t.events] == sorted(e.start for e in t.events)


def test_costs_dict_callable_and_fraction_exactness():
    s = GPipe(3, 4)
    by_dict = s.simulate({"F": Fraction(1, 3), "B": Fraction(2, 3)})
    assert by_dict.makespan == 6 and isinstance(by_dict.makespan, Fraction)  # (m+p-1)*(F+B)
    assert by_dict.bubble_fraction == 2 / 6

    # Per-stage costs through a callable: the last stage is twice as slow.
    def per_stage(a):
        return (2 if a.stage == 2 else 1) * (1 if a.kind == "F" else 2)

    t = s.simulate(per_stage)
    assert t.busy_time == [12, 12, 24]
    assert [e.end - e.start for e in t.device_events(2)] == [2] * 4 + [4] * 4

    default = s.simulate()
    assert s.simulate({"F": 1}).makespan == default.makespan  # missing kinds keep defaults


@pytest.mark.parametrize(
    "costs, words",
    [
        ({"X": 1}, "unknown action kind"),
        ({"F": -1}, ">= 0"),
        ({"B": float("nan")}, "finite"),
        ({"F": "1"}, "number"),
        (lambda a: -1, "action 0F0"),
        (42, "costs must be"),
    ],
)
def test_bad_costs(costs, words):
    with pytest.raises(ValueError, match=words):
        GPipe(1, 1).simulate(costs)


def test_split_backward_frees_residuals_at_w():
    late = Listed(1, 2, {0: ["0F0", "0I0", "0F1", "0W0", "0I1", "0W1"]}).simulate()
    early = Listed(1, 2, {0: ["0F0", "0I0", "0W0", "0F1", "0I1", "0W1"]}).simulate()
    assert late.peak_in_flight == [2]  # 0F1 runs before 0W0 frees microbatch 0
    assert early.peak_in_flight == [1]
    assert late.makespan == 6


def test_stage_peak_with_two_stages_per_device():
    t = GPipe(2, 3, stages_per_device=2).simulate()
    assert t.stage_peak_in_flight == {0: 3, 1: 3, 2: 3, 3: 3}
    assert t.peak_in_flight == [6, 6]


def test_empty_and_zero_cost_timeline():
    t = Timeline([], 2)
    assert t.makespan == 0 and t.bubble_fraction == 0.0 and t.peak_in_flight == [0, 0]
    assert "empty" in t.to_ascii()
    z = GPipe(2, 2).simulate({"F": 0, "B": 0})
    assert z.makespan == 0 and z.peak_in_flight == [2, 2]


def test_to_ascii_rows_and_legend():
    t = OneFOneB(4, 8).simulate()
    text = t.to_ascii()
    rows = [line for line in text.splitlines() if line.startswith("dev ")]
    assert len(rows) == 4
    assert rows[0].startswith("dev 0 |0F0 0F1 0F2 0F3 ")
    assert rows[3].startswith("dev 3 |" + "." * 12 + "3F0 3B0 ")
    assert len({len(r) for r in rows}) == 1  # aligned
    assert "makespan 33" in text and "bubble 27.27%" in text
    assert "peak in-flight per device [4, 3, 2, 1]" in text
    narrow = t.to_ascii(width=60)
    assert all(len(line) <= 60 for line in narrow.splitlines() if line.startswith("dev "))


def test_chrome_trace(tmp_path):
    t = OneFOneB(3, 4).simulate()
    path = t.to_chrome_trace(tmp_path / "trace.json")
    doc = json.loads(path.read_text())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 2 * 3 * 4
    assert {e["tid"] for e in spans} == {0, 1, 2} and {e["pid"] for e in spans} == {0}
    first = next(e for e in spans if e["name"] == "1B0")
    ev = next(e for e in t.events if str(e.action) == "1B0")
    assert first["ts"] == float(ev.start) * 1000 and first["dur"] == 2000.0
    assert first["args"] == {"kind": "B", "stage": 1, "microbatch": 0}
    names = [e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "thread_name"]
    assert names == ["device 0", "device 1", "device 2"]


@pytest.mark.parametrize("suffix, magic", [("png", b"\x89PNG"), ("svg", b"<svg")])
def test_plot(tmp_path, suffix, magic):
    path = OneFOneB(2, 3).simulate().plot(tmp_path / f"t.{suffix}")
    data = path.read_bytes()
    assert magic in data[:400]
