"""No import cycle among the modules of src/lossscale (their top-level imports).

A module importing its own package's submodules (`from pkg import sub`, or a
package's `__init__` gathering its children) is how Python packages work and
is not a cycle; any other chain of top-level imports that comes back to its
start is.
"""

import ast
import pathlib

import lossscale

ROOT = pathlib.Path(lossscale.__file__).parent.parent


def _modules():
    modules = {}
    for path in (ROOT / "lossscale").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


def _graph(modules):
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.parse(path.read_text()).body:  # top level only
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                subs = [s for s in subs if s in modules]
                deps.update(subs)
                if len(subs) < len(node.names):
                    deps.add(node.module)
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def _cycles(graph):
    state, stack, found = {}, [], []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for dep in sorted(graph[module]):
            if dep.startswith(module + "."):
                continue  # a package importing its own submodule
            if state.get(dep) == "open":
                found.append(stack[stack.index(dep) :] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    return found


def test_no_top_level_import_cycle():
    assert _cycles(_graph(_modules())) == []


def test_the_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d.e"}, "d.e": set()}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
