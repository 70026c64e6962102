"""Action IR, Schedule constructor checks, placement helpers and dependencies()."""

import numpy as np
import pytest

from jaxpipe.schedule import (
    Action,
    GPipe,
    Interleaved1F1B,
    OneFOneB,
    Schedule,
    ScheduleError,
    dependencies,
)


def test_str_and_parse_roundtrip():
    assert str(Action("F", 2, 0)) == "2F0"
    assert Action.parse("2F0") == Action("F", 2, 0)
    assert Action.parse("12W3") == Action("W", 12, 3)
    assert Action.parse(" 3 i 14 ") == Action("I", 3, 14)
    for a in (Action("B", 0, 7), Action("I", 31, 0), Action("W", 5, 123)):
        assert Action.parse(str(a)) == a


def test_action_is_frozen_hashable_with_ordered_fields():
    a = Action("F", 1, 2)
    assert (a.kind, a.stage, a.microbatch) == ("F", 1, 2)
    assert Action(kind="F", stage=1, microbatch=2) == a
    assert len({a, Action("F", 1, 2), Action("B", 1, 2)}) == 2
    with pytest.raises(AttributeError):
        a.stage = 3  # type: ignore[misc]
    # numpy integers are normalised, so they hash like ints
    assert Action("F", np.int64(1), np.int32(2)) == a
    assert type(Action("F", np.int64(1), 2).stage) is int
    assert a.is_forward and not a.is_backward and Action("W", 0, 0).is_backward


@pytest.mark.parametrize(
    "args, words",
    [
        (("X", 0, 0), ["kind", "F, B, I, W", "'X'"]),
        (("f", 0, 0), ["kind"]),
        (("F", -1, 0), ["stage", ">= 0"]),
        (("F", 0, -2), ["microbatch", ">= 0"]),
        (("F", 1.5, 0), ["stage", "int"]),
        (("F", True, 0), ["stage", "bool"]),
    ],
)
def test_bad_action(args, words):
    with pytest.raises(ValueError) as err:
        Action(*args)
    for w in words:
        assert w in str(err.value)


@pytest.mark.parametrize("text", ["", "F0", "2F", "2X0", "2FF0", "-1F0", "a2F0", "2 F 0 x"])
def test_parse_rejects_bad_strings(text):
    with pytest.raises(ValueError, match="2F0|kind"):
        Action.parse(text)


def test_parse_rejects_non_str():
    with pytest.raises(ValueError, match="str"):
        Action.parse(20)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"num_devices": 0, "num_microbatches": 4}, "num_devices"),
        ({"num_devices": 2, "num_microbatches": -1}, "num_microbatches"),
        ({"num_devices": 2, "num_microbatches": 4, "stages_per_device": 0}, "stages_per_device"),
        ({"num_devices": 2.0, "num_microbatches": 4}, "num_devices"),
        ({"num_devices": True, "num_microbatches": 4}, "num_devices"),
    ],
)
def test_constructor_rejects_non_positive_ints(kwargs, name):
    with pytest.raises(ScheduleError, match=name):
        GPipe(**kwargs)
    assert issubclass(ScheduleError, ValueError)


def test_schedule_is_abstract():
    with pytest.raises(TypeError):
        Schedule(2, 2)  # type: ignore[abstract]


def test_attributes_placement_and_device_stages():
    s = GPipe(3, 5, stages_per_device=2)
    assert (s.num_devices, s.num_microbatches, s.stages_per_device, s.num_stages) == (3, 5, 2, 6)
    assert [s.placement(i) for i in range(6)] == [0, 1, 2, 0, 1, 2]
    assert s.device_stages(1) == [1, 4]
    assert set(s.actions()) == {0, 1, 2}
    with pytest.raises(ScheduleError, match="device 3"):
        s.device_stages(3)
    assert GPipe.name == "gpipe" and OneFOneB.name == "1f1b"
    assert Interleaved1F1B.name == "interleaved"
    assert repr(OneFOneB(4, 8)) == "OneFOneB(num_devices=4, num_microbatches=8)"


def test_builtin_parameter_errors():
    with pytest.raises(ScheduleError, match="stages_per_device=1"):
        OneFOneB(2, 4, stages_per_device=2)
    with pytest.raises(ScheduleError, match="multiple of num_devices"):
        Interleaved1F1B(4, 6, 2)
    with pytest.raises(ScheduleError, match="stages_per_device >= 2"):
        Interleaved1F1B(2, 4, 1)
    assert Interleaved1F1B(2, 4).stages_per_device == 2


class _SplitOneFOneB(OneFOneB):
    """1F1B with every backward split into I immediately followed by W."""

    def device_actions(self, device):
        out = []
        for a in super().device_actions(device):
            if a.kind == "B":
                out += [Action("I", a.stage, a.microbatch), Action("W", a.stage, a.microbatch)]
            else:
                out.append(a)
        return out


def test_dependencies_follow_the_contract():
    s = OneFOneB(3, 2)
    P = Action.parse
    assert dependencies(P("0F1"), s) == []
    assert dependencies(P("2F1"), s) == [P("1F1")]
    assert dependencies(P("2B0"), s) == [P("2F0")]  # last stage: only its own forward
    assert dependencies(P("1B0"), s) == [P("1F0"), P("2B0")]

    split = _SplitOneFOneB(3, 2)
    assert split.uses_split_backward(1, 0) and not s.uses_split_backward(1, 0)
    assert dependencies(P("1I0"), split) == [P("1F0"), P("2I0")]
    assert dependencies(P("1W0"), split) == [P("1I0")]
    split.validate()
