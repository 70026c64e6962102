"""``jp.pipeline`` and the :class:`Pipeline` it returns: the face a training loop uses.

:func:`pipeline` traces, cuts and splits a loss and hands the stages to a runtime
(:class:`jaxpipe.api.internals.Internals` does the work). :class:`Pipeline` keeps to what
a training loop calls: ``value_and_grad``, ``loss``, ``init``/``train_step``/``params``,
``shard``/``unshard`` (with ``staged_value_and_grad`` for resident parameters), the
ahead-of-time ``lower``, and ``plan``; everything else a pipeline holds (stages, cut,
executor tables, build times, jitted programs) is under ``pipe.inspect``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jaxpipe.api.auto import batch_rows, choose_microbatches, placeholder, resolve_auto
from jaxpipe.api.inputs import on_own_mesh
from jaxpipe.api.internals import Internals
from jaxpipe.distributed.agreement import check_same_training
from jaxpipe.errors import PipelineTypeError
from jaxpipe.runtime import Runtime
from jaxpipe.schedule import Schedule
from jaxpipe.train.options import TrainOptions
from jaxpipe.train.state import TrainState

__all__ = ["Pipeline", "pipeline"]

PROGRAMS = ("train_step", "value_and_grad", "loss")


def _own_mesh(method: Callable) -> Callable:
    """Run a Pipeline method under the pipeline's mesh where the caller's
    ``jax.set_mesh`` names another (:func:`jaxpipe.api.inputs.on_own_mesh`)."""
    @functools.wraps(method)
    def run(self: Pipeline, *args: Any, **kwargs: Any) -> Any:
        with on_own_mesh(self._internals.mesh, f"pipe.{method.__name__}"):
            return method(self, *args, **kwargs)

    return run


class Pipeline:
    """A loss function compiled for pipelined execution under one schedule.

    Build it with :func:`pipeline`. ``value_and_grad(params, batch)`` returns the mean loss
    over microbatches and its gradient, equal to ``jax.value_and_grad`` of the unpipelined
    mean loss. ``shard``/``unshard`` move parameters into and out of the runtime's stage
    layout; ``init``/``train_step`` train with optax keeping parameters resident. ``plan``
    prints what each stage and device holds; ``inspect`` holds the rest (the stages, the
    cut report, the executor and its tick tables, build times, the jitted programs).
    """

    def __init__(self, loss_fn: Callable[..., jax.Array], params: Any, batch: Any,
                 **options: Any) -> None:
        with on_own_mesh(options.get("mesh"), "jp.pipeline"):
            self._internals = self._build(loss_fn, params, batch, options)

    @staticmethod
    def _build(loss_fn: Callable, params: Any, batch: Any, options: dict) -> Internals:
        auto = resolve_auto(options.get("schedule"))
        if auto is not None and auto.microbatches == "auto":  # built once per m
            first = placeholder(auto, options["mesh"], options.get("axis", "pipe"), batch)
            return choose_microbatches(
                auto, first.num_devices, batch_rows(batch),
                lambda a: Internals(loss_fn, params, batch, **{**options, "schedule": a}))
        return Internals(loss_fn, params, batch, **options)

    def __getattr__(self, name: str) -> Any:
        # reached only for names a Pipeline lacks: point to where an inspected one lives
        if name != "_internals" and hasattr(self._internals, name):
            raise AttributeError(
                f"'Pipeline' has no attribute {name!r}; it is pipe.inspect.{name} (the "
                "pipeline keeps the training loop's methods, pipe.inspect the rest).")
        raise AttributeError(f"'Pipeline' object has no attribute {name!r}")

    # ---------------------------------------------------------------- what it is
    @property
    def mesh(self) -> Mesh:
        """The mesh the pipeline runs on."""
        return self._internals.mesh

    @property
    def schedule(self) -> Schedule:
        """The schedule it runs (with ``schedule="auto"``: the one chosen)."""
        return self._internals.schedule

    @property
    def num_microbatches(self) -> int:
        """How many microbatches every batch is split into."""
        return self._internals.num_microbatches

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes the batch is split over (gradients are averaged over them)."""
        return self._internals.batch_axes

    @property
    def plan(self) -> Any:
        """Per-stage layers, FLOPs, bytes, in-flight counts and predicted memory/bubble;
        ``print(pipe.plan)`` is a readable table."""
        return self._internals.plan

    @property
    def inspect(self) -> Internals:
        """Everything else the pipeline holds (:class:`~jaxpipe.api.internals.Internals`):
        ``stages``, ``cut_report``, ``executor`` (``executor.lowering``: the tick tables),
        ``build_times``, ``auto_choice``, ``param_specs``, the jitted programs
        (``value_and_grad_fn``, ``eval_fn``), ``reference_value_and_grad``,
        ``compare_compiled``, ..."""
        return self._internals

    # ---------------------------------------------------------------- compute
    @_own_mesh
    def value_and_grad(self, params: Any, batch: Any, key: Any = None
                       ) -> tuple[jax.Array, Any]:
        """Mean loss over microbatches and its gradient w.r.t. ``params`` (same pytree).

        ``key``: with ``rng=True``, the PRNG key of this call (microbatch ``i`` gets
        ``jax.random.fold_in(key, i)``); otherwise ``None``. Inputs are moved onto the
        pipeline's mesh first, wherever they are. It may be called inside your own
        ``jax.jit`` (e.g. with an optax update around it); inputs are then placed by
        sharding constraints, and the per-compile XLA options jaxpipe's own programs
        carry are that jit's to pass: ``jax.jit(step, compiler_options=
        jaxpipe.xla_flags.compiler_options(platform))``.
        """
        it = self._internals
        it.check_context("pipe.value_and_grad")
        return it.run_value_and_grad(it.place_params(params), it.place_batch(batch),
                                     it.place_key(key, "pipe.value_and_grad"))

    @_own_mesh
    def staged_value_and_grad(self, staged: Any, batch: Any, key: Any = None
                              ) -> tuple[jax.Array, Any]:
        """As :meth:`value_and_grad`, with parameters and gradients in the stage layout
        (what a training loop keeps resident; no gather of gradients)."""
        it = self._internals
        it.check_context("pipe.staged_value_and_grad")
        return it.run_staged_value_and_grad(
            it.place_staged(staged, "staged_value_and_grad"), it.place_batch(batch),
            it.place_key(key, "pipe.staged_value_and_grad"))

    @_own_mesh
    def loss(self, params_or_state: Any, batch: Any, key: Any = None) -> Any:
        """The pipelined loss, forward only: evaluation and batched inference.

        Runs the schedule's forward actions only (each device's F actions in its order):
        no residual is kept and no backward is compiled. ``params_or_state``: the user's
        parameter pytree, or a :class:`~jaxpipe.train.state.TrainState` (evaluated in the
        stage layout, nothing gathered). Returns the loss reduced as the pipeline's
        ``reduction`` says, or ``(loss, aux)`` with ``has_aux`` (each aux leaf stacked
        over microbatches, as :meth:`value_and_grad` returns it). ``key``: with
        ``rng=True``, the PRNG key of this call.

        Example::

            eval_loss = pipe.loss(state, eval_batch)      # no gradient, no gather
            loss, aux = pipe.loss(params, batch)          # with has_aux=True
        """
        it = self._internals
        it.check_context("pipe.loss")
        batch = it.place_batch(batch)
        key = it.place_key(key, "pipe.loss")
        if isinstance(params_or_state, TrainState):
            staged = it.live_state(params_or_state, "pipe.loss").params
            return it.run_staged_loss(staged, batch, key)
        return it.run_loss(it.place_params(params_or_state, "pipe.loss(params, ...)"),
                           batch, key)

    # ---------------------------------------------------------------- layout
    @_own_mesh
    def shard(self, params: Any) -> Any:
        """Move ``params`` into the executor's stage layout (resident on the devices).

        For the SPMD runtime: one array ``[devices, *shape]`` per parameter slot, sharded
        over the pipe axis; tied parameters are copied onto every stage that reads them.
        """
        it = self._internals
        placed = it.place_params(params, "pipe.shard(params)")
        return it.shard_leaves(jax.tree.leaves(placed))

    @_own_mesh
    def unshard(self, staged: Any) -> Any:
        """Inverse of :meth:`shard`: the user's parameter pytree (replicated)."""
        it = self._internals
        return it.user_tree(it.unshard_leaves(it.place_staged(staged, "unshard")))

    # ---------------------------------------------------------------- training
    @_own_mesh
    def init(self, params: Any, optimizer: Any, *, skip_nonfinite: bool = False,
             clip_global_norm: float | None = None) -> TrainState:
        """Train state for :meth:`train_step`: parameters and per-stage optax state.

        The state owns its optimizer: :meth:`train_step` always trains it with
        ``optimizer``, whatever else is initialised on this pipeline later.

        Args:
          params: the user parameter pytree.
          optimizer: any ``optax.GradientTransformation``; it runs per stage on that
            stage's parameter pytree (other stages' leaves are ``None``).
          skip_nonfinite: if the loss or gradient norm is NaN/inf, leave the parameters
            and optimizer state (its counts and schedules too) unchanged for that step
            (``metrics["skipped"] == 1``); ``state.step`` counts every call, skipped
            ones included.
          clip_global_norm: clip gradients by their true global norm (over all stages)
            before the optimizer.
        """
        it = self._internals
        options = TrainOptions(skip_nonfinite=skip_nonfinite, clip_global_norm=clip_global_norm)
        trainer = it.trainer(optimizer, options)
        if jax.process_count() > 1:  # every process must train alike, or the step hangs
            check_same_training(trainer.abstract_state().opt_state, options)
        leaves = jax.tree.leaves(it.place_params(params, "pipe.init(params, ...)"))
        # Replicated over the mesh, as train_step returns it (else the 2nd step recompiles).
        step = it.placement.put(np.zeros((), np.int32), it.placement.replicated, "step")
        return TrainState(it.shard_leaves(leaves), trainer.init_opt_state(leaves), step,
                          trainer)

    @_own_mesh
    def train_step(self, state: TrainState, batch: Any, key: Any = None
                   ) -> tuple[TrainState, dict]:
        """One optimizer step: ``(state, batch) -> (state, metrics)``; jitted, state donated.

        ``state`` must be the one the previous step returned (its buffers are reused);
        ``key`` is the step's PRNG key with ``rng=True`` (split a fresh one every step).
        """
        it = self._internals
        it.check_context("pipe.train_step")
        state = it.live_state(state, "train_step")
        batch = it.place_batch(batch)
        key = it.place_key(key, "pipe.train_step")
        state, metrics = state.trainer.step(state, batch, key)
        aux = metrics.pop("aux", [])
        if it.objective.has_aux:
            metrics["aux"] = it.aux_tree(aux)
        return state, metrics

    @_own_mesh
    def params(self, state: TrainState) -> Any:
        """The user parameter pytree held by a train state."""
        it = self._internals
        return it.user_tree(it.unshard_leaves(it.live_state(state, "pipe.params").params))

    # ---------------------------------------------------------------- ahead of time
    @_own_mesh
    def lower(self, program: str = "train_step", *, optimizer: Any = None,
              skip_nonfinite: bool = False, clip_global_norm: float | None = None) -> Any:
        """One of the pipeline's programs lowered from abstract inputs, no data needed.

        The ahead-of-time path, as ``jax.jit(f).trace(...).lower()``: the inputs are the
        ``jax.ShapeDtypeStruct`` s of the parameters and batch the pipeline was built
        with (placed as a call would place them), so nothing is put on a device. Build
        the pipeline on a mesh of compile-only devices (:func:`jaxpipe.aot.target`) and
        ``.compile()`` the result to compile for a TPU or GPU this machine does not have.

        Args:
          program: ``"train_step"`` (needs ``optimizer``; the state is abstract too),
            ``"value_and_grad"`` or ``"loss"`` (the forward-only program).
          optimizer, skip_nonfinite, clip_global_norm: as :meth:`init` takes them.

        Returns:
          ``jax.stages.Lowered``: ``.compile()`` it, then ``.memory_analysis()``,
          ``.as_text()`` (or :func:`jaxpipe.aot.compile_report` for all of it).

        Example::

            mesh = jaxpipe.aot.target("gpu:h200:8").mesh((8,), ("pipe",))
            pipe = jp.pipeline(loss_fn, abstract_params, abstract_batch, mesh=mesh,
                               schedule=jp.OneFOneB(8, 16))
            compiled = pipe.lower("train_step", optimizer=optax.adamw(1e-3)).compile()
        """
        if program not in PROGRAMS:
            raise PipelineTypeError(f"program must be one of {', '.join(map(repr, PROGRAMS))}"
                                    f", got {program!r}.")
        if (optimizer is None) != (program != "train_step"):
            raise PipelineTypeError(
                "pipe.lower('train_step', optimizer=...) needs the optax optimizer the "
                "state trains with" if optimizer is None else
                f"pipe.lower({program!r}) takes no optimizer (only 'train_step' has "
                "optimizer state).")
        if program != "train_step" and (skip_nonfinite or clip_global_norm is not None):
            raise PipelineTypeError(
                f"pipe.lower({program!r}) takes no skip_nonfinite / clip_global_norm: they "
                "are options of the optimizer step, only in 'train_step'; drop them.")
        self._internals.check_context(f"pipe.lower({program!r})")
        return self._internals.lower(program, optimizer, TrainOptions(
            skip_nonfinite=skip_nonfinite, clip_global_norm=clip_global_norm))


def pipeline(
    loss_fn: Callable[[Any, Any], jax.Array],
    params: Any,
    batch: Any,
    *,
    mesh: Mesh,
    schedule: Schedule,
    cut: Any = "auto",
    axis: str = "pipe",
    runtime: str | Runtime = "spmd",
    rng: bool = False,
    batch_axes: Any = None,
    param_specs: Any = None,
    has_aux: bool = False,
    reduction: str = "mean",
) -> Pipeline:
    """Compile ``loss_fn`` for pipelined execution under ``schedule`` on ``mesh``.

    Args:
      loss_fn: ``loss_fn(params, microbatch) -> scalar``, the per-microbatch loss. Mark
        candidate cuts with :func:`jaxpipe.boundary` or :func:`jaxpipe.layer`.
      params: parameter pytree (arrays or ``jax.ShapeDtypeStruct``) to trace with.
      batch: a full batch pytree (arrays or ``ShapeDtypeStruct``); every leaf is split
        into ``schedule.num_microbatches`` along axis 0.
      mesh: a mesh with a pipeline axis of size ``schedule.num_devices``. Its other axes
        split the batch (``batch_axes``) or shard parameters (``param_specs``), or both.
      schedule: any validated :class:`jaxpipe.Schedule`.
      cut: ``"auto"`` (memory-aware cutter), ``"markers"`` (markers grouped evenly into
        ``num_stages`` stages, the outer ones taking any extra), or a :class:`jaxpipe.Cut`.
      axis: name of the pipeline mesh axis.
      runtime: ``"spmd"`` (one jit(shard_map) program), ``"reference"`` (sequential), or
        a :class:`jaxpipe.runtime.Runtime` instance.
      rng: ``True`` for a loss that draws random numbers (dropout):
        ``loss_fn(params, microbatch, key)`` then gets microbatch ``i``'s key
        ``jax.random.fold_in(key, i)`` of the key passed to ``value_and_grad`` /
        ``train_step`` (with ``n`` data shards: piece ``j`` of microbatch ``i`` gets
        ``fold_in(key, i * n + j)``; over batch axes that also shard parameters the
        stage runs on their whole piece and draws with its first key).
      batch_axes: the mesh axes that split the batch (data parallelism; gradients are
        averaged over them). Default: the axes the batch is placed split over along its
        axis 0 (``jax.device_put(batch, NamedSharding(mesh, P('fsdp')))``, as ``jax.jit``
        keeps an input's sharding); for a batch not placed so, every axis but ``axis``
        that no parameter is sharded over and no activation constraint of the model
        names. An axis may also
        shard parameters (FSDP: ``batch_axes=('fsdp',)`` with ``P('fsdp', None)``
        weights).
      param_specs: how parameters are sharded over the non-pipe axes. Default: as they
        are placed, like ``jax.jit`` keeps an input's sharding (a ``NamedSharding`` on
        ``mesh`` keeps its spec; host or single-device arrays are replicated; a
        parameter on another mesh is an error). Or a pytree with the structure of
        ``params`` of ``PartitionSpec`` (``None`` / ``P()``: replicated), e.g.
        ``{'w1': P(None, 'model'), 'w2': P('model', None)}`` for tensor parallelism.
        Staged parameters, gradients and optimizer state keep these shardings (a slot
        array is ``P(axis, *spec)``); the stages run under JAX's sharding over these
        axes, the model's own ``with_sharding_constraint`` s included (see
        docs/multihost.md).

      has_aux: ``loss_fn`` returns ``(loss, aux)``, ``aux`` any pytree of arrays computed
        on whichever stage computes it (logged values, predictions): ``value_and_grad``
        returns ``((loss, aux), grads)`` as ``jax.value_and_grad(has_aux=True)`` does,
        ``loss`` returns ``(loss, aux)``, ``train_step`` puts it in ``metrics["aux"]``.
        Each aux leaf comes back stacked over microbatches on a leading axis of size
        ``num_microbatches``, in microbatch order; over batch axes the program splits by
        hand (data parallelism), a second axis holds each data shard's value. Aux values
        never enter the gradient.
      reduction: how the microbatches' losses combine: ``"mean"`` (default), ``"sum"``, or
        ``"weighted"``. With ``"mean"`` and ``"sum"``, over batch axes the program splits
        by hand (data parallelism) each shard's ``loss_fn`` value counts as a mean over
        its rows (the shards' values are averaged), so ``loss_fn`` must average over
        rows there; a loss that sums over rows takes ``"weighted"``, which is exact for
        any split. ``"weighted"``: ``loss_fn`` returns ``(loss_sum, weight)`` (with ``has_aux``,
        ``((loss_sum, weight), aux)``) and the pipeline's loss is ``sum(loss_sum) /
        sum(weight)`` over every microbatch and data shard, with exactly that quotient's
        gradient (a weight the parameters differentiate is refused: wrap it in
        ``jax.lax.stop_gradient`` where a constant is meant). E.g. a per-token loss over
        padded sequences: return the summed loss of the real tokens and their count.

    Example::

        mesh = jax.make_mesh((4,), ("pipe",))
        pipe = jp.pipeline(loss_fn, params, batch, mesh=mesh,
                           schedule=jp.OneFOneB(4, 8), cut="markers")
        loss, grads = pipe.value_and_grad(params, batch)
    """
    return Pipeline(loss_fn, params, batch, mesh=mesh, schedule=schedule, cut=cut, axis=axis,
                    runtime=runtime, rng=rng, batch_axes=batch_axes, param_specs=param_specs,
                    has_aux=has_aux, reduction=reduction)
