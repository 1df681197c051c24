"""Shared fixtures: every backend-neutral test runs on numpy, torch and jax.

`backend` is a small helper object: `backend.name`, `backend.array(np_array)`
makes a native array (float32 unless the input says otherwise), and
`backend.numpy(x)` reads one back. CI installs every extra, so no backend is
skipped there; a missing one fails the test instead of hiding it.
"""

import numpy as np
import pytest

BACKENDS = ("numpy", "torch", "jax")


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
        import jax.numpy as jnp

        return jnp.asarray(x)

    def numpy(self, x):
        from lossscale.backends import ops_for, unwrap

        return np.asarray(ops_for(unwrap(x)).to_numpy(unwrap(x)))

    def __repr__(self):
        return self.name


@pytest.fixture(params=BACKENDS)
def backend(request):
    return Backend(request.param)


@pytest.fixture
def rng():
    return np.random.default_rng(0)
