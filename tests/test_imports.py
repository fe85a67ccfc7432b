"""No import cycles among jax_mlpo's modules, function-level imports included.

A cycle that works today works only because one of its imports runs late (inside a function)
or after the names it needs are bound; moving that import to the top of its module, or
importing the modules in another order, then fails far from the change. So the modules form a
strict layering (``types`` below ``kernels`` and ``native``, and so on up to ``transform``),
checked here statically on the source: every ``import`` statement, wherever it is, except under
``if TYPE_CHECKING:`` (never run).
"""

from __future__ import annotations

import ast
import pathlib
import textwrap

from processes import json_lines

ROOT = pathlib.Path(__file__).resolve().parents[1]


def module_files(root: pathlib.Path, package: str) -> dict[str, pathlib.Path]:
    """The modules of ``package`` (a directory under ``root``) by dotted name.

    Args:
      root: the directory that holds the package.
      package: the top-level package's name.

    Returns:
      ``{"pkg.sub.mod": path}``; a package is named by its ``__init__.py``.
    """
    files = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def _type_checking_only(tree: ast.AST) -> set[int]:
    """Ids of the nodes under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts))]


def import_edges(
    files: dict[str, pathlib.Path], type_checking: bool = False
) -> dict[tuple[str, str], list[int]]:
    """The modules each module imports when its import statements run.

    ``import a.b.c`` runs the packages ``a`` and ``a.b`` too, unless the importer is inside
    them (their ``__init__`` is already running then: Python's normal package layering, not a
    cycle). ``from p import n`` runs ``p``, and ``p.n`` when that is a module; when ``n`` is a
    name defined in ``p``'s ``__init__``, it needs ``p`` even from inside ``p``.

    Args:
      files: from :func:`module_files`.
      type_checking: whether imports under ``if TYPE_CHECKING:`` count too.

    Returns:
      ``{(importer, imported): [line, ...]}`` for the modules in ``files``.
    """
    edges: dict[tuple[str, str], list[int]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = set() if type_checking else _type_checking_only(tree)
        is_package = path.name == "__init__.py"
        inside = set(_ancestors(name)) | ({name} if is_package else set())
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: set[str] = set()
            if isinstance(node, ast.Import):
                for alias in node.names:
                    targets.add(alias.name)
                    targets.update(a for a in _ancestors(alias.name) if a not in inside)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".")[: len(name.split(".")) - node.level + is_package]
                    parent = ".".join(base + ([node.module] if node.module else []))
                else:
                    parent = node.module or ""
                targets.update(a for a in [*_ancestors(parent), parent] if a not in inside)
                for alias in node.names:
                    sub = f"{parent}.{alias.name}"
                    targets.add(sub if sub in files else parent)
            for target in targets:
                if target in files and target != name:
                    edges.setdefault((name, target), []).append(node.lineno)
    return edges


def import_cycles(edges: dict[tuple[str, str], list[int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, list[str]] = {}
    for src, dst in edges:
        graph.setdefault(src, []).append(dst)
        graph.setdefault(dst, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:  # recursion depth is bounded by the number of modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def _describe(cycle: list[str], edges: dict[tuple[str, str], list[int]]) -> str:
    members = set(cycle)
    lines = [
        f"  {src} imports {dst} (line {', '.join(map(str, sorted(set(at))))})"
        for (src, dst), at in sorted(edges.items())
        if src in members and dst in members
    ]
    return " <-> ".join(cycle) + ":\n" + "\n".join(lines)


def test_no_import_cycles_among_jax_mlpo_modules():
    files = module_files(ROOT, "jax_mlpo")
    assert "jax_mlpo.types" in files and "jax_mlpo.native" in files
    edges = import_edges(files)
    cycles = import_cycles(edges)
    assert not cycles, "import cycles:\n" + "\n".join(_describe(c, edges) for c in cycles)


# what the storage layer may build on: the layers above it (the host cache, the engine, the
# checkpoints) pass in what it needs instead
TIERS_MAY_IMPORT = ("tiers", "native", "types", "errors")

# The packages' layers, bottom up: what each may import besides itself (the small types and
# errors at the bottom; an interface two layers share lives in the lower one, as the engine's
# HostOptimizer does). Imports under TYPE_CHECKING count: a type-only cycle is still a cycle of
# the design.
PACKAGE_MAY_IMPORT: dict[str, set[str]] = {
    "errors": set(),
    "types": set(),
    "native": {"errors", "types"},
    "tiers": {"errors", "types", "native"},
    "config": {"errors", "types", "tiers"},
    "engine": {"errors", "types", "native", "tiers", "config"},
    "optimizers": {"errors", "types", "native", "engine"},
    "sharding": {"errors", "types", "config"},
    "transforms": {
        "errors",
        "types",
        "native",
        "tiers",
        "config",
        "engine",
        "optimizers",
        "sharding",
    },  # fmt: skip
    "checkpoint": {
        "errors",
        "types",
        "native",
        "tiers",
        "config",
        "engine",
        "sharding",
        "transforms",
    },  # fmt: skip
    "extend": {"errors", "types", "native", "config", "engine", "optimizers", "transforms"},
    "testing": {"errors", "types", "tiers", "config", "engine", "transforms", "checkpoint"},
}


def package_edges(files: dict[str, pathlib.Path]) -> dict[tuple[str, str], list[str]]:
    """Which of the top package's subpackages (or top-level modules) import which, with the
    module-level imports behind each edge; the top package's own ``__init__`` is left out (it
    re-exports the public API from every layer)."""
    top = next(iter(files)).split(".")[0]
    out: dict[tuple[str, str], list[str]] = {}
    for (src, dst), lines in import_edges(files, type_checking=True).items():
        a, b = src.split("."), dst.split(".")
        if len(a) < 2 or len(b) < 2 or a[1] == b[1]:
            continue
        out.setdefault((a[1], b[1]), []).append(f"{src} -> {dst} (line {lines[0]})")
    assert all(src != top for src, _ in out)
    return out


def test_the_packages_form_layers():
    files = module_files(ROOT, "jax_mlpo")
    edges = package_edges(files)
    unknown = sorted({p for edge in edges for p in edge} - set(PACKAGE_MAY_IMPORT))
    assert not unknown, f"packages not in PACKAGE_MAY_IMPORT: {unknown}: give each its layer"
    wrong = [
        f"  {src} may not import {dst}: " + "; ".join(why[:3])
        for (src, dst), why in sorted(edges.items())
        if dst not in PACKAGE_MAY_IMPORT[src]
    ]
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)
    # the table itself is a tree of layers, not a cycle
    allowed = {(a, b): [0] for a, bs in PACKAGE_MAY_IMPORT.items() for b in bs}
    assert not import_cycles(allowed)


def write_package(root: pathlib.Path, sources: dict[str, str]) -> None:
    """Writes a small package's files (path under ``root`` -> source) for the checks' own tests."""
    for rel, text in sources.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))


def test_a_package_cycle_fails_the_layers_check(tmp_path):
    """Two packages that import each other, one of them only for types, is a cycle."""
    sources = {
        "pkg/__init__.py": "",
        "pkg/low/__init__.py": "",
        "pkg/low/a.py": """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from pkg.high.b import B
            """,
        "pkg/high/__init__.py": "",
        "pkg/high/b.py": "from pkg.low import a\nclass B: ...\n",
    }
    write_package(tmp_path, sources)
    edges = package_edges(module_files(tmp_path, "pkg"))
    assert set(edges) == {("low", "high"), ("high", "low")}
    assert import_cycles({edge: [0] for edge in edges}) == [["high", "low"]]


def test_the_tiers_import_nothing_above_them():
    files = module_files(ROOT, "jax_mlpo")
    allowed = tuple(f"jax_mlpo.{name}" for name in TIERS_MAY_IMPORT)
    above = [
        f"  {src} imports {dst} (line {', '.join(map(str, sorted(set(at))))})"
        for (src, dst), at in sorted(import_edges(files).items())
        if src.startswith("jax_mlpo.tiers.")
        and not any(dst == a or dst.startswith(a + ".") for a in allowed)
    ]
    assert "jax_mlpo.tiers.file" in files
    assert not above, "jax_mlpo.tiers imports from above it:\n" + "\n".join(above)


def test_the_check_sees_function_level_and_relative_imports(tmp_path):
    sources = {
        "pkg/__init__.py": "from pkg import top\n",
        "pkg/top.py": "from pkg.sub import leaf\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/leaf.py": """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from pkg import other
            def late():
                from .. import top
            """,
        "pkg/other.py": "import pkg.sub.leaf\n",
        "pkg/layered.py": "import pkg.top\nfrom pkg import sub\n",
        "pkg/attr.py": "from pkg import NAME\n",
    }
    write_package(tmp_path, sources)
    edges = import_edges(module_files(tmp_path, "pkg"))
    # The function-level relative import closes top -> leaf -> top; the TYPE_CHECKING import
    # and a submodule's (implicit) need of its parent package close nothing.
    assert import_cycles(edges) == [["pkg.sub.leaf", "pkg.top"]]
    assert ("pkg.other", "pkg.sub") in edges and ("pkg.other", "pkg") not in edges
    assert ("pkg.sub.leaf", "pkg.other") not in edges
    assert ("pkg.attr", "pkg") in edges  # a name from the package's __init__ needs it run


def test_import_jax_mlpo_leaves_orbax_out_until_checkpoint_is_used():
    """``import jax_mlpo`` imports no orbax (a process that only trains does not pay for it at
    start-up); ``jax_mlpo.checkpoint`` imports it on first use."""
    code = (
        "import json, sys, jax_mlpo; before = 'orbax.checkpoint' in sys.modules; "
        "jax_mlpo.checkpoint.OffloadCheckpointHandler; "
        "print(json.dumps({'before': before, 'after': 'orbax.checkpoint' in sys.modules}))"
    )
    assert json_lines(["-c", code], 120) == [{"before": False, "after": True}]
