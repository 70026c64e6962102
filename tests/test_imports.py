"""The package's import graph: no cycle anywhere, and every module imports on its own.

Every import statement counts, wherever it is: at the top, inside a function (an import
moved into a function to dodge a cycle is still the cycle) or under ``TYPE_CHECKING``
(a type that needs a module that needs this one is a layer flowing back up).
"""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "jaxpipe"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports (a ``from m import x`` names ``m.x`` if that is
    a module, else ``m``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            # the root package only maps public names to modules lazily (by string)
            if t and t != name and t != "jaxpipe":
                out.add(t)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_the_package():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "jaxpipe.runtime.spmd.program.build" in graph  # the walk sees subpackages
    assert "jaxpipe.stages.stage_fn" in graph["jaxpipe.stages.splitter"]
    cycles = _cycles(graph)
    assert not cycles, "import cycles (each group imports itself through the others):\n" + \
        "\n".join(" <-> ".join(c) for c in cycles)


# The layers, foundation first: a module may import its own layer and those before it,
# never one after it (docs/architecture.md draws the same order).
LAYERS = [
    ("jaxpipe.errors", "jaxpipe.jax_compat", "jaxpipe.xla_flags", "jaxpipe.build_times",
     "jaxpipe.compile_watch", "jaxpipe.distributed", "jaxpipe.transport_threads"),
    ("jaxpipe.jaxpr",),
    ("jaxpipe.sharding",),
    ("jaxpipe.schedule",),
    ("jaxpipe.stages",),
    ("jaxpipe.cut",),
    ("jaxpipe.train",),
    ("jaxpipe.runtime",),
    ("jaxpipe.api",),
    ("jaxpipe.flax", "jaxpipe.checkpoint", "jaxpipe.checkpoint_files", "jaxpipe.aot"),
    ("jaxpipe.tools", "jaxpipe.launch"),
]


def _layer(name: str) -> int:
    for rank, prefixes in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return rank
    raise AssertionError(f"{name} belongs to no layer: add it to LAYERS in {__file__}")


def test_imports_go_only_down_the_layers():
    modules = _modules()
    upward = []
    for name, path in modules.items():
        if name == "jaxpipe":
            continue
        for dep in _imports(name, path, modules):
            if _layer(dep) > _layer(name):
                upward.append(f"{name} (layer {_layer(name)}) imports {dep} "
                              f"(layer {_layer(dep)})")
    assert not upward, "imports up the layers:\n" + "\n".join(sorted(upward))


def test_the_package_top_holds_only_its_layers_and_a_few_modules():
    top = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    assert len(top) <= 10, top
    assert _layer("jaxpipe.api.pipeline") > _layer("jaxpipe.runtime.base")


def test_no_module_over_500_lines():
    long = {name: n for name, path in _modules().items()
            if (n := len(path.read_text().splitlines())) > 500}
    assert not long, f"split these modules (one idea each): {long}"


def test_every_module_imports_on_its_own():
    """Each module imported first, in a fresh package state, loads (no import-order
    dependence a cycle checker that reads only the source could miss)."""
    code = """
import importlib, sys
names = sys.argv[1:]
bad = []
for n in names:
    for k in [k for k in sys.modules if k == "jaxpipe" or k.startswith("jaxpipe.")]:
        del sys.modules[k]
    try:
        importlib.import_module(n)
    except Exception as e:
        bad.append(f"{n}: {e!r}")
print("\\n".join(bad))
sys.exit(1 if bad else 0)
"""
    names = sorted(_modules())
    run = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True,
                         cwd=PACKAGE.parent, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


def test_private_jax_is_read_in_one_module_only():
    """``jax._src`` is imported by ``jaxpipe/jax_compat.py`` alone: a JAX upgrade that
    moves a private object breaks one guarded accessor, with an error naming it."""
    offenders = []
    for name, path in _modules().items():
        if name == "jaxpipe.jax_compat":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{name}: {m}" for m in mods if m.startswith("jax._src")]
    assert not offenders, offenders


def test_a_moved_private_jax_object_names_itself_and_the_supported_versions(monkeypatch):
    import jax._src.pjit
    import pytest

    import jaxpipe as jp
    from jaxpipe import jax_compat

    prim = jax_compat.sharding_constraint_p()
    assert prim.name == "sharding_constraint"
    monkeypatch.delattr(jax._src.pjit, "sharding_constraint_p")
    with pytest.raises(jp.PipelineError, match=r"sharding_constraint_p.*supports JAX >= 0\.10"):
        jax_compat.sharding_constraint_p()
