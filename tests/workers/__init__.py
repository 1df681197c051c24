"""Scripts the tests run in subprocesses (several ranks, another Keras backend).

Each runs as a module of the `tests` package from the repository root:
`python -m tests.workers.NAME ...` with `cwd=ROOT` (`command` builds the
line), so it imports the other helpers by the names the tests use
(`tests.workers.fsdp2_worker`) and `tests/` is never on its `sys.path`. Its
test imports it as `tests.workers.NAME` for its constants and
single-process helpers.
"""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def command(path, *args):
    """`python -m tests.workers.NAME ARGS...` for the worker file `path`; run it with `cwd=ROOT`."""
    module = ".".join(pathlib.Path(path).resolve().relative_to(ROOT).with_suffix("").parts)
    return [sys.executable, "-m", module, *(str(a) for a in args)]
