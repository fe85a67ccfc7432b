"""The process's state lives in one object, ``jax_mlpo.transforms.runtime.RUNTIME``.

A module-level table that the library changes at run time is state a reader cannot see from a
call's arguments, shared by every optimizer of the process. This test reads the library's
source (``ast``) for module-level names that are changed after import: bound to a container
and then written (an item set or deleted, a mutating method called), rebound through
``global``, a thread-local, or a function memoized for the process (``functools.cache``).
"""

from __future__ import annotations

import ast
import pathlib
import textwrap

import jax_mlpo

PACKAGE = pathlib.Path(jax_mlpo.__file__).parent

# What may stay at module level, and why.
ALLOWED = {
    # the record of the exceptions updates raised inside XLA calls, by the number their message
    # carries: the errors module is below every layer (the FFI transport reports through it)
    # and jax_mlpo.errors.typed() reads it; it keeps the last 64
    ("errors.py", "_RAISED"),
    # the loaded CUDA extension module (an import, cached as Python caches modules)
    ("native/copies.py", "cuda_module"),
    # the test-only module's CUDA targets, registered with XLA once per process
    ("native/testing.py", "_cuda_registered"),
}

_MUTATORS = {"append", "extend", "insert", "add", "update", "pop", "popitem", "clear",
             "setdefault", "remove", "discard", "set"}  # fmt: skip
_CONTAINERS = {"dict", "list", "set", "OrderedDict", "defaultdict", "WeakKeyDictionary",
               "WeakValueDictionary", "WeakSet", "Event", "deque", "Counter"}  # fmt: skip


def _name_of_call(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        return ast.unparse(node.func).split(".")[-1]
    return None


def module_state(source: str) -> set[str]:
    """The module-level names of ``source`` that hold state changed after import."""
    tree = ast.parse(source)
    containers, found = set(), set()
    for node in tree.body:
        targets, value = [], None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        for t in targets:
            if not isinstance(t, ast.Name):
                continue
            literal = isinstance(value, ast.Dict | ast.List | ast.Set | ast.DictComp
                                 | ast.ListComp | ast.SetComp)  # fmt: skip
            if literal or _name_of_call(value) in _CONTAINERS:
                containers.add(t.id)
            if _name_of_call(value) == "local":  # threading.local()
                found.add(t.id)
        if isinstance(node, ast.FunctionDef) and any(
            ast.unparse(d).split(".")[-1] in ("cache", "lru_cache") for d in node.decorator_list
        ):
            found.add(node.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.update(node.names)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store | ast.Del):
            if isinstance(node.value, ast.Name) and node.value.id in containers:
                found.add(node.value.id)
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Subscript):
            base = node.target.value
            if isinstance(base, ast.Name) and base.id in containers:
                found.add(base.id)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            base = node.func.value
            if (isinstance(base, ast.Name) and base.id in containers
                    and node.func.attr in _MUTATORS):  # fmt: skip
                found.add(base.id)
    return found


def test_no_module_level_state_outside_the_runtime():
    found = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        found |= {(relative, name) for name in module_state(path.read_text())}
    assert found == ALLOWED, (
        f"module-level state outside jax_mlpo.transforms.runtime.RUNTIME: "
        f"{sorted(found - ALLOWED)}; no longer found: {sorted(ALLOWED - found)}"
    )


def test_the_check_finds_each_kind_of_module_state():
    source = textwrap.dedent("""
        import functools, threading, weakref
        TABLE = {}
        ITEMS = []
        PLAN = None
        LOCAL = threading.local()
        WEAK = weakref.WeakKeyDictionary()
        CONSTANT = {"a": 1}          # read only: not state
        EVENT = threading.Event()

        def f(k):
            global PLAN
            PLAN = k
            TABLE[k] = 1
            ITEMS.append(k)
            WEAK.setdefault(k, 1)
            EVENT.clear()
            return CONSTANT[k]

        @functools.cache
        def measured():
            return 1.0
    """)
    assert module_state(source) == {"TABLE", "ITEMS", "PLAN", "LOCAL", "WEAK", "EVENT",
                                    "measured"}  # fmt: skip
