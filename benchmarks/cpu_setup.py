"""Before jax starts: the CPU setup of a standalone benchmark script (imports no jax)."""

from __future__ import annotations

import os

#: Single-threaded XLA:CPU, as JAX's FAQ gives it. XLA stops reading ``XLA_FLAGS`` at the
#: bare ``intra_op_parallelism_threads=1``: this string goes last (:func:`with_flags`).
SINGLE_THREAD_FLAGS = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"


def with_flags(*flags: str) -> str:
    """``XLA_FLAGS`` of ``flags`` then :data:`SINGLE_THREAD_FLAGS` (last, see there)."""
    return " ".join([*(f for f in flags if f), SINGLE_THREAD_FLAGS])


def virtual_cpus(devices: int) -> None:
    """``devices`` virtual CPU devices (:func:`jaxpipe.xla_flags.cpu_devices`; a count
    already in ``XLA_FLAGS`` wins), XLA's threads left as they are."""
    from jaxpipe.xla_flags import cpu_devices  # (imports no jax)

    cpu_devices(devices)


def single_core_cpu(devices: int) -> None:
    """``devices`` virtual CPU devices and single-threaded XLA, the process pinned to one
    core: devices take turns, so time measures total work. Flags already in
    ``XLA_FLAGS`` win."""
    from jaxpipe.xla_flags import cpu_devices  # (imports no jax)

    flags = cpu_devices(devices)
    if "multi_thread_eigen" not in flags:
        flags += " " + SINGLE_THREAD_FLAGS
    os.environ["XLA_FLAGS"] = flags.strip()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})


def pin_to_core(core: int | None) -> int | None:
    """Pin this process to the ``core``-th core (modulo their count, when there are at
    least two); returns the core, or ``None`` where nothing was pinned.

    The candidates are all of the machine's cores, not this process's inherited
    affinity: ``run.py`` pins itself to one core and its children inherit that.
    """
    if core is None or not hasattr(os, "sched_setaffinity"):
        return None
    try:
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
    except OSError:
        pass  # a cpuset may forbid some cores; use what we are allowed
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    target = cores[core % len(cores)]
    os.sched_setaffinity(0, {target})
    return target
