"""What ``pipe.inspect`` reports about a built pipeline, beyond the steps ``Pipeline`` runs.

:class:`InternalsReports` is mixed into :class:`~jaxpipe.api.internals.Internals` and reads
only what it exposes: the parameters' shardings and owners, the reference executor's answer,
the lowered programs, the plan, and the summaries a checkpoint and other processes compare.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from jaxpipe.runtime import Executor
from jaxpipe.sharding.mesh_axes import to_spec
from jaxpipe.train.options import TrainOptions

__all__ = ["InternalsReports"]


class InternalsReports:
    """The reports of a built pipeline (mixed into :class:`~jaxpipe.api.internals.Internals`)."""

    @property
    def param_specs(self) -> Any:
        """The parameters' sharding over the non-pipe mesh axes: a pytree of
        ``PartitionSpec`` with the structure of ``params`` (``P()``: replicated)."""
        return jax.tree.unflatten(self.traced.params_treedef,
                                  [to_spec(d) for d in self.param_dims])

    @property
    def param_owners(self) -> dict[int, tuple[int, ...]]:
        """Parameter leaf -> the stages that read it (a tied leaf has several; a stacked
        weight split over stages lists the stages holding its rows)."""
        owners: dict[int, set[int]] = {}
        for pid, stages in self.executor.spec.param_owners.items():
            owners.setdefault(self.views.views[pid].leaf, set()).update(stages)
        return {leaf: tuple(sorted(s)) for leaf, s in sorted(owners.items())}

    @property
    def batch_sharding(self) -> Any:
        """The ``NamedSharding`` batches are placed with: axis 0 split over the batch axes
        (those the program is manual over first), replicated over the pipe axis. Build
        multi-process batches with it to skip a reshard at every call."""
        return self.placement.batch

    def stage_params(self, staged: Any) -> list[list[jax.Array]]:
        """Every stage's parameter inputs as its device holds them (tied: each copy; a
        stacked weight split over stages: the stage's rows)."""
        return self.executor.stage_params(self.place_staged(staged, "stage_params"))

    @functools.cached_property
    def _reference(self) -> Executor:
        from jaxpipe.runtime.reference import ReferenceRuntime

        return ReferenceRuntime().build(self.executor.spec)

    def reference_value_and_grad(self, params: Any, batch: Any, key: Any = None
                                 ) -> tuple[jax.Array, Any]:
        """Same as :meth:`value_and_grad`, run by the sequential reference executor."""
        params = self.place_params(params)
        key = self.place_key(key, "pipe.reference_value_and_grad")
        loss, aux, grads = self._reference.value_and_grad(
            self.check_params(params), self.microbatches(self.place_batch(batch), key))
        return self.value(loss, aux), self.user_tree(grads)

    def abstract_inputs(self) -> tuple[Any, Any, Any]:
        """``(params, batch, key)`` as ``jax.ShapeDtypeStruct`` s placed as a call places
        them (``key``: ``None`` without ``rng``): what the ahead-of-time path lowers."""
        placement = self.placement
        params = jax.tree.unflatten(self.traced.params_treedef, [
            jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s or placement.replicated)
            for a, s in zip(self.param_avals, placement.param_shardings
                            or [None] * len(self.param_avals), strict=True)])
        batch = jax.tree.unflatten(self.batch_treedef, [
            jax.ShapeDtypeStruct(shape, dtype, sharding=placement.batch)
            for shape, dtype in zip(self.batch_shapes, self.batch_dtypes, strict=True)])
        key = (jax.ShapeDtypeStruct((), self.key_dtype, sharding=placement.replicated)
               if self.rng else None)
        return params, batch, key

    def lower(self, program: str, optimizer: Any = None,
              options: TrainOptions | None = None) -> Any:
        """``program`` (``"train_step"``, ``"value_and_grad"`` or ``"loss"``) lowered from
        :meth:`abstract_inputs` (see ``Pipeline.lower``, which checks the arguments)."""
        params, batch, key = self.abstract_inputs()
        if program == "value_and_grad":
            return self.value_and_grad_fn.trace(params, batch, key).lower()
        if program == "loss":
            return self.eval_fn.trace(params, batch, key).lower()
        trainer = self.trainer(optimizer, options or TrainOptions())
        return trainer.step_fn.trace(trainer.abstract_state(), batch, key).lower()

    @functools.cached_property
    def plan(self) -> Any:
        """Per-stage layers, FLOPs, bytes, in-flight counts and predicted memory/bubble."""
        from jaxpipe.api.plan import Plan

        return Plan.build(self)

    def compare_compiled(self, params: Any, batch: Any, optimizer: Any = None) -> dict:
        """Predicted per-device bytes next to the compiled program's ``memory_analysis()``."""
        from jaxpipe.api.plan import Plan

        return Plan.compare_compiled(self, params, batch, optimizer)

    def layout_summary(self) -> dict[str, Any]:
        """Schedule, sizes and cut: what a checkpoint in the stage layout depends on."""
        sched = self.schedule
        return {
            "schedule": type(sched).__qualname__,
            "num_devices": sched.num_devices,
            "num_microbatches": sched.num_microbatches,
            "stages_per_device": sched.stages_per_device,
            "cuts": [int(c) for c in self.cuts],
            "runtime": self.runtime.name,
        }

    def fingerprint(self) -> dict[str, Any]:
        """A JSON-able summary of everything the compiled program depends on.

        Schedule (class, p, m, v, a digest of every device's action list), cut, mesh,
        parameter and microbatch shapes, and the executor's own digests (e.g. of the
        lowered tick table). Processes compare it before running collectives
        (:func:`jaxpipe.distributed.agreement.config_summary`).
        """
        from jaxpipe.distributed.agreement import config_summary

        return config_summary(self)
