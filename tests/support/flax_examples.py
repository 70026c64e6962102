"""Load flax's own example models pinned under ``tests/flax_examples`` (see its README)."""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parent.parent / "flax_examples"


def _import_from(folder: Path, *names: str) -> list[types.ModuleType]:
    sys.path.insert(0, str(folder))
    try:
        return [importlib.import_module(n) for n in names]
    finally:
        sys.path.remove(str(folder))


def gemma() -> tuple[types.ModuleType, types.ModuleType, types.ModuleType]:
    """flax's Gemma: ``(transformer, transformer_cfg, modules)``, imported once."""
    try:
        import jaxtyping  # noqa: F401
    except ImportError:  # one annotation needs it; not a dependency of ours
        shim = types.ModuleType("jaxtyping")
        shim.Array = jax.Array
        sys.modules["jaxtyping"] = shim
    return tuple(_import_from(ROOT / "gemma", "transformer", "transformer_cfg", "modules"))


def lm1b() -> types.ModuleType:
    """flax's lm1b ``models`` module, imported once (as ``lm1b_models``)."""
    if "lm1b_models" not in sys.modules:
        spec = importlib.util.spec_from_file_location("lm1b_models", ROOT / "lm1b" / "models.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["lm1b_models"] = module
        spec.loader.exec_module(module)
    return sys.modules["lm1b_models"]
