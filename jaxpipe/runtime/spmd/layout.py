"""Where the SPMD program keeps each stage's values: parameter slots and flat layouts.

SPMD needs every device to hold buffers of one shape, while stages differ (embedding
first, head last). Parameters are whole-array *slots* (:class:`ParamSlots`); residuals,
hand-offs and messages are packed into flat per-dtype vectors (:class:`Layout`), whose
width per dtype is the maximum over what they must hold, so only that slack is padded.
:class:`StageLayouts` gathers every stage's layouts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from jaxpipe.runtime.spmd.lowering import Pool
from jaxpipe.stages import StageFn

__all__ = ["Layout", "ParamSlots", "StageLayouts", "merge_widths"]


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


@dataclass(frozen=True)
class StageLayouts:
    """Flat layouts of every stage's stored values and messages, and the parameter slots.

    Attributes:
      slots: the parameter slots of every device.
      residuals: all residuals a stage stores per microbatch (for sizes).
      pools: per :class:`~.lowering.Pool`, per stage, the part of its stored values kept
        in that pool: residuals only the input-gradient reads, residuals the
        weight-gradient reads too (``StageFn.w_res_ids``), and the I -> W hand-off.
      act_out / act_in: the forward message (stage carry) a stage sends / receives.
      ct_out / ct_in: the cotangent message a stage receives (for its differentiable
        carry out) / sends back (for its differentiable carry in).
      msg_width: elements per dtype of one message slot (fits every message).
    """

    slots: ParamSlots
    residuals: list[Layout]
    pools: dict[Pool, list[Layout]]
    act_out: list[Layout]
    act_in: list[Layout]
    ct_out: list[Layout]
    ct_in: list[Layout]
    msg_width: dict[str, int]

    @classmethod
    def build(cls, stages: Sequence[StageFn], param_avals: Sequence,
              device_stages: Sequence[Sequence[int]]) -> StageLayouts:
        pools = {
            Pool.RESIDUAL_A: [Layout([st.residual_avals[i] for i in st.i_only_residual_ids])
                              for st in stages],
            Pool.RESIDUAL_B: [Layout([st.residual_avals[i] for i in st.w_res_ids])
                              for st in stages],
            Pool.HANDOFF: [Layout(st.w_residual_avals) for st in stages],
        }
        act_out = [Layout([] if st.is_last else st.out_avals) for st in stages]
        ct_in = [Layout(st.ct_in_avals()) for st in stages]
        return cls(
            slots=ParamSlots(stages, param_avals, device_stages),
            residuals=[Layout(st.residual_avals) for st in stages],
            pools=pools,
            act_out=act_out,
            act_in=[Layout(st.in_avals) for st in stages],
            ct_out=[Layout([] if st.is_last else st.ct_out_avals()) for st in stages],
            ct_in=ct_in,
            msg_width=merge_widths(act_out + ct_in),
        )

    def pool_sizes(self) -> dict[Pool, list[dict[str, int]]]:
        """Per pool, per stage, elements per dtype one microbatch stores (for lowering)."""
        return {pool: [lay.sizes for lay in layouts] for pool, layouts in self.pools.items()}
