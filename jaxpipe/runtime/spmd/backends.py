"""What the SPMD runtime needs to know of the backends it builds programs for.

The programs it builds (:data:`BACKENDS`), how it prices a permutation against the
cutter's FLOP costs (:func:`exchange_flops`), how hard the lowering's local search works
where devices run concurrently (:data:`REFINE_EVALS`), and what a mesh's devices are.
"""

from __future__ import annotations

from typing import Any

import jax

from jaxpipe.errors import PipelineError

__all__ = ["BACKENDS", "EXCHANGE_LATENCY_FLOPS", "LINK_FLOPS_PER_BYTE", "REFINE_EVALS",
           "STORED_BYTE_TICK_FLOPS", "TICK_OVERHEAD_FLOPS", "concurrent", "exchange_flops",
           "packed_w_error",
           "platform_of"]

#: The programs :class:`SpmdRuntime` builds.
BACKENDS = ("auto", "cpu", "gpu", "tpu")

#: Nominal FLOPs a device computes in the time its link to a neighbour moves one byte,
#: and in the fixed time of one permutation (launch, handshake): what
#: ``SpmdRuntime(overlap="auto")`` prices an exchange at against the cutter's FLOP
#: costs. GPU: H100/H200-class, ~4e14 FLOP/s sustained, ~4e11 B/s NVLink a direction,
#: ~10 us a permutation; TPU: v5-class, ~2e14 FLOP/s, ~1e11 B/s ICI, ~10 us. Estimates,
#: not measurements: pass ``overlap=True`` / ``False`` where a measurement says
#: otherwise.
LINK_FLOPS_PER_BYTE = {"gpu": 1.0e3, "tpu": 2.0e3}
EXCHANGE_LATENCY_FLOPS = {"gpu": 4.0e9, "tpu": 2.0e9}


def exchange_flops(backend: str, message_bytes: int) -> float:
    """One permutation of a ``message_bytes`` message, in FLOPs of compute time."""
    return message_bytes * LINK_FLOPS_PER_BYTE[backend] + EXCHANGE_LATENCY_FLOPS[backend]


#: The fixed time of one tick of the program, in FLOPs of compute time, that
#: ``schedule="auto"`` adds per tick when it ranks schedules (:mod:`.predict`): CPU,
#: what ``jaxpipe calibrate`` measured on a 2-core Xeon, ~150 us a tick at ~8e10 FLOP/s
#: (1.22e7 with 4 virtual devices taking turns, 1.23e7 with 2 processes of one core
#: each, gloo; benchmarks/sections/auto.py); GPU and TPU, the latency of a permutation
#: (:data:`EXCHANGE_LATENCY_FLOPS`), estimates: no device was measured.
TICK_OVERHEAD_FLOPS = {"cpu": 1.2e7, "gpu": 4.0e9, "tpu": 2.0e9}

#: What every byte a device stores (its residual buffers) costs a tick, in FLOPs of
#: compute time: the tick loop carries the buffers through every tick. CPU: 1.0, what
#: ``jaxpipe calibrate`` measured on a 2-core Xeon from GPipe against 1F1B (the same work
#: and ticks; GPipe stores 4x the bytes): 0.99 with 4 virtual devices taking turns, 2.6
#: with 2 processes. GPU and TPU: 0, an assumption (no device measured). ``jaxpipe
#: calibrate`` measures it on yours.
STORED_BYTE_TICK_FLOPS = {"cpu": 1.0, "gpu": 0.0, "tpu": 0.0}


#: Local-search evaluations over the ticks where devices run concurrently
#: (:mod:`.lowering.refine`): 0.3-0.7 s of lowering at p=8, m=16-32, at most ~0.8 s at p=64.
REFINE_EVALS = 1200


def packed_w_error(backend: str) -> PipelineError:
    return PipelineError(
        "iw_same_tick=True runs a W as a second step in its I's tick; the accelerator "
        f"program (backend={backend!r}) runs one step per tick. Use iw_same_tick=False or "
        "'auto', or backend='cpu'.")


def platform_of(mesh: Any = None) -> str:
    """The platform of ``mesh``'s devices (a compile-only TPU or GPU mesh included: the
    program is built for the devices it will run on, not for this process's backend)."""
    if mesh is not None:
        return mesh.devices.flat[0].platform
    return jax.default_backend()


def concurrent(mesh: Any = None) -> bool:
    """Whether the pipeline's devices run at the same time (an accelerator, or several
    processes); virtual CPU devices in one process take turns, and there the grouping of
    actions into ticks costs nothing."""
    return platform_of(mesh) != "cpu" or jax.process_count() > 1
