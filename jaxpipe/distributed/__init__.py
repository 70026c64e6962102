"""Multi-process helpers: start ``jax.distributed``, build global inputs, check agreement.

A jaxpipe pipeline is one SPMD program. With several processes (several hosts, or
several local processes started by ``python -m jaxpipe.launch``) every process runs
the *same* Python script, builds the *same* :class:`~jaxpipe.Pipeline` over a mesh of
all global devices (``jax.devices()``), and calls it with *global* ``jax.Array`` inputs.
JAX's multi-controller runtime then runs one program across all of them; the
``ppermute`` between pipeline stages crosses processes where the mesh does.

Typical script (works unchanged single-process, under the launcher and on a cluster)::

    import jax
    import jaxpipe as jp
    from jaxpipe import distributed as jpd

    jpd.initialize()                                  # before any other jax call
    mesh = jax.make_mesh((jax.device_count(),), ("pipe",))
    params = jpd.replicate(params, mesh)             # same values on every process
    batch = jpd.global_batch(local_batch, mesh)      # this process's rows
    pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh, schedule=...)
    jpd.check_consistent(pipe)                       # clear error, not a hang
    loss, grads = pipe.value_and_grad(params, batch)
    grads = jpd.fetch(grads)                         # numpy, on every process

The three things that differ from single-process use:

1. ``initialize()`` must run before anything touches the JAX backend.
2. Inputs must be global arrays: a numpy array in one process is only that process's
   view; :func:`global_batch` and :func:`replicate` build global arrays from it.
3. Every process must build the same pipeline. If one process uses, say, a different
   ``num_microbatches``, the processes would compile different programs whose
   collectives never match up and hang; :func:`check_consistent` compares a summary of
   the configuration across processes and raises a :class:`~jaxpipe.PipelineError`
   naming the field that differs instead.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxpipe.distributed.agreement import (
    check_consistent,
    check_same_training,
    config_summary,
    differences,
)
from jaxpipe.errors import PipelineError
from jaxpipe.jax_compat import cluster_environments, distributed_client
from jaxpipe.transport_threads import idle_transport_threads

__all__ = [
    "ENV_COORDINATOR",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "check_consistent",
    "check_same_training",
    "config_summary",
    "differences",
    "fetch",
    "global_batch",
    "initialize",
    "replicate",
]

#: Environment variables set by ``python -m jaxpipe.launch`` and read by :func:`initialize`.
ENV_COORDINATOR = "JAXPIPE_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAXPIPE_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXPIPE_PROCESS_ID"
ENV_INIT_TIMEOUT = "JAXPIPE_INIT_TIMEOUT"
ENV_HEARTBEAT_TIMEOUT = "JAXPIPE_HEARTBEAT_TIMEOUT"

def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    cpu_collectives: str | None = "gloo",
    initialization_timeout: int | None = None,
    heartbeat_timeout: int | None = None,
    require: bool = False,
    transport_threads: str = "idle",
) -> bool:
    """Start JAX's multi-controller runtime (``jax.distributed.initialize``) if needed.

    Where the process count and coordinator come from, first match wins:

    1. the arguments;
    2. the ``JAXPIPE_*`` environment variables set by ``python -m jaxpipe.launch``;
    3. JAX's own cluster auto-detection (SLURM, Open MPI, Kubernetes/GKE, Cloud TPU),
       i.e. ``jax.distributed.initialize()`` with no arguments.

    If none applies the script runs single-process and this returns ``False`` (set
    ``require=True`` to raise instead). Call it before any other JAX call. Under the
    launcher, an uncaught exception ends the process at once (exit code 1) rather than
    in JAX's shutdown barrier, which waits for processes still inside a collective; the
    launcher then stops the others.

    Args:
      coordinator_address: ``host:port`` of process 0's coordination service.
      num_processes: total number of processes.
      process_id: this process's index in ``[0, num_processes)``.
      cpu_collectives: the CPU cross-process collectives backend (``"gloo"``; or
        ``"mpi"``). Without one, CPU computations cannot span processes. ``None``
        leaves JAX's setting alone.
      initialization_timeout: seconds to wait for all processes to connect (JAX's
        default is 300; the launcher passes its own ``--timeout``).
      heartbeat_timeout: seconds after which a process that stopped answering is
        declared dead and the others are shut down instead of waiting forever.
      require: raise if no multi-process configuration is found.
      transport_threads: with gloo, ``"idle"`` (default) starts JAX's backend here and,
        where it is the CPU, gives gloo's event-loop threads Linux's ``SCHED_IDLE`` policy
        (:mod:`jaxpipe.transport_threads`): they poll all the time, and at normal
        priority they take part of the compute core (2 processes pinned to a core each:
        a 128 KiB permute after 1.4 ms of compute 0.95 -> 0.15 ms; an 8 x 512 MLP's
        interleaved 1F1B step at m=16 151 -> 112 ms; benchmarks/README.md).
        ``"normal"`` leaves them alone.

    Returns:
      ``True`` if ``jax.distributed`` was initialized (now or before), else ``False``.
    """
    import jax

    if _already_initialized():
        return True
    env = os.environ
    launched = process_id is None and ENV_PROCESS_ID in env  # by python -m jaxpipe.launch
    if coordinator_address is None and ENV_COORDINATOR in env:
        coordinator_address = env[ENV_COORDINATOR]
    if num_processes is None and ENV_NUM_PROCESSES in env:
        num_processes = int(env[ENV_NUM_PROCESSES])
    if process_id is None and ENV_PROCESS_ID in env:
        process_id = int(env[ENV_PROCESS_ID])
    if initialization_timeout is None and ENV_INIT_TIMEOUT in env:
        initialization_timeout = int(env[ENV_INIT_TIMEOUT])
    if heartbeat_timeout is None and ENV_HEARTBEAT_TIMEOUT in env:
        heartbeat_timeout = int(env[ENV_HEARTBEAT_TIMEOUT])

    if transport_threads not in ("idle", "normal"):
        raise PipelineError(f"transport_threads={transport_threads!r}: pass 'idle' (gloo's "
                            "event-loop threads never take a core from computation) or "
                            "'normal' (leave them as JAX starts them).")
    explicit = (coordinator_address, num_processes, process_id)
    if any(v is not None for v in explicit) and any(v is None for v in explicit):
        raise PipelineError(
            "initialize needs coordinator_address, num_processes and process_id together "
            f"(got {coordinator_address!r}, {num_processes!r}, {process_id!r}); pass all "
            "three, or none to use the launcher's environment or cluster auto-detection."
        )
    if not any(v is not None for v in explicit) and not _cluster_detected():
        if require:
            raise PipelineError(
                "no multi-process configuration found: start the script with "
                "`python -m jaxpipe.launch --nproc N script.py`, on a cluster JAX detects "
                "(SLURM, Open MPI, Kubernetes, Cloud TPU), or pass coordinator_address, "
                "num_processes and process_id."
            )
        return False
    if cpu_collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    kwargs: dict[str, Any] = {}
    if initialization_timeout is not None:
        kwargs["initialization_timeout"] = initialization_timeout
    if heartbeat_timeout is not None:
        kwargs["heartbeat_timeout_seconds"] = heartbeat_timeout
    jax.distributed.initialize(coordinator_address, num_processes, process_id, **kwargs)
    if launched:
        _exit_on_uncaught()
    if transport_threads == "idle" and jax.config.jax_cpu_collectives_implementation == "gloo":
        # (starting the backend here; an accelerator host's is left alone)
        idle_transport_threads(lambda: jax.default_backend() == "cpu")
    return True


def _exit_on_uncaught() -> None:
    """Under ``python -m jaxpipe.launch``: an uncaught exception ends the process at once
    (its traceback printed, exit code 1). Otherwise JAX's shutdown barrier waits for the
    processes still inside a collective, minutes, before the launcher sees any exit and
    stops them."""
    import sys

    hook = sys.excepthook

    def excepthook(kind: type, value: BaseException, tb: Any) -> None:
        hook(kind, value, tb)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    sys.excepthook = excepthook


def _already_initialized() -> bool:
    return distributed_client() is not None  # (private API moved: None, not initialized)


def _cluster_detected() -> bool:
    """True if one of JAX's cluster environments (SLURM, MPI, k8s, TPU) is present."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        return True
    return any(env.is_env_present() for env in cluster_environments())


# ------------------------------------------------------------------------- inputs
def _data_axes(mesh, axis: str, data_axes: Sequence[str] | None) -> tuple[str, ...]:
    if data_axes is not None:
        return tuple(data_axes)
    return tuple(a for a in mesh.axis_names if a != axis)


def global_batch(local_batch: Any, mesh, *, axis: str = "pipe",
                 data_axes: Sequence[str] | None = None) -> Any:
    """Build a global batch (``jax.Array`` leaves) from this process's part of it.

    Along the pipeline axis every device needs the whole batch of its data-parallel
    group, so the batch is *replicated* over ``axis`` and *sharded* over the other
    mesh axes (``data_axes``, default: every axis but ``axis``). Each process passes
    the rows that belong to its devices (``jax.make_array_from_process_local_data``):

    - mesh with only a ``pipe`` axis: every process passes the **full** batch (the same
      values everywhere);
    - ``data x pipe`` mesh: each process passes its data shard's rows; the global
      batch size is the sum over processes.

    Single-process it is equivalent to ``jax.device_put`` with that sharding.
    """
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    daxes = _data_axes(mesh, axis, data_axes)
    sharding = NamedSharding(mesh, P(daxes if daxes else None))

    def one(x):
        x = np.asarray(x)
        if x.ndim == 0:
            raise PipelineError(
                "global_batch: batch leaves need a leading batch axis; got a scalar."
            )
        return jax.make_array_from_process_local_data(sharding, x)

    return jax.tree.map(one, local_batch)


def replicate(tree: Any, mesh) -> Any:
    """Place a pytree replicated on every device of ``mesh`` (e.g. initial parameters).

    Every process must pass the same values (e.g. the same ``jax.random.key`` seed):
    nothing compares them (:func:`check_consistent` compares shapes and the program,
    not values); use ``jax.experimental.multihost_utils.assert_equal`` if unsure.
    """
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    sharding = NamedSharding(mesh, P())
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), tree
    )


def fetch(tree: Any) -> Any:
    """Copy a pytree of (possibly multi-process) ``jax.Array`` s to numpy on every process.

    Fully replicated arrays are read from a local shard (no communication); sharded
    arrays that span processes are gathered with ``process_allgather`` (a collective:
    every process must call ``fetch`` on the same tree).
    """
    import jax
    from jax.experimental import multihost_utils

    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(x)
        if x.sharding.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    return jax.tree.map(one, tree)
