"""Parameter padding groups: a padded memory model's parameter bytes of every stage range.

Under a padded :class:`~jaxpipe.cut.memory_model.MemoryModel` (one SPMD program) a device
holds one slot per parameter leaf of its stages, per storage class, and every device
gets the most slots of each class any device needs. :func:`param_groups` turns the
segments' parameter leaves into the range matrices the searches bound.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np

from jaxpipe.cut.cost import SegmentCost

__all__ = ["param_groups"]


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
