"""The package's shape: no import cycle (function-local imports included) and no module
over 400 lines. Parsed with ``ast``, nothing imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "lightning_acgc"
MAX_LINES = 400


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:`` (never run)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                skipped.update(id(n) for n in ast.walk(child))
    return skipped


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports anywhere in its body (functions too)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skipped = _type_checking_only(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    # Importing ``a.b.c`` runs ``a/b/__init__.py`` first: an edge to each package above
    # it, except the root and the importer's own packages (which import it themselves).
    own = _ancestors(name) | {name}
    out |= {p for m in out for p in _ancestors(m) if p not in own and "." in p}
    return {m for m in out if m in known and m not in own}


def _ancestors(name: str) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_finds_a_cycle_and_a_function_local_import(tmp_path: Path) -> None:
    """The checker itself: a cycle closed by an import inside a function is found."""
    a = tmp_path / "a.py"
    a.write_text("import pkg.b\n")
    b = tmp_path / "b.py"
    b.write_text("def f():\n    from pkg import a\n")
    graph = {
        "pkg.a": _imports("pkg.a", a, {"pkg.a", "pkg.b"}),
        "pkg.b": _imports("pkg.b", b, {"pkg.a", "pkg.b"}),
    }
    assert _cycles(graph) == [["pkg.a", "pkg.b"]]


def test_no_import_cycles() -> None:
    graph = _graph()
    assert "lightning_acgc.lightning.callback" in graph
    assert _cycles(graph) == []


def test_engine_imports_no_policy_and_no_lightning() -> None:
    for name, path in _modules().items():
        if name.startswith("lightning_acgc.engine"):
            deps = _imports(name, path, set(_modules()))
            assert not {d for d in deps if d.startswith("lightning_acgc.policies")}, name
            assert "lightning" not in path.read_text().replace("lightning_acgc", ""), name


@pytest.mark.parametrize("name", sorted(_modules()))
def test_module_is_small(name: str) -> None:
    lines = len(_modules()[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name}: {lines} lines"
