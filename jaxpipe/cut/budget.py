"""The memory budget ``cut="auto"`` uses: the device's own limit, minus a stated reserve.

JAX reports a device's allocator limit as ``device.memory_stats()["bytes_limit"]`` on
GPU and TPU (what the allocator may hand out, after ``XLA_PYTHON_CLIENT_MEM_FRACTION``
on GPU); a compile-only device (an ahead-of-time target, :mod:`jaxpipe.aot`) has the
capacity of its kind (:mod:`jaxpipe.sharding.device_memory`); CPU devices report nothing, so there
``cut="auto"`` is the plain compute-balanced cut, as before. :func:`auto_cut` turns the limit into a
:class:`~jaxpipe.cut.Cut` with ``memory_budget`` and ``remat="auto"``: the fastest cut
and recomputation that fit.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from jaxpipe.cut.options import Cut
from jaxpipe.jaxpr.avals import format_bytes
from jaxpipe.sharding.device_memory import capacity, is_compile_only

__all__ = ["AUTO_RESERVE", "auto_cut", "device_memory_limit"]

#: Fraction of the device limit ``cut="auto"`` keeps out of the budget: XLA's own
#: scratch space and fragmentation, and the memory model's error (its predictions are
#: within 15% of the compiled programs it was checked on, most within 10%).
AUTO_RESERVE = 0.10


def device_memory_limit(devices: Iterable[Any]) -> tuple[int, str] | None:
    """The smallest memory capacity among ``devices`` and where it comes from (e.g.
    ``"NVIDIA H100 bytes_limit"``); ``None`` when any of them does not report one (CPU).

    Devices of another process are skipped (their stats are not readable here), except
    compile-only ones, which belong to no process and whose capacity is their kind's.
    """
    found: list[tuple[int, str]] = []
    for device in devices:
        if (not is_compile_only(device)
                and getattr(device, "process_index", 0) != _process_index()):
            continue  # another host's device: its stats are not readable here
        cap = capacity(device)  # ValueError for a compile-only device of unknown kind
        if cap is None:
            return None
        found.append((cap.bytes, cap.source))
    return min(found) if found else None


def _process_index() -> int:
    import jax

    return jax.process_index()


def auto_cut(devices: Iterable[Any], held_bytes: int = 0, reserve: float = AUTO_RESERVE
             ) -> Cut:
    """What ``cut="auto"`` means on ``devices``.

    With a device limit: ``Cut(memory_budget=limit * (1 - reserve) - held_bytes,
    remat="auto")``, where ``held_bytes`` is what every device holds besides what the
    cutter models (the batch). Without one (CPU): ``Cut()``.
    """
    found = device_memory_limit(devices)
    if found is None:
        return Cut()
    limit, where = found
    budget = int(limit * (1.0 - reserve)) - int(held_bytes)
    source = (f"device memory: {where} {format_bytes(limit)} minus a "
              f"{reserve:.0%} reserve")
    if held_bytes:
        source += f" and {format_bytes(held_bytes)} of batch"
    return Cut(memory_budget=max(budget, 1), remat="auto", budget_source=source)
