"""No import cycle among bearsdk modules (issue 18).

The test reads every module of the package with :mod:`ast` (nothing is
imported, so a deferred import inside a function is seen exactly like a
module-level one), builds the graph of which module makes which other one
execute, and fails naming every cycle.

How an import becomes edges:

* ``import bearsdk.a.b``, ``from bearsdk.a.b import x`` and their relative
  forms make ``bearsdk.a.b`` execute, and before it every package ``__init__``
  above it (``bearsdk.a``), so each of those is an edge. A package that
  contains the importing module is left out: its ``__init__`` has already
  started when the module runs, so importing a sibling does not run it again.
* ``from P import x`` is an edge to ``P.x`` when ``x`` is a submodule, and to
  ``P`` itself when ``x`` is a name ``P/__init__.py`` defines - even from
  inside ``P``, since the name exists only once that ``__init__`` has run so
  far.
* Imports under ``if TYPE_CHECKING:`` never execute and do not count; a
  constant ``importlib.import_module("bearsdk....")`` does, and so does
  ``_twins.compiled("bearsdk....")`` / ``_twins.available(...)``.

``bearsdk/schedulers`` is a link to the top-level ``schedulers/`` folder; its
files are walked as ``bearsdk.schedulers.*``, the name the package uses. The
compiled modules are part of the graph too: their names come from
``setup.py``'s ``EXTENSIONS`` and their Python imports from the ``.pyx``
sources (``cimport`` is resolved at compile time and does not count).
"""

from __future__ import annotations

import ast
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

import bearsdk

pytestmark = pytest.mark.once  # (it reads the sources, whichever twins are loaded)

ROOT = Path(bearsdk.__file__).resolve().parent
REPO = ROOT.parent

# Cycles not broken yet, each as the sorted tuple of its modules. The test
# checks this set exactly: a new cycle fails, and so does a fixed one that is
# still listed.
KNOWN_CYCLES: frozenset[tuple[str, ...]] = frozenset()


def _extensions() -> dict[str, Path]:
    """Compiled module name -> its Cython source, as setup.py lists them."""
    tree = ast.parse((REPO / "setup.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "EXTENSIONS" for t in node.targets
        ):
            table = ast.literal_eval(node.value)
            return {name: REPO / src for name, src in table.items()}
    raise AssertionError("setup.py has no EXTENSIONS table")


_PYX_IMPORT = re.compile(r"^[ \t]*(from[ \t]+[\w.]+[ \t]+import[ \t]|import[ \t])")


def _pyx_imports(path: Path) -> ast.Module:
    """The Python import statements of a Cython source, as an AST."""
    lines = path.read_text(encoding="utf-8").splitlines()
    statements: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not _PYX_IMPORT.match(line):
            continue
        text = line.strip()
        while text.count("(") > text.count(")") and i < len(lines):
            text += " " + lines[i].strip()
            i += 1
        statements.append(text)
    return ast.parse("\n".join(statements), str(path))


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = dict(_extensions())
    for folder, dirs, files in os.walk(ROOT, followlinks=True):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        rel = Path(folder).relative_to(ROOT)
        parts = ["bearsdk", *rel.parts]
        if "__init__.py" not in files:
            continue
        for name in files:
            if not name.endswith(".py"):
                continue
            stem = name[: -len(".py")]
            module = ".".join(parts if stem == "__init__" else [*parts, stem])
            found[module] = Path(folder) / name
    return found


def _is_type_checking(test: ast.expr) -> bool:
    if isinstance(test, ast.Name):
        return test.id == "TYPE_CHECKING"
    return isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Yields every node that can execute, skipping TYPE_CHECKING blocks."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _targets(module: str, path: Path, known: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """Yields (module that must execute, line) for each runtime import."""
    if path.suffix == ".pyx":
        tree = _pyx_imports(path)
    else:
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = _package_of(module, path)
    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from _chain(module, alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            yield from _chain(module, source, node.lineno)
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in known:
                    yield sub, node.lineno
                elif source == module or _inside(module, source):
                    # A name of a package this module lives in: its
                    # __init__ must have got that far first.
                    yield source, node.lineno
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (getattr(node.func, "attr", None) or getattr(node.func, "id", None))
            # bearsdk._twins loads a compiled module by name, as import_module does.
            in {"import_module", "compiled", "available"}
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield from _chain(module, node.args[0].value, node.lineno)


def _inside(module: str, package: str) -> bool:
    return module.startswith(package + ".")


def _chain(module: str, target: str, line: int) -> Iterator[tuple[str, int]]:
    """The target and every package above it that is not already running."""
    if target != "bearsdk" and not target.startswith("bearsdk."):
        return
    parts = target.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if name == module or _inside(module, name):
            continue
        yield name, line


def import_graph() -> dict[str, dict[str, int]]:
    """Maps each module to the modules it makes execute (with a line)."""
    known = _modules()
    graph: dict[str, dict[str, int]] = {}
    for module, path in known.items():
        edges = graph.setdefault(module, {})
        for target, line in _targets(module, path, known):
            if target in known and target != module:
                edges.setdefault(target, line)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0

    def visit(root: str) -> None:
        # Iterative, so a deep package cannot hit the recursion limit.
        nonlocal counter
        work: list[tuple[str, Iterator[str]]] = []

        def enter(node: str) -> None:
            nonlocal counter
            index[node] = low[node] = counter
            counter += 1
            stack.append(node)
            on_stack.add(node)
            work.append((node, iter(sorted(graph.get(node, {})))))

        enter(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    enter(child)
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def _describe(component: list[str], graph: dict[str, dict[str, int]]) -> str:
    members = set(component)
    edges = [
        f"{a} -> {b} (line {line})"
        for a in component
        for b, line in sorted(graph[a].items())
        if b in members
    ]
    return "{" + ", ".join(component) + "}: " + "; ".join(edges)


def test_the_walk_sees_the_whole_package() -> None:
    graph = import_graph()
    # The link to the top-level schedulers/ folder is walked under its
    # package name, and subpackages are found.
    assert "bearsdk.schedulers.spec" in graph
    assert "bearsdk.router.router" in graph
    assert "bearsdk.emulator.engine" in graph
    # A plain edge the package certainly has.
    assert "bearsdk.errors" in graph["bearsdk.schedulers.spec"]
    # Compiled modules are nodes, with the imports of their .pyx source.
    assert "bearsdk.io._shm_c" in graph["bearsdk.io.shm"]
    assert "bearsdk.snapshot" in graph["bearsdk.replay._replay_c"]


def test_the_walk_counts_deferred_imports_and_skips_type_checking(
    tmp_path: Path,
) -> None:
    package = tmp_path / "bearsdk"
    (package / "a").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a" / "__init__.py").write_text("from bearsdk.a.one import f\n")
    (package / "a" / "one.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from bearsdk import two\n"
        "def f():\n"
        "    from bearsdk.three import g\n"
    )
    (package / "two.py").write_text("import bearsdk.a\n")
    (package / "three.py").write_text("from bearsdk.a.one import f\n")
    known = {
        "bearsdk": package / "__init__.py",
        "bearsdk.a": package / "a" / "__init__.py",
        "bearsdk.a.one": package / "a" / "one.py",
        "bearsdk.two": package / "two.py",
        "bearsdk.three": package / "three.py",
    }
    graph = {
        m: {t for t, _ in _targets(m, p, known) if t in known and t != m} for m, p in known.items()
    }
    # Inside bearsdk.a, importing a sibling does not rerun bearsdk.a.
    assert graph["bearsdk.a"] == {"bearsdk.a.one"}
    # The function-level import counts; the TYPE_CHECKING one does not.
    assert graph["bearsdk.a.one"] == {"bearsdk.three"}
    # From outside, a submodule import runs the package __init__ first.
    assert graph["bearsdk.three"] == {"bearsdk.a", "bearsdk.a.one"}
    with_edges = {m: dict.fromkeys(t, 1) for m, t in graph.items()}
    assert cycles(with_edges) == [["bearsdk.a", "bearsdk.a.one", "bearsdk.three"]]


def test_no_import_cycle() -> None:
    graph = import_graph()
    found = {tuple(c) for c in cycles(graph)}
    new = sorted(found - KNOWN_CYCLES)
    fixed = sorted(KNOWN_CYCLES - found)
    assert not new, "import cycles:\n" + "\n".join(_describe(list(c), graph) for c in new)
    assert not fixed, f"fixed cycles still listed in KNOWN_CYCLES: {fixed}"
