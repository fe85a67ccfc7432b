"""docs/design.md's map of the package, checked against the code.

The layers diagram draws exactly the packages' imports. Each principle of MLP-Offload has
exactly one home: the module or package the principles table names, whose docstring names the
principle, and no other module's docstring does. Every module appears in the module map, and no
module outgrows one concept (800 lines; the engine class 300, with collaborators rather than
mixin bases).
"""

from __future__ import annotations

import ast
import pathlib
import re

from test_imports import module_files, package_edges

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "jax_mlpo"
DESIGN = ROOT / "docs" / "design.md"

# The paper's principles (MLP-Offload, Maurya et al., SC'25, its four design principles: its
# multi-path offloading counted apart from the placement that feeds it).
PAPER_PRINCIPLES = {
    "multi-path asynchronous offloading",
    "placement by a bandwidth model",
    "concurrency control",
    "cache-friendly ordering",
    "delayed gradient conversion",
}
# A module holds one concept: past this many lines it holds more than one (a reader's limit,
# not a target: a module is cut by concept).
MAX_LINES = 800
MAX_FUNCTION_LINES = 60
# The functions still longer, and why.
LONG_FUNCTIONS = {
    # optax.MultiSteps's update, kept in its own order to be read beside optax's
    "transforms/accumulation.py:update": "optax's order",
    # the per-subgroup loop, one pass a reader follows top to bottom
    "engine/engine.py:_step": "the loop",
    # the jaxpr walk and its three helpers over one environment
    "transforms/overlap.py:loss_at_first_use": "one walk",
}
MAX_ENGINE_LINES = 300


def _section(title: str) -> str:
    text = DESIGN.read_text()
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def _table(section: str) -> list[list[str]]:
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[1:]]


def _docstring(path: pathlib.Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return " ".join(doc.lower().split())


def _home_docstring(home: str) -> pathlib.Path:
    path = PACKAGE / home
    return path / "__init__.py" if home.endswith("/") else path


def _modules() -> list[pathlib.Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")


def principles() -> dict[str, str]:
    """``{principle: home}`` from the principles table."""
    homes = {}
    for principle, home, _ in _table(_section("Principles and their homes")):
        assert principle not in homes, f"{principle!r} has two rows"
        homes[principle] = home.strip("`")
    return homes


def test_each_principle_of_the_paper_has_one_home_in_the_table():
    homes = principles()
    assert set(homes) >= PAPER_PRINCIPLES, PAPER_PRINCIPLES - set(homes)
    for principle, home in homes.items():
        assert _home_docstring(home).is_file(), f"{principle}: no module {home}"


def test_each_principle_is_named_by_its_home_and_no_other_module():
    for principle, home in principles().items():
        naming = {
            path.relative_to(PACKAGE).as_posix()
            for path in PACKAGE.rglob("*.py")
            if principle.lower() in _docstring(path)
        }
        expected = _home_docstring(home).relative_to(PACKAGE).as_posix()
        assert naming == {expected}, f"{principle!r} is named by {sorted(naming)}, not {expected}"


def test_every_module_is_in_the_module_map():
    section = _section("Modules")
    rows = {row[0]: row[1] for row in _table(section)}
    missing = []
    for path in _modules():
        rel = path.relative_to(PACKAGE).as_posix()
        package, _, name = rel.rpartition("/")
        in_package_row = any(
            f"`{package}/`" in cells and f"`{name}`" in concept for cells, concept in rows.items()
        )
        if f"`{rel}`" not in section and not in_package_row:
            missing.append(rel)
    assert not missing, f"modules missing from docs/design.md's module map: {missing}"


def test_no_module_outgrows_one_concept():
    sources = [p for p in PACKAGE.rglob("*") if p.suffix in {".py", ".cc", ".cu", ".h"}]
    assert any(p.suffix == ".cc" for p in sources)
    long = {
        p.relative_to(PACKAGE).as_posix(): n
        for p in sources
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines: {long}"


def function_lengths(source: str) -> dict[str, int]:
    """Each function's (and method's) lines of code in ``source``, its docstring left out."""
    out = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = node.end_lineno - node.lineno + 1
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                lines -= first.end_lineno - first.lineno + 1
            out[node.name] = max(lines, out.get(node.name, 0))
    return out


def test_functions_fit_on_a_screen():
    """A function a reader takes in at once: at most MAX_FUNCTION_LINES lines of code. The
    longer ones are listed, so the list stays true: one that shrinks leaves it."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for name, n in function_lengths(path.read_text()).items():
            if n > MAX_FUNCTION_LINES:
                found[f"{path.relative_to(PACKAGE).as_posix()}:{name}"] = n
    assert set(found) == set(LONG_FUNCTIONS), (
        f"functions over {MAX_FUNCTION_LINES} lines: {found}; listed: {sorted(LONG_FUNCTIONS)}"
    )


def test_the_engine_is_one_class_with_collaborators_not_mixins():
    tree = ast.parse((PACKAGE / "engine" / "engine.py").read_text())
    (engine,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine"]
    assert not engine.bases, f"Engine has base classes {[ast.unparse(b) for b in engine.bases]}"
    lines = engine.end_lineno - engine.lineno + 1
    assert lines <= MAX_ENGINE_LINES, f"class Engine has {lines} lines"


# every layer imports these; the diagram leaves them out
UNDRAWN = {"errors", "types"}


def _arrows(section: str) -> set[tuple[str, str]]:
    """The ``a --> b`` arrows of the section's mermaid flowchart."""
    block = re.search(r"```mermaid\n(flowchart .*?)```", section, re.S)
    assert block, "no mermaid flowchart in the section"
    return set(re.findall(r"^\s*(\w+) --> (\w+)\s*$", block.group(1), re.M))


def test_the_layers_diagram_draws_the_imports_of_the_code():
    """An import between packages added or removed in the code fails here until the diagram in
    docs/design.md's "Layers" follows it (``errors`` and ``types`` left out)."""
    imports = {
        edge for edge in package_edges(module_files(ROOT, "jax_mlpo")) if not set(edge) & UNDRAWN
    }
    drawn = _arrows(_section("Layers"))
    assert drawn == imports, (
        f"imported but not drawn: {sorted(imports - drawn)}; "
        f"drawn but not imported: {sorted(drawn - imports)}"
    )


def test_the_arrow_parser_reads_a_flowchart():
    section = "## L\n```mermaid\nflowchart TD\n    a[a/]\n    a --> b\n    b --> c\n```\n"
    assert _arrows(section) == {("a", "b"), ("b", "c")}


def test_the_table_parser_reads_the_rows():
    # the checks above are only as good as the parse: a row with a backticked home is read
    rows = _table("## T\n| a | b |\n|---|---|\n| x | `y.py` |\n")
    assert rows == [["x", "`y.py`"]] and re.fullmatch(r"`[^`]+`", rows[0][1])


EXPERIMENTS = PACKAGE.parent / "experiments"


def test_every_benchmark_is_in_the_experiments_table_and_exists():
    """What experiments/bench holds is maintained: each module is named in experiments/README.md
    (a benchmark's row, or the shared parts' list), and each row's module exists."""
    readme = (EXPERIMENTS / "README.md").read_text()
    bench = EXPERIMENTS / "bench"
    for path in bench.rglob("*.py"):
        if path.name == "__init__.py":
            continue
        rel = path.relative_to(bench)
        dotted = ".".join(rel.with_suffix("").parts)
        assert dotted in readme or rel.name in readme, f"experiments/bench/{rel}: not in README"
    # the modules of the rows (the GPU check is a script run with bash)
    rows = [m for m in re.findall(r"^\| [^|]+ \| `([\w.]+) ", readme, re.M) if m != "bash"]
    assert len(rows) >= 10
    for module in rows:
        found = bench.joinpath(*module.split(".")).with_suffix(".py")
        assert found.exists(), f"the README's experiments.bench.{module} does not exist"


def test_the_package_shows_its_layers():
    """A few modules at the top; the rest in the packages of the layers (transforms, engine,
    sharding, optimizers, tiers, native, checkpoint)."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 6, f"{len(top)} modules directly in jax_mlpo/: {top}"
