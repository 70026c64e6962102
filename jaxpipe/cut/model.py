"""Memory models: what the cutter needs to know about how a runtime lays out memory.

A runtime describes its layout with one :class:`MemoryModel` and hands it to the
cutter (``choose_cuts(..., memory_model=...)``); the cutter never copies a runtime's
layout. Two are predefined:

* :data:`SPMD_MEMORY`: jaxpipe's one-program SPMD runtime. All devices run the same
  program, so every buffer has the busiest device's shape, and parameters are
  whole-array slots, padded per ``(shape, dtype)`` to the device with the most.
* :data:`DEVICE_MEMORY`: each device holds exactly its own stages' bytes (MPMD).

The two formulas a runtime is most likely to change live here, as methods of the
model, and the cutter uses nothing else: :meth:`MemoryModel.residual_bytes` (what a
stage's stored residuals occupy) and :meth:`MemoryModel.workspace_bytes` (what a stage
needs while it runs, beyond everything stored).

This module also turns a model's parameter classes into the *padding groups* the
searches bound (:func:`param_groups`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxpipe.cost import SegmentCost

__all__ = ["MemoryModel", "SPMD_MEMORY", "DEVICE_MEMORY", "param_groups"]


@dataclass(frozen=True)
class MemoryModel:
    """How a runtime lays out memory across devices, as far as the cutter is concerned.

    Attributes:
      name: shown in plans and errors (``"spmd"``, ``"device"``).
      padded: ``True`` when every device allocates the busiest device's buffers
        (one SPMD program, one shape); the cutter then minimises the padded peak
        (``CutResult.padded_memory``). ``False`` when each device holds only its
        own stages' bytes (MPMD); it minimises ``max_device(own bytes)``.
      param_class: ``(shape, dtype name) -> storage class`` of a parameter leaf.
        Parameters are padded per class to the busiest device (SPMD whole-array
        slots: a device gets as many slots of a class as any device needs). ``None``:
        no per-class padding (all parameters pad as one group).
      workspace_residual_sets: transient memory while a stage runs its backward, in
        *full* residual sets of that stage: the residuals it would store without
        recomputation, whatever policy it uses (a backward reads or rebuilds them).
        ``Cut.workspace_residual_sets`` overrides it.
      workspace_param_sets: more transient memory while a stage runs, in parameter
        bytes of that stage (the parameter gradients a backward produces, and their
        sums with the accumulated ones). ``Cut.workspace_param_sets`` overrides it.

    Example (an MPMD runtime that measured about two sets of temporaries)::

        MemoryModel("mpmd", padded=False, param_class=None, workspace_residual_sets=2.0)
    """

    name: str
    padded: bool
    param_class: Callable[[tuple[int, ...], str], Hashable] | None
    workspace_residual_sets: float = 1.0
    workspace_param_sets: float = 0.0

    def __post_init__(self) -> None:
        for what in ("workspace_residual_sets", "workspace_param_sets"):
            if not getattr(self, what) >= 0:
                raise ValueError(f"MemoryModel.{what} must be >= 0, got {getattr(self, what)}")

    def residual_bytes(self, in_flight: Any, residual_set: Any) -> Any:
        """Bytes a stage's stored residuals occupy on its device.

        ``in_flight`` live sets of ``residual_set`` bytes each (numbers or broadcasting
        arrays: the searches call it on whole range matrices). A padded model allocates
        the largest per-device sum of these (plus transfers) on every device.
        """
        return in_flight * residual_set

    def workspace_bytes(self, full_residual_set: Any, param_bytes: Any) -> Any:
        """Transient bytes while a stage runs (numbers or broadcasting arrays).

        ``full_residual_set``: the stage's residual bytes without recomputation;
        ``param_bytes``: its parameter bytes. A device needs the workspace of its
        largest stage (a padded model: of the largest stage anywhere).
        """
        return (self.workspace_residual_sets * full_residual_set
                + self.workspace_param_sets * param_bytes)


#: jaxpipe's SPMD runtime: one program, buffers of one shape, parameters in
#: whole-array slots per (shape, dtype). Workspace: half the largest stage's full
#: residual set plus twice its parameter bytes. Measured on CPU (``compare_compiled``),
#: a backward holds 0.2-0.8 of its stage's full residual set as temporaries (slices
#: read from the residual storage, or recomputed activations: about the same for every
#: recomputation policy), plus the parameter gradients it produces and their
#: accumulated sums (the compiled branch does not add in place), about twice the
#: stage's parameter bytes; one full residual set alone over-predicted unbalanced GPT
#: cuts by 16% and under-predicted recomputed stages with large parameters by 28%.
SPMD_MEMORY = MemoryModel("spmd", True, lambda shape, dtype: (shape, dtype), 0.5, 2.0)

#: Each device holds only its own stages' bytes, as an MPMD runtime would.
DEVICE_MEMORY = MemoryModel("device", False, None, 1.0)


def _range_bytes(n: int, additive: np.ndarray, shared: list[tuple[list[int], float]]
                 ) -> np.ndarray:
    """Bytes of segment ranges ``[a, b)`` as an ``(n+1, n+1)`` matrix.

    ``additive[k]``: bytes only segment ``k`` reads. ``shared``: (reader segments,
    bytes) of leaves several segments read; such a leaf counts once if any of its
    readers lies in the range.
    """
    idx = np.arange(n + 1)
    pre = np.concatenate([[0.0], np.cumsum(additive)])
    out = pre[None, :] - pre[:, None]
    for segs, nbytes in shared:
        nxt = np.full(n + 1, n + 1)  # first reader at or after a
        for s in sorted(segs, reverse=True):
            nxt[: s + 1] = s
        out = out + nbytes * (nxt[:, None] < idx[None, :])
    return out


def param_groups(
    costs: Sequence[SegmentCost],
    param_class: Callable[[tuple[int, ...], str], Hashable] | None,
    single: bool,
) -> tuple[list[np.ndarray], float, np.ndarray]:
    """Parameter bytes of every range: per padding group, a constant, and in total.

    Under a padded model a device needs one slot per leaf of its stages, per storage
    class (``param_class`` of the leaf's shape and dtype), and every device gets the
    most slots of each class any device needs. So the padded bytes are a sum over
    classes of a maximum over devices. A class with a single leaf costs its bytes
    whatever the cut (when devices hold one stage each, or one segment reads it);
    classes whose per-segment bytes are proportional (the same block repeated) merge
    into one group. Leaves without a class (``param_class`` is ``None``, or
    hand-built costs without shapes) and private bytes form one group, which makes
    the padding ``max_device(params)``.

    Returns ``(groups, const, total)``: one ``(n+1, n+1)`` range matrix per group,
    the bytes every device holds whatever the cut, and the total parameter bytes of
    every range (``inf`` on empty ranges).
    """
    n = len(costs)
    readers: dict[int, list[int]] = {}
    nbytes: dict[int, int] = {}
    klass: dict[int, Any] = {}
    anon: Any = object()
    for k, c in enumerate(costs):
        for leaf, b in c.param_leaf_bytes.items():
            readers.setdefault(leaf, []).append(k)
            nbytes[leaf] = b
            if leaf not in klass:
                shape = c.param_leaf_shapes.get(leaf)
                klass[leaf] = (anon if param_class is None or shape is None
                               else param_class(tuple(shape[0]), str(shape[1])))
    members: dict[Any, list[int]] = {}
    for leaf, key in klass.items():
        members.setdefault(key, []).append(leaf)
    private = np.array([c.private_param_bytes for c in costs], np.float64)
    members.setdefault(anon, [])

    const = 0.0
    merged: dict[tuple, list[Any]] = {}  # proportional signature -> [additive, shared]
    total = np.zeros((n + 1, n + 1))
    for key, leaves in members.items():
        additive = private.copy() if key is anon else np.zeros(n)
        shared = []
        for leaf in leaves:
            if len(readers[leaf]) == 1:
                additive[readers[leaf][0]] += nbytes[leaf]
            else:
                shared.append((readers[leaf], float(nbytes[leaf])))
        matrix = _range_bytes(n, additive, shared)
        total += matrix
        if key is not anon and len(leaves) == 1 and (single or not shared):
            const += float(sum(nbytes[leaf] for leaf in leaves))
            continue
        if not additive.any() and not shared:
            continue
        if shared or key is anon:
            sig: tuple = ("own", id(key))
        else:  # proportional per-segment bytes merge
            sig = tuple(np.round(additive / additive.max(), 12))
        if sig in merged:
            merged[sig][0] += additive
            merged[sig][1] += shared
        else:
            merged[sig] = [additive, list(shared)]
    groups = [_range_bytes(n, add, sh) for add, sh in merged.values()]
    idx = np.arange(n + 1)
    total = np.where(idx[:, None] >= idx[None, :], np.inf, total)
    return groups, const, total
