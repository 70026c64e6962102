"""Facts about abstract values used by every layer: size in bytes, differentiability, and
how a value crosses a stage boundary (PRNG keys as their key data).

One definition each, so that the cost model, the stage splitter, the runtimes and the
plan agree on what "differentiable" means and how big a value is.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpipe.jax_compat import key_impl

__all__ = ["aval_bytes", "boundary_aval", "format_bytes", "from_boundary",
           "is_differentiable", "is_key", "to_boundary"]


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


def is_key(aval: Any) -> bool:
    """True for PRNG key values (``jax.random.key``): an extended dtype."""
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def shard_bytes(aval: Any) -> int:
    """Bytes one device holds of a value of type ``aval``: with sharding in types
    (Explicit mesh axes), its bytes divided by the axes its type shards it over."""
    nbytes = aval_bytes(aval)
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or sharding.spec is None:
        return nbytes
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    shards = math.prod(sizes[a] for e in sharding.spec if e is not None
                       for a in ((e,) if isinstance(e, str) else e))
    return nbytes // shards


def typed_sds(aval: Any, shape: Any = None) -> jax.ShapeDtypeStruct:
    """``aval`` as a ``ShapeDtypeStruct`` to trace with (``shape``: another shape), keeping
    a sharding over Explicit mesh axes (sharding in types); others carry none."""
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    keep = (mesh is not None and not mesh.empty and sharding.spec is not None
            and any(e is not None for e in sharding.spec))
    return jax.ShapeDtypeStruct(aval.shape if shape is None else shape, aval.dtype,
                                sharding=sharding if keep else None)


def boundary_aval(aval: Any) -> Any:
    """How a value of abstract type ``aval`` crosses a stage boundary.

    Keys cross as their raw key data (shape ``aval.shape + impl key shape``, ``uint32``);
    every other value as itself.
    """
    if not is_key(aval):
        return aval
    sds = jax.ShapeDtypeStruct(aval.shape, aval.dtype)
    return jax.make_jaxpr(jax.random.key_data)(sds).out_avals[0]


def to_boundary(x: Any) -> Any:
    """A concrete or traced value in its boundary form (key data for keys)."""
    return jax.random.key_data(x) if is_key(x) else x


def from_boundary(x: Any, aval: Any) -> Any:
    """Inverse of :func:`to_boundary` for a value whose traced type is ``aval``."""
    if not is_key(aval):
        return x
    return jax.random.wrap_key_data(x, impl=key_impl(aval.dtype))
