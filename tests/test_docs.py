"""The docs keep up with the package: every module is listed, every link resolves."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jaxpipe"
README = (ROOT / "README.md").read_text()


def _modules() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("*.py"))


def test_architecture_lists_every_module():
    text = (ROOT / "docs" / "architecture.md").read_text()
    modules = _modules()
    assert "jaxpipe/runtime/spmd/program/build.py" in modules
    missing = [m for m in modules if f"`{m}`" not in text]
    assert not missing, f"docs/architecture.md's module index misses {missing}"


def test_readme_layout_lists_every_top_level_module_and_package():
    layout = README[README.index("## Layout of the package"):]
    block = layout[layout.index("```\n") + 4:layout.index("```", layout.index("```\n") + 4)]
    listed = {line.split()[0] for line in block.splitlines() if line.startswith("jaxpipe/")}
    top = {f"jaxpipe/{p.name}" for p in PACKAGE.glob("*.py")}
    top |= {f"jaxpipe/{p.name}/" for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert top - listed == set(), f"README's layout misses {sorted(top - listed)}"
    assert listed - top == set(), f"README's layout names what is gone: {sorted(listed - top)}"


def test_readme_starts_with_the_commands_and_an_example():
    lines = README.splitlines()
    first_python = next(i for i, line in enumerate(lines) if line.startswith("```python"))
    assert first_python < 40
    assert len((ROOT / "benchmarks" / "README.md").read_text().splitlines()) < 250
    assert "python examples/gpt.py" in "\n".join(lines[:first_python])
    assert "python -m pytest -q -n 2 --dist loadfile tests" in "\n".join(lines[:first_python])
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q -n 2 --dist loadfile" in ci  # CI runs the README's command


def test_relative_links_resolve():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
            ROOT / "benchmarks" / "README.md"]
    broken = []
    for doc in docs:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target:
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_api_md_lists_every_public_name_of_a_pipeline():
    from jaxpipe.api.pipeline import Pipeline

    public = {n for n in dir(Pipeline) if not n.startswith("_")}
    assert 0 < len(public) <= 15, sorted(public)
    text = (ROOT / "docs" / "api.md").read_text()
    table = text[text.index("## `Pipeline`"):text.index("## `pipe.inspect`")]
    listed = set(re.findall(r"^\| `(\w+)", table, re.M))
    assert listed == public, (sorted(public - listed), sorted(listed - public))
