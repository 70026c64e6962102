"""The few private JAX objects jaxpipe reads, each behind one guarded accessor.

JAX has no public name for them (the sharding-constraint primitive, per-output dead-code
elimination of a jaxpr, its partial evaluation, the distributed client's state, its
cluster environments). A JAX upgrade may move one; then the accessor fails with an error
that names it and the JAX versions jaxpipe supports, instead of an ``ImportError`` deep in
a trace.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jaxpipe.errors import PipelineError

__all__ = ["JAX_WRAPPER_MODULES", "SUPPORTED_JAX", "cluster_environments",
           "context_with_mesh", "dce_jaxpr", "distributed_client", "is_ordered_effect",
           "key_impl", "partial_eval_jaxpr", "sharding_constraint_p"]

#: The JAX versions jaxpipe is built and tested against.
SUPPORTED_JAX = ">= 0.10, < 0.11"


#: Modules of JAX's own wrapping machinery (a function of theirs is made anew at every
#: traced call; :mod:`jaxpipe.jaxpr.identity` keys it by its code and what it wraps).
JAX_WRAPPER_MODULES = ("jax._src.interpreters.partial_eval", "jax._src.linear_util",
                       "jax._src.custom_derivatives", "jax._src.api_util")


def _moved(what: str, err: Exception) -> PipelineError:
    import jax

    return PipelineError(
        f"jaxpipe reads JAX's private {what}, which this JAX ({jax.__version__}) does not "
        f"have ({type(err).__name__}: {err}). jaxpipe supports JAX {SUPPORTED_JAX}: install "
        "one of those (pip install 'jax>=0.10,<0.11'), or report the new location.")


def sharding_constraint_p() -> Any:
    """The primitive of ``jax.lax.with_sharding_constraint``."""
    try:
        from jax._src.pjit import sharding_constraint_p as prim
    except ImportError as err:
        raise _moved("jax._src.pjit.sharding_constraint_p", err) from None
    return prim


def dce_jaxpr() -> Callable[..., Any]:
    """``partial_eval.dce_jaxpr(jaxpr, used_outputs, instantiate=...)``."""
    try:
        from jax._src.interpreters import partial_eval as pe

        return pe.dce_jaxpr
    except (ImportError, AttributeError) as err:
        raise _moved("jax._src.interpreters.partial_eval.dce_jaxpr", err) from None


def partial_eval_jaxpr() -> Callable[..., Any]:
    """``partial_eval.partial_eval_jaxpr_nounits(closed_jaxpr, unknowns, instantiate)``:
    the equations computable from the known inputs alone, as a jaxpr of them (scan and
    call bodies split too), and which outputs are."""
    try:
        from jax._src.interpreters import partial_eval as pe

        return pe.partial_eval_jaxpr_nounits
    except (ImportError, AttributeError) as err:
        raise _moved("jax._src.interpreters.partial_eval.partial_eval_jaxpr_nounits",
                     err) from None


def is_ordered_effect(effect: Any) -> bool:
    """Whether a jaxpr's effect is ordered (``jax.debug.print(..., ordered=True)``, an
    ordered ``io_callback``): JAX runs those on one device only."""
    try:
        from jax._src import effects
    except ImportError as err:
        raise _moved("jax._src.effects.ordered_effects", err) from None
    return effects.ordered_effects.contains(effect)


def key_impl(key_dtype: Any) -> Any:
    """The PRNG implementation of a key dtype (``jax.random.key(0).dtype``), for
    ``jax.random.wrap_key_data(data, impl=...)``: JAX names it only on key arrays."""
    try:
        return key_dtype._impl
    except AttributeError as err:
        raise _moved("the key dtype's _impl", err) from None


def context_with_mesh(ctx: Any, mesh: Any) -> Any:
    """An equation's context (``eqn.ctx``: the mesh it was traced under, its compute type,
    its PRNG and metadata settings) with ``mesh`` in place of its abstract mesh."""
    try:
        return type(ctx)._create(ctx.compute_type, ctx.threefry_partitionable, mesh,
                                 ctx.remove_size_one_mesh_axis,
                                 None if ctx.xla_metadata is None
                                 else tuple(sorted(ctx.xla_metadata.items())))
    except (AttributeError, TypeError) as err:
        raise _moved("JaxprEqnContext._create", err) from None


def distributed_client() -> Any:
    """The client of ``jax.distributed`` (``None``: not initialized, or not found)."""
    try:
        from jax._src import distributed
    except ImportError:
        return None
    return getattr(getattr(distributed, "global_state", None), "client", None)


def cluster_environments() -> list[Any]:
    """JAX's cluster environments that detect themselves (SLURM, MPI, k8s, TPU); empty
    when JAX keeps them elsewhere."""
    try:
        from jax._src import clusters

        return [env for env in clusters.ClusterEnv._cluster_types
                if env.opt_in_only_method is False]
    except (ImportError, AttributeError):
        return []
