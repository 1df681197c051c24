"""The tests mirror `src/` (tests/README.md): which modules still lack a test module of their name.

The test of `src/lossscale/a/b.py` is `tests/a/test_b.py`; for
`lossscale.torch` and `lossscale.tensorflow`, whose folders would shadow the
frameworks, `tests/test_torch_b.py` (`tests/test_tensorflow_b.py`) or
`tests/test_b.py`. `UNMIRRORED` lists the modules without one (today none): a new module
joins the list only on purpose, and a module that gets its test module
leaves it.
"""

import pathlib

import lossscale

SRC = pathlib.Path(lossscale.__file__).parent
TESTS = pathlib.Path(__file__).parent

UNMIRRORED = set()


def _test_modules(module):
    """Where the test module of `module` (relative to src/lossscale) may stand."""
    *folders, name = module.parts
    yield TESTS.joinpath(*folders, f"test_{name}")
    if folders and folders[0] in ("torch", "tensorflow"):
        yield TESTS / f"test_{folders[0]}_{name}"
        yield TESTS / f"test_{name}"


def _unmirrored():
    return {
        module.as_posix()
        for module in (p.relative_to(SRC) for p in SRC.rglob("*.py"))
        if module.name != "__init__.py" and not any(p.is_file() for p in _test_modules(module))
    }


def test_every_module_without_a_test_module_of_its_name_is_listed():
    assert sorted(_unmirrored() - UNMIRRORED) == []


def test_every_listed_module_still_exists_and_still_lacks_one():
    assert sorted(UNMIRRORED - _unmirrored()) == []
