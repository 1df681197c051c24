"""The backend seam: discovery, mixing errors, and each primitive on every backend."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import lossscale as ls
import lossscale.backends
from lossscale.backends import backend_of, common_backend, get_ops, ops_for


def test_backend_of(backend):
    assert backend_of(backend.array(np.ones(2))) == backend.name
    assert backend_of(ls.Variable(backend.array(np.ones(2)))) == backend.name
    assert backend_of(1.5) == "numpy" and backend_of(np.float32(2)) == "numpy"


def test_torch_parameter_is_torch():
    import torch

    assert backend_of(torch.nn.Parameter(torch.ones(1))) == "torch"


def test_unknown_type_rejected():
    with pytest.raises(
        TypeError,
        match="Expected a NumPy array, a torch.Tensor, a jax.Array, a tf.Tensor, a tf.Variable "
        "or a lossscale.Variable. Received: str",
    ):
        backend_of("x")


def test_mixing_backends_names_both():
    import jax.numpy as jnp
    import torch

    with pytest.raises(ValueError, match="found both 'torch' and 'jax'"):
        common_backend([torch.ones(1), None, 2.0, jnp.ones(1)])
    assert common_backend([None, 3.0]) == "numpy"
    assert ops_for(torch.ones(1)).NAME == "torch"
    with pytest.raises(
        ValueError,
        match=r"`backend` must be one of \('numpy', 'torch', 'jax', 'tensorflow'\). "
        r"Received: backend='tf'",
    ):
        get_ops("tf")


def test_primitives(backend):
    ops = get_ops(backend.name)
    x = backend.array(np.array([-4.0, 1.0, 9.0]))
    y = backend.array(np.array([1.0, 2.0, 3.0]))
    checks = {
        "sqrt": (ops.sqrt(ops.abs(x)), [2, 1, 3]),
        "square": (ops.square(x), [16, 1, 81]),
        "sign": (ops.sign(x), [-1, 1, 1]),
        "maximum": (ops.maximum(x, y), [1, 2, 9]),
        "minimum": (ops.minimum(x, 2.0), [-4, 1, 2]),
        "clip": (ops.clip(x, -1, 2), [-1, 1, 2]),
        "where": (ops.where(x > 0, x, y), [1, 1, 9]),
        "power": (ops.power(y, 2.0), [1, 4, 9]),
        "floor": (ops.floor(x / 2), [-2, 0, 4]),
        "exp": (ops.exp(y * 0), [1, 1, 1]),
        "log": (ops.log(ops.exp(y)), [1, 2, 3]),
        "cos": (ops.cos(y * 0), [1, 1, 1]),
        "sum": (ops.sum(x), 6.0),
        "cast": (ops.cast(x, "float16"), [-4, 1, 9]),
    }
    for name, (got, expected) in checks.items():
        np.testing.assert_allclose(backend.numpy(got), expected, rtol=1e-6, err_msg=name)
    assert ops.dtype_name(ops.cast(x, "float16")) == "float16"
    assert ops.shape(x) == (3,)
    assert bool(backend.numpy(ops.logical_and(x > 0, y > 1))[1])
    assert bool(backend.numpy(ops.logical_not(x > 0))[0])
    full = ops.full((2,), 3, "int32", like=x)
    assert ops.dtype_name(full) == "int32" and backend.numpy(full).tolist() == [3, 3]
    copied = ops.copy(x)
    assert backend.numpy(copied).tolist() == backend.numpy(x).tolist()


def test_multi_tensor_helpers(backend, rng):
    ops = get_ops(backend.name)
    grads = [rng.normal(size=s).astype(np.float32) for s in [(3, 2), (4,)]]
    native = [backend.array(g) for g in grads]
    np.testing.assert_allclose(
        float(backend.numpy(ops.global_norm(native))),
        np.sqrt(sum((g.astype(np.float64) ** 2).sum() for g in grads)),
        rtol=1e-6,
    )
    assert bool(backend.numpy(ops.all_finite(native)))
    for bad in (np.inf, -np.inf, np.nan):
        broken = native[:1] + [backend.array(np.array([1.0, bad, 0.0, 2.0]))]
        assert not bool(backend.numpy(ops.all_finite(broken)))
    half = [backend.array(g, dtype="float16") for g in grads]
    unscaled = ops.unscale(half, backend.array(np.float32(4.0)))
    assert all(ops.dtype_name(u) == "float32" for u in unscaled)
    np.testing.assert_allclose(
        backend.numpy(unscaled[0]), grads[0].astype(np.float16) / 4, rtol=1e-6
    )


def test_finite_unscaled(backend, rng):
    """Every gradient divided by the scale finite: inf, NaN and an overflow by division fail."""
    ops = get_ops(backend.name)
    grads = [rng.normal(size=s).astype(np.float32) for s in [(3, 2), (4,)]]

    def check(arrays, scale):
        native = [backend.array(a) for a in arrays]
        return bool(backend.numpy(ops.finite_unscaled(native, backend.array(np.float32(scale)))))

    assert check(grads, 1024.0)
    assert check(grads, 0.5)
    assert check([], 2.0)
    for bad in (np.inf, -np.inf, np.nan):
        assert not check(grads[:1] + [np.array([1.0, bad, 0.0], np.float32)], 1024.0)
    large = grads[:1] + [np.array([2e38, -1.0], np.float32)]
    assert check(large, 1.0)
    assert not check(large, 0.5)  # 4e38 leaves float32


def test_assign_primitives_keep_dtype(backend):
    ops = get_ops(backend.name)
    storage = ops.asarray(np.array([1.0, 2.0], np.float16), dtype="float16")
    storage = ops.assign_add(storage, backend.array(np.array([1.0, 1.0])))
    storage = ops.assign_sub(storage, 0.5)
    storage = ops.assign(storage, ops.asarray(np.array([3.0, 3.0]), dtype="float16"))
    assert ops.dtype_name(storage) == "float16"
    assert backend.numpy(storage).tolist() == [3.0, 3.0]


def test_cond_takes_the_right_branch(backend):
    ops = get_ops(backend.name)
    v = ls.Variable(backend.array(np.array([1.0, 2.0])))
    for pred, expected in [
        (backend.array(np.array(True)), [2.0, 3.0]),
        (backend.array(np.array(False)), [2.0, 1.0]),
    ]:
        ops.cond(
            pred,
            lambda: v.assign_add(backend.array(np.ones(2))),
            lambda: v.assign(backend.array(np.array([2.0, 1.0]))),
            [v],
        )
        assert backend.numpy(v).tolist() == expected


def test_cond_under_jit_writes_only_the_taken_branch():
    import jax
    import jax.numpy as jnp

    ops = get_ops("jax")
    v = ls.Variable(jnp.array([1.0, 2.0]))

    def step(value, flag):
        v.rebind(value)
        ops.cond(flag, lambda: v.assign(v.value * jnp.nan), lambda: v.assign_add(1.0), [v])
        return v.value

    out = jax.jit(step)(jnp.array([1.0, 2.0]), jnp.array(False))
    assert np.asarray(out).tolist() == [2.0, 3.0]


def test_numpy_quiet_silences_overflow():
    import warnings

    ops = get_ops("numpy")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ops.quiet():
            np.float32(3e38) * np.float32(10)


def test_import_pulls_in_neither_torch_nor_jax_nor_tensorflow():
    code = (
        "import sys, lossscale, numpy as np; import lossscale.optimizers as o; "
        "o.Adam().apply([np.ones(2, np.float32)], [np.ones(2, np.float32)]); "
        "print('torch' in sys.modules, 'jax' in sys.modules, 'tensorflow' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "False"]


def test_import_reads_no_environment_variable():
    # numpy is imported first so that only lossscale's own reads are recorded.
    code = (
        "import os, numpy\nseen = []\nenv = type(os.environ)\n"
        "get, getitem = env.get, env.__getitem__\n"
        "env.get = lambda self, k, d=None: seen.append(k) or get(self, k, d)\n"
        "env.__getitem__ = lambda self, k: seen.append(k) or getitem(self, k)\n"
        "import lossscale\nprint(seen)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _imports(path):
    """Every module `path` imports (absolute names; `from a import b` gives `a.b`)."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


BACKEND_DIR = Path(lossscale.backends.__file__).parent
# Each backend's modules in the order their package's docstring lists them:
# a module may import only those before it, so the seam reads top-down.
LAYERS = {
    "numpy": ["parallel", "ops", "fused", "kernels"],
    "torch": [
        "control",
        "dtensors",
        "layout",
        "ops",
        "scale_update",
        "multi",
        "float16_range",
        "plans",
        "host",
        "foreach",
        "adamw",
        "fused",
        "kernels",
    ],
    "jax": ["ops", "multi", "float16_range", "fused", "kernels"],
    "tensorflow": [
        "ops",
        "control",
        "multi",
        "float16_range",
        "replicas",
        "fused",
        "compiled",
        "kernels",
    ],
}


def test_the_seam_knows_no_optimizer():
    for path in BACKEND_DIR.rglob("*.py"):
        assert not any(n.startswith("lossscale.optimizers") for n in _imports(path)), path


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_backend_modules_import_top_down(name):
    package = f"lossscale.backends.{name}"
    layers = LAYERS[name]
    assert sorted(p.stem for p in (BACKEND_DIR / name).glob("*.py")) == sorted(
        layers + ["__init__"]
    )
    for position, module in enumerate(layers):
        imported = _imports(BACKEND_DIR / name / f"{module}.py")
        local = {
            n.removeprefix(package + ".").split(".")[0] for n in imported if n.startswith(package)
        }
        assert local <= set(layers[:position]), (module, local)
        # a package-level import would run the registry (and everything) first
        assert package not in imported, module
