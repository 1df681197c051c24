"""The tests mirror `src/` (tests/README.md): which modules still lack a test module of their name.

The test of `src/lossscale/a/b.py` is `tests/a/test_b.py`, for every module,
`lossscale.torch` and `lossscale.tensorflow` included: `tests` is a package,
so `tests/torch` is `tests.torch` and shadows no framework (the last two
tests check that). `UNMIRRORED` lists the modules without one (today none):
a new module joins the list only on purpose, and a module that gets its test
module leaves it.
"""

import importlib
import importlib.util
import pathlib
import sys

import pytest

import lossscale

SRC = pathlib.Path(lossscale.__file__).parent
TESTS = pathlib.Path(__file__).parent

UNMIRRORED = set()


def _test_module(module):
    """The test module of `module` (relative to src/lossscale): `a/b.py` -> tests/a/test_b.py."""
    *folders, name = module.parts
    return TESTS.joinpath(*folders, f"test_{name}")


def _unmirrored():
    return {
        module.as_posix()
        for module in (p.relative_to(SRC) for p in SRC.rglob("*.py"))
        if module.name != "__init__.py" and not _test_module(module).is_file()
    }


def test_every_module_without_a_test_module_of_its_name_is_listed():
    assert sorted(_unmirrored() - UNMIRRORED) == []


def test_every_listed_module_still_exists_and_still_lacks_one():
    assert sorted(UNMIRRORED - _unmirrored()) == []


def _under_tests(path):
    return path is not None and pathlib.Path(path).resolve().is_relative_to(TESTS.resolve())


def test_tests_is_not_on_sys_path():
    # `tests` is a package: pytest puts the repository root on `sys.path`,
    # and the workers run as `python -m tests.workers.NAME` from there.
    assert not [p for p in sys.path if pathlib.Path(p or ".").resolve() == TESTS.resolve()]


def test_no_folder_or_module_of_tests_shadows_a_package():
    # `tests/torch` is `tests.torch`: `import torch` finds the framework or,
    # where it is not installed (the minimum-versions leg), fails.
    names = sorted(p.stem for p in TESTS.iterdir() if p.is_dir() or p.suffix == ".py")
    assert {"torch", "tensorflow", "keras", "optax", "workers"} <= set(names)
    for name in (n for n in names if n.isidentifier() and not n.startswith("__")):
        spec = importlib.util.find_spec(name)
        if spec is None:
            with pytest.raises(ModuleNotFoundError):
                importlib.import_module(name)
            continue
        assert not _under_tests(spec.origin), spec
        assert not any(_under_tests(p) for p in spec.submodule_search_locations or ()), spec
