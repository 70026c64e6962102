"""The XLA flags a pipeline wants on each backend, set before JAX starts its backend.

The accelerator program (``SpmdRuntime(backend="gpu")``) is built so that XLA:GPU can run
ahead: straight-line ticks, one unconditional collective-permute per direction, with the
overlap option its operand from the loop's carry. What XLA then does with it depends on
flags that are off by default on GPU; JAX's GPU performance guide
(``docs/gpu_performance_tips.md``, "Pipeline Parallelism on GPU") recommends them for
pipelines:

- ``--xla_gpu_enable_latency_hiding_scheduler=true``: schedule a collective-permute's start
  early and its end late, around independent compute (the overlap);
- ``--xla_gpu_experimental_parallel_collective_overlap_limit=2``: both directions'
  permutes in flight at once (by default the second starts after the first is done);
- ``--xla_gpu_experimental_collective_start_as_early_as_possible=true``: start them
  before the tick's ``conditional`` (the scheduler costs a conditional as one small
  kernel and would otherwise start them after it, overlapping only the buffer writes);
- ``--xla_gpu_enable_command_buffer=`` (empty): no CUDA graphs, which JAX's pipeline
  guide turns off (and whose conditional nodes are off by default anyway);
- ``--xla_disable_hlo_passes=collective-permute-motion``: keep the permutes where the
  program puts them.

Not ``xla_gpu_experimental_pipeline_parallelism_opt_level``, which JAX's guide names: it
turns one permute into a send/recv whose recv-done comes before the switch (no overlap).
Read from XLA:GPU's scheduled HLO of deviceless compiles (``jaxpipe.aot``, H200 target):
with all of these, both permutes start before the switch and end after it, for every
built-in and gallery schedule.

:data:`COMPILER_OPTIONS` holds the scheduling ones as per-compile options
(``lowered.compile(COMPILER_OPTIONS["gpu"])``: what ``jaxpipe.aot`` compiles with, no
``XLA_FLAGS`` at start-up needed).

On TPU, XLA:TPU schedules collectives with its latency-hiding scheduler by default;
jaxpipe asks for nothing there. On CPU its programs compile with LLVM at ``-O1``
(``xla_backend_optimization_level=1``, per compile; XLA's default is 2): the CPU program is
mostly Eigen's matmuls and the tick's small loops, which run as fast at ``-O1`` (measured,
2 cores: 1F1B and Interleaved steps of a 16-block MLP and of the GPT benchmark model
unchanged within noise), while XLA compiles it 20-25% faster (a 16-block MLP's program:
0.48 -> 0.38 s; Interleaved 0.57 -> 0.42 s). A flag ``XLA_FLAGS`` names wins over every
per-compile option here.

Call :func:`apply` before the first JAX computation (JAX reads ``XLA_FLAGS`` once, when
it starts a backend), or set the flags where you launch::

    import jaxpipe.xla_flags
    jaxpipe.xla_flags.apply("gpu")   # before jax starts its backend
    import jax
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping, Sequence

__all__ = ["COMPILER_OPTIONS", "FAST_CPU_COMPILE", "RECOMMENDED", "apply", "attached_platform",
           "compiler_options", "cpu_devices", "cpu_unless_attached", "fast_cpu_compile",
           "recommended"]

#: Per platform, XLA options the accelerator program is compiled with, per compile
#: (``lowered.compile(COMPILER_OPTIONS["gpu"])``; see the module docstring).
COMPILER_OPTIONS: dict[str, dict[str, bool | int]] = {
    "gpu": {
        "xla_gpu_enable_latency_hiding_scheduler": True,
        "xla_gpu_experimental_parallel_collective_overlap_limit": 2,
        "xla_gpu_experimental_collective_start_as_early_as_possible": True,
    },
    "tpu": {},
    "cpu": {"xla_backend_optimization_level": 1},
}


def compiler_options(platform: str) -> dict[str, bool | int] | None:
    """The per-compile options for programs on ``platform``'s devices (a mesh's
    ``devices.flat[0].platform``), as ``jax.jit(..., compiler_options=)`` takes them;
    ``None`` where there are none. jaxpipe's own jitted programs pass them, so a real or
    a compile-only GPU mesh gets the overlap without ``XLA_FLAGS``. An option that
    ``XLA_FLAGS`` names is left out: the user's flag wins (a per-compile option would
    override it)."""
    named = _named(os.environ.get("XLA_FLAGS", "").split())
    return {k: v for k, v in COMPILER_OPTIONS.get(platform, {}).items()
            if k not in named} or None


def _named(flags: Sequence[str]) -> set[str]:
    """The option names ``flags`` set (``--name=value`` -> ``name``)."""
    return {f.split("=", 1)[0].lstrip("-") for f in flags}


def _flag(name: str, value: bool | int) -> str:
    return f"--{name}={str(value).lower() if isinstance(value, bool) else value}"


#: Per platform, the flags :func:`apply` adds (see the module docstring).
RECOMMENDED: dict[str, tuple[str, ...]] = {
    "gpu": (
        *(_flag(k, v) for k, v in COMPILER_OPTIONS["gpu"].items()),
        "--xla_gpu_enable_command_buffer=",
        "--xla_disable_hlo_passes=collective-permute-motion",
    ),
    "tpu": (),
    "cpu": (),
}


def recommended(platform: str) -> tuple[str, ...]:
    """The flags for ``platform`` (``"gpu"``, ``"tpu"`` or ``"cpu"``)."""
    if platform not in RECOMMENDED:
        raise ValueError(f"unknown platform {platform!r}: expected one of "
                         f"{', '.join(map(repr, RECOMMENDED))}")
    return RECOMMENDED[platform]


def apply(platform: str, env: MutableMapping[str, str] | None = None) -> str:
    """Add :func:`recommended` flags for ``platform`` to ``env["XLA_FLAGS"]`` (default
    ``os.environ``), keeping every flag already set there (a flag named there wins over
    ours). Returns the new ``XLA_FLAGS``. Has no effect on a backend JAX has started."""
    return _add_flags(recommended(platform), env)


def _add_flags(flags: Sequence[str], env: MutableMapping[str, str] | None) -> str:
    """``env["XLA_FLAGS"]`` (default ``os.environ``) with those of ``flags`` it does not
    name already (a flag named there wins). Returns the new ``XLA_FLAGS``."""
    env = os.environ if env is None else env
    have = env.get("XLA_FLAGS", "").split()
    names = _named(have)
    added = [f for f in flags if not _named([f]) & names]
    # XLA stops reading at the first token without "--" (JAX's FAQ suggests a bare
    # ``intra_op_parallelism_threads=1``): ours go before it, or XLA would ignore them
    bare = next((i for i, f in enumerate(have) if not f.startswith("--")), len(have))
    env["XLA_FLAGS"] = " ".join([*have[:bare], *added, *have[bare:]])
    return env["XLA_FLAGS"]


def attached_platform() -> str:
    """``"gpu"``, ``"tpu"`` or ``"cpu"``: the accelerator this machine has, from its device
    nodes, without starting JAX. An installed CUDA plugin or libtpu alone (what
    ahead-of-time compiles need, ``jaxpipe[aot]``) is not a device: on a machine without
    one, JAX would try to start it and fall back to the CPU with errors on every start."""
    import glob

    if os.path.exists("/dev/nvidiactl") or glob.glob("/dev/nvidia[0-9]*"):
        return "gpu"
    if glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"):
        return "tpu"
    return "cpu"


def cpu_unless_attached(env: MutableMapping[str, str] | None = None) -> None:
    """Set ``JAX_PLATFORMS=cpu`` (unless already set) on a machine with no accelerator
    attached (:func:`attached_platform`), before JAX starts."""
    env = os.environ if env is None else env
    if attached_platform() == "cpu":
        env.setdefault("JAX_PLATFORMS", "cpu")


def cpu_devices(count: int, env: MutableMapping[str, str] | None = None) -> str:
    """Ask XLA:CPU for ``count`` virtual devices, before JAX starts its backend: one
    process can then build and run a pipeline over a mesh of them (tests, benchmarks,
    examples). A device count already in ``env["XLA_FLAGS"]`` (default ``os.environ``)
    wins; the flag goes before a bare token XLA would stop reading at (see :func:`apply`).
    Returns the new ``XLA_FLAGS``."""
    return _add_flags([f"--xla_force_host_platform_device_count={count}"], env)


#: XLA:CPU's elemental IR emitter for fused loops in place of its MLIR fusion emitters. The
#: optimized HLO is the same; what goes is the MLIR context and pass pipeline XLA sets up for
#: every program and kernel, most of a small program's compile (a one-op program 31 -> 20
#: ms). For many small programs that are compiled and barely run: the test suite (1,650
#: -> 1,443 test-seconds) and ``benchmarks/run.py --quick`` (106 -> 55 s). Measured with
#: jaxlib 0.10.2 on 2 cores.
FAST_CPU_COMPILE = "--xla_cpu_use_fusion_emitters=false"

#: jaxlib releases known to read :data:`FAST_CPU_COMPILE` (XLA aborts at a flag it does not
#: know, so it is only ever added for these).
_FAST_CPU_COMPILE_JAXLIB = ("0.10.",)


def fast_cpu_compile(env: MutableMapping[str, str] | None = None) -> str:
    """Add :data:`FAST_CPU_COMPILE` to ``env["XLA_FLAGS"]`` (default ``os.environ``)
    before JAX starts, where the installed jaxlib is one known to read it and the flag is
    not already named there. Returns the new ``XLA_FLAGS``."""
    from importlib import metadata

    try:
        known = metadata.version("jaxlib").startswith(_FAST_CPU_COMPILE_JAXLIB)
    except metadata.PackageNotFoundError:
        known = False
    return _add_flags([FAST_CPU_COMPILE] if known else [], env)
