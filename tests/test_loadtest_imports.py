"""Dependencies run one way: the product never imports its load tests, no module imports
itself through others (no cycle in ``storaged``, ``tiers``, ``erasure`` and ``loadtest``,
taken together, type-checking imports counted too: a name imported for its type is a
dependency of its reader), and a benchmark imports the harness (``loadtest.harness``),
never another benchmark. Every import counts, those inside functions too (a lazy import is
a dependency all the same); where only imports that run are asked for, those under ``if
TYPE_CHECKING:`` are left out. Found by reading the sources, not by importing them.

The storage leaves (``tiers``, ``erasure``) import nothing from ``storaged`` and the client
(``storaged.client``) nothing from ``tiers``: here type-checking imports count too, since a
name a leaf cannot run without is a dependency however it is spelled.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("storaged", "tiers", "erasure", "loadtest")
HARNESS = "loadtest.harness"


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _run_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of ``tree`` but the bodies of ``if TYPE_CHECKING:`` (their ``else`` runs)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and (
            (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
            or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
        ):
            for child in node.orelse:
                yield child
                yield from _run_nodes(child)
            continue
        yield node
        yield from _run_nodes(node)


def imports_in(
    source: str, module: str, filename: str = "<source>", *, type_checking: bool = False
) -> Iterator[str]:
    """Every module the code of ``module`` imports when it runs (``from a import b`` yields
    ``a`` and ``a.b``); with ``type_checking``, those under ``if TYPE_CHECKING:`` too."""
    package = module.rpartition(".")[0]
    tree = ast.parse(source, filename)
    for node in ast.walk(tree) if type_checking else _run_nodes(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the importing module's package
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def imports_of(path: Path, *, type_checking: bool = False) -> Iterator[str]:
    yield from _imports_of(path, type_checking)


@functools.cache
def _imports_of(path: Path, type_checking: bool) -> tuple[str, ...]:
    """``imports_of`` read and parsed once a session: the tests below read every source
    of the four packages seven times over (about 40 s of parsing on the loaded CI machine),
    and a source does not change while they run."""
    return tuple(
        imports_in(path.read_text(), module_name(path), str(path), type_checking=type_checking)
    )


def imports_into(packages: tuple[str, ...], forbidden: str) -> dict[str, list[str]]:
    """Module of ``packages`` (dotted, e.g. ``storaged.client``; a module is one too) -> the
    modules of package ``forbidden`` (dotted too) it imports, type-checking imports included; only
    modules that do."""
    paths = []
    for package in packages:
        base = REPO / package.replace(".", "/")
        paths += [base.with_suffix(".py")] if base.with_suffix(".py").is_file() else []
        paths += sorted(base.rglob("*.py"))
    assert paths, packages
    found = {
        module_name(path): sorted(
            m
            for m in imports_of(path, type_checking=True)
            if m == forbidden or m.startswith(f"{forbidden}.")
        )
        for path in paths
    }
    return {name: modules for name, modules in found.items() if modules}


def graph(*packages: str, type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports (submodules it names included);
    with ``type_checking``, those imported under ``if TYPE_CHECKING:`` too."""
    modules = {module_name(p): p for package in packages for p in (REPO / package).rglob("*.py")}
    return {
        name: {
            m for m in imports_of(path, type_checking=type_checking) if m in modules and m != name
        }
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


def test_imports_that_run_count_and_type_checking_ones_do_not() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "import a\n"
        "if TYPE_CHECKING:\n    import b\nelse:\n    import c\n"
        "if typing.TYPE_CHECKING:\n    import d\n"
        "def f():\n    from e import g\n"
        "from . import h\n"
    )
    found = set(imports_in(source, "pkg.mod"))
    assert {"a", "c", "e", "e.g", "pkg", "pkg.h"} <= found
    assert not found & {"b", "d"}


def test_type_checking_imports_count_when_asked() -> None:
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from b import c\n"
    assert not {"b", "b.c"} & set(imports_in(source, "pkg.mod"))
    assert {"b", "b.c"} <= set(imports_in(source, "pkg.mod", type_checking=True))


def test_the_storage_leaves_import_nothing_from_storaged() -> None:
    """``tiers`` and ``erasure`` are given what they need (the chunk id's form and digest
    live in ``erasure.content``), so they can be read, tested and reused alone."""
    assert imports_into(("tiers", "erasure"), "storaged") == {}
    assert imports_into(("erasure",), "tiers") == {}  # the bottom: tiers build on it


def test_the_client_imports_nothing_from_tiers() -> None:
    """The client speaks the wire's vocabulary (``storaged.wire``), not the server's tiers."""
    assert imports_into(("storaged.client", "storaged.client.dcp"), "tiers") == {}


def test_the_client_imports_nothing_of_the_service_or_the_tools() -> None:
    """A client (a training job, the CLI's client commands) runs no node: it needs neither
    the node, its front ends, nor the tools (the local-cluster launcher, the demo)."""
    client = ("storaged.client",)
    for forbidden in ("storaged.node", "storaged.front", "storaged.tools", "storaged.coord"):
        assert imports_into(client, forbidden) == {}, forbidden


def test_the_product_never_imports_the_load_tests() -> None:
    offenders = {
        module_name(path): sorted(m for m in imports_of(path) if m.split(".")[0] == "loadtest")
        for package in ("storaged", "tiers", "erasure")
        for path in (REPO / package).rglob("*.py")
    }
    assert {name: found for name, found in offenders.items() if found} == {}


def test_no_import_cycle_in_the_product_or_the_load_tests() -> None:
    edges = graph(*PACKAGES)
    # The graph is real: edges within and across packages, lazy imports included.
    assert "storaged.tools.demo" in edges["storaged.cli"]
    assert "storaged.client.command" in edges["storaged.tools.demo"]
    assert "storaged.client" in edges["loadtest.harness.trace"]
    assert "tiers.nvme" in edges["storaged.node.core"]
    assert a_cycle(edges) is None


def test_no_import_cycle_counting_type_checking_imports() -> None:
    """A name imported for its type is a dependency of the reader too: the product has no
    cycle even counting them (the node's stages take narrow services, ``node/services.py``,
    not the ``Node`` that wires them)."""
    edges = graph(*PACKAGES, type_checking=True)
    assert "storaged.node.services" in edges["storaged.node.pipeline.repair"]  # counted
    assert a_cycle(edges) is None


def test_no_module_of_the_node_or_its_coordination_names_the_node() -> None:
    """Only the node's users (the HTTP front end, the CLI, ``storaged.node`` re-exporting it)
    name ``Node``; its stages, the catalogues and the shared-memory listener do not."""
    node = {"storaged.node.core", "storaged.node.core.Node", "storaged.node.Node"}
    named = {
        name
        for name, path in ((module_name(p), p) for p in (REPO / "storaged").rglob("*.py"))
        if node & set(imports_of(path, type_checking=True))
    }
    assert {"storaged.front.http", "storaged.cli"} <= named  # the search finds its users
    assert named <= {"storaged.node", "storaged.front.http", "storaged.cli"}, sorted(named)


def test_a_benchmark_imports_the_harness_not_another_benchmark() -> None:
    edges = graph("loadtest")
    benchmarks = {
        name for name in edges if name not in ("loadtest", "loadtest.__main__")
        if not name.startswith(HARNESS)
    }  # fmt: skip
    assert {"loadtest.restore", "loadtest.vs_dcp", "loadtest.direct"} <= benchmarks
    assert all(edges[name] for name in benchmarks - {"loadtest.etcd_coord", "loadtest.nvme"})
    offenders = {
        name: sorted(m for m in edges[name] if not m.startswith(HARNESS) and m != "loadtest")
        for name in benchmarks
    }
    assert {name: found for name, found in offenders.items() if found} == {}


def test_the_harness_imports_no_benchmark() -> None:
    edges = graph("loadtest")
    harness = {name: found for name, found in edges.items() if name.startswith(HARNESS)}
    assert len(harness) > 10 and edges["loadtest.harness.command"]
    offenders = {
        name: sorted(m for m in found if not m.startswith(HARNESS))
        for name, found in harness.items()
    }
    assert {name: found for name, found in offenders.items() if found} == {}
