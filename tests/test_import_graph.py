"""The package's layout: its import graph has no cycle, and no module does too many jobs.

Every ``import`` and ``from ... import`` under ``src/ratekeeper`` counts, those inside functions
too (a cycle dodged by a late import is still a cycle); only imports under
``if TYPE_CHECKING:``, which serve annotations and never run, are left out. ``from . import x``
is an edge to the module ``x`` when there is one, and ``from .pkg import name`` an edge to the
package ``pkg`` (its ``__init__`` runs), and to ``pkg.name`` when that is a module; importing a
module of a subpackage is an edge to that subpackage too (its ``__init__`` runs first). The root
package, the public face, is not counted as imported by its own modules.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "ratekeeper"


def _modules() -> dict[str, Path]:
    found = {}
    for path in (SRC / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _runtime_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement but those under ``if TYPE_CHECKING:``."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports when it runs."""
    modules = _modules()
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        here = name if is_package else name.rpartition(".")[0]
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = here.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                targets = [origin] + [f"{origin}.{alias.name}" for alias in node.names]
            for imported in targets:
                # The module itself, or the nearest package of it that is one of ours.
                target = imported
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target == PACKAGE and name != PACKAGE:  # ``from . import x`` of the root
                    edges[name].add(target)
                # Importing ``a.b.c`` runs the package ``a.b`` first: an edge to it too (but
                # not to the root package, the public face every module is imported through).
                while target.startswith(f"{PACKAGE}."):
                    if target != name and not name.startswith(f"{target}."):
                        edges[name].add(target)
                    target = target.rpartition(".")[0]
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for other in sorted(edges[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_import_graph_has_no_cycle() -> None:
    assert cycles(graph()) == []


def test_the_checker_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_hand_written_module_is_over_500_lines() -> None:
    """One job per module: none over 500 lines (generated code aside)."""
    long = {
        name: lines
        for name, path in _modules().items()
        if not path.name.endswith("_pb2.py") and (lines := len(path.read_text().splitlines())) > 500
    }
    assert long == {}
