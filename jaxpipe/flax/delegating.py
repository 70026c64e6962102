"""What both flax pipelines share: the wrapped ``jp.Pipeline`` and the methods they adapt."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding

__all__ = ["Delegating", "pipeline_fn", "placed_on"]


def pipeline_fn() -> Callable[..., Any]:
    # Imported late: jaxpipe.api.pipeline pulls in the tracer/cutter/runtime, which the
    # markers (and models merely decorated with them) never need.
    from jaxpipe.api.pipeline import pipeline as jp_pipeline

    return jp_pipeline


class Delegating:
    """Forward every attribute not defined here to the wrapped ``jp.Pipeline``."""

    pipe: Any

    def __getattr__(self, name: str) -> Any:
        # Only reached for names not found normally; guard against recursion while
        # ``pipe`` itself is not set yet (e.g. during unpickling).
        if name == "pipe":
            raise AttributeError(name)
        return getattr(self.pipe, name)

    @property
    def plan(self) -> Any:
        """The wrapped pipeline's plan (stages, layers, bytes, bubble); printable."""
        return self.pipe.plan

    def shard(self, params: Any) -> Any:
        """Move parameters into the per-device stage layout (see ``Pipeline.shard``)."""
        return self.pipe.shard(self.as_params(params))

    def unshard(self, staged: Any) -> Any:
        """Inverse of :meth:`shard`: the parameters as the pure-dict pytree."""
        return self.pipe.unshard(staged)

    def value_and_grad(self, params: Any, batch: Any, key: Any = None
                       ) -> tuple[jax.Array, Any]:
        """Pipelined mean loss over microbatches and its gradient (a pure dict);
        ``key`` with ``rng=True``."""
        return self.pipe.value_and_grad(self.as_params(params), batch, key)

    def loss(self, params: Any, batch: Any, key: Any = None) -> Any:
        """The pipelined loss, forward only (``Pipeline.loss``): parameters as for
        :meth:`value_and_grad`, or a :meth:`init` / :meth:`train_step` state (evaluated in
        the stage layout). ``(loss, aux)`` with ``has_aux=True``."""
        from jaxpipe.train.state import TrainState

        if isinstance(params, TrainState):
            return self.pipe.loss(params, batch, key)
        return self.pipe.loss(self.as_params(params), batch, key)

    def init(self, params: Any, optimizer: Any, *, skip_nonfinite: bool = False,
             clip_global_norm: float | None = None) -> Any:
        """Training state for :meth:`train_step` (parameters + optax state, staged);
        options as for ``Pipeline.init``."""
        return self.pipe.init(self.as_params(params), optimizer,
                              skip_nonfinite=skip_nonfinite, clip_global_norm=clip_global_norm)

    def train_step(self, state: Any, batch: Any, key: Any = None
                   ) -> tuple[Any, dict[str, Any]]:
        """One jitted optimizer step; ``state`` is donated. Returns ``(state, metrics)``;
        ``key`` with ``rng=True``."""
        return self.pipe.train_step(state, batch, key)

    def params(self, state: Any) -> Any:
        """The parameters (pure-dict pytree) held in a :meth:`init`/:meth:`train_step` state."""
        return self.pipe.params(state)

    def as_params(self, params: Any) -> Any:
        """The parameter pytree the wrapped pipeline takes, from what a user of this
        flax pipeline passes (each flax pipeline takes its own forms: a model, an
        ``nnx.State``, a variables dict); the wrapped pipeline checks it."""
        return params


def placed_on(params: Any, mesh: Any) -> bool:
    """Some leaf of ``params`` carries a ``NamedSharding`` over ``mesh``'s axes."""
    return any(isinstance(getattr(x, "sharding", None), NamedSharding)
               and tuple(x.sharding.mesh.axis_names) == tuple(mesh.axis_names)
               for x in jax.tree.leaves(params))
