"""Agreement across processes: every process of a multi-process run must build the same
pipeline and the same train step, or their programs' collectives never match and hang.

:func:`config_summary` is what must agree; :func:`differences` exchanges a summary
through ``jax.distributed``'s key-value store and names each field that differs, with
every process's value; :func:`check_consistent` (at every multi-process pipeline build)
and :func:`check_same_training` (``pipe.init``) raise a :class:`~jaxpipe.PipelineError`
from it. The public face is :mod:`jaxpipe.distributed`, which re-exports these.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

from jaxpipe.errors import PipelineError
from jaxpipe.jax_compat import distributed_client

__all__ = ["check_consistent", "check_same_training", "config_summary", "differences"]

# Bytes of the configuration summary exchanged by the device all-gather (fixed, so that
# every process runs the same gather even when the summaries differ).
_SUMMARY_BYTES = 8192


def config_summary(pipe) -> dict[str, Any]:
    """A JSON-able summary of everything that must agree across processes.

    ``pipe.inspect.fingerprint()``: schedule (class, p, m, v, every device's action
    list), cut, mesh shape and axis names, parameter and microbatch shapes/dtypes, what
    the loss returns (the reduction, ``has_aux`` and the shapes of its outputs: the
    program's final reductions move them), and the executor's digests (for SPMD, of the
    lowered tick table: what the compiled program's collectives depend on). ``pipe``: a
    pipeline (or its ``pipe.inspect``).
    """
    pipe = getattr(pipe, "inspect", pipe)  # what a built pipeline holds
    sched = pipe.schedule
    actions = {str(d): [str(a) for a in acts] for d, acts in sched.actions().items()}
    avals = pipe.traced.jaxpr.invars
    n = pipe.traced.num_params
    return {
        "schedule": f"{type(sched).__module__}.{type(sched).__qualname__}",
        "num_devices": sched.num_devices,
        "num_microbatches": sched.num_microbatches,
        "stages_per_device": sched.stages_per_device,
        "actions_sha256": _sha(json.dumps(actions, sort_keys=True)),
        "cuts": [int(c) for c in pipe.cuts],
        "mesh": {str(k): int(v) for k, v in pipe.mesh.shape.items()},
        "axis": pipe.axis,
        "params": [f"{tuple(v.aval.shape)}:{v.aval.dtype}" for v in avals[:n]],
        "params_tree_sha256": _sha(str(pipe.traced.params_treedef)),
        "microbatch": [f"{tuple(v.aval.shape)}:{v.aval.dtype}" for v in avals[n:]],
        "loss": {"reduction": pipe.objective.reduction, "has_aux": pipe.objective.has_aux,
                 "outputs": [f"{tuple(a.shape)}:{a.dtype}"
                             for a in pipe.traced.closed_jaxpr.out_avals]},
        "runtime": pipe.runtime.name,
        # only when used, so pipelines without them keep their fingerprint
        **({"batch_axes": list(pipe.batch_axes),
            "param_specs": _sha(str(pipe.param_dims))}
           if pipe.mesh_axes.param_axes else {}),
        **pipe.executor.fingerprint(),
    }


def _sha(data: str | bytes) -> str:
    if isinstance(data, str):
        data = data.encode()
    return hashlib.sha256(data).hexdigest()[:16]


def check_consistent(pipe) -> None:
    """Raise a :class:`PipelineError` if the pipeline differs between processes.

    Every process must call this (one small exchange, through the coordination
    service) after building the pipeline and before running it. Single-process it does
    nothing. The error names each field that differs and its value on every process,
    e.g.::

        the pipeline differs across processes (they would compile different programs
        and hang): num_microbatches: process 0: 4, process 1: 2. ...
    """
    import jax

    if jax.process_count() == 1:
        return
    diffs = differences(config_summary(pipe), "pipeline")
    if diffs:
        raise PipelineError(
            "the pipeline differs across processes (they would compile different programs "
            "whose collectives never match, and hang): " + diffs
            + ". Build the same pipeline (same schedule, num_microbatches, cut, mesh, "
            "parameter and batch shapes) in every process."
        )


def check_same_training(opt_state: Any, options: Any) -> None:
    """Raise a :class:`PipelineError` if ``pipe.init``'s optimizer differs between
    processes (its state's structure, shapes and dtypes: another optax transformation)
    or its train options do (clipping, non-finite skips): the processes would compile
    different steps and hang. Hyperparameters inside a transformation (a learning rate)
    are not seen. Every process calls it (``pipe.init``, several processes)."""
    import jax

    leaves = jax.tree_util.tree_flatten_with_path(opt_state)[0]
    diffs = differences({
        "optimizer_state": _sha(str(jax.tree.structure(opt_state)) + str(
            [(jax.tree_util.keystr(k), tuple(v.shape), str(v.dtype)) for k, v in leaves])),
        "options": repr(options)}, "init")
    if diffs:
        raise PipelineError(
            "pipe.init differs across processes (they would compile different train steps "
            f"and hang): {diffs}. Pass the same optimizer and train options in every "
            "process.")


def differences(summary: dict[str, Any], name: str) -> str:
    """Every field of ``summary`` (JSON-able) whose value differs between processes, with
    each process's value ("" where all agree); an exchange every process must make (the
    n-th of ``name`` meets the others' n-th). It goes through ``jax.distributed``'s
    key-value store, not the devices: a program of an earlier call may still be running
    its collectives, and gloo would mix the two (a device all-gather only where no
    client is found)."""
    client = distributed_client()
    summaries = (_allgather_json(summary) if client is None
                 else _exchange_json(client, summary, name))
    diffs = []
    for key in summary:
        vals = [s.get(key) for s in summaries]
        if any(v != vals[0] for v in vals):
            per = ", ".join(f"process {i}: {v}" for i, v in enumerate(vals))
            diffs.append(f"{key}: {per}")
    return "; ".join(diffs)


_EXCHANGES: dict[str, int] = {}  # per name, how many this process has made


def _exchange_json(client: Any, obj: Any, name: str) -> list[Any]:
    """Every process's ``obj`` through the coordination service's key-value store (the
    n-th exchange of ``name`` in every process meets the n-th of the others)."""
    import jax

    n = _EXCHANGES[name] = _EXCHANGES.get(name, -1) + 1
    key = f"jaxpipe/{name}/{n}"
    client.key_value_set(f"{key}/{jax.process_index()}", json.dumps(obj, sort_keys=True))
    return [json.loads(client.blocking_key_value_get(f"{key}/{i}", _EXCHANGE_TIMEOUT_MS))
            for i in range(jax.process_count())]


#: how long an exchange waits for the slowest process (it may still be compiling)
_EXCHANGE_TIMEOUT_MS = 30 * 60 * 1000


def _allgather_json(obj: Any) -> list[Any]:
    """Gather one small JSON-able object from every process (fixed-size byte buffer)."""
    from jax.experimental import multihost_utils

    raw = json.dumps(obj, sort_keys=True).encode()
    if len(raw) > _SUMMARY_BYTES - 8:
        # Too long to ship whole: ship a digest instead (still detects any difference).
        raw = json.dumps({"sha256": _sha(raw)}).encode()
    buf = np.zeros(_SUMMARY_BYTES, np.uint8)
    buf[:8] = np.frombuffer(np.int64(len(raw)).tobytes(), np.uint8)
    buf[8:8 + len(raw)] = np.frombuffer(raw, np.uint8)
    out = np.asarray(multihost_utils.process_allgather(buf))
    res = []
    for row in out:
        length = int(np.frombuffer(row[:8].tobytes(), np.int64)[0])
        res.append(json.loads(row[8:8 + length].tobytes().decode()))
    return res
