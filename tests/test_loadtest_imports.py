"""Dependencies run one way: the product never imports its load tests, and the load tests
import each other without a cycle. Every import counts, those inside functions too (a lazy
import is a dependency all the same); found by reading the sources, not by importing them.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> Iterator[str]:
    """Every module ``path`` imports (``from a import b`` yields ``a`` and ``a.b``)."""
    package = module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the importing module's package
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (submodules it names included)."""
    modules = {module_name(p): p for p in (REPO / package).rglob("*.py")}
    return {
        name: {m for m in imports_of(path) if m in modules and m != name}
        for name, path in modules.items()
    }


def a_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path of module names, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_finder_finds_cycles() -> None:
    assert a_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert a_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_product_never_imports_the_load_tests() -> None:
    offenders = {
        module_name(path): sorted(m for m in imports_of(path) if m.split(".")[0] == "loadtest")
        for package in ("storaged", "tiers", "erasure")
        for path in (REPO / package).rglob("*.py")
    }
    assert {name: found for name, found in offenders.items() if found} == {}


def test_the_load_tests_import_each_other_without_a_cycle() -> None:
    edges = graph("loadtest")
    assert "loadtest.harness.cluster" in edges and edges["loadtest.restore"]  # the graph is real
    assert a_cycle(edges) is None
    # The harness imports no benchmark.
    harness = {name: found for name, found in edges.items() if name.startswith("loadtest.harness")}
    assert {
        name: sorted(m for m in found if not m.startswith("loadtest.harness"))
        for name, found in harness.items()
        if any(not m.startswith("loadtest.harness") for m in found)
    } == {}
