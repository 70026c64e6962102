"""The runtime seam: what every way of executing stage functions under a schedule provides.

The layers above (trace, cut, stages) hand a runtime one :class:`RuntimeSpec`: the stage
functions, the schedule, the mesh and the facts computed once about them (who owns a
tied parameter, which leaves a microbatch has). A :class:`Runtime` is a small,
configurable factory (``jp.pipeline(..., runtime=SpmdRuntime())`` or a registered name
such as ``"spmd"``); :meth:`Runtime.build` binds it to one spec and returns an
:class:`Executor`, which does the work: move parameters into its own layout and back,
compute the pipelined value and gradient, and compile a training step around an
optimizer.

To add a runtime (an MPMD one, say), subclass both, register the name with
:func:`jaxpipe.runtime.register`, and touch nothing above this file: ``Pipeline`` only
talks to these two classes.
"""

from __future__ import annotations

import abc
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import jax
from jax.sharding import Mesh

from jaxpipe.jaxpr.avals import aval_bytes
from jaxpipe.jaxpr.objective import MEAN, Objective
from jaxpipe.sharding.mesh_axes import Dims, MeshAxes
from jaxpipe.sharding.param_views import ParamViews

if TYPE_CHECKING:
    from jaxpipe.cut.memory_model import MemoryModel
    from jaxpipe.schedule import Action, Schedule
    from jaxpipe.stages.stage_fn import StageFn
    from jaxpipe.train.options import TrainOptions

__all__ = ["Executor", "Runtime", "RuntimeSpec", "StepFn"]

#: ``(params_in_runtime_layout, opt_state, batch_mb) -> (params, opt_state, metrics)``
StepFn = Callable[[Any, Any, list], tuple[Any, Any, dict]]


@dataclass(frozen=True)
class RuntimeSpec:
    """Everything a runtime is built from, resolved by the layers above it.

    Attributes:
      stages: the stage functions, in stage order (``stages[s].index == s``).
      schedule: the validated schedule (placement and every device's action order).
      mesh: the device mesh; ``axis`` is its pipeline axis.
      axis: name of the pipeline mesh axis.
      batch_axes: the mesh axes over which the batch is split and gradients averaged.
      param_avals: abstract value of every parameter input of the stages: the flat
        leaves of the user's pytree, except that a scanned stack's stacked weights split
        over several stages come as one input per stage (its rows; see
        :mod:`jaxpipe.sharding.param_views`).
      params_treedef: the treedef of the user's parameter pytree (optimizers run on
        per-stage views of it).
      microbatch_avals: abstract value of every flat batch leaf of one microbatch on
        one data shard (what a stage function reads).
      param_owners: parameter input -> the stages that read it, ascending. An input read
        by several stages (a tied embedding) lives on each; its gradient is their sum.
      param_views: the parameter inputs as views of the user's leaves (which leaf of
        ``params_treedef`` each is, whole or which rows); ``None`` when every input is a
        whole leaf. A stage holds at most one input of each leaf.
      param_dims: per parameter input, its sharding over the non-pipe mesh axes as
        :data:`jaxpipe.sharding.mesh_axes.Dims` (one tuple of axis names per dimension); empty when
        every parameter is replicated over them.
      param_axes: the mesh axes left to JAX's sharding: some parameter is sharded over
        them, or a model on Explicit axes shards its values over them (see
        :class:`jaxpipe.sharding.mesh_axes.MeshAxes`: the program is manual over the pipe axis and
        the other batch axes, and leaves these to JAX's sharding inside the stages).
      action_cost: the cutter's cost of every action (``CutResult.action_cost``), or
        ``None``. The SPMD runtime groups actions into ticks by it where that runs
        faster under its sync model (:func:`jaxpipe.runtime.spmd.lowering.lower`).
      objective: what the loss function returns and how the pipeline reduces it
        (:class:`jaxpipe.jaxpr.objective.Objective`: the last stage outputs the loss, then the
        weight and aux leaves; every runtime reduces them alike).
      batch_weight: with ``reduction="weighted"``, the weight as a ``ClosedJaxpr`` of one
        microbatch's batch leaves where no parameter enters it
        (:func:`jaxpipe.jaxpr.weight.batch_weight`): a runtime totals it before the
        backward and seeds each microbatch's loss with ``1 / total``; ``None``: it
        divides the summed gradients by the total at the end.
    """

    stages: tuple[StageFn, ...]
    schedule: Schedule
    mesh: Mesh
    axis: str
    batch_axes: tuple[str, ...]
    param_avals: tuple[Any, ...]
    params_treedef: Any
    microbatch_avals: tuple[Any, ...]
    param_owners: Mapping[int, tuple[int, ...]]
    param_views: ParamViews | None = None
    param_dims: tuple[Dims, ...] = ()
    param_axes: tuple[str, ...] = ()
    action_cost: Callable[[Action], float] | None = None
    objective: Objective = MEAN
    batch_weight: Any = None

    @property
    def mesh_axes(self) -> MeshAxes:
        """The roles of the mesh axes (pipe, manual and automatic batch, parameter)."""
        return MeshAxes(self.axis, self.batch_axes, self.param_axes)

    def shards(self, dims: Dims) -> int:
        """How many pieces ``dims`` split a value into (the product of its axes' sizes)."""
        return math.prod(self.mesh.shape[a] for d in dims for a in d)

    def device_bytes(self, pid: int) -> int:
        """Bytes of parameter input ``pid`` on one device holding it (its shard)."""
        return aval_bytes(self.param_avals[pid]) // self.shards(self.dims(pid))

    def dims(self, pid: int) -> Dims:
        """The sharding of parameter input ``pid`` over the non-pipe axes."""
        if not self.param_dims:
            return ((),) * len(self.param_avals[pid].shape)
        return self.param_dims[pid]

    @functools.cached_property
    def views(self) -> ParamViews:
        """The parameter inputs over the user's leaves (see :mod:`jaxpipe.sharding.param_views`)."""
        return self.param_views or ParamViews.whole(self.param_avals)

    def tree_leaf(self, pid: int) -> int:
        """The leaf of ``params_treedef`` parameter input ``pid`` is (rows of)."""
        return self.param_views.views[pid].leaf if self.param_views else pid

    def leaf_dims(self, leaf: int) -> Dims:
        """The sharding of user leaf ``leaf`` over the non-pipe axes (its views')."""
        return self.dims(self._first_view[leaf])

    @functools.cached_property
    def _first_view(self) -> dict[int, int]:
        """User leaf -> its first view (parameter input)."""
        first: dict[int, int] = {}
        for pid, leaf in enumerate(self.views.leaf_of):
            first.setdefault(leaf, pid)
        return first

    @property
    def num_microbatches(self) -> int:
        return self.schedule.num_microbatches

    @property
    def tied(self) -> tuple[int, ...]:
        """Parameter leaves read by more than one stage, ascending."""
        return tuple(pid for pid, owners in sorted(self.param_owners.items())
                     if len(owners) > 1)


class Executor(abc.ABC):
    """A runtime bound to one pipeline: its stages, schedule and mesh.

    Parameters live in the executor's own *staged* layout (whatever suits it: per-device
    slot arrays for SPMD, plain leaves for the reference executor). Outside it they are
    the flat leaves of the user's pytree (``param_leaves``: a scanned stack's stacked
    weights whole, not the stages' views of them; ``spec.views`` maps between the two).
    Batches arrive as flat leaves shaped ``[num_microbatches, microbatch, ...]``.

    Every compute method reduces the loss as ``spec.objective`` says and returns the aux
    leaves of the loss function (``[]`` without ``has_aux``), each stacked over
    microbatches: ``[m, *shape]``, or ``[m, shards, *shape]`` over batch axes the
    runtime splits microbatches over by hand.
    """

    spec: RuntimeSpec

    #: ``True`` for an executor whose compute runs eagerly, op by op (``Pipeline`` then
    #: calls it directly instead of jitting it): the reference executor.
    eager: ClassVar[bool] = False

    # -- parameters ---------------------------------------------------------------
    @abc.abstractmethod
    def shard(self, param_leaves: list) -> Any:
        """User parameter leaves -> the staged layout (traceable)."""

    @abc.abstractmethod
    def unshard(self, staged: Any) -> list:
        """Staged layout -> user parameter leaves, one copy each (traceable)."""

    @abc.abstractmethod
    def staged_abstract(self) -> Any:
        """The staged layout as ``jax.ShapeDtypeStruct``\\ s, with shardings."""

    @abc.abstractmethod
    def check_staged(self, staged: Any, what: str) -> None:
        """Raise ``PipelineError`` naming ``what`` unless ``staged`` has the staged layout."""

    def stage_params(self, staged: Any) -> list[list[jax.Array]]:
        """Every stage's parameter inputs as its device holds them (tied: each copy; a
        stacked weight split over stages: the stage's rows). Default: from
        :meth:`unshard` and the spec's views."""
        inputs = self.spec.views.take(self.unshard(staged))
        return [[inputs[i] for i in st.param_ids] for st in self.spec.stages]

    def stage_layout(self) -> dict[str, Any]:
        """Where the staged layout keeps the parameters, as JSON: per stage, its device
        and the user leaves (rows of a stacked leaf: ``[leaf, start, stop]``) it holds.
        Executors of one runtime with equal layouts put every parameter in the same
        place, so a checkpoint of the staged layout restores only into an equal one."""
        sched, views = self.spec.schedule, self.spec.views.views
        return {"runtime": type(self).__name__, "stages": [
            {"device": int(sched.placement(st.index)),
             "params": [[views[i].leaf, views[i].start, views[i].stop] for i in st.param_ids]}
            for st in self.spec.stages]}

    # -- compute ------------------------------------------------------------------
    @abc.abstractmethod
    def value_and_grad(self, param_leaves: list, batch_mb: list
                       ) -> tuple[jax.Array, list, list]:
        """``(loss, aux leaves, gradient of every user parameter leaf)``."""

    @abc.abstractmethod
    def staged_value_and_grad(self, staged: Any, batch_mb: list
                              ) -> tuple[jax.Array, list, Any]:
        """As :meth:`value_and_grad`, parameters and gradients in the staged layout."""

    @abc.abstractmethod
    def loss(self, param_leaves: list, batch_mb: list) -> tuple[jax.Array, list]:
        """``(loss, aux leaves)``, forward only: no residual kept, no backward run."""

    @abc.abstractmethod
    def staged_loss(self, staged: Any, batch_mb: list) -> tuple[jax.Array, list]:
        """As :meth:`loss`, parameters in the staged layout."""

    # -- training -----------------------------------------------------------------
    @abc.abstractmethod
    def make_train_step(self, optimizer: Any, options: TrainOptions) -> tuple[StepFn, Any]:
        """Compile-ready training step for ``optimizer`` and the initial optimizer state.

        Returns ``(step, init_opt_state)``: ``step(staged, opt_state, batch_mb)`` computes
        gradients and applies the per-stage optimizer update (see :mod:`jaxpipe.train.state`),
        returning ``(staged, opt_state, metrics)`` (``metrics["aux"]``: the aux leaves,
        with ``has_aux``); ``init_opt_state(param_leaves)`` builds
        the optimizer state in the executor's layout. Both are traceable; the caller jits.
        """

    @abc.abstractmethod
    def opt_state_abstract(self, init_opt_state: Any) -> Any:
        """Abstract (shape, dtype, sharding) optimizer state made by ``init_opt_state``."""

    # -- reports ------------------------------------------------------------------
    @abc.abstractmethod
    def memory_report(self) -> dict[str, Any]:
        """What this executor allocates per device: ``buffer_bytes`` (total) and
        ``device_rows`` (per device: ``residual_peak``, ``residual_bytes``)."""

    def timing_report(self, cost: Callable[[Any], float], *,
                      schedule_makespan: float | None = None) -> str | None:
        """One line on how the executed program's time compares with the schedule's own
        under per-action ``cost`` (``None``: nothing to say, e.g. a sequential runtime).
        ``schedule_makespan``: ``schedule.simulate(cost).makespan`` if the caller has it
        (the cutter does), so the schedule is not simulated again."""
        return None

    def program_report(self) -> str | None:
        """One line on the program this executor runs (``None``: nothing to say)."""
        return None

    def compiled_check(self) -> Callable[[Any, str], None] | None:
        """``check(compiled, what)``, run on each entry point's first compiled program
        before it runs; it raises ``PipelineError`` for a program this runtime cannot run
        (``None``: nothing to check)."""
        return None

    @abc.abstractmethod
    def fingerprint(self) -> dict[str, str]:
        """Short digests of everything the compiled program depends on beyond the spec
        (e.g. lowered tables); processes compare them before running collectives."""


class Runtime(abc.ABC):
    """A way of executing pipelines: configuration plus a factory for :class:`Executor`.

    ``name`` is what ``jp.pipeline(..., runtime=name)`` accepts for a default instance.
    """

    name: ClassVar[str]

    @property
    @abc.abstractmethod
    def memory_model(self) -> MemoryModel:
        """How this runtime lays out memory, for the memory-aware cutter."""

    def memory_model_for(self, mesh: Mesh | None = None) -> MemoryModel:
        """The memory model of the program this runtime builds for ``mesh`` (a runtime
        whose program differs by platform lays memory out differently). Default:
        :attr:`memory_model`."""
        return self.memory_model

    @abc.abstractmethod
    def build(self, spec: RuntimeSpec) -> Executor:
        """Bind this runtime to one pipeline."""

    def shares_cores(self) -> bool:
        """Whether stages should come split into a prologue, a core other stages share
        and an epilogue (:mod:`jaxpipe.stages.shared_cores`), for this runtime to compile each
        core once. Default: no, every stage runs whole."""
        return False

    def in_flight(self, schedule: Any, mesh: Mesh | None = None, mesh_axes: Any = None
                  ) -> list[int] | None:
        """Per stage, the live residual sets this runtime's program holds at its peak for
        ``schedule``, where that differs from the schedule's own (the cutter budgets
        them); ``None``: the schedule's."""
        return None

    def predicted_time(self, schedule: Any, action_cost: Callable[[Any], float] | None,
                       mesh: Mesh | None = None, mesh_axes: Any = None,
                       stored_bytes: float = 0.0) -> float | None:
        """This runtime's time for ``schedule`` under per-action ``action_cost``, before
        anything is built (``schedule="auto"`` ranks by it); ``stored_bytes``: what a
        device stores for its backwards under the cut (the cutter's prediction). ``None``:
        the schedule's own simulated makespan is the best guess."""
        return None

    def splits_backward(self, mesh: Mesh | None = None, mesh_axes: Any = None) -> bool:
        """Whether this runtime runs backwards as I then W (then the hand-off between
        them is stored too, and splitting a stage into parts must not enlarge it)."""
        return False

    def instead_of(self, executor: Executor) -> Runtime | None:
        """The runtime to cut and build with again where ``executor`` (this runtime's)
        turned down a program the cut was made for; ``None``: keep it (the default)."""
        return None

    def instead_of_infeasible(self, mesh: Mesh | None = None, mesh_axes: Any = None
                              ) -> Runtime | None:
        """The runtime to cut and build with again where a memory budget is infeasible
        under this runtime's :meth:`in_flight` but one of its other programs holds
        fewer residual sets; ``None``: the refusal stands (the default)."""
        return None
