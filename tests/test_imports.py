"""cpullm's modules import one another without a circle: every import statement of a module
(at its top, or inside its functions; not those for type checkers alone) is an edge, and
no module reaches itself again."""

from __future__ import annotations

import ast
from pathlib import Path

import cpullm

ROOT = Path(cpullm.__file__).parent


def modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The cpullm modules that ``name`` imports: ``from X import y`` names X.y where that is
    a module, else X."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    targets: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                for alias in node.names:
                    child = f"{module}.{alias.name}"
                    targets.add(child if child in known else module)
            for field in ("body", "orelse", "finalbody", "handlers"):
                inner = getattr(node, field, None)
                if isinstance(inner, list):
                    visit([n for n in inner if isinstance(n, ast.stmt | ast.ExceptHandler)])
            if isinstance(node, ast.ExceptHandler):
                visit(node.body)

    visit(ast.parse(path.read_text()).body)
    return {target for target in targets if target in known and target != name}


def test_no_import_circle():
    known = modules()
    graph = {name: imported(name, path, known) for name, path in known.items()}
    assert len(graph) > 100 and graph["cpullm.entrypoints.llm"]  # the walk finds the imports
    done: set[str] = set()

    def walk(name: str, trail: list[str]) -> None:
        if name in trail:
            circle = trail[trail.index(name):] + [name]
            raise AssertionError("import circle: " + " -> ".join(circle))
        if name in done:
            return
        for target in sorted(graph[name]):
            walk(target, trail + [name])
        done.add(name)

    for name in sorted(graph):
        walk(name, [])
