"""Test setup: 8 virtual CPU devices, LLVM at -O0 and the elemental emitter, float32
defaults. Runs before jax imports."""

import os

from jaxpipe.xla_flags import cpu_devices, fast_cpu_compile  # (imports no jax)

cpu_devices(8)
# most of the suite's time is XLA compiling small programs: without the MLIR fusion
# emitters' fixed cost per program (jaxpipe.xla_flags.FAST_CPU_COMPILE) the same HLO
# compiles faster (1,650 -> 1,443 test-seconds, every test passing). Subprocesses inherit it.
fast_cpu_compile()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    # XLA:CPU's LLVM at -O0, not its default -O2: the same HLO programs (what every
    # structural assertion reads), both sides of a numerical comparison compiled alike,
    # and XLA's compile, most of the suite's time, about halved against -O1: 778 -> 403
    # test-seconds of backend compile, 757 -> 525 s wall on 2 cores, every test passing
    # (the slower machine code costs little at these sizes). Subprocesses inherit it. (A
    # compilation cache shared by the run's processes saved 7 s more: the suite has none.)
    os.environ["XLA_FLAGS"] = "--xla_backend_optimization_level=0 " + os.environ["XLA_FLAGS"]

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

#: Files whose tests run whole models end to end (examples, flax's models, several
#: processes, the benchmarks' smoke run, ahead-of-time TPU/GPU compiles, every schedule of
#: the gallery, the reference executor): the slow tier. ``pytest -m "not slow"`` runs the
#: rest (schedules, cutter, lowering, the SPMD program's exactness, input checks, docs) in
#: about three minutes on 2 cores: the inner loop (README, Development).
SLOW_FILES = frozenset({
    "test_accelerator.py", "test_aot.py", "test_benchmarks.py", "test_examples.py",
    "test_flax.py", "test_flax_examples.py", "test_gallery.py", "test_lanes.py",
    "test_multiprocess.py", "test_objective.py", "test_readme.py", "test_remat.py",
    "test_sharded.py", "test_stacks.py", "test_stages.py", "test_stateful.py",
    "test_train_state.py",
})


_missing = SLOW_FILES - {p.name for p in Path(__file__).parent.glob("test_*.py")}
assert not _missing, f"SLOW_FILES names test files that do not exist: {sorted(_missing)}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
