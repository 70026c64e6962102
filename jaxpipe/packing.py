"""Pack lists of arrays of mixed shapes into one flat vector per dtype, and back.

SPMD needs every device to hold buffers of one shape, while stages differ (embedding
first, head last). Each stage's parameters, residuals and messages are therefore packed
into flat per-dtype vectors; a buffer's width per dtype is the maximum over what it must
hold, so only that slack is padded.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import jax.numpy as jnp
import numpy as np

__all__ = ["Layout", "merge_widths"]


def _key(dtype) -> str:
    return np.dtype(dtype).name


class Layout:
    """Where each array of a fixed list of avals lives inside per-dtype flat vectors."""

    def __init__(self, avals: Sequence):
        self.avals = list(avals)
        self.slots: list[tuple[str, int, int]] = []  # (dtype key, offset, size)
        sizes: dict[str, int] = {}
        for a in self.avals:
            k = _key(a.dtype)
            n = math.prod(a.shape)
            self.slots.append((k, sizes.get(k, 0), n))
            sizes[k] = sizes.get(k, 0) + n
        self.sizes = sizes

    def pack(self, leaves: Sequence, widths: dict[str, int]) -> dict[str, jnp.ndarray]:
        """Flatten ``leaves`` into ``{dtype: vector of widths[dtype]}``, zero padded."""
        parts: dict[str, list] = {k: [] for k in widths}
        for (k, _, _), x in zip(self.slots, leaves, strict=True):
            parts[k].append(jnp.ravel(x))
        out = {}
        for k, w in widths.items():
            used = self.sizes.get(k, 0)
            pad = [jnp.zeros((w - used,), k)] if w > used else []
            vec = parts[k] + pad
            out[k] = jnp.concatenate(vec) if len(vec) > 1 else (vec[0] if vec else
                                                                 jnp.zeros((0,), k))
        return out

    def unpack(self, flat: dict[str, jnp.ndarray]) -> list:
        """Inverse of :meth:`pack` (ignores the padding)."""
        return [
            flat[k][off:off + n].reshape(a.shape)
            for (k, off, n), a in zip(self.slots, self.avals, strict=True)
        ]


def merge_widths(layouts: Iterable[Layout]) -> dict[str, int]:
    """Per-dtype width that can hold any of ``layouts`` (sorted keys, deterministic)."""
    w: dict[str, int] = {}
    for lay in layouts:
        for k, n in lay.sizes.items():
            w[k] = max(w.get(k, 0), n)
    return dict(sorted(w.items()))


class ParamSlots:
    """Parameters as a list of whole arrays ("slots") that every device holds.

    Each stage's parameter leaves are assigned to slots of the same shape and dtype on
    its device; a device needs as many slots of a shape as its stages have leaves of
    that shape, and every device gets the maximum. Homogeneous stages need no padding
    at all; a heterogeneous stage (an embedding) costs one slot of its shape on every
    device. Whole arrays (no flat packing) let the stage code use parameters and
    accumulate gradients in place, without per-tick copies.
    """

    def __init__(self, stages, param_avals: Sequence, device_stages: Sequence[Sequence[int]]):
        counts: dict[tuple, int] = {}
        assign: dict[tuple[int, int], tuple[tuple, int]] = {}
        for mine in device_stages:
            used: dict[tuple, int] = {}
            for s in mine:
                for j, pid in enumerate(stages[s].param_ids):
                    a = param_avals[pid]
                    key = (tuple(a.shape), _key(a.dtype))
                    assign[(s, j)] = (key, used.get(key, 0))
                    used[key] = used.get(key, 0) + 1
            for key, n in used.items():
                counts[key] = max(counts.get(key, 0), n)
        self.slots = [(key, i) for key in sorted(counts) for i in range(counts[key])]
        index = {slot: n for n, slot in enumerate(self.slots)}
        self.shapes = [key[0] for key, _ in self.slots]
        self.dtypes = [key[1] for key, _ in self.slots]
        self.stage_slots: list[list[int]] = [
            [index[assign[(st.index, j)]] for j in range(len(st.param_ids))] for st in stages
        ]

    def __len__(self) -> int:
        return len(self.slots)

    def nbytes(self) -> int:
        """Bytes of one device's slots."""
        return sum(math.prod(s) * np.dtype(d).itemsize
                   for s, d in zip(self.shapes, self.dtypes, strict=True))
