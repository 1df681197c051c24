"""The API reference names what exists, and every public name has its entry.

The site itself is built by `./run docs` (`mkdocs build --strict`); these
checks are the cheap part that a rename or a new public name would break.
"""

import contextlib
import importlib
import pathlib
import re
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
API_PAGES = sorted((ROOT / "docs" / "api").glob("*.md"))
DOCUMENTED = [
    m.group(1) for page in API_PAGES for m in re.finditer(r"^::: (\S+)$", page.read_text(), re.M)
]
PUBLIC_MODULES = [
    "lossscale",
    "optimizers",
    "schedules",
    "mixed_precision",
    "pytree",
    "saving",
    "torch",
]


def _resolve(path):
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name != ".".join(parts[:i]):
                raise
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ModuleNotFoundError(path)


@pytest.mark.parametrize("path", DOCUMENTED)
def test_documented_name_exists(path):
    assert _resolve(path) is not None


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_public_name_is_documented(module):
    module = _resolve(module if module == "lossscale" else f"lossscale.{module}")
    documented = set()
    for path in DOCUMENTED:
        # A path that does not resolve fails test_documented_name_exists.
        with contextlib.suppress(AttributeError, ModuleNotFoundError):
            documented.add(id(_resolve(path)))
    names = getattr(module, "__all__", None) or [
        n for n, v in vars(module).items() if not n.startswith("_") and callable(v)
    ]
    public = {n: getattr(module, n) for n in names}
    missing = [
        n
        for n, v in public.items()
        if id(v) not in documented and not isinstance(v, types.ModuleType)
    ]
    assert not missing, f"{module.__name__}: no API page documents {missing}"


def test_docstring_examples_are_google_sections():
    # "Example:" (singular, as Keras writes it) is no section to the docs'
    # parser: its doctest would render as nested quotes instead of code.
    src = ROOT / "src" / "lossscale"
    offenders = [
        str(path.relative_to(src))
        for path in src.rglob("*.py")
        if "backends" not in path.parts and re.search(r"^\s*Example:\s*$", path.read_text(), re.M)
    ]
    assert not offenders, f"use an indented 'Examples:' section in {offenders}"


def test_getting_started_includes_every_quickstart():
    # The page pulls each quickstart in from examples/, where the suite runs it.
    page = (ROOT / "docs" / "getting_started.md").read_text()
    included = re.findall(r"--8<--\n(examples/quickstart_\w+\.py)\n--8<--", page)
    expected = sorted(f"examples/{p.name}" for p in (ROOT / "examples").glob("quickstart_*.py"))
    assert sorted(included) == expected and len(expected) == 5
