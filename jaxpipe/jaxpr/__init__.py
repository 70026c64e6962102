"""The jaxpr layer: a user's loss as one flat jaxpr, and the facts every layer reads of it.

Owns the cut markers (:mod:`~jaxpipe.jaxpr.markers`: ``jp.boundary``, ``@jp.layer``),
tracing a per-microbatch loss to a jaxpr with its candidate cuts
(:mod:`~jaxpipe.jaxpr.trace`), the one interpreter that evaluates equations into the
current trace (:mod:`~jaxpipe.jaxpr.interpret`), structural identity of jaxpr fragments
(:mod:`~jaxpipe.jaxpr.identity`), facts about abstract values
(:mod:`~jaxpipe.jaxpr.avals`) and what a loss returns per microbatch
(:mod:`~jaxpipe.jaxpr.objective`). Imports only JAX and the foundation modules at the
package's top (``errors``, ``jax_compat``).
"""
