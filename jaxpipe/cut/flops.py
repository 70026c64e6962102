"""FLOP counting: forward FLOPs of a jaxpr's equations, from their shapes alone.

The cost model (:mod:`jaxpipe.cut.cost`) sums them per segment. ``dot_general`` and
``conv_general_dilated`` are exact (2 x multiply-accumulates); elementwise primitives
count one FLOP per output element (transcendentals included); reductions and cumulative
ops count one per input element; pure data movement (reshape, transpose, slicing,
gather, dtype conversion, ...) counts zero. Nested jaxprs are followed:
``jit``/``remat``/``custom_jvp``/``custom_vjp`` are summed, ``scan`` bodies are
multiplied by ``length``, ``cond`` takes the most expensive branch, and ``while`` loops
count one iteration (their trip count is not static).
"""

from __future__ import annotations

import math
from typing import Any

from jax.extend import core as jcore

__all__ = ["eqn_flops", "jaxpr_flops"]

# Data movement and bookkeeping: no arithmetic.
_FREE = frozenset({
    "reshape", "broadcast_in_dim", "squeeze", "expand_dims", "transpose", "slice",
    "dynamic_slice", "dynamic_update_slice", "concatenate", "pad", "gather", "rev",
    "iota", "convert_element_type", "bitcast_convert_type", "copy", "copy_p",
    "device_put", "sharding_constraint", "mesh_cast", "reshard", "stop_gradient",
    "jaxpipe_boundary", "random_seed", "random_wrap", "random_unwrap", "random_bits",
    "threefry2x32", "optimization_barrier", "name", "pvary", "squeeze_p", "split",
    "select_and_gather_add", "tie_in", "with_sharding_constraint", "full_like",
    "scatter",
})
# One FLOP per *input* element.
_REDUCE = frozenset({
    "reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
    "reduce_xor", "argmax", "argmin", "cumsum", "cumprod", "cummax", "cummin",
    "cumlogsumexp", "sort", "reduce_precision", "top_k",
})
# One FLOP per *update* element.
_SCATTER = frozenset({"scatter_add", "scatter_sub", "scatter_mul", "scatter_min", "scatter_max"})


def _size(aval: Any) -> int:
    shape = getattr(aval, "shape", None)
    return int(math.prod(shape)) if shape is not None else 0


def _inner(j: Any) -> Any:
    return j.jaxpr if hasattr(j, "jaxpr") and hasattr(j, "consts") else j


def eqn_flops(eqn: Any) -> float:
    """Forward FLOPs of one jaxpr equation (recursing into nested jaxprs)."""
    name = eqn.primitive.name
    params = eqn.params
    if name == "dot_general":
        (lhs_contract, _), _ = params["dimension_numbers"]
        lhs_shape = eqn.invars[0].aval.shape
        k = math.prod(lhs_shape[d] for d in lhs_contract)
        return 2.0 * _size(eqn.outvars[0].aval) * k
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval
        out_feature_dim = params["dimension_numbers"].rhs_spec[0]
        # Each output element is a dot over (input features per group x kernel window).
        macs_per_out = _size(rhs) // max(rhs.shape[out_feature_dim], 1)
        return 2.0 * _size(eqn.outvars[0].aval) * macs_per_out
    if name == "scan":
        return params["length"] * jaxpr_flops(params["jaxpr"])
    if name == "cond":
        return max((jaxpr_flops(b) for b in params["branches"]), default=0.0)
    if name == "while":
        # Trip count is dynamic: count one iteration of cond + body.
        return jaxpr_flops(params["cond_jaxpr"]) + jaxpr_flops(params["body_jaxpr"])
    subs = list(jcore.jaxprs_in_params(params))
    if subs:  # jit, remat, custom_jvp/custom_vjp, closed_call, shard_map, ...
        return float(sum(jaxpr_flops(s) for s in subs))
    if name in _FREE:
        return 0.0
    if name in _REDUCE:
        return float(sum(_size(v.aval) for v in eqn.invars))
    if name in _SCATTER:
        return float(_size(eqn.invars[-1].aval))
    if name in ("reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window"):
        return float(_size(eqn.outvars[0].aval) * math.prod(params["window_dimensions"]))
    # Elementwise (and anything unknown): one per output element.
    return float(sum(_size(v.aval) for v in eqn.outvars))


def jaxpr_flops(jaxpr: Any) -> float:
    """Forward FLOPs of a ``Jaxpr`` or ``ClosedJaxpr`` (see the module docstring)."""
    return float(sum(eqn_flops(e) for e in _inner(jaxpr).eqns))
