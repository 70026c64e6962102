"""The jaxpipe command: console entry point, main() and its error handling."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jaxpipe.tools.cli import main, parse_costs


def _check_1f1b_output(out):
    assert "dev 0 |0F0 0F1 0F2 0F3 " in out
    assert "makespan        33" in out
    assert "bubble fraction 0.2727" in out
    table = out[out.index("peak in-flight  busy"):].splitlines()[1:5]
    assert [row.split()[:3] for row in table] == [
        ["0", "0", "4"], ["1", "1", "3"], ["2", "2", "2"], ["3", "3", "1"],
    ]


def test_module_entry_point():
    proc = subprocess.run(
        [sys.executable, "-m", "jaxpipe.tools.cli", "simulate", "1f1b", "-p", "4", "-m", "8"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    _check_1f1b_output(proc.stdout)


def test_console_script():
    exe = shutil.which("jaxpipe")
    if exe is None:
        pytest.skip("console script not installed (pip install -e .)")
    proc = subprocess.run([exe, "simulate", "1f1b", "-p", "4", "-m", "8"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    _check_1f1b_output(proc.stdout)


def test_main_direct_with_outputs(tmp_path, capsys):
    plot, trace = tmp_path / "t.png", tmp_path / "t.json"
    rc = main(["simulate", "interleaved", "-p", "2", "-m", "4", "-v", "2",
               "--costs", "F=1,B=1", "--plot", str(plot), "--trace", str(trace)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "stages_per_device=2" in out and "bubble fraction 0.1111" in out  # 1/9
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert len([e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]) == 32


def test_lowered_program_shows_shared_ticks_and_efficiency(capsys):
    """--lowered prints the SPMD program's ticks and its lowered efficiency: 1F1B p=4 with
    the full backward unsplit loses nothing (each tick's permutation lists only the
    pairs that exchange); split into I then W, the cotangent moves before W runs and
    the program beats the schedule as written (33 / 30)."""
    assert main(["simulate", "1f1b", "-p", "4", "-m", "8", "--lowered"]) == 0
    out = capsys.readouterr().out
    assert "lowered efficiency 1.000 (async makespan 33 / lowered 33; 22 ticks" in out
    assert "dev 3 .   .   .   3F0 3B0 3F1 3B1" in out
    assert main(["simulate", "1f1b", "-p", "4", "-m", "8", "--lowered", "--split-backward",
                 "--costs", "F=1,B=2,I=1,W=1"]) == 0
    out = capsys.readouterr().out
    assert "lowered efficiency 1.100 (async makespan 33 / lowered 30; 30 ticks" in out
    assert "dev 3 .   .   .   3F0 3I0 3W0 3F1" in out


def test_lowered_program_with_the_local_search(capsys):
    """--refine N runs the runtime's local search over ticks (with the default costs when
    none are given): interleaved p=4 m=8 with B unsplit goes from 57/66 to 57/59."""
    assert main(["simulate", "interleaved", "-p", "4", "-m", "8", "--lowered"]) == 0
    assert "lowered efficiency 0.864 (async makespan 57 / lowered 66;" in capsys.readouterr().out
    assert main(["simulate", "interleaved", "-p", "4", "-m", "8", "--lowered",
                 "--refine", "400"]) == 0
    assert "lowered efficiency 0.966 (async makespan 57 / lowered 59;" in capsys.readouterr().out


def test_lowered_program_across_processes(capsys):
    """--processes lowers the CPU program as the runtime does where devices run in several
    processes: messages move lazily (Interleaved1F1B p=2 m=8: devices meet at 19 tick ends,
    not 30) and the local search is on; --tick-cost prices the ticks it adds (43 -> 36,
    nothing lost). Both refuse the gpu program, and a tick cost nothing is chosen by."""
    argv = ["simulate", "interleaved", "-p", "2", "-m", "8", "--lowered"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "devices meet at 30 of 34 tick ends" in out
    assert "lowered efficiency 0.836 (async makespan 51 / lowered 61;" in out
    assert main([*argv, "--processes"]) == 0
    out = capsys.readouterr().out
    assert "across processes messages move lazily" in out
    assert "devices meet at 19 of 43 tick ends" in out
    assert "lowered efficiency 1.000 (async makespan 51 / lowered 51; 43 ticks" in out
    assert main([*argv, "--processes", "--tick-cost", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "devices meet at 19 of 36 tick ends" in out
    assert "lowered efficiency 1.000 (async makespan 51 / lowered 51; 36 ticks" in out
    assert main([*argv, "--backend", "gpu", "--processes"]) == 2
    assert "describe the CPU program" in capsys.readouterr().err
    assert main([*argv, "--tick-cost", "1"]) == 2
    assert "pass --costs, or --refine N" in capsys.readouterr().err


def test_lowered_accelerator_program_and_its_overlap(capsys):
    """--backend gpu lowers for the accelerator program (every B as I then W, every pair
    meeting every tick); --overlap on sends each tick's messages during the next tick, at
    one more tick of latency; auto keeps it off without a transfer time and turns it on
    where the transfer would otherwise add to every tick."""
    argv = ["simulate", "1f1b", "-p", "4", "-m", "8", "--lowered", "--backend", "gpu"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "gpu program" in out and "(overlap off)" in out
    assert "lowered efficiency 1.100 (async makespan 33 / lowered 30; 30 ticks" in out
    assert main([*argv, "--overlap", "on"]) == 0
    out = capsys.readouterr().out
    assert "(overlap on)" in out and "41 ticks" in out
    assert main([*argv, "--transfer", "0.5"]) == 0
    assert "(overlap on)" in capsys.readouterr().out


def test_user_file_schedule(tmp_path, capsys):
    f = tmp_path / "s.py"
    f.write_text("from jaxpipe.schedule import GPipe\nclass Mine(GPipe):\n    name = 'mine'\n")
    assert main(["simulate", f"{f}:Mine", "-p", "2", "-m", "2"]) == 0
    assert "Mine(num_devices=2, num_microbatches=2)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, words",
    [
        (["simulate", "nope", "-p", "2", "-m", "2"], "unknown schedule 'nope'"),
        (["simulate", "interleaved", "-p", "4", "-m", "6"], "multiple of num_devices"),
        (["simulate", "1f1b", "-p", "0", "-m", "2"], "num_devices must be a positive int"),
        (["simulate", "1f1b", "-p", "x", "-m", "2"], "invalid int value"),
        (["simulate", "1f1b", "-m", "2"], "required"),
        (["simulate", "1f1b", "-p", "2", "-m", "2", "--costs", "Q=1"], "bad cost 'Q=1'"),
        (["simulate", "1f1b", "-p", "2", "-m", "2", "--costs", "F=1e400"], "too large"),
        (["simulate", "1f1b", "-p", "2", "-m", "2", "--lowered", "--transfer", "inf"],
         "must be a finite number >= 0, got inf"),
        (["simulate", "1f1b", "-p", "2", "-m", "2", "--lowered", "--refine", "-1"],
         "must be an int >= 0"),
        (["simulate", "1f1b", "-p", "4", "-m", "8", "--split-backward", "--backend", "gpu"],
         "--backend, --split-backward describe the lowered SPMD program: add --lowered"),
        (["simulate", "1f1b", "-p", "4", "-m", "8", "--lowered", "--overlap", "on"],
         "--overlap describes the gpu/tpu program"),
        (["frobnicate"], "invalid choice"),
        ([], "required"),
    ],
)
def test_errors_are_one_line_exit_2(argv, words, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0] and words in lines[0]


def test_help_exits_zero(capsys):
    assert main(["simulate", "--help"]) == 0
    assert "--costs" in capsys.readouterr().out


def test_parse_costs():
    assert parse_costs("F=1, b=2.5,W=1/3") == {"F": 1, "B": 2.5, "W": pytest.approx(1 / 3)}


@pytest.mark.parametrize("source, words", [
    ("class A(GPipe)\n    pass\n", "SyntaxError at line 2"),
    ("import nosuchmod\n", "No module named 'nosuchmod'"),
    ("class A(GPipe):\n    def device_actions(self, d):\n        return 1 / 0\n",
     "ZeroDivisionError: division by zero (at "),
    ("class A(GPipe):\n    def device_actions(self, d):\n        return None\n",
     "device_actions(0) returned None"),
])
def test_schedule_file_failures_are_one_line_exit_2(tmp_path, capsys, source, words):
    f = tmp_path / "mine.py"
    f.write_text("from jaxpipe.schedule import GPipe\n" + source)
    assert main(["simulate", f"{f}:A", "-p", "2", "-m", "2"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], lines


def test_directory_as_schedule_file_and_bad_sizes(tmp_path, capsys):
    assert main(["simulate", f"{tmp_path}:A", "-p", "2", "-m", "2"]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert main(["simulate", "1f1b", "-p", "2", "-m", "2", "--width", "0"]) == 2
    assert "must be a positive int" in capsys.readouterr().err


def test_no_public_name_is_a_submodule_name():
    """Importing a submodule binds it on its package, so a public name shared with a
    submodule (``jp.pipeline`` once was both) would depend on import order. None is, and
    every public name resolves to what its module defines, whatever was imported first."""
    import jaxpipe

    package = Path(jaxpipe.__file__).parent
    submodules = {p.stem for p in package.glob("*.py")} | {
        p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    public = set(jaxpipe.__all__) - jaxpipe._SUBMODULES
    assert public and not public & submodules, public & submodules
    code = ("import jaxpipe.api.pipeline\nfrom jaxpipe.api.pipeline import Pipeline\n"
            "import jaxpipe.schedule, jaxpipe.jaxpr.markers\nimport jaxpipe as jp\n"
            "assert callable(jp.pipeline), jp.pipeline\n"
            "assert jp.Pipeline is Pipeline and jp.boundary is jaxpipe.jaxpr.markers.boundary\n"
            "assert jp.schedule is jaxpipe.schedule\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
