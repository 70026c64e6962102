"""Flax integration: ``@jp.layer`` on Module classes, and pipelines over nnx / linen models.

Decorating a Module class
-------------------------
``@jp.layer`` on a flax ``nnx.Module`` or ``linen.Module`` subclass returns a
*subclass* (same ``__name__``, ``__qualname__``, ``__module__``, fields and
methods) whose ``__call__`` passes its outputs through :func:`jaxpipe.boundary`.
Every call of the module is then one cuttable unit for the pipeline cutter::

    @jp.layer
    class Block(nnx.Module):
        def __init__(self, d, *, rngs):
            self.linear = nnx.Linear(d, d, rngs=rngs)

        def __call__(self, x):
            return x + nnx.relu(self.linear(x))

Without a pipeline the boundary is the identity, so outputs, parameter trees
(names included) and serialization are exactly those of the undecorated class.
A subclass rather than in-place patching is used so that ``jp.layer(nnx.Linear)``
gives a cuttable ``Linear`` without changing flax's own ``Linear`` everywhere.
The wrapping needs nothing from flax: it is :func:`jaxpipe.jaxpr.markers.layer_class`
(re-exported here as ``jaxpipe.flax.layer_class``).

Pipelining a model
------------------
:func:`pipeline` (nnx) and :func:`pipeline_linen` (linen) are thin adapters over
:func:`jaxpipe.pipeline`: they pull the trainable parameters out of the model as a
pure ``dict`` pytree, pipeline a loss over that dict (rebuilding the model inside
the traced loss), and hand back an object with the whole ``jp.Pipeline`` API plus a
way to write trained parameters back into the model or variables.

State that is not a trained parameter
-------------------------------------
- *Randomness (dropout).* Build with ``rng=True`` and pass a PRNG key to every call
  (``pipe.value_and_grad(model, batch, key)``, ``pipe.train_step(state, batch, key)``).
  Microbatch ``i`` gets ``jax.random.fold_in(key, i)`` (see :func:`jaxpipe.pipeline`);
  for nnx, every RNG stream of the model is reseeded from it before ``loss_fn`` runs
  (:func:`reseed`), so the streams' keys and counters flow through the stages and each
  dropout layer of each microbatch draws its own bits. For linen, ``loss_fn`` receives
  the key as its last argument (``module.apply(..., rngs={"dropout": key})``). A loss
  that draws from the model's streams without ``rng=True`` is refused: every
  microbatch and step would reuse the same bits.
- *Other non-parameter state* (batch statistics in eval mode, constants) is read as a
  constant. A loss that *updates* it (``nnx.BatchNorm`` in training mode, or assigning
  to a parameter) is refused: the pipeline returns only the loss and gradients, so the
  update would be lost. Passing a model whose non-parameter state or static attributes
  changed since the pipeline was built is refused the same way.
"""

from jaxpipe.flax.linen import LinenPipeline, pipeline_linen
from jaxpipe.flax.nnx import NnxPipeline, pipeline
from jaxpipe.flax.state import reseed  # what rng=True does per microbatch
from jaxpipe.jaxpr.markers import layer_class  # the class form of @jp.layer

__all__ = [
    "layer_class",
    "pipeline",
    "pipeline_linen",
    "reseed",
    "NnxPipeline",
    "LinenPipeline",
]
