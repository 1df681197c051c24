"""Shared fixtures: every backend-neutral test runs on numpy, torch, jax and tensorflow.

`backend` is a small helper object: `backend.name`, `backend.array(np_array)`
makes a native array (float32 unless the input says otherwise), and
`backend.numpy(x)` reads one back. CI installs every extra, so no backend is
skipped there; a missing one fails the test instead of hiding it.
"""

import os
import sys

# Keras reads `KERAS_BACKEND` once, at its first import, which may come
# from any module collected before the Keras tests (TensorFlow's own
# `tf.keras` among them): every in-process Keras of the suite runs on torch
# (other backends run in subprocesses), so it is set before anything else.
os.environ["KERAS_BACKEND"] = "torch"

# JAX compiles a program again whenever it is traced anew: a fresh `jax.jit`
# of the same step in every test, eager Keras's `lax.cond` of fresh closures
# at every step. One compilation cache for the run serves the repeats (the
# same executables, keyed by the program and the compiler's options), shared
# by both test processes and the subprocesses they start, which inherit the
# environment; it starts empty, as on CI, and goes at the end of the run.
# JAX reads these variables at import, which comes after this.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _JAX_CACHE = tempfile.mkdtemp(prefix="lossscale-tests-jax-cache-")
    atexit.register(shutil.rmtree, _JAX_CACHE, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _JAX_CACHE
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

# The test processes share the machine's cores. A framework whose thread
# pool spans all of them spins against the other process's threads while
# waiting at its barriers: beside a busy neighbour, a torch training loop of
# 0.15 s alone took 12 s. Each process (and the subprocesses it starts,
# which inherit the environment) gets its share of the cores for the
# OpenMP, BLAS, TensorFlow intra-op and XLA pools, set before any of them
# starts; a variable already set is left as it is.
_PROCESSES = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _PROCESSES > 1:
    _SHARE = max(1, (os.cpu_count() or 1) // _PROCESSES)
    for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_name, str(_SHARE))
    os.environ.setdefault("TF_NUM_INTRAOP_THREADS", str(_SHARE))
    if _SHARE == 1 and "XLA_FLAGS" not in os.environ:
        os.environ["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from tests import floors  # noqa: E402

BACKENDS = floors.backends()


def force_numpy_threads(monkeypatch, workers=3):
    """Makes `numpy_parallel` share even tiny block lists among `workers` threads."""
    from lossscale.backends.numpy import parallel as numpy_parallel

    monkeypatch.setattr(numpy_parallel, "MIN_ELEMENTS_PER_WORKER", 128)
    monkeypatch.setattr(numpy_parallel, "MIN_MEAN_BLOCK_FOR_THREADS", 1)
    monkeypatch.setattr(numpy_parallel, "cpu_count", lambda: workers)


@pytest.fixture(autouse=True)
def _torch_threads_kept():
    """Fails a test that leaves torch's intra-op thread count changed.

    The count is the process's share of the cores (above); a test, or
    library code it runs, that raises it for the rest of the process slows
    every later torch test there by up to a hundred times (`bench.floor`
    once did).
    """
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    yield
    torch = sys.modules.get("torch")
    if torch is not None and before is not None:
        after = torch.get_num_threads()
        assert after == before, f"torch's thread count changed from {before} to {after}"


# Property tests draw the same examples on every run, like every other seeded
# input here: a CI run is reproducible, and a new example set is a deliberate
# change (HYPOTHESIS_PROFILE=explore draws fresh ones, for hunting locally).
settings.register_profile("seeded", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "seeded"))


class Backend:
    def __init__(self, name):
        self.name = name

    def array(self, x, dtype=None):
        x = np.asarray(x)
        if dtype is None and x.dtype == np.float64:
            dtype = "float32"
        x = x.astype(dtype) if dtype is not None else x
        if self.name == "numpy":
            return x.copy()
        if self.name == "torch":
            import torch

            return torch.from_numpy(x.copy())
        if self.name == "tensorflow":
            # A tf.Variable, TensorFlow's mutable array: wrapped by a
            # lossscale.Variable without copying, as a model's are (tensors
            # are tested on their own in test_tensorflow_*).
            import tensorflow as tf

            return tf.Variable(x)
        import jax.numpy as jnp

        return jnp.asarray(x)

    def numpy(self, x):
        from lossscale.backends import ops_for, unwrap

        return np.asarray(ops_for(unwrap(x)).to_numpy(unwrap(x)))

    def __repr__(self):
        return self.name


# Session-scoped: one two-rank run, however the tests of the modules that read
# it (tests/torch/test_optimizer.py, tests/optimizers/test_checkpoint.py)
# interleave in a test process.
@pytest.fixture(scope="session")
def fsdp2_checkpoint_ranks(tmp_path_factory):
    """What tests/workers/fsdp2_checkpoint_worker.py wrote on each of its two ranks."""
    from pathlib import Path

    from tests import workers
    from tests.test_distributed import free_port, launch
    from tests.workers import fsdp2_checkpoint_worker as worker

    out = tmp_path_factory.mktemp("fsdp2_checkpoint")
    proc = launch(
        workers.command(Path(worker.__file__), out, free_port()),
        finished=lambda: all((out / f"rank{r}.npz").exists() for r in (0, 1)),
        cwd=workers.ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [dict(np.load(out / f"rank{r}.npz")) for r in (0, 1)]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return Backend(request.param)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# The minimum-versions leg (see tests/floors.py): modules and functions that
# import a package that leg does not install are left out, by name.
_LEFT_OUT = []


def pytest_ignore_collect(collection_path, config):
    if not floors.restricted() or collection_path.suffix != ".py":
        return None
    if not collection_path.name.startswith("test_"):
        return None
    missing = floors.module_needs_missing(collection_path)
    if missing is None:
        return None
    _LEFT_OUT.append(f"{collection_path.relative_to(config.rootpath)} (imports {missing})")
    return True


def pytest_collection_modifyitems(config, items):
    if not floors.restricted():
        return
    kept, dropped = [], []
    for item in items:
        function = getattr(item, "function", None)
        missing = floors.params_need_missing(item) or (
            floors.function_needs_missing(function) if function else None
        )
        (dropped if missing else kept).append(item)
        if missing:
            _LEFT_OUT.append(f"{item.nodeid} (imports {missing})")
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_report_header(config):
    if floors.restricted():
        return f"backends: {', '.join(BACKENDS)} (LOSSSCALE_TEST_BACKENDS)"
    return None


def pytest_terminal_summary(terminalreporter):
    if _LEFT_OUT:
        terminalreporter.write_sep("-", f"left out: {len(_LEFT_OUT)} (tests/floors.py)")
        for line in _LEFT_OUT:
            terminalreporter.write_line(line)


class GroupCheck:
    """Fails the run where `--dist loadgroup` loses the `xdist_group` marks.

    pytest-xdist groups by a "@name" it appends to each node id; pytest
    9.2.0 keeps node ids elsewhere, so the groups were silently lost and
    every module-scoped worker ran once per process.
    """

    def pytest_runtest_setup(self, item):
        if not getattr(item.config.option, "loadgroup", False):
            return
        if item.get_closest_marker("xdist_group") and "@" not in item.nodeid:
            pytest.fail(
                f"--dist loadgroup did not group {item.nodeid} (marked xdist_group): "
                f"pytest {pytest.__version__} with this pytest-xdist does not keep the "
                "group in the node id; constraints.txt pins one that does",
                pytrace=False,
            )


def pytest_configure(config):
    config.pluginmanager.register(GroupCheck(), "lossscale-group-check")
