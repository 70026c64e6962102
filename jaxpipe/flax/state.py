"""nnx model state inside a pipeline: what is not a trained parameter.

A pipelined nnx loss merges the model from the trained parameters and the model's other
state (RNG streams, batch statistics). This module holds the rules for that other state:

- :func:`reseed`: with ``rng=True`` every RNG stream is reseeded from the microbatch's
  key, so keys and counters flow through the stages;
- :func:`check_updates`: a loss that updates state the pipeline would lose (batch
  statistics in training mode, a parameter) or draws random numbers without a key is
  refused;
- :func:`check_same_model`: a model passed to a call must be the one the pipeline was
  traced with (same structure and static attributes, same non-parameter state).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpipe.errors import PipelineError

__all__ = ["check_same_model", "check_updates", "reseed", "same_tree", "stream_tags", "value",
           "variables_of"]


def variables_of(state: Any) -> list[tuple[str, Any]]:
    """``(path, Variable)`` of every variable of an nnx State."""
    from flax import nnx

    leaves = jax.tree.flatten_with_path(state, is_leaf=lambda v: isinstance(v, nnx.Variable))[0]
    return [(jax.tree_util.keystr(p), v) for p, v in leaves]


def value(v: Any) -> Any:
    return v.get_value() if hasattr(v, "get_value") else v.value


def stream_tags(rest: Any) -> list[str]:
    """Names of the RNG streams (``nnx.Rngs``) held in the model's non-parameter state."""
    from flax import nnx

    return sorted({v.tag for _, v in variables_of(rest) if isinstance(v, nnx.RngKey)})


def reseed(model: Any, key: jax.Array) -> Any:
    """Reseed every RNG stream of an nnx ``model`` from one key; returns ``model``.

    Stream ``name`` gets the key ``jax.random.fold_in(key, zlib.crc32(name.encode()))``
    (split to the stream's shape where it holds a key per stacked layer) and its counter
    restarts at 0, so different streams draw different bits. A pipeline
    built with ``rng=True`` does this with microbatch ``i``'s key
    (``jax.random.fold_in(key, i)``) before calling ``loss_fn``; the unpipelined
    equivalent of one microbatch is therefore::

        jp.flax.reseed(model, jax.random.fold_in(key, i))
        loss_i = loss_fn(model, microbatch_i)
    """
    from flax import nnx

    tags = sorted({s.tag for _, s in nnx.iter_graph(model) if isinstance(s, nnx.RngStream)})
    keys = {t: jax.random.fold_in(key, jnp.uint32(zlib.crc32(t.encode()))) for t in tags}
    if keys:
        # a stream stacked over layers (nnx.split_rngs + nnx.vmap, scanned with nnx.scan)
        # holds a key per layer: its new keys are the stream key split to that shape
        nnx.reseed(model, policy=lambda _, k, shape: k if not shape
                   else jax.random.split(k, shape), **keys)
    return model


def check_updates(before: dict, before_p: dict, rest_after: Any, params_after: Any,
                  rng: bool, passed_through: Callable[[], set[str]]) -> None:
    """Raise a PipelineError if ``loss_fn`` updated model state the pipeline would lose.

    A variable holding a new value object is an update unless ``passed_through()`` (asked
    only then) lists its path: the variables whose values only went through calls
    unchanged (nnx's lifted transforms write every variable back)."""
    from flax import nnx

    added = [path for path, _ in variables_of(rest_after) if path not in before] + [
        path for path, _ in variables_of(params_after) if path not in before_p]
    if added:
        raise PipelineError(
            f"loss_fn adds variables to the model while it runs ({', '.join(added[:4])}"
            f"{', ...' if len(added) > 4 else ''}: e.g. self.sow(nnx.Intermediate, ...)); a "
            "pipeline would lose them. Return what you record as aux (has_aux=True), or "
            "take them out before loss_fn returns (nnx.pop(model, nnx.Intermediate)).")
    through: set[str] | None = None

    def changed(path: str, now: Any, then: Any) -> bool:
        nonlocal through
        if now is then:
            return False
        through = passed_through() if through is None else through
        return path not in through

    for path, v in variables_of(params_after):
        if changed(path, value(v), before_p[path]):
            raise PipelineError(
                f"loss_fn assigns to the parameter {path}; inside a pipeline a parameter is "
                "an input of the loss, and the update would be lost. Compute the new value "
                "in loss_fn without storing it in the model.")
    drawn = []
    for path, v in variables_of(rest_after):
        if not changed(path, value(v), before.get(path)):
            continue
        if isinstance(v, nnx.RngState):
            drawn.append(v.tag)
            continue
        fix = ("Call model.eval() (BatchNorm then uses its running statistics) before "
               "jp.flax.pipeline, or use a normalization without state (LayerNorm, RMSNorm)."
               if isinstance(v, nnx.BatchStat) else
               "Compute the value in loss_fn (returned as aux with has_aux=True where you "
               "need it) instead of storing it in the model.")
        raise PipelineError(
            f"loss_fn updates the model's {type(v).__name__} {path}; a pipeline returns only "
            f"the loss and gradients (and aux), so the update would be lost. {fix}")
    if drawn and not rng:
        raise PipelineError(
            f"loss_fn draws random numbers from the model's nnx.Rngs stream(s) "
            f"{sorted(set(drawn))} (e.g. nnx.Dropout); without a key per call every "
            "microbatch and step would reuse the same bits. Build with "
            "jp.flax.pipeline(..., rng=True) and pass a key to each call "
            "(pipe.value_and_grad(model, batch, key), pipe.train_step(state, batch, key)), "
            "or make the model deterministic (model.eval()).")


def same_tree(a: Any, b: Any) -> bool:
    """Same structure and, leaf by leaf, the same array object or equal values."""
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    return ta == tb and all(
        x is y or (np.shape(x) == np.shape(y) and bool(np.all(np.asarray(x) == np.asarray(y))))
        for x, y in zip(la, lb, strict=True))


def check_same_model(model: Any, graphdef: Any, rest_values: dict, wrt: Any) -> None:
    """Refuse a model whose structure or non-parameter state differs from the one
    the pipeline was traced with (the pipeline would silently use the old one).

    ``rest_values``: path -> the value of every non-parameter variable when traced.
    """
    from flax import nnx

    now_graphdef, _, now_rest = nnx.split(model, wrt, ...)
    if now_graphdef != graphdef:
        raise PipelineError(
            "the model's structure or static attributes changed since the pipeline was "
            "built (e.g. model.train() / model.eval(), or a replaced submodule); the "
            "pipeline runs the model it was traced with. Rebuild it with "
            "jp.flax.pipeline(model, ...) for the model as it is now."
        )
    for path, v in variables_of(now_rest):
        if isinstance(v, nnx.RngState):
            continue  # RNG streams are reseeded per microbatch (rng=True) or unused
        a, b = rest_values[path], value(v)
        if a is not b and not (np.shape(a) == np.shape(b)
                               and bool(np.all(np.asarray(a) == np.asarray(b)))):
            raise PipelineError(
                f"the model's {type(v).__name__} {path} changed since the pipeline was "
                "built; the pipeline reads non-parameter state as a constant from the "
                "model it was built with. Rebuild the pipeline with jp.flax.pipeline("
                "model, ...) to use the new values."
            )
