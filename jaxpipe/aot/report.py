"""Compile a pipeline's program for its mesh and say what one device holds, and whether it fits.

:func:`compile_report` lowers one of a pipeline's programs from abstract inputs
(``Pipeline.lower``), compiles it with the compiler of the mesh's devices (XLA:TPU or
XLA's CUDA compiler for a :func:`jaxpipe.aot.target` mesh, XLA:CPU otherwise) and
returns a :class:`CompileReport`: the compiled ``memory_analysis()`` per device next to
the cutter's prediction and the device's capacity, the tick loop's census (conditionals,
loops, collectives and what overlaps them, copies per tick) and the time each phase
took. ``print(report)`` is what ``jaxpipe compile`` shows.

XLA's CUDA compiler does not refuse a program larger than the device (no device, no
allocator): the fit is ``arguments + outputs + temporaries - aliased <= capacity``, the
check done here. XLA:TPU refuses one at compile time; the report then says so instead
of raising.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from jaxpipe.api.plan import predicted_with_optimizer
from jaxpipe.jaxpr.avals import format_bytes
from jaxpipe.sharding.device_memory import capacity

__all__ = ["CompileReport", "compile_report"]


@dataclass
class CompileReport:
    """One compiled program of a pipeline, per device.

    Attributes:
      program: ``"train_step"``, ``"value_and_grad"`` or ``"loss"``.
      platform, device_kind: of the mesh's devices; ``devices``: how many.
      capacity: bytes one device's program may use (``None``: unknown, e.g. CPU);
        ``capacity_source``: where that figure comes from.
      argument_bytes, output_bytes, temp_bytes, alias_bytes: ``memory_analysis()``
        of the compiled program (per device: the program is SPMD); ``None`` when the
        compiler refused the program (``error``).
      predicted_bytes: the cutter's per-device prediction (the plan's, incl. batch), for
        ``"train_step"`` (what the cutter models: parameters, gradients, optimizer state,
        residuals), with the optimizer state of the optimizer compiled (the cut assumes
        ``Cut.optimizer_bytes_per_param_byte``, Adam's 2); ``None`` for the other
        programs, which hold no optimizer state.
      lower_s, compile_s: seconds lowering and compiling took.
      census: the tick loop's census (``TickLoopCensus``), ``None`` where the program
        has no tick loop with a collective (one device).
      error: the compiler's refusal (TPU: out of HBM), else ``None``.
    """

    program: str
    platform: str
    device_kind: str
    devices: int
    capacity: int | None
    capacity_source: str | None
    argument_bytes: int | None
    output_bytes: int | None
    temp_bytes: int | None
    alias_bytes: int | None
    predicted_bytes: float | None
    lower_s: float
    compile_s: float
    census: Any = None
    error: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def total_bytes(self) -> int | None:
        """What one device holds while the program runs: arguments + outputs +
        temporaries - aliased (donated) bytes."""
        if self.argument_bytes is None:
            return None
        return (self.argument_bytes + self.output_bytes + self.temp_bytes
                - self.alias_bytes)

    @property
    def fits(self) -> bool | None:
        """Whether the program fits the device (``None``: capacity unknown)."""
        if self.error is not None:
            return False
        if self.capacity is None or self.total_bytes is None:
            return None
        return self.total_bytes <= self.capacity

    @property
    def predicted_ratio(self) -> float | None:
        """The cutter's prediction over compiled arguments + temporaries."""
        if self.argument_bytes is None or self.predicted_bytes is None:
            return None
        return self.predicted_bytes / max(1, self.argument_bytes + self.temp_bytes)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["census"] = None if self.census is None else asdict(self.census)
        out.update(total_bytes=self.total_bytes, fits=self.fits,
                   predicted_ratio=self.predicted_ratio)
        return out

    def __str__(self) -> str:
        lines = [f"jaxpipe compile: {self.program} for {self.devices} x {self.device_kind} "
                 f"({self.platform})"]
        cap = ("unknown" if self.capacity is None
               else f"{format_bytes(self.capacity)} ({self.capacity_source})")
        if self.error is not None:
            lines.append(f"  the compiler refused it: {self.error}")
        else:
            lines.append(
                f"  per device: arguments {format_bytes(self.argument_bytes)}, temporaries "
                f"{format_bytes(self.temp_bytes)}, outputs {format_bytes(self.output_bytes)}"
                f", aliased {format_bytes(self.alias_bytes)}")
            lines.append(f"  total {format_bytes(self.total_bytes)}" + (
                "" if self.predicted_bytes is None else
                f"; the cutter predicted {format_bytes(self.predicted_bytes)} "
                f"({self.predicted_ratio:.2f} x arguments + temporaries)"))
        verdict = {True: "fits", False: "DOES NOT FIT", None: "fit unknown"}[self.fits]
        lines.append(f"  capacity {cap}: {verdict}")
        if self.census is not None:
            lines.append("  tick loop:")
            lines += ["    " + line for line in self.census.summary().splitlines()]
        lines.append(f"  lower {self.lower_s:.2f} s, compile {self.compile_s:.2f} s")
        for key, value in self.extra.items():
            lines.append(f"  {key}: {value}")
        return "\n".join(lines)

    __repr__ = __str__


_OOM = re.compile(r"RESOURCE_EXHAUSTED|[Oo]ut of memory|exceeds available")


def compile_report(pipe: Any, program: str = "train_step", *, optimizer: Any = None,
                   compiler_options: dict[str, Any] | None = None,
                   **train_options: Any) -> CompileReport:
    """Compile ``pipe``'s ``program`` for its mesh's devices and report per device.

    Args:
      pipe: a pipeline (any mesh: a :func:`jaxpipe.aot.target` mesh compiles for that
        accelerator).
      program: ``"train_step"`` (default; ``optimizer`` defaults to ``optax.adam``, the
        optimizer the cutter's memory model assumes), ``"value_and_grad"`` or ``"loss"``.
      compiler_options: XLA options for this compile (default: those the pipeline's
        programs carry for their platform, :func:`jaxpipe.xla_flags.compiler_options`).
      train_options: ``skip_nonfinite`` / ``clip_global_norm`` as ``pipe.init`` takes them.

    Example::

        t = jaxpipe.aot.target("tpu:v5e:2x4")
        pipe = jp.pipeline(loss_fn, abstract_params, abstract_batch,
                           mesh=t.mesh((8,), ("pipe",)), schedule=jp.OneFOneB(8, 16))
        print(jaxpipe.aot.compile_report(pipe, optimizer=optax.adamw(1e-3)))
    """
    from jaxpipe.runtime.spmd.program.hlo_census import census

    if program == "train_step" and optimizer is None:
        import optax

        optimizer = optax.adam(1e-3)
    device = pipe.mesh.devices.flat[0]
    t0 = time.perf_counter()
    lowered = pipe.lower(program, optimizer=optimizer, **train_options)
    t1 = time.perf_counter()
    memory, text, error = None, None, None
    try:
        compiled = lowered.compile(compiler_options)
        memory, text = compiled.memory_analysis(), compiled.as_text()
    except Exception as e:  # noqa: BLE001 - only the compiler's out-of-memory refusal
        if not _OOM.search(str(e)):
            raise
        error = " ".join(str(e).split())[:300]
    t2 = time.perf_counter()
    predicted, extra = None, {}
    if program == "train_step":
        predicted, note = predicted_with_optimizer(pipe.inspect, optimizer)
        extra = {} if note is None else {"optimizer state": note}
    cap = capacity(device)
    found = None
    if text is not None:
        try:
            found = census(text)
        except ValueError:  # no tick loop with a collective: one pipeline device
            found = None

    def field_(name: str) -> int | None:
        return None if memory is None else int(getattr(memory, name))

    return CompileReport(
        program=program, platform=device.platform, device_kind=device.device_kind,
        devices=pipe.mesh.size, capacity=None if cap is None else cap.bytes,
        capacity_source=None if cap is None else cap.source,
        argument_bytes=field_("argument_size_in_bytes"),
        output_bytes=field_("output_size_in_bytes"),
        temp_bytes=field_("temp_size_in_bytes"), alias_bytes=field_("alias_size_in_bytes"),
        predicted_bytes=predicted, lower_s=t1 - t0, compile_s=t2 - t1, census=found,
        error=error, extra=extra)
