"""Which tests the minimum-versions leg of `./run test` runs.

That leg (`./run floors`) installs the declared floors of NumPy, JAX,
jaxlib and optax (constraints-floors.txt) and none of the other frameworks,
and sets `LOSSSCALE_TEST_BACKENDS=numpy,jax`: the `backend` fixture then
runs on those two only, and a test module or test function that imports a
package this environment lacks (torch, TensorFlow, Keras, ...) is left out,
listed by name in the report header and counted as deselected, never
skipped. Without the variable (the main suite) nothing is left out: a
missing framework fails the tests that need it.
"""

import ast
import importlib.util
import inspect
import os
import pathlib
import textwrap

ALL_BACKENDS = ("numpy", "torch", "jax", "tensorflow")
_TESTS = pathlib.Path(__file__).parent


def backends():
    """The backends the `backend` fixture runs on: all, or those the variable names."""
    named = os.environ.get("LOSSSCALE_TEST_BACKENDS")
    if named is None:
        return ALL_BACKENDS
    chosen = tuple(b.strip() for b in named.split(",") if b.strip())
    unknown = [b for b in chosen if b not in ALL_BACKENDS]
    if unknown or not chosen:
        raise ValueError(
            f"LOSSSCALE_TEST_BACKENDS must name some of {ALL_BACKENDS}, comma-separated. "
            f"Received: LOSSSCALE_TEST_BACKENDS={named!r}"
        )
    return chosen


def restricted():
    return os.environ.get("LOSSSCALE_TEST_BACKENDS") is not None


def _imported(tree, top_level_only):
    """The dotted names `tree` imports; `from a import b` names both `a` and `a.b`."""
    nodes = tree.body if top_level_only else ast.walk(tree)
    for node in nodes:
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names)


def _helper(name):
    """The file of the helper module or package of `tests` the dotted `name` is, or None.

    `tests` is a package (tests/README.md): its helpers are imported by their
    full names (`tests.reference`, `tests.workers.fsdp2_worker`); any other
    name is an installed package's, never a folder of tests/.
    """
    if name.split(".")[0] != "tests":
        return None
    path = _TESTS.parent.joinpath(*name.split("."))
    for candidate in (path.with_name(path.name + ".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _missing(names, seen):
    """The first of `names` (or of what a tests/ helper module they name imports) not installed."""
    for name in names:
        top = name.split(".")[0]
        helper = _helper(name)
        if helper is not None:
            if name not in seen:
                seen.add(name)
                found = _missing(_imported(ast.parse(helper.read_text()), True), seen)
                if found:
                    return found
        elif _helper(top) is not None:
            continue  # a name inside a helper (`from tests.optimizer_table import ROWS`)
        elif importlib.util.find_spec(top) is None:
            return top
    return None


def module_needs_missing(path):
    """The package a test module imports at its top level that is not installed, or None."""
    return _missing(_imported(ast.parse(pathlib.Path(path).read_text()), True), set())


def params_need_missing(item):
    """A backend left out that one of `item`'s parameters names (`[torch-numpy]`), or None."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return None
    chosen = backends()
    for value in callspec.params.values():
        values = value if isinstance(value, tuple) else (value,)
        for v in values:
            if isinstance(v, str) and v in ALL_BACKENDS and v not in chosen:
                return f"{v}, a backend left out"
    return None


def function_needs_missing(function, seen=None):
    """The package `function` imports, or a tests/ helper it calls imports, not installed."""
    seen = set() if seen is None else seen
    if function in seen:
        return None
    seen.add(function)
    try:
        if not pathlib.Path(inspect.getsourcefile(function)).is_relative_to(_TESTS):
            return None
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return None
    found = _missing(_imported(tree, False), set())
    if found:
        return found
    for called in _referenced(tree, function.__globals__):
        found = function_needs_missing(called, seen)
        if found:
            return found
    return None


def _referenced(tree, namespace):
    """The functions `tree` names, `f` or `module.f`, found in `namespace`."""
    for node in ast.walk(tree):
        target = None
        if isinstance(node, ast.Name):
            target = namespace.get(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            owner = namespace.get(node.value.id)
            if inspect.ismodule(owner):
                target = getattr(owner, node.attr, None)
        if inspect.isfunction(target):
            yield target
