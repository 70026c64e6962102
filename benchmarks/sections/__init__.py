"""Benchmark sections: one module each, found by ``benchmarks/run.py``; the name is the
module's name.

A section module defines::

    ORDER = 30                  # its place in a full run (one that reuses another
                                # section's compiled programs runs after it)
    FIELDS = ("p", "rows")      # keys its result always has; the runner and tests check them
    def run(r: Runner) -> dict  # measure; r.s is the Settings sections share, r.s.quick
                                # the smoke test

and may define ``summary(res) -> str`` (markdown for ``summary.md``), ``plot(res, save)``
(``save(fig, "name.png")``) and ``CPU_ONLY = True`` (elsewhere the runner records why it
did not run). A section's own sizes are a frozen dataclass in its module with
``for_run(quick)`` (e.g. ``OverheadSettings``), read with ``harness.section_settings`` and
recorded in its result under ``"settings"``. Adding a section is adding one such file
here, or in a folder passed with ``--more-sections``.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["Section", "discover"]


@dataclass(frozen=True)
class Section:
    """One section as the runner sees it."""

    name: str
    order: int
    fields: tuple[str, ...]
    run: Callable[[Any], dict[str, Any]]
    summary: Callable[[dict[str, Any]], str] | None
    plot: Callable[[dict[str, Any], Callable[[Any, str], None]], None] | None
    cpu_only: bool

    @classmethod
    def of(cls, module: ModuleType, name: str) -> Section:
        missing = [a for a in ("ORDER", "FIELDS", "run") if not hasattr(module, a)]
        if missing:
            raise TypeError(f"benchmark section {name!r} ({module.__file__}) does not define "
                            f"{', '.join(missing)}; a section module defines ORDER (int), "
                            "FIELDS (tuple of result keys) and run(r) -> dict "
                            "(see benchmarks/sections/__init__.py)")
        return cls(name, int(module.ORDER), tuple(module.FIELDS), module.run,
                   getattr(module, "summary", None), getattr(module, "plot", None),
                   bool(getattr(module, "CPU_ONLY", False)))


def _load_file(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"benchmark_section_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def discover(more: Sequence[str | Path] = ()) -> dict[str, Section]:
    """Every section in this package and in the folders ``more``, in run order."""
    found: dict[str, Section] = {}
    for info in pkgutil.iter_modules(__path__):
        found[info.name] = Section.of(importlib.import_module(f"{__name__}.{info.name}"),
                                      info.name)
    for folder in map(Path, more):
        if not folder.is_dir():
            raise FileNotFoundError(f"--more-sections {folder}: not a folder of section "
                                    "modules")
        for path in sorted(folder.glob("*.py")):
            if path.stem.startswith("_"):
                continue
            if path.stem in found:
                raise ValueError(f"benchmark section {path.stem!r} in {folder} has the name "
                                 "of a section already found; rename the file")
            found[path.stem] = Section.of(_load_file(path), path.stem)
    return dict(sorted(found.items(), key=lambda kv: (kv[1].order, kv[0])))
