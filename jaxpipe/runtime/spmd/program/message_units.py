"""A message as the tick programs move it: a unit of rows per storage class.

Every tick program (:mod:`.cpu_ticks`, :mod:`.accelerator_ticks`, :mod:`.lane_ticks`)
writes arriving messages into inbox slots (:func:`write_unit`) and, where a permutation
moves one byte buffer instead of one array per class, packs and unpacks them
(:func:`pack`, :func:`unpack`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxpipe.runtime.spmd.program.layout import Bufs

__all__ = ["pack", "unpack", "write_unit"]


def write_unit(buf: Bufs, msg: Bufs, slot: Any, unit: dict) -> Bufs:
    """``buf`` (an inbox) with message ``msg`` written at its slot ``slot``."""
    return {c: lax.dynamic_update_slice_in_dim(buf[c], msg[c], slot * n, 0,
                                               allow_negative_indices=False)
            for c, n in unit.items()}


def pack(msg: Bufs, unit: dict, packed: bool) -> Any:
    """A message as what a permutation moves: one byte buffer (``packed``), or the unit
    itself."""
    if not packed:
        return msg
    return jnp.concatenate([_bytes(msg[c]).reshape(-1) for c in unit])


def unpack(payload: Any, unit: dict, packed: bool) -> Bufs:
    """:func:`pack` undone."""
    if not packed:
        return payload
    out, at = {}, 0
    for c, n in unit.items():
        shape = (n, *c.row_shape)
        size = int(np.prod(shape)) * np.dtype(c.dtype).itemsize
        out[c] = _from_bytes(payload[at:at + size], shape, c.dtype)
        at += size
    return out


def _bytes(x: jax.Array) -> jax.Array:
    """``x`` as uint8, one trailing byte axis for wider dtypes."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8)
    return lax.bitcast_convert_type(x, jnp.uint8)


def _from_bytes(b: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return b.reshape(shape).astype(jnp.bool_)
    if dtype.itemsize == 1:
        return lax.bitcast_convert_type(b.reshape(shape), dtype)
    return lax.bitcast_convert_type(b.reshape(*shape, dtype.itemsize), dtype)
