"""How much memory a device offers a program, for real and for compile-only devices.

A device JAX can run on reports its allocator limit (``device.memory_stats()
["bytes_limit"]`` on GPU and TPU; CPU reports nothing). A *compile-only* device (from
``jax.experimental.topologies``, what ahead-of-time compiles for a TPU or GPU target use)
reports nothing either, so its capacity comes from what is known of its kind:

- TPU: the HBM XLA:TPU says is available to one device, read from libtpu 0.0.42's own
  out-of-memory message ("exceeds available HBM (15.75G)") on each topology
  (:data:`TPU_HBM`);
- GPU: the ``device_memory_size`` of the target config the compile-only topology was
  made with; :mod:`jaxpipe.aot.targets` registers each config it makes
  (:func:`register`).

This module imports nothing of jaxpipe: the cutter's budget and the ahead-of-time tools
both read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["TPU_HBM", "Capacity", "capacity", "is_compile_only", "register"]

_GIB = 1 << 30

#: Per TPU ``device_kind``: the bytes of HBM XLA:TPU lets one device's program use
#: (libtpu 0.0.42, measured from its RESOURCE_EXHAUSTED message on a deviceless compile;
#: v4 counts per TensorCore: a v4 topology has two devices a chip).
TPU_HBM: dict[str, int] = {
    "TPU v4": int(15.25 * _GIB),
    "TPU v5 lite": int(15.75 * _GIB),
    "TPU v5": int(95.74 * _GIB),
    "TPU v5p": int(95.74 * _GIB),
    "TPU v6 lite": int(31.25 * _GIB),
}

# device_kind -> bytes, for compile-only GPU topologies made from a known config
_REGISTERED: dict[str, int] = {}


@dataclass(frozen=True)
class Capacity:
    """A device's memory for one program: ``bytes`` and where the figure comes from."""

    bytes: int
    source: str


def register(device_kind: str, nbytes: int) -> None:
    """Record that compile-only devices of ``device_kind`` have ``nbytes`` of memory."""
    _REGISTERED[device_kind] = int(nbytes)


def is_compile_only(device: Any) -> bool:
    """Whether ``device`` exists only to compile for (a topology's device): nothing runs
    on it and nothing can be placed on it."""
    client = getattr(device, "client", None)
    return getattr(client, "runtime_type", "") == "compile_only_runtime"


def capacity(device: Any) -> Capacity | None:
    """The memory one program may use on ``device``; ``None`` where nothing says (CPU).

    Raises ``ValueError`` for a compile-only device of an unknown kind, since a budget
    silently missing there would let the cutter plan a program that does not fit.
    """
    kind = str(getattr(device, "device_kind", device))
    if is_compile_only(device):
        if kind in _REGISTERED:
            return Capacity(_REGISTERED[kind], f"target config of {kind!r}")
        if kind in TPU_HBM:
            return Capacity(TPU_HBM[kind], f"{kind} HBM available to XLA:TPU")
        raise ValueError(
            f"no memory capacity is known for compile-only devices of kind {kind!r}; make "
            "the mesh with jaxpipe.aot.target(...) (which knows its devices' memory), or "
            "pass cut=jp.Cut(memory_budget=BYTES) to set the budget yourself.")
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without memory stats
        return None
    if not stats or not stats.get("bytes_limit"):
        return None
    return Capacity(int(stats["bytes_limit"]), f"{kind} bytes_limit")
