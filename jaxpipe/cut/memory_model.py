"""Memory models: how a runtime lays out memory, as far as the memory-aware cutter needs.

A runtime describes its layout with one :class:`MemoryModel` and hands it to the
cutter (``choose_cuts(..., memory_model=...)``); the cutter never copies a runtime's
layout. Two are predefined:

* :data:`SPMD_MEMORY`: jaxpipe's one-program SPMD runtime. All devices run the same
  program, so every buffer has the busiest device's shape, and parameters are
  whole-array slots, padded per ``(shape, dtype)`` to the device with the most.
* :data:`DEVICE_MEMORY`: each device holds exactly its own stages' bytes (MPMD).

The two formulas a runtime is most likely to change live here, as methods of the
model, and the cutter uses nothing else: :meth:`MemoryModel.residual_bytes` (what a
stage's stored residuals occupy) and :meth:`MemoryModel.workspace_bytes` (what a stage
needs while it runs, beyond everything stored).

The runtimes own their models (``Runtime.memory_model``); :mod:`jaxpipe.cut` takes one
through that seam and turns its parameter classes into padding groups
(:mod:`jaxpipe.cut.padding`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

__all__ = ["ACCELERATOR_MEMORY", "DEVICE_MEMORY", "SPMD_MEMORY", "TPU_MEMORY", "MemoryModel"]


@dataclass(frozen=True)
class MemoryModel:
    """How a runtime lays out memory across devices, as far as the cutter is concerned.

    Attributes:
      name: shown in plans and errors (``"spmd"``, ``"device"``).
      padded: ``True`` when every device allocates the busiest device's buffers
        (one SPMD program, one shape); the cutter then minimises the padded peak
        (``CutResult.padded_memory``). ``False`` when each device holds only its
        own stages' bytes (MPMD); it minimises ``max_device(own bytes)``.
      param_class: ``(shape, dtype name) -> storage class`` of a parameter leaf.
        Parameters are padded per class to the busiest device (SPMD whole-array
        slots: a device gets as many slots of a class as any device needs). ``None``:
        no per-class padding (all parameters pad as one group).
      workspace_residual_sets: transient memory while a stage runs its backward, in
        *full* residual sets of that stage: the residuals it would store without
        recomputation, whatever policy it uses (a backward reads or rebuilds them).
        ``Cut.workspace_residual_sets`` overrides it.
      workspace_param_sets: more transient memory while a stage runs, in parameter
        bytes of that stage (the parameter gradients a backward produces, and their
        sums with the accumulated ones). ``Cut.workspace_param_sets`` overrides it.
      workspace_stored_sets: more transient memory, in residual sets of the stage as
        its policy stores them (copies of what a tick stores; a recomputing stage
        stores less and so copies less).

    Example (an MPMD runtime that measured about two sets of temporaries)::

        MemoryModel("mpmd", padded=False, param_class=None, workspace_residual_sets=2.0)
    """

    name: str
    padded: bool
    param_class: Callable[[tuple[int, ...], str], Hashable] | None
    workspace_residual_sets: float = 1.0
    workspace_param_sets: float = 0.0
    workspace_stored_sets: float = 0.0

    def __post_init__(self) -> None:
        for what in ("workspace_residual_sets", "workspace_param_sets",
                     "workspace_stored_sets"):
            if not getattr(self, what) >= 0:
                raise ValueError(f"MemoryModel.{what} must be >= 0, got {getattr(self, what)}")

    def residual_bytes(self, in_flight: Any, residual_set: Any) -> Any:
        """Bytes a stage's stored residuals occupy on its device.

        ``in_flight`` live sets of ``residual_set`` bytes each (numbers or broadcasting
        arrays: the searches call it on whole range matrices). A padded model allocates
        the largest per-device sum of these (plus transfers) on every device.
        """
        return in_flight * residual_set

    def workspace_bytes(self, full_residual_set: Any, param_bytes: Any,
                        stored_set: Any = 0.0) -> Any:
        """Transient bytes while a stage runs (numbers or broadcasting arrays).

        ``full_residual_set``: the stage's residual bytes without recomputation;
        ``param_bytes``: its parameter bytes; ``stored_set``: its residual bytes under
        its policy. A device needs the workspace of its largest stage (a padded model:
        of the largest stage anywhere).
        """
        return (self.workspace_residual_sets * full_residual_set
                + self.workspace_param_sets * param_bytes
                + self.workspace_stored_sets * stored_set)


#: jaxpipe's SPMD runtime: one program, buffers of one shape, parameters in
#: whole-array slots per (shape, dtype). Workspace: half the largest stage's full
#: residual set plus twice its parameter bytes. Measured on CPU (``compare_compiled``),
#: a backward holds 0.2-0.8 of its stage's full residual set as temporaries (slices
#: read from the residual storage, or recomputed activations: about the same for every
#: recomputation policy), plus the parameter gradients it produces and their
#: accumulated sums (the compiled branch does not add in place), about twice the
#: stage's parameter bytes; one full residual set alone over-predicted unbalanced GPT
#: cuts by 16% and under-predicted recomputed stages with large parameters by 28%.
SPMD_MEMORY = MemoryModel("spmd", True, lambda shape, dtype: (shape, dtype), 0.5, 2.0)

#: The SPMD runtime's accelerator program (``backend="gpu"`` / ``"tpu"``): the same
#: layout, more workspace. Each tick's switch returns the rows it stores and the
#: gradients it adds as outputs that are written after it (the buffers stay out of the
#: conditional), and the conditional's outputs are buffers of their own: besides what the
#: CPU program holds, about one more full residual set of outputs, one of the residuals a
#: backward reads, and one of its transient activations. Gradients are added after the
#: switch into the accumulators, so one parameter set of transients, not two. Measured
#: from XLA's CUDA compiler (deviceless, H200 target; ``compile_report``'s arguments +
#: temporaries of the train step), about 1.0 parameter set on MLPs of width 1024-8192;
#: 2.3 full residual sets puts tiny fp32 LMs (width 512-1024, GPipe and 1F1B, 4 devices)
#: within 3% of compiled and the 6.5B bf16 GPT of ``benchmarks/sections/aot.py`` (p=8:
#: GPipe, 1F1B, Interleaved1F1B v=2 and 4) within 1-9%, all over. (3.3, fitted to the
#: tiny LMs alone before a device's stages shared their storage, over-predicted the GPT
#: by 10-23%.)
ACCELERATOR_MEMORY = MemoryModel("spmd-accelerator", True, SPMD_MEMORY.param_class, 2.3,
                                 1.0)

#: The accelerator program compiled by XLA:TPU: 3.3 full residual sets and one parameter
#: set of workspace plus 4.5 residual sets of a stage as its policy stores them.
#: Measured from XLA:TPU (deviceless, v5p target), 6.5B-parameter bf16 GPT (32 blocks,
#: width 4096, seq 2048), p=8, m=16, AdamW step: beyond 3.3 full sets, 1F1B held 4.2
#: stored sets of its 4-block stage, Interleaved1F1B v=2 4.9 of its 2-block stage, v=4
#: 5.6 of its block, GPipe whose stages recompute (storing little) none
#: (``benchmarks/sections/aot.py``): 0.93-1.15 of compiled with 4.5.
TPU_MEMORY = MemoryModel("spmd-tpu", True, SPMD_MEMORY.param_class, 3.3, 1.0, 4.5)

#: Each device holds only its own stages' bytes, as an MPMD runtime would.
DEVICE_MEMORY = MemoryModel("device", False, None, 1.0)
