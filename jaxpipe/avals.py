"""Facts about abstract values used by every layer: size in bytes, differentiability.

One definition each, so that the cost model, the stage splitter, the runtimes and the
plan agree on what "differentiable" means and how big a value is.
"""

from __future__ import annotations

import math
from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = ["aval_bytes", "format_bytes", "is_differentiable"]


def is_differentiable(aval: Any) -> bool:
    """True for inexact (floating or complex) values: those jaxpipe differentiates.

    Integer and boolean values (token ids, masks, step counters) and extended dtypes
    (PRNG keys) flow through stages as non-differentiable inputs.
    """
    dtype = getattr(aval, "dtype", None)
    # jnp.issubdtype knows bfloat16/float8 and extended dtypes (PRNG keys: False)
    return dtype is not None and bool(jnp.issubdtype(dtype, jnp.inexact))


def aval_bytes(aval: Any) -> int:
    """Bytes of one value of abstract type ``aval`` (0 for tokens and the like)."""
    dtype = getattr(aval, "dtype", None)
    shape = getattr(aval, "shape", None)
    if dtype is None or shape is None:
        return 0
    try:
        itemsize = int(np.dtype(dtype).itemsize)
    except TypeError:  # extended dtypes (PRNG keys) know their own size
        itemsize = int(getattr(dtype, "itemsize", 0) or 0)
    return int(math.prod(shape)) * itemsize


def format_bytes(nbytes: float) -> str:
    """``1536 -> '1.50 KiB'``: binary units, two decimals, plain bytes below 1 KiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} B"
