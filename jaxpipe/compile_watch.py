"""A jitted entry point that says, once, when it compiles again for inputs of the same shapes.

Every entry point of a :class:`jaxpipe.Pipeline` (``value_and_grad``, ``loss``,
``train_step``, ...) places its inputs canonically before the call
(:mod:`jaxpipe.api.input_placement`), so a second compilation for the same shapes means
something else changed; :class:`CompileWatch` names the entry point and the first input
whose signature differs in a :class:`RecompileWarning`.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

import jax

from jaxpipe.build_times import BuildTimes

__all__ = ["CompileWatch", "RecompileWarning"]


class RecompileWarning(UserWarning):
    """A pipeline entry point compiled again for inputs of the same shapes."""


def _signature(args: Any) -> list[tuple[str, str]]:
    """(path, 'shape dtype weak sharding') of every array leaf of ``args``."""
    out = []
    for path, x in jax.tree.flatten_with_path(args)[0]:
        weak = " weak_type" if getattr(getattr(x, "aval", None), "weak_type", False) else ""
        out.append((jax.tree_util.keystr(path),
                    f"{getattr(x, 'shape', ())} {getattr(x, 'dtype', type(x).__name__)}"
                    f"{weak} {getattr(x, 'sharding', 'host')}"))
    return out


class CompileWatch:
    """A jitted function that warns once when it compiles a second time.

    Inputs are placed canonically before the call, so a second compilation for the same
    shapes means something else changed (a parameter sharding of the user's own, a
    weak type, a jax config flag). The warning names the entry point and the first input
    whose signature differs from the first call's. Called with tracers (inside the
    caller's own jit), it runs ``fn`` without its per-compile options, which JAX refuses
    on a nested jit.
    """

    def __init__(self, fn: Callable, name: str,
                 check: Callable[[Any, str], None] | None = None,
                 times: BuildTimes | None = None, *,
                 compiler_options: dict[str, Any] | None = None, **jit_kwargs: Any) -> None:
        #: ``jax.jit(fn, compiler_options=..., **jit_kwargs)``: what a call runs
        self.fn = jax.jit(fn, compiler_options=compiler_options, **jit_kwargs)
        self.name = name
        #: what a call inside the caller's own ``jax.jit`` runs: JAX takes per-compile
        #: options on the outermost jit only (the caller's to pass), so ``fn`` without them
        self.nested = jax.jit(fn, **jit_kwargs) if compiler_options else self.fn
        #: ``check(compiled, name)`` runs once, on the program compiled for the first call
        #: (a runtime's refusal of a program it cannot run, before it runs)
        self.check = check
        #: where the first call's lowering and compile seconds go (``pipe.plan`` shows them)
        self.times = times
        self._first: list | None = None
        self._warned = False
        self._nested_checked = False

    def __call__(self, *args: Any) -> Any:
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
            # inside the caller's jit: its program holds this one and is compiled with it
            # (nothing of ours to time), but a program this runtime cannot run is refused
            # all the same, from a compile of the pipeline alone
            if self._first is None and self.check is not None and not self._nested_checked:
                self.check(self.fn.lower(*args).compile(), self.name)
                self._nested_checked = True
            return self.nested(*args)
        if self._first is None and (self.check is not None or self.times is not None):
            # jit reuses this compilation for the call below
            t0 = time.perf_counter()
            lowered = self.fn.lower(*args)
            t1 = time.perf_counter()
            compiled = lowered.compile()
            if self.times is not None:
                self.times.compiled(self.name, t1 - t0, time.perf_counter() - t1)
            if self.check is not None:
                self.check(compiled, self.name)
        before = self._cache_size()
        out = self.fn(*args)
        if self._first is None:
            self._first = _signature(args)
        elif not self._warned and self._cache_size() > max(before, 1):
            self._warned = True
            now = _signature(args)
            diff = next((f"{p}: {b} (first call: {a})" for (p, a), (_, b) in zip(
                self._first, now, strict=False) if a != b),
                "no input signature changed: something around the call did, e.g. a "
                "jax.set_mesh context or a jax config flag set for one call and not the "
                "other")
            warnings.warn(
                f"{self.name} compiled again for inputs of the same shapes ({diff}); every "
                "new input signature costs a full compilation. Pass inputs with the same "
                "dtypes and shardings at every call (jaxpipe places batches and "
                "parameters on the pipeline's mesh itself). This warning is shown once.",
                RecompileWarning, stacklevel=3)
        return out

    def _cache_size(self) -> int:
        size: Callable[[], int] | None = getattr(self.fn, "_cache_size", None)
        return size() if size is not None else 0

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn.lower(*args, **kwargs)


