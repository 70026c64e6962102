"""What the train layer reads of a runtime: the parameter layout and the step builder.

The train layer sits below the runtimes (they run its :class:`StageOptimizer` per stage),
so it names what it needs of them as protocols instead of importing them:
:class:`jaxpipe.runtime.base.RuntimeSpec` is a :class:`ParamLayout` and
:class:`jaxpipe.runtime.base.Executor` a :class:`StepBuilder`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

__all__ = ["ParamLayout", "StageParams", "StepBuilder"]


class StageParams(Protocol):
    """A stage's parameter inputs (indices into :attr:`ParamLayout.param_avals`)."""

    @property
    def param_ids(self) -> Sequence[int]: ...


class ParamLayout(Protocol):
    """How a pipeline's parameter inputs relate to the user's tree and to its stages."""

    @property
    def param_avals(self) -> Sequence[Any]: ...
    @property
    def params_treedef(self) -> Any: ...
    @property
    def stages(self) -> Sequence[StageParams]: ...
    @property
    def param_owners(self) -> Mapping[int, tuple[int, ...]]: ...
    @property
    def mesh(self) -> Any: ...

    def tree_leaf(self, pid: int) -> int: ...


class StepBuilder(Protocol):
    """What a :class:`jaxpipe.train.state.Trainer` compiles its step from."""

    @property
    def spec(self) -> ParamLayout: ...

    def make_train_step(self, optimizer: Any, options: Any) -> tuple[Callable, Any]: ...
    def staged_abstract(self) -> Any: ...
    def opt_state_abstract(self, init_opt_state: Any) -> Any: ...
    def compiled_check(self) -> Callable[[Any, str], None] | None: ...
