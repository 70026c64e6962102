"""Parameter views: the stages' parameter inputs as rows of the user's parameter leaves.

The user passes one pytree of parameters; the stages read *views* of its leaves. Usually
a view is a whole leaf. A scanned layer stack (:mod:`jaxpipe.stages.stacks`) cut over several
stages splits its stacked weights: each stage's view is the rows ``[start, stop)`` of the
leaf's leading axis (its own layers), so no stage holds another stage's layers.

:class:`ParamViews` is the one place that maps between the two. The
:class:`~jaxpipe.Pipeline` takes views of the user's leaves on the way in (``take``) and
puts gradients and parameters back together on the way out (``gather``); a runtime sees
only views, and the per-stage optimizer places a stage's views in the user's tree
(``leaf_of``)::

    views = ParamViews((ParamView(0), ParamView(1, 0, 3), ParamView(1, 3, 5)), avals)
    view_leaves = views.take([embed, stacked_w])   # [embed, stacked_w[:3], stacked_w[3:]]
    views.gather(view_leaves)                      # [embed, stacked_w]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["ParamView", "ParamViews"]


@dataclass(frozen=True)
class ParamView:
    """A parameter input of the stages: user leaf ``leaf``, whole or rows
    ``[start, stop)`` of its leading axis (a piece of a stacked layer parameter)."""

    leaf: int
    start: int | None = None
    stop: int | None = None

    def take(self, x: Any) -> Any:
        return x if self.start is None else x[self.start:self.stop]

    def aval(self, leaf_aval: Any) -> jax.ShapeDtypeStruct:
        """The view's shape and dtype, given its leaf's."""
        shape = tuple(leaf_aval.shape)
        if self.start is not None:
            shape = (self.stop - self.start, *shape[1:])
        return jax.ShapeDtypeStruct(shape, leaf_aval.dtype)


@dataclass(frozen=True)
class ParamViews:
    """The stages' parameter inputs (``views``, in order) over the user's leaves.

    Views are ordered by leaf, and the views of one leaf by ``start`` and cover it
    exactly, so ``gather`` is a concatenation and ascending view indices follow the
    user tree's leaf order.

    Attributes:
      views: one :class:`ParamView` per stage parameter input.
      leaf_avals: the user's parameter leaves (shape, dtype).
    """

    views: tuple[ParamView, ...]
    leaf_avals: tuple[Any, ...]

    @classmethod
    def whole(cls, leaf_avals: Sequence[Any]) -> ParamViews:
        """Every leaf passed whole (a loss without split stacks)."""
        return cls(tuple(ParamView(i) for i in range(len(leaf_avals))), tuple(leaf_avals))

    def __post_init__(self) -> None:
        by_leaf: dict[int, list[ParamView]] = {}
        for w in self.views:
            by_leaf.setdefault(w.leaf, []).append(w)
        for leaf, aval in enumerate(self.leaf_avals):
            ws = by_leaf.get(leaf, [])
            if [w.start for w in ws] == [None]:
                continue
            edges = [0, *(w.stop for w in ws)]
            if (not ws or [w.start for w in ws] != edges[:-1] or edges[-1] != aval.shape[0]
                    or sorted(set(edges)) != edges):
                raise ValueError(f"the views {ws} of parameter leaf {leaf} do not cover it")
        if [w.leaf for w in self.views] != sorted(w.leaf for w in self.views):
            raise ValueError("parameter views must be ordered by leaf")

    @property
    def avals(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """Shape and dtype of every view: what the stages' parameter inputs are."""
        return tuple(w.aval(self.leaf_avals[w.leaf]) for w in self.views)

    @property
    def leaf_of(self) -> tuple[int, ...]:
        """View index -> the user leaf it is (rows of)."""
        return tuple(w.leaf for w in self.views)

    def take(self, leaves: Sequence[Any]) -> list:
        """User leaves -> view leaves (traceable)."""
        return [w.take(leaves[w.leaf]) for w in self.views]

    def gather(self, view_leaves: Sequence[Any]) -> list:
        """View leaves -> user leaves: the views of a split leaf concatenated along axis 0
        (parameters and their gradients alike; traceable)."""
        parts: list[list[Any]] = [[] for _ in self.leaf_avals]
        for w, x in zip(self.views, view_leaves, strict=True):
            parts[w.leaf].append(x)
        return [p[0] if len(p) == 1 else jnp.concatenate(p, axis=0) for p in parts]
