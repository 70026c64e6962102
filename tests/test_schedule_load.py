"""load_schedule: built-in names, file.py:Class, module:Class, and its errors."""

import textwrap

import pytest

from jaxpipe.schedule import (
    BUILTIN_SCHEDULES,
    GPipe,
    Interleaved1F1B,
    OneFOneB,
    ScheduleError,
    load_schedule,
)


@pytest.mark.parametrize(
    "name, cls",
    [
        ("gpipe", GPipe),
        ("GPipe", GPipe),
        ("1f1b", OneFOneB),
        ("1F1B", OneFOneB),
        ("interleaved", Interleaved1F1B),
        ("Interleaved1F1B", Interleaved1F1B),
        ("jaxpipe.schedule.gpipe:GPipe", GPipe),
    ],
)
def test_builtin_names(name, cls):
    assert load_schedule(name) is cls


def test_registry_and_class_passthrough():
    assert BUILTIN_SCHEDULES == {"gpipe": GPipe, "1f1b": OneFOneB, "interleaved": Interleaved1F1B}
    assert load_schedule(OneFOneB) is OneFOneB
    with pytest.raises(ScheduleError, match="not a Schedule subclass"):
        load_schedule(int)  # type: ignore[arg-type]


USER_FILE = textwrap.dedent(
    """
    from jaxpipe import Action, Schedule

    class Reversed(Schedule):
        name = "reversed"

        def device_actions(self, device):
            (stage,) = self.device_stages(device)
            mbs = range(self.num_microbatches)
            return [Action("F", stage, mb) for mb in mbs] + [
                Action("B", stage, mb) for mb in reversed(mbs)
            ]

    NOT_A_SCHEDULE = 3
    """
)


def test_file_path_class(tmp_path, monkeypatch):
    (tmp_path / "my_sched.py").write_text(USER_FILE)
    cls = load_schedule(f"{tmp_path}/my_sched.py:Reversed")
    assert cls.name == "reversed"
    cls(3, 4).validate()
    monkeypatch.chdir(tmp_path)
    assert load_schedule("my_sched.py:Reversed") is cls  # same file -> same module


def test_file_errors(tmp_path):
    path = tmp_path / "my_sched.py"
    path.write_text(USER_FILE)
    with pytest.raises(ScheduleError, match=r"not found.*gpipe, 1f1b, interleaved"):
        load_schedule(f"{tmp_path}/missing.py:Reversed")
    with pytest.raises(ScheduleError, match=r"no class 'Nope'.*Reversed"):
        load_schedule(f"{path}:Nope")
    with pytest.raises(ScheduleError, match="NOT_A_SCHEDULE is not a Schedule subclass"):
        load_schedule(f"{path}:NOT_A_SCHEDULE")
    with pytest.raises(ScheduleError, match="ClassName"):
        load_schedule(str(path))


@pytest.mark.parametrize("name", ["pipedream", "", "no.such.module:X"])
def test_unknown_names_list_valid_ones(name):
    with pytest.raises(ScheduleError, match="gpipe, 1f1b, interleaved"):
        load_schedule(name)
